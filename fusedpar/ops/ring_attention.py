"""``fusedpar.ops.ring_attention``: attention over a sequence split across the ranks of a
context-parallel group, with the K/V exchange hidden behind the blockwise attention.

Layouts (``layout=``): ``"zigzag"`` (default): the global sequence is cut into ``2W``
chunks and rank ``r`` holds chunks ``r`` and ``2W-1-r`` (``fusedpar.parallel.zigzag_shard``),
so causal work is equal on every rank; ``"contiguous"``: rank ``r`` holds chunk ``r`` of W;
``"zigzag_docs"`` (packed documents, ``cu_seqlens``): each document is cut into ``2W``
chunks and rank ``r`` holds chunks ``r`` and ``2W-1-r`` of every document, in document
order (``fusedpar.parallel.sequence_shard``; ring-flash-attn's varlen zigzag), so causal
work is equal on every rank within each document, not only over the whole row.

Backends: ``triton`` (per ring step, a copy kernel pulls the visible rows of a peer's K/V
from symmetric memory once its flag flips, while an attention kernel folds the previous
step's block into fp32 state), ``pipelined`` (K/V around the ring by async P2P),
``pipelined_sdpa`` (the same ring, each step torch's attention kernel with its lse),
``ulysses`` (all-to-all heads <-> sequence), ``allgather_kv`` (gather K/V).

Ring blocks (``ring_plan``): rank ``r`` attends its queries to the K/V of every source rank
``src``, one flash-attention block per (query chunk, key chunk) pair with that pair's
diagonal offset, cut to the keys its window reaches (packed documents cut further), or none.
Without a window, most causal blocks are fully visible, fully masked (skipped) or the own
block (causal in local indices). Partial results merge in fp32 with the stable
log-sum-exp update. Every backward recomputes the blocks from the saved (global) lse: a
block's ``P = exp(S - lse)`` is its share of the whole softmax, so its dQ/dK/dV are exact.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..comm import (counters, get_buffer, get_loopback_buffers, group_name, layout as pad_layout,
                    resolve_group, symmetric)
from ..errors import FusedparError
from ..kernels import flash_attention as kernels
from ..kernels import signal as signal_kernels
from . import protocol as C
from .all_gather import all_gather
from .reduce_scatter import reduce_scatter
from .backend import Backend, Dispatcher, Plans, autocast_inputs, autocast_off
from .registry import EXAMPLE_WORLD, register
from .flash_attention import (DISPATCHER as FLASH_DISPATCHER, KERNEL_DTYPES, AttentionCall,
                              attend_block, attend_block_backward, backward_backend,
                              check_attention_inputs, check_cu_seqlens, check_mask_args,
                              default_scale, delta_of, host_list)
from .ring_plan import RingBlock, band_block, key_ranges, rank_chunks, ring_blocks

OP = "ring_attention"
LAYOUTS = ("zigzag", "contiguous", "zigzag_docs")
MASK_SCHEMA = ("str group_name, bool causal, float softmax_scale, int window_left, int window_right, "
               "float softcap, str layout, Tensor? cu_seqlens, str backend")
SCHEMA = f"(Tensor q, Tensor k, Tensor v, {MASK_SCHEMA}) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, Tensor? dlse, "
                   f"{MASK_SCHEMA}) -> (Tensor, Tensor, Tensor)")


class RingCall:
    """One rank's call: this rank's ``q [B, S_local, H, D]``, ``k``/``v [B, S_local, H_kv, D]``;
    ``group`` None: a loopback call of ``world_size`` simulated ranks."""

    op = OP

    def __init__(self, q, k, v, group, causal: bool, scale: float, layout: str, world_size: int = 0,
                 cu_seqlens: torch.Tensor | None = None, lse_grad: bool = False,
                 window: tuple[int, int] = (-1, -1), softcap: float = 0.0, *,
                 rank: int | None = None, documents: list[tuple[int, int]] | None = None):
        self.q, self.k, self.v, self.group = q, k, v, group
        self.x = q  # what C.raise_on_mismatch reads
        self.causal, self.scale, self.layout = causal, scale, layout
        self.window, self.softcap = tuple(window), softcap
        if group is not None and not world_size:
            world_size = dist.get_world_size(group)
        self.world_size = world_size
        if rank is None:
            rank = dist.get_rank(group) if group is not None else 0
        self.rank = rank
        self.cu_seqlens = cu_seqlens
        self.lse_grad = lse_grad  # a backward call whose lse has a gradient
        # documents of the global sequence (packed with cu_seqlens), as [start, end) ranges
        if documents is None:
            ends = host_list(cu_seqlens) if cu_seqlens is not None else [0, world_size * q.shape[1]]
            documents = list(zip(ends, ends[1:]))
        self.documents = documents

    def maker(self):
        """A function of ``(q, k, v, cu_seqlens)`` making calls like this one (a plan's,
        ``backend.Plans``): the group, rank, mask and documents kept (a plan's key holds the
        documents' values), none of the tensors."""
        group, causal, scale, layout, world = self.group, self.causal, self.scale, self.layout, self.world_size
        lse_grad, window, softcap, rank, documents = (self.lse_grad, self.window, self.softcap,
                                                      self.rank, self.documents)
        return lambda q, k, v, cu_seqlens: RingCall(q, k, v, group, causal, scale, layout, world,
                                                    cu_seqlens, lse_grad, window, softcap,
                                                    rank=rank, documents=documents)

    def cache_key(self) -> tuple:
        name = self.group.group_name if self.group is not None else f"loopback{self.world_size}"
        return (name, self.q.device.type, self.q.dtype, self.q.shape[2], self.k.shape[2],
                self.q.shape[3], self.layout, self.cu_seqlens is not None, self.lse_grad,
                self.window != (-1, -1), self.softcap > 0)

    def describe(self) -> str:
        return (f"q {tuple(self.q.shape)}, k/v {tuple(self.k.shape)} {self.q.dtype} on "
                f"{self.q.device.type}, layout {self.layout!r}, world size {self.world_size}")

    def fingerprint(self) -> int:
        return symmetric.fingerprint(OP, self.q.dtype, tuple(self.q.shape), tuple(self.k.shape),
                                     self.causal, self.layout, self.documents, self.window,
                                     self.softcap)

    def description(self) -> list[int]:
        """For mismatch errors: q's shape and the K/V head count, the sequence dim."""
        return symmetric.describe_words(7, self.q.dtype, (*self.q.shape, self.k.shape[2]), 1)

    @property
    def local(self) -> str:
        """The flash_attention backend of the blocks: the kernel on GPU, the reference math
        on CPU (the interpreter is a test tool); the same on every rank."""
        return "triton" if self.q.device.type == "cuda" else "reference"

    def blocks(self, src: int, rank: int | None = None) -> list[RingBlock]:
        """The blocks of ``rank``'s (default: this rank's) queries against ``src``'s K/V
        (``ring_plan.ring_blocks``); empty when no query sees any of its keys."""
        rank = self.rank if rank is None else rank
        return ring_blocks(self.layout, self.world_size, rank, src, self.q.shape[1], self.causal,
                           self.window, self.packed_documents)

    @property
    def packed_documents(self) -> list[tuple[int, int]] | None:
        return self.documents if self.cu_seqlens is not None else None

    def block_mask(self, block: RingBlock) -> dict:
        """``attend_block``'s mask of ``block`` on tensors sliced to its rows and keys."""
        return dict(window=block.window, softcap=self.softcap, diag_offset=block.sliced_diag())

    def whole_mask(self) -> dict:
        """``attend_block``'s mask of the whole sequence in global order."""
        return dict(window=self.window, softcap=self.softcap)

    def chunks(self) -> list[tuple[int, int, int]]:
        """``(local start, global start, length)`` of this rank's chunks."""
        return rank_chunks(self.layout, self.world_size, self.rank, self.q.shape[1],
                           self.packed_documents)

    def positions(self, device) -> torch.Tensor:
        """``layout_positions`` of this call."""
        return layout_positions(self.layout, self.world_size, self.q.shape[1],
                                self.packed_documents, device)

    def to_global(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The rank-order concatenation of every rank's part (along ``dim``) in global order."""
        return x.index_select(dim, self.positions(x.device).argsort())

    def to_rank_order(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of ``to_global``."""
        return x.index_select(dim, self.positions(x.device))


def layout_positions(layout: str, world: int, seqlen: int, documents=None, device=None) -> torch.Tensor:
    """The global position (int64) of each row of the rank-order concatenation of every
    rank's ``seqlen`` rows in ``layout`` (``documents``: ``zigzag_docs``' ``[start, end)``
    ranges); ``gathered.index_select(dim, positions.argsort())`` is the global order."""
    return torch.cat([torch.arange(start, start + n, device=device) for rank in range(world)
                      for _, start, n in rank_chunks(layout, world, rank, seqlen, documents)])


def check_ring_inputs(op: str, q, k, v, layout: str, world: int, cu_seqlens=None) -> None:
    check_attention_inputs(op, q, k, v)
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"fusedpar.{op}: with cu_seqlens (packed documents) the batch must be "
                             f"1 (the pack), got B={q.shape[0]}")
        check_cu_seqlens(op, cu_seqlens, world * q.shape[1], q.device,
                         "the global sequence (W * S_local) has ")
    if layout not in LAYOUTS:
        raise ValueError(f"fusedpar.{op}: layout={layout!r}; choose one of {LAYOUTS}")
    if layout == "zigzag_docs":
        check_documents(op, cu_seqlens, world)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"fusedpar.{op}: q has S_local={q.shape[1]} but k/v have {k.shape[1]}; "
                         "every rank holds the same positions of q, k and v")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(
            f"fusedpar.{op}: layout 'zigzag' needs the global sequence length W*S_local = "
            f"{world * q.shape[1]} divisible by 2W = {2 * world}, i.e. an even S_local (got "
            f"{q.shape[1]}); pad the sequence to a multiple of {2 * world} or use "
            "layout='contiguous'"
        )


def check_documents(op: str, cu_seqlens, world: int) -> None:
    """``layout="zigzag_docs"``'s needs: ``cu_seqlens`` (checked by the caller otherwise), and
    every document a multiple of ``2W`` long (cut into ``2W`` equal chunks)."""
    if cu_seqlens is None:
        raise ValueError(f"fusedpar.{op}: layout='zigzag_docs' shards each packed document; pass "
                         "cu_seqlens (the documents' cumulative ends over the global sequence), "
                         "or use layout='zigzag' for one sequence")
    odd = _uneven_documents(cu_seqlens, world)
    if odd:
        shown = ", ".join(f"document {i}: {n}" for i, n in odd[:4]) + (", ..." if len(odd) > 4 else "")
        raise ValueError(f"fusedpar.{op}: layout='zigzag_docs' cuts every document into 2W = "
                         f"{2 * world} equal chunks, but cu_seqlens has document lengths that are "
                         f"not multiples of {2 * world} ({shown}); pad each document to a multiple "
                         f"of {2 * world}, or use layout='zigzag' (the whole packed row zigzag)")


def packed_layout(cu_seqlens: torch.Tensor, world: int) -> str:
    """The zigzag layout for a packed row: ``"zigzag_docs"`` when every document of
    ``cu_seqlens`` is a multiple of ``2W`` long (each document's causal work balanced over
    the ranks), else ``"zigzag"`` (the whole row; the same results, balanced over the row)."""
    return "zigzag" if _uneven_documents(cu_seqlens, world) else "zigzag_docs"


def _uneven_documents(cu_seqlens: torch.Tensor, world: int) -> list[tuple[int, int]]:
    """``(index, length)`` of the documents of ``cu_seqlens`` not a multiple of ``2W`` long."""
    ends = host_list(cu_seqlens)
    return [(i, b - a) for i, (a, b) in enumerate(zip(ends, ends[1:])) if (b - a) % (2 * world)]


def merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> None:
    """Fold a block's ``(out, lse)`` into the fp32 accumulators at ``rows`` (stable update:
    ``lse' = logaddexp(lse, lse_b)``, ``out' = out e^(lse - lse') + out_b e^(lse_b - lse')``)."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    keep = torch.exp(old - new).transpose(1, 2).unsqueeze(-1)
    take = torch.exp(block_lse - new).transpose(1, 2).unsqueeze(-1)
    out[:, rows] = out[:, rows] * keep + block_out.float() * take
    lse[:, :, rows] = new


def _rows(stat: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The ``rows`` of an lse-layout ``[B, H, S]`` tensor, or None."""
    return None if stat is None else stat[:, :, rows]


def _kv_grads(dkv: torch.Tensor, dtype: torch.dtype):
    """dK, dV from a stacked ``[2, ...]`` gradient, as separate tensors (op outputs may not
    alias each other)."""
    return dkv[0].to(dtype, copy=True), dkv[1].to(dtype, copy=True)


def _accumulators(q):
    b, s, h, _ = q.shape
    return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
            torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class RingBackend(Backend):
    """A ring_attention backend. ``run(call)``, the op's forward (``out`` and ``lse``
    contiguous, as the fake's), is what ``Backend.plan``'s default plan calls."""

    def run(self, call: RingCall):
        out, lse = self.forward(call)
        return out.contiguous(), lse.contiguous()


def packed_reason(call: RingCall) -> list[str]:
    return (["packed documents (cu_seqlens) run on the triton, pipelined and allgather_kv backends"]
            if call.cu_seqlens is not None else [])


class Pipelined(RingBackend):
    """W steps around the ring: the K/V block received at step s is sent on at step s+1
    while the attention of step s runs (async P2P: gloo on CPU, NCCL on GPU). Backward:
    K/V travel the ring again and each block's dK/dV accumulator travels with it, reaching
    its owner after W-1 hops; the owner's own block stays local. The accumulator travels in
    the input dtype (each rank adds its part in fp32 and rounds once per hop), so a call
    moves the lower bound (W-1) (|K/V| + |dK/dV|) of a ring. The backward passes each step
    the final out and lse of its rows (as ring-flash-attn does)."""

    name = "pipelined"

    def step(self, call: RingCall) -> str:
        """The flash_attention backend of each ring step."""
        return call.local

    def forward(self, call: RingCall):
        C.raise_on_mismatch(call)
        world, rank = call.world_size, call.rank
        _, left, right = C.ring_neighbours(call.group)
        q = call.q
        kv = torch.stack([call.k, call.v])
        bufs = [kv, torch.empty_like(kv)]
        out, lse = _accumulators(q)
        for step in range(world):
            src, current = (rank - step) % world, bufs[step % 2]
            if step < world - 1:
                requests = C.exchange(current, bufs[(step + 1) % 2], left, right, call.group)
            for block in call.blocks(src):
                rows, keys = slice(*block.rows), slice(*block.keys)
                merge(out, lse, rows, *attend_block(q[:, rows], current[0][:, keys],
                                                    current[1][:, keys], block.causal, call.scale,
                                                    self.step(call), call.block_mask(block)))
            if step < world - 1:
                for request in requests:
                    request.wait()
        counters.record(OP, self.name, (world - 1) * _nbytes(kv))
        return out.to(q.dtype), lse

    def backward(self, call: RingCall, out, lse, dout, dlse):
        world, rank = call.world_size, call.rank
        _, left, right = C.ring_neighbours(call.group)
        q = call.q
        kv = torch.stack([call.k, call.v])
        bufs = [kv, torch.empty_like(kv)]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        own = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        travelling = [torch.zeros_like(kv), torch.empty_like(kv)]  # accumulators of others' K/V
        grad_requests = []
        for step in range(world):
            src, current = (rank - step) % world, bufs[step % 2]
            if step < world - 1:
                kv_requests = C.exchange(current, bufs[(step + 1) % 2], left, right, call.group)
            for request in grad_requests:  # this step's accumulator has arrived
                request.wait()
            # the partial dK/dV of src's block, added to in fp32 (in place when fp32)
            acc = own if step == 0 else travelling[(step - 1) % 2].float()
            for block in call.blocks(src):
                rows, keys = slice(*block.rows), slice(*block.keys)
                bdq, bdk, bdv = attend_block_backward(
                    q[:, rows], current[0][:, keys], current[1][:, keys], out[:, rows],
                    lse[:, :, rows], dout[:, rows], _rows(dlse, rows), block.causal, call.scale,
                    self.step(call), call.block_mask(block))
                dq[:, rows] += bdq
                acc[0][:, keys] += bdk
                acc[1][:, keys] += bdv
            if step > 0:  # pass the accumulator on; receive the next (own, after the last step)
                sending = acc.to(kv.dtype)  # dK/dV travel in the input dtype, like K/V
                grad_requests = C.exchange(sending, travelling[step % 2], left, right, call.group)
            if step < world - 1:
                for request in kv_requests:
                    request.wait()
        for request in grad_requests:
            request.wait()
        if world > 1:
            own += travelling[(world - 1) % 2]
        counters.record(OP, self.name, 2 * (world - 1) * _nbytes(kv))  # K/V, then dK/dV
        return dq.to(q.dtype), *_kv_grads(own, q.dtype)


class PipelinedSdpa(Pipelined):
    """The pipelined ring with torch's attention kernel per step (flash_attention's ``sdpa``:
    flash, cuDNN or memory-efficient on CUDA, flash on CPU), merged by the same
    online-softmax rule; what ring-flash-attn and torch's ``context_parallel`` do. A backward
    whose lse has a gradient runs on another ring (torch's backward ops take none)."""

    name = "pipelined_sdpa"

    def not_supported_reasons(self, call: RingCall) -> list[str]:
        # the own (diagonal) block stands for every step: the others differ only in lengths
        block = AttentionCall(call.q, call.k, call.v, call.causal, call.scale, lse_grad=call.lse_grad,
                              window=call.window, softcap=call.softcap)
        return packed_reason(call) + FLASH_DISPATCHER.backends["sdpa"].not_supported_reasons(block)

    def step(self, call: RingCall) -> str:
        return "sdpa"


class TritonRing(Pipelined):
    """Symmetric memory, each peer's K/V crossing the link once per call: every rank stages
    its K/V in its symmetric buffer and raises READY; then, per ring step, a copy kernel
    waits for the step's source (bounded, fingerprint checked) and copies the K/V rows this
    rank's queries can see into one of two local slots (counting the bytes), while the
    attention kernel of the previous step folds its slot into fp32 online-softmax state
    (own K/V first; causally masked blocks are neither copied nor computed). On GPU the
    copies run on a side stream, so step s+1's copy overlaps step s's attention. The last
    attention launch ends the call (DONE to the peers, NaN outputs on failure). Per call
    signature a plan (``_Ring``) holds the launches, slots and state; a call without packed
    documents may be captured in a CUDA graph. The backward pass is the pipelined ring's
    (K/V and dK/dV once around the ring)."""

    name = "triton"

    def not_supported_reasons(self, call: RingCall) -> list[str]:
        reasons = C.triton_reasons(call)
        if call.q.dtype not in KERNEL_DTYPES:
            reasons.append(f"dtype {call.q.dtype} (the kernel takes float32, float16, bfloat16)")
        return reasons

    def plan(self, call: RingCall) -> _Ring:
        """The calls of ``call``'s signature on the group's buffer (the plan's ``buf``)."""
        buf = get_buffer(call.group, 2 * _nbytes(call.k), call.q.device)
        return _Ring(call, [buf])

    def forward(self, call: RingCall):
        return self.plan(call)(call.q, call.k, call.v, call.cu_seqlens)

    def run_views(self, bufs, qs, ks, vs, call: RingCall):
        """``[(out, lse)]`` per rank view in ``bufs`` (one, or all W for loopback)."""
        return _Ring(call, bufs, any_strides=True).run_views(qs, ks, vs)


# Buffer (rank view) -> {signature: the ring's fp32 state and K/V slots}. Calls on one buffer
# run one after another on the device (``SymmetricBuffer.next_epoch`` orders a call's stream
# after the last call's), so every plan of one shape on a buffer shares one workspace; it
# lives as long as the buffer does (a buffer a CUDA graph was captured on outlives its
# replacement, and so does what the graph's launches write).
_WORKSPACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _workspace(buf, q_shape, kv_shape, dtype: torch.dtype, device: torch.device, slots: int):
    """``((acc, stat), [slot] * slots)`` of calls of these shapes on ``buf``, made once."""
    kept = _WORKSPACES.get(buf)
    if kept is None:
        kept = _WORKSPACES[buf] = {}
    key = (tuple(q_shape), tuple(kv_shape), dtype, slots)
    if key not in kept:
        b, s, h, _ = q_shape
        state = (torch.empty(q_shape, dtype=torch.float32, device=device),
                 torch.empty(2, b, h, s, dtype=torch.float32, device=device))
        kept[key] = state, [torch.empty(kv_shape, dtype=dtype, device=device) for _ in range(slots)]
    return kept[key]


def _copy_stream(device: torch.device):
    """The stream the K/V copies run on (None: in stream order, on CPU)."""
    return C.side_stream(device) if device.type == "cuda" else None


# The ops of one rank's ring (``ring_schedule``): K/V copies of a peer (on the side stream
# where there is one), a wait of the main stream for a copy, an attention step.
COPY, WAIT, STEP = "copy", "wait", "step"


def ring_schedule(peers: list[int], has_blocks: dict[int, bool], own_steps: int,
                  peer_steps: dict[int, int]) -> list[tuple[str, int]]:
    """The order of one rank's ops: ``(COPY, i)`` (peer ``peers[i]``'s copies into slot
    ``i % 2``), ``(WAIT, i)`` (the main stream waits for copy ``i``), ``(STEP, j)`` (the j-th
    attention launch, own blocks first, then each peer's in ``peers`` order). Copy ``i + 1``
    is issued after the steps that last read its slot (those of peer ``i - 1``); the last
    step ends the call, so every copy precedes it: copies after it (peers none of whose keys
    this rank sees: a fingerprint check, no rows) move before it, and the main stream waits
    for the last copy right before it."""
    ops: list[tuple[str, int]] = [(COPY, 0)] if peers else []
    steps = 0
    ops += [(STEP, j) for j in range(own_steps)]
    steps += own_steps
    for i, src in enumerate(peers):
        if i + 1 < len(peers):
            ops.append((COPY, i + 1))
        if has_blocks[src]:
            ops.append((WAIT, i))
            ops += [(STEP, steps + j) for j in range(peer_steps[src])]
            steps += peer_steps[src]
    if not steps or not peers:
        return ops
    last = max(n for n, (kind, _) in enumerate(ops) if kind == STEP)
    head = ops[:last] + [op for op in ops[last + 1:] if op[0] == COPY]
    join = (WAIT, len(peers) - 1)  # copies are issued in peer order: the last one's
    return head + ([join] if head[-1] != join else []) + [ops[last]]


class _RingView:
    """One rank view's part of ``_Ring``: its staged K/V, copy and step launches in order."""

    def __init__(self, ring: _Ring, call: RingCall, buf, q: torch.Tensor, workspace):
        rank, world = buf.rank, buf.world_size
        self.ring, self.buf, self.rank, self.pad_table = ring, buf, rank, buf.pad_table
        self.staged = buf.data(ring.dtype, ring.kv_numel)  # this rank's K/V, flat
        state, slots = workspace
        blocks = {src: call.blocks(src, rank) for src in range(world)}
        peers = [(rank - step) % world for step in range(1, world)]
        sources = [(rank, self.staged.view(ring.kv_shape))]
        sources += [(src, slots[i % 2]) for i, src in enumerate(peers)]
        steps = [(src, kv, block) for src, kv in sources for block in blocks[src]]
        launches = []
        for j, (src, kv, block) in enumerate(steps):
            launches.append(kernels.RingStep(
                q, kv, state, buf.pad_table, rank, src, block.rows[0], block.keys, block.causal,
                call.scale, first=j == 0, last=j == len(steps) - 1, row_hi=block.rows[1],
                diag=block.diag, window=block.window, softcap=call.softcap, world_size=world,
                end=j == len(steps) - 1))
        # a launch of no programs ends nothing: DONE then takes a launch of its own
        self.ends = bool(launches) and launches[-1].grid[0] > 0
        copies = [[kernels.RingCopy(slots[i % 2], buf.pad_table, rank, world, 0, ring.meta,
                                    ring.timeout_ns, src, rows, sms=ring.sms)
                   for rows in key_ranges(blocks[src]) or [(0, 0)]] for i, src in enumerate(peers)]
        schedule = ring_schedule(peers, {src: bool(blocks[src]) for src in peers}, len(blocks[rank]),
                                 {src: len(blocks[src]) for src in peers})
        if ring.side is None:  # in stream order: the copies and steps one after another
            self.ops = [launch for kind, i in schedule if kind != WAIT
                        for launch in (copies[i] if kind == COPY else [launches[i]])]
        else:
            events = [torch.cuda.Event() for _ in copies]
            self.fork = torch.cuda.Event()
            self.ops = [(kind, (copies[i], events[i]) if kind == COPY else
                         events[i] if kind == WAIT else launches[i]) for kind, i in schedule]

    def attend(self, q: torch.Tensor):
        """This rank's ``(out, lse)`` once every rank has staged (its K/V is in ``staged``)."""
        ring = self.ring
        out = torch.empty(ring.q_shape, dtype=ring.dtype, device=ring.device)
        lse = torch.empty(ring.lse_shape, dtype=torch.float32, device=ring.device)
        stats = C.stats_tensor(ring.device)
        if ring.side is None:
            for launch in self.ops:
                launch(q, out, lse, stats)
        else:
            self._attend_on_streams(q, out, lse, stats)
        if not self.ends:
            signal_kernels.signal_peers(self.pad_table, pad_layout.DONE, self.rank, ring.world, 0, -1)
        counters.record(OP, "triton", stats)
        return out, lse

    def _attend_on_streams(self, q, out, lse, stats) -> None:
        """The ops with the copies on the side stream, each after what the current stream
        has queued (the slot it fills was last read there)."""
        side = self.ring.side
        main = torch.cuda.current_stream()
        try:
            for kind, item in self.ops:
                if kind == STEP:
                    item(q, out, lse, stats)
                elif kind == WAIT:
                    main.wait_event(item)
                else:
                    copies, done = item
                    self.fork.record(main)
                    side.wait_event(self.fork)
                    torch.cuda.set_stream(side)
                    for launch in copies:
                        launch(q, out, lse, stats)
                    done.record(side)
                    torch.cuda.set_stream(main)
        finally:
            torch.cuda.set_stream(main)


class _Ring:
    """The triton ring's calls of one signature on a set of rank views (one, or all W of a
    loopback): the fingerprint and description, and per view (``_RingView``) the blocks,
    the launches of ``ring_kv_copy`` and ``ring_attn_step`` with their grids and configs,
    in order; the slots and fp32 state are the buffer's (``_workspace``). Calling it runs a
    group's call (a plan of ``Plans``: ``buf`` is the group's buffer). Nothing of a call
    without packed documents depends on a host value a replay would freeze (the kernels take
    the epoch from the device), so it may be captured in a CUDA graph; a packed call's
    documents are baked into its launches, so it refuses capture."""

    def __init__(self, call: RingCall, bufs, any_strides: bool = False):
        """``any_strides``: the calls' q may have other strides than ``call.q`` (a loopback's
        ranks): each is made contiguous."""
        q, k = call.q, call.k
        self.world, self.device, self.dtype = call.world_size, q.device, q.dtype
        self.kv_shape, self.kv_numel = (2, *k.shape), 2 * k.numel()
        b, s, h, _ = q.shape
        self.q_shape, self.lse_shape = tuple(q.shape), (b, h, s)
        self.meta, self.desc = call.fingerprint(), call.description()
        self.graphable = call.cu_seqlens is None
        self.timeout_ns = bufs[0].timeout_ns  # a plan lives until the settings change
        self.sms = signal_kernels.sm_count(q.device)
        self.side = _copy_stream(q.device)
        # the steps read q rows whose last dim is contiguous, with the strides of the plan's q
        self.q_copy = any_strides or q.stride(-1) != 1
        like = q.contiguous() if self.q_copy else q
        workspace = _workspace(bufs[0], q.shape, self.kv_shape, q.dtype, q.device,
                               min(2, self.world - 1))
        self.views = [_RingView(self, call, buf, like, workspace) for buf in bufs]
        self.buf = bufs[0]

    def _stage(self, view: _RingView, k: torch.Tensor, v: torch.Tensor) -> None:
        view.buf.publish(self.desc)  # before READY: what peers read after a mismatch
        signal_kernels.stage(torch.stack([k, v]), view.staged, view.pad_table, view.rank, self.world,
                             self.meta, self.timeout_ns, sms=self.sms)

    def __call__(self, q, k, v, cu_seqlens=None):
        """A group's call: this rank's ``(out, lse)``."""
        view = self.views[0]
        buf = view.buf
        buf.next_epoch(self.graphable, kernel_advances=True)
        self._stage(view, k, v)
        out_lse = view.attend(q.contiguous() if self.q_copy else q)
        buf.finish(OP)
        return out_lse

    def run_views(self, qs, ks, vs) -> list:
        """Every view's ``(out, lse)``: all stage before any attends, so one process can play
        every rank."""
        for view in self.views:
            view.buf.next_epoch(self.graphable, kernel_advances=True)
        for view, k, v in zip(self.views, ks, vs):
            self._stage(view, k, v)
        results = [view.attend(q.contiguous() if self.q_copy else q) for view, q in zip(self.views, qs)]
        for view in self.views:
            view.buf.finish(OP)
        return results


def _global_kv(call: RingCall, kv: torch.Tensor) -> torch.Tensor:
    """All-gather ``[2, B, S_local, H_kv, D]`` and put the sequence in global order."""
    gathered = all_gather(kv, 2, call.group, backend=None if kv.is_cuda else "reference")
    return call.to_global(gathered, 2)


class AllGatherKV(RingBackend):
    """All-gather K/V (``fusedpar.ops.all_gather``), then attend locally: each local query
    chunk (cut at document boundaries when packed) to the part of its document before it
    (full) and to itself (causal). The choice for GQA with few KV heads, and for packed
    documents that cross ranks. Backward: gather again, reduce-scatter dK/dV."""

    name = "allgather_kv"

    def _blocks(self, call: RingCall):
        """Each local query chunk, cut at document ends, against its document's keys (in
        global order) that the window reaches: RingBlocks of local rows and global keys."""
        for first, g, n in call.chunks():  # local row first holds global position g
            for start, end in call.documents:
                lo, hi = max(start, g), min(end, g + n)  # queries of this document
                if lo < hi:
                    local = first + lo - g
                    block = band_block((local, local + hi - lo), (start, end), lo - local,
                                       call.causal, call.window)
                    if block is not None:
                        yield block

    def forward(self, call: RingCall):
        C.raise_on_mismatch(call)
        kv = _global_kv(call, torch.stack([call.k, call.v]))
        out, lse = _accumulators(call.q)
        for block in self._blocks(call):
            rows, keys = slice(*block.rows), slice(*block.keys)
            merge(out, lse, rows, *attend_block(call.q[:, rows], kv[0][:, keys], kv[1][:, keys],
                                                block.causal, call.scale, call.local,
                                                call.block_mask(block)))
        return out.to(call.q.dtype), lse

    def backward(self, call: RingCall, out, lse, dout, dlse):
        kv = _global_kv(call, torch.stack([call.k, call.v]))
        q = call.q
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for block in self._blocks(call):
            rows, keys = slice(*block.rows), slice(*block.keys)
            bdq, bdk, bdv = attend_block_backward(q[:, rows], kv[0][:, keys], kv[1][:, keys],
                                                  out[:, rows], lse[:, :, rows], dout[:, rows],
                                                  _rows(dlse, rows), block.causal, call.scale,
                                                  call.local, call.block_mask(block))
            dq[:, rows] += bdq
            dkv[0][:, keys] += bdk
            dkv[1][:, keys] += bdv
        own = reduce_scatter(call.to_rank_order(dkv, 2), "sum", 2, call.group,  # to the owners
                             backend=None if q.is_cuda else "reference")
        return dq.to(q.dtype), *_kv_grads(own, q.dtype)


def _to_heads(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """``[B, S_local, H, ...]`` sequence-sharded to ``[B, W*S_local, H/W, ...]`` head-sharded
    (sequence in rank order)."""
    b, s, h = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, s, world, h // world, *rest).movedim(2, 0).contiguous()
    recv = torch.empty_like(send)
    C.all_to_all_single(recv, send, group)
    counters.record(OP, "ulysses", (world - 1) * _nbytes(send) // world)
    return recv.movedim(0, 1).reshape(b, world * s, h // world, *rest)


def _to_sequence(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """The inverse of ``_to_heads``."""
    b, total, hw = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, world, total // world, hw, *rest).movedim(1, 0).contiguous()
    recv = torch.empty_like(send)
    C.all_to_all_single(recv, send, group)
    counters.record(OP, "ulysses", (world - 1) * _nbytes(send) // world)
    return recv.permute(1, 2, 0, *range(3, recv.dim())).reshape(b, total // world, world * hw, *rest)


class Ulysses(RingBackend):
    """All-to-all heads <-> sequence (every rank gets the whole sequence for H/W heads),
    attend locally, all-to-all back. K/V heads are replicated to W when H_kv < W."""

    name = "ulysses"

    def not_supported_reasons(self, call: RingCall) -> list[str]:
        world, heads, kv_heads = call.world_size, call.q.shape[2], call.k.shape[2]
        reasons = packed_reason(call)
        if heads % world:
            reasons.append(f"H={heads} query heads do not split over W={world} ranks (H % W != 0); "
                           "use a ring backend or a group whose size divides H")
        if kv_heads % world and world % kv_heads:
            reasons.append(f"H_kv={kv_heads} K/V heads neither split over nor replicate to "
                           f"W={world} ranks")
        return reasons

    @staticmethod
    def _heads(call: RingCall, *tensors):
        world, kv_heads = call.world_size, call.k.shape[2]
        out = []
        for i, t in enumerate(tensors):
            if i in (1, 2) and kv_heads < world:  # K/V: one replica per rank
                t = t.repeat_interleave(world // kv_heads, 2)
            out.append(call.to_global(_to_heads(t, world, call.group), 1))
        return out

    @staticmethod
    def _stat_heads(call: RingCall, stat: torch.Tensor) -> torch.Tensor:
        """An lse-layout ``[B, H, S_local]`` tensor to ``[B, H/W, S]`` in global order."""
        full = _to_heads(stat.transpose(1, 2), call.world_size, call.group)
        return call.to_global(full, 1).transpose(1, 2).contiguous()

    def forward(self, call: RingCall):
        C.raise_on_mismatch(call)
        world = call.world_size
        q, k, v = self._heads(call, call.q, call.k, call.v)
        out, lse = attend_block(q, k, v, call.causal, call.scale, call.local, call.whole_mask())
        out = _to_sequence(call.to_rank_order(out.to(call.q.dtype), 1), world, call.group)
        lse = _to_sequence(call.to_rank_order(lse.transpose(1, 2), 1), world, call.group)
        return out, lse.transpose(1, 2).contiguous()

    def backward(self, call: RingCall, out, lse, dout, dlse):
        world, kv_heads = call.world_size, call.k.shape[2]
        q, k, v, do = self._heads(call, call.q, call.k, call.v, dout)
        delta = self._stat_heads(call, delta_of(out, dout, dlse))  # moves far less than out
        grads = attend_block_backward(q, k, v, None, self._stat_heads(call, lse), do, None,
                                      call.causal, call.scale, call.local, call.whole_mask(), delta)
        dq, dk, dv = (_to_sequence(call.to_rank_order(g, 1), world, call.group) for g in grads)
        if kv_heads < world:  # sum the replicas' gradients
            b, s, _, d = dk.shape
            dk, dv = (g.view(b, s, kv_heads, world // kv_heads, d).sum(3) for g in (dk, dv))
        return dq, dk, dv


# pipelined_sdpa first: it is plain torch's way (torch's context_parallel: a ring with SDPA's
# kernels as its steps), and the other rings' step kernel measured slower than SDPA on the
# H100 (benchmarks/results); the rings are not tuned (no shape bucket), so this order is
# the choice wherever it can run (no window, softcap, packing or lse gradient)
DISPATCHER = Dispatcher(OP, [PipelinedSdpa(), TritonRing(), Pipelined(), Ulysses(), AllGatherKV()])


PLANS = Plans(OP)
CU_SEQLENS_ARG = 7  # cu_seqlens' index among the arguments after q, k, v (MASK_SCHEMA)


def _call(q, k, v, group_name_, causal, softmax_scale, window_left, window_right, softcap, layout,
          cu_seqlens, lse_grad=False) -> RingCall:
    group = resolve_group(group_name_)
    check_ring_inputs(OP, q, k, v, layout, dist.get_world_size(group), cu_seqlens)
    return RingCall(q, k, v, group, causal, softmax_scale, layout, cu_seqlens=cu_seqlens,
                    lse_grad=lse_grad, window=(window_left, window_right), softcap=softcap)


def _documents_key(op: str, q: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple:
    """A packed call's documents as part of its plan's key (their values shape the plan).
    Refuses CUDA-graph capture first: the values are read on the host (no read while
    capturing) and baked into the call's launches, which a replay would repeat whatever the
    documents of its step."""
    if symmetric.capturing(q.device):
        raise FusedparError(
            f"fusedpar.{op}: a call with packed documents (cu_seqlens) cannot be captured in a "
            "CUDA graph: the documents are read on the host and baked into the call, so every "
            "replay would attend within the documents of the capture. Run packed calls eagerly "
            "(capture the layers around them), or capture calls without cu_seqlens (rows of one "
            "sequence each, fixed shapes)")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        return None, type(cu_seqlens)  # no plan: its checks say what is wrong
    return tuple(host_list(cu_seqlens)), cu_seqlens.dtype, cu_seqlens.device


@torch.library.custom_op("fusedpar::ring_attention", mutates_args=(), schema=SCHEMA)
def _ring_attention_op(q, k, v, *args):
    cu_seqlens = args[CU_SEQLENS_ARG]
    documents = None if cu_seqlens is None else _documents_key(OP, q, cu_seqlens)
    key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
           v.shape, v.stride(), v.dtype, v.device, documents, args[:CU_SEQLENS_ARG],
           args[CU_SEQLENS_ARG + 1])
    plan = PLANS.get(key)
    # a ring's launches hold its buffer's addresses: once the group's buffer grew, a new plan
    # (unlike the fused matmuls', which follow it; so a step whose later call grows the
    # buffer needs a second eager step before a capture takes its ring)
    if plan is None or isinstance(plan, _Ring) and not plan.buf.live:
        plan = PLANS.make(key, q.device, lambda: _plan(q, k, v, *args))
    return plan(q, k, v, cu_seqlens)  # out and lse contiguous: the fake's layout


def _plan(q, k, v, *args):
    """Every call of this signature: checked, its backend chosen, then the backend's plan
    (the triton ring's ``_Ring``; a plain-torch ring's ``Backend.plan``)."""
    call = _call(q, k, v, *args[:-1])
    return DISPATCHER.select(call, args[-1]).plan(call)


@_ring_attention_op.register_fake
def _(q, k, v, *args):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("fusedpar::ring_attention_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _ring_attention_backward_op(q, k, v, out, lse, dout, dlse, *args):
    call = _call(q, k, v, *args[:-1], lse_grad=dlse is not None)
    grads = backward_backend(DISPATCHER, call, args[-1]).backward(call, out, lse, dout, dlse)
    return tuple(g.contiguous() for g in grads)


@_ring_attention_backward_op.register_fake
def _(q, k, v, out, lse, dout, dlse, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *ctx.args = inputs  # MASK_SCHEMA's arguments
    cu_seqlens = ctx.args[CU_SEQLENS_ARG]
    ctx.args[CU_SEQLENS_ARG] = None  # saved as a tensor
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    args = list(ctx.args)
    args[CU_SEQLENS_ARG] = cu_seqlens
    dq, dk, dv = _ring_attention_backward_op(q, k, v, out, lse, dout, dlse, *args)
    return (dq, dk, dv) + (None,) * len(args)


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def ring_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                            causal: bool = False, softmax_scale: float | None = None,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            mask_align: str = "top_left", layout: str = "zigzag",
                            cu_seqlens: torch.Tensor | None = None, backend: str | None = None):
    """``(out, lse)`` of attention over the sequence split across ``group``; the same as::

        unshard = partial(sequence_unshard, dim=1, layout=layout, cu_seqlens=cu_seqlens)
        out, lse = flash_attention(q, unshard(k), unshard(v), causal=causal, return_lse=True,
                                   ...)  # q at its global positions, per document if packed
        # = rows of flash_attention(unshard(q), unshard(k), unshard(v)) that this rank holds

    q: ``[B, S_local, H, D]``, k/v: ``[B, S_local, H_kv, D]``: this rank's part of the
    sequence in ``layout`` (``"zigzag"``: chunks ``r`` and ``2W-1-r`` of ``2W``, see
    ``fusedpar.parallel.zigzag_shard``; ``"contiguous"``: chunk ``r`` of ``W``;
    ``"zigzag_docs"``: chunks ``r`` and ``2W-1-r`` of each document of ``cu_seqlens``, every
    document a multiple of ``2W`` long, see ``fusedpar.parallel.sequence_shard``). ``lse`` is
    fp32 ``[B, H, S_local]``; both outputs are differentiable. The mask is
    ``flash_attention``'s by global position: ``window_size=(left, right)`` (query ``i``
    sees keys ``i - left .. i + right``; -1 unbounded; ``causal``: ``right = 0``), ``softcap``
    (Gemma 2's ``softcap * tanh(s / softcap)``); ``mask_align`` is accepted for
    flash-attn's signature, and both alignments are one here (q and k/v are the same
    sequence). Key blocks a rank's queries cannot see are neither moved (``triton``) nor
    computed. Backends: ``pipelined``
    (K/V around the ring by async P2P, overlapped with the blocks), ``pipelined_sdpa`` (that
    ring with torch's attention kernel and its lse per step, as torch's ``context_parallel``;
    flash_attention's ``sdpa`` limits: no window or softcap; the default where it runs),
    ``ulysses`` (all-to-all
    heads <-> sequence; needs ``H % W == 0``), ``allgather_kv`` (gather K/V, attend
    locally), ``triton`` (pulls each peer's K/V rows that this rank's queries see from
    symmetric memory once, overlapped with the blocks; its backward is the pipelined one).
    The local blocks run the flash-attention kernel on GPU. Packed documents:
    ``cu_seqlens`` (int32 cumulative ends over the *global* sequence, in global order,
    identical on every rank; B = 1; the sequence sharded as ``layout`` says: each document
    zigzag with ``"zigzag_docs"``, which balances each document's causal work, or the whole
    row) confines attention to each document, also across ranks (``triton``, ``pipelined``,
    ``allgather_kv``). Every rank must pass the same shapes; a difference raises
    ``ValueError`` before any K/V moves. Under ``torch.autocast``, q, k and v are cast to
    its dtype first, as SDPA's inputs are. The first call of a signature (shapes, strides,
    dtypes, arguments, documents) checks and plans; later ones only run. The ``triton``
    forward may be captured in a CUDA graph after one eager call of its signature, except
    with ``cu_seqlens`` (the documents are baked into the call: capture raises
    ``FusedparError``).
    """
    window, softcap, _ = check_mask_args(OP, window_size, softcap, mask_align)
    q, k, v = autocast_inputs(q, k, v)
    with autocast_off(q):
        return _ring_attention_op(q, k, v, group_name(group), bool(causal),
                                  default_scale(q, softmax_scale), *window, softcap, layout,
                                  cu_seqlens, backend or "")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                   causal: bool = False, softmax_scale: float | None = None,
                   window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   mask_align: str = "top_left", layout: str = "zigzag",
                   cu_seqlens: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """The output of ``ring_attention_with_lse`` (same arguments)."""
    return ring_attention_with_lse(q, k, v, group, causal=causal, softmax_scale=softmax_scale,
                                   window_size=window_size, softcap=softcap, mask_align=mask_align,
                                   layout=layout, cu_seqlens=cu_seqlens, backend=backend)[0]


def ring_attention_loopback(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], *,
                            causal: bool = False, softmax_scale: float | None = None,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            layout: str = "zigzag", cu_seqlens: torch.Tensor | None = None):
    """Every rank's part of ``ring_attention_with_lse`` in this process (rank r holds
    ``qs[r]``, ``ks[r]``, ``vs[r]``) over loopback symmetric buffers with the ``triton``
    kernel; returns each rank's ``(out, lse)``. Forward only: for single-device benchmarks
    and tests of the protocol. Calls of one signature (shapes, dtypes, mask, documents) reuse
    one plan; without ``cu_seqlens`` a call may be captured in a CUDA graph after an eager
    one."""
    world = len(qs)
    if world < 1 or len(ks) != world or len(vs) != world:
        raise ValueError(f"fusedpar.{OP}_loopback: qs, ks, vs must hold one tensor per simulated "
                         f"rank; got {len(qs)}, {len(ks)}, {len(vs)}")
    for r in range(world):
        for name, got, first in (("qs", qs[r], qs[0]), ("ks", ks[r], ks[0]), ("vs", vs[r], vs[0])):
            if got.shape != first.shape or got.dtype != first.dtype or got.device != first.device:
                raise ValueError(f"fusedpar.{OP}_loopback: {name}[{r}] is {tuple(got.shape)} "
                                 f"{got.dtype} on {got.device}, {name}[0] is {tuple(first.shape)} "
                                 f"{first.dtype} on {first.device}; they must match")
    window, softcap, _ = check_mask_args(f"{OP}_loopback", window_size, softcap, "top_left")
    q, k, v = qs[0], ks[0], vs[0]
    scale = default_scale(q, softmax_scale)
    documents = None if cu_seqlens is None else _documents_key(f"{OP}_loopback", q, cu_seqlens)
    bufs = get_loopback_buffers(world, 2 * _nbytes(k), q.device)  # remade after a failure
    key = (world, q.shape, q.dtype, q.device, k.shape, k.dtype, v.shape, v.dtype, bool(causal), scale,
           window, softcap, layout, documents)
    ring = LOOPBACK_PLANS.get(key)
    if ring is None or ring.buf is not bufs[0]:
        def build():
            check_ring_inputs(f"{OP}_loopback", q, k, v, layout, world, cu_seqlens)
            call = RingCall(q.contiguous(), k, v, None, bool(causal), scale, layout, world_size=world,
                            cu_seqlens=cu_seqlens, window=window, softcap=softcap)
            DISPATCHER.select(call, "triton")  # raises where the triton kernels cannot run
            return _Ring(call, bufs, any_strides=True)

        ring = LOOPBACK_PLANS.make(key, q.device, build)
    return ring.run_views(qs, ks, vs)


LOOPBACK_PLANS = Plans(f"{OP}_loopback")


# no reference backend: the tests' oracle is plain-torch attention over the whole sequence
register(DISPATCHER, (ring_attention, ring_attention_with_lse, ring_attention_loopback), oracle=None,
         example=lambda device: RingCall(
             *[torch.zeros(1, 2 * EXAMPLE_WORLD, 2, 16, device=device)] * 3, None, True, 0.25,
             "zigzag", world_size=EXAMPLE_WORLD))
