"""The expert-parallel SwiGLU expert MLP (``moe_experts``): dispatch -> grouped GEMM ->
SwiGLU -> grouped GEMM -> combine.

Backends (``pipelined`` is the default; ``fused`` runs when asked for):
- ``fused``: symmetric memory. Every rank stages its expert-sorted copies; each source's
  block of rows for this rank's experts is copied once into a local buffer (the copy
  engine on a side stream on a GPU, raising a per-source GATHERED flag), while the first
  grouped GEMM (``kernels.gemm_peers.grouped_mm_peers_kernel``) multiplies each source's
  rows as soon as its flag is up (own rank first) and applies SwiGLU to its fp32 gate and
  up tiles (the ``[rows, 2I]`` product is written only when autograd needs it); then the
  second grouped GEMM writes its tiles straight into the source ranks' buffers, where each
  rank reads its results back (no separate all-to-all). Both GEMMs tile runs of blocks: a
  tile may hold several sources' rows of one expert where they lie back to back (one expert
  per rank), so splitting the rows by source costs no partial tile per source. The backward
  pass is the same exchange over the output gradients (gather GEMM with w2 whose epilogue
  applies the SwiGLU vector-Jacobian product to its fp32 tiles, push GEMM with w13); the
  weight gradients are computed where the experts live, one launch each over every
  source's rows.
- ``pipelined``: the exchange split by source rank with async P2P (gloo on CPU, NCCL on
  GPU). A token travels once to each rank holding any of its experts (DeepEP's layout),
  after its expert ids and weights there (fp32, a few bytes a row); the receiver expands
  each row into its copies, sorted by expert, and returns one row per token: its copies'
  outputs, weighted and summed. Step ``s`` sends to ``rank + s`` and receives from
  ``rank - s`` (every pair is
  matched in the same step on both sides, so NCCL cannot deadlock); the expert GEMMs run on
  this rank's own tokens while the other sources' rows travel, then on each source's rows
  as they arrive, and each source's results go back as soon as they are done. The backward
  pass is the same pipeline over the output gradients (the weights' gradients are computed
  where the experts' outputs are, and go back after), then the weight gradients in one
  launch each. SwiGLU and its backward run in the grouped GEMMs' epilogues
  (``kernels.grouped_mm.grouped_mm_rows``), as in ``fused``. Each source's rows are their
  own GEMM, so each pays its partial tiles (~10% more tiles than one GEMM over all rows at
  W=8 with one expert per rank, ~40% with 32 experts per rank, counted on CPU).
- ``reference``: the unfused ops (``moe_dispatch`` -> ``grouped_mm`` -> ``swiglu`` ->
  ``grouped_mm`` -> ``moe_combine``). The only backend that takes ``max_tokens_per_rank``:
  the padded dispatch and ``grouped_mm(..., masked_m=)``, no host read.
Every backend moves only routed rows, once there and once back (no padding), in the
forward pass and again in the backward, and counts both: a row per token and rank holding
its experts (``pipelined``), or a row per routed copy (``fused``, ``reference``). ``moe_experts_loopback`` runs every rank's part in one
process (fused, or the unfused ops, over loopback symmetric buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..comm import counters, get_buffer, get_loopback_buffers, layout, resolve_group, symmetric
from ..errors import BackendNotSupportedError
from ..kernels import gemm_peers
from ..kernels import grouped_mm as kernels
from . import protocol as C
from .calls import CollectiveCall, REDUCE_DTYPES
from .backend import Backend, Dispatcher, autocast_inputs, autocast_off
from .grouped_mm import grouped_mm, runs_triton
from .moe import (_DTYPE_CODES, _check_same_everywhere, _eager_under_compile, _permute, _Permute,
                  _sort, _unpermute, _Unpermute, check_routing, checked_counts, exchange_counts,
                  host_to_device, moe_combine, moe_dispatch, swiglu)

OP = "moe_experts"


def check_expert_weights(op: str, x, w13, w2) -> None:
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fusedpar.{op}: w13 must be [E_local, 2I, H] and w2 [E_local, H, I], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"fusedpar.{op}: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 "
                         f"{tuple(w2.shape)} do not fit: need w13 [E_local, 2I, H={x.shape[1]}] and "
                         "w2 [E_local, H, I]")
    if not x.dtype == w13.dtype == w2.dtype:
        raise TypeError(f"fusedpar.{op}: x is {x.dtype}, w13 {w13.dtype} and w2 {w2.dtype}; cast "
                        "them to one dtype")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"fusedpar.{op}: x, w13 and w2 are {x.dtype}; the expert GEMMs take "
                        "float32, float16 or bfloat16")
    if not x.device == w13.device == w2.device:
        raise ValueError(f"fusedpar.{op}: x, w13 and w2 must be on one device, got {x.device}, "
                         f"{w13.device} and {w2.device}")


@dataclass
class ExpertsCall:
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    group: dist.ProcessGroup
    max_tokens_per_rank: int | None = None

    def cache_key(self) -> tuple:
        return (self.group.group_name, self.x.device.type, self.x.dtype,
                self.max_tokens_per_rank is None)

    def agree(self) -> tuple[int, int, int, int]:
        """Check (one tiny all-gather) that every rank passed the same sizes and dtype;
        returns ``(world, rank, experts per rank, k)``."""
        local, k = self.w13.shape[0], self.topk_idx.shape[1]
        _check_same_everywhere(OP, self.group, [self.x.shape[1], k, local, self.w13.shape[1],
                                                _DTYPE_CODES.get(self.x.dtype, 9)],
                               "hidden size, k, experts per rank, 2 x intermediate size, dtype")
        return dist.get_world_size(self.group), dist.get_rank(self.group), local, k

    def describe(self) -> str:
        return (f"x {tuple(self.x.shape)} {self.x.dtype} on {self.x.device.type}, topk_idx "
                f"{tuple(self.topk_idx.shape)}, w13 {tuple(self.w13.shape)}")


def _padded_reasons(call: ExpertsCall) -> list[str]:
    """Why the exchanges with host-read sizes cannot take ``max_tokens_per_rank``."""
    if call.max_tokens_per_rank is None:
        return []
    return ["max_tokens_per_rank asks for no host read, and this backend reads the routing "
            "counts on the host (the reference backend keeps them on the device)"]


class Reference(Backend):
    """The unfused ops of the docstring; with ``max_tokens_per_rank`` the padded dispatch
    and masked grouped GEMMs (``grouped_mm(..., masked_m=)``): no host read."""

    name = "reference"

    def run(self, call: ExpertsCall) -> torch.Tensor:
        num_experts = call.w13.shape[0] * dist.get_world_size(call.group)
        recv_x, tokens_per_expert, handle = moe_dispatch(
            call.x, call.topk_idx, call.topk_weights, num_experts, call.group,
            max_tokens_per_rank=call.max_tokens_per_rank)
        if call.max_tokens_per_rank is None:
            groups = dict(offs=tokens_per_expert.cumsum(0).to(torch.int32))
        else:  # recv_x [E_local, W * M, H]: only each expert's first rows are multiplied
            groups = dict(masked_m=tokens_per_expert)
        h = swiglu(grouped_mm(recv_x, call.w13.transpose(1, 2), **groups))
        return moe_combine(grouped_mm(h, call.w2.transpose(1, 2), **groups), handle)


@dataclass
class _Plan:
    """Who sends what to whom: ``send[d]`` rows to rank d, ``recv[s]`` rows from rank s;
    ``copies[s]`` the copies source s's rows hold (one per row unless the rows carry a token
    for several experts), in (local expert, token) order, ``offs[s]`` their group ends."""

    group: dist.ProcessGroup
    rank: int
    world: int
    send: list
    recv: list
    copies: list
    offs: torch.Tensor  # int32 [W, E_local]
    segment_ends: torch.Tensor  # int32 [W * E_local]: of the (source, expert) segments of all copies
    table: torch.Tensor | None = None  # fused: every rank's copies per expert (host, [W, E])
    k: int = 0
    keep_back: bool = True  # fused: the forward's results outlive the call (autograd saves them)

    @classmethod
    def from_counts(cls, group, rank: int, send_counts: torch.Tensor, recv_counts: torch.Tensor,
                    device: torch.device, rows: tuple[list, list] | None = None):
        """``send_counts[d, e]`` copies this rank sends to rank d's expert e, ``recv_counts[s,
        e]`` it receives from rank s for its expert e (host int ``[W, E_local]``); the group
        ends go to ``device`` in one copy that does not wait for its stream. ``rows``: the
        rows sent to and received from each rank, where not a row per copy."""
        ends = host_to_device(torch.cat([recv_counts.cumsum(1).flatten(),
                                         recv_counts.flatten().cumsum(0)]).to(torch.int32), device)
        world, copies = send_counts.shape[0], recv_counts.sum(1).tolist()
        send, recv = rows or (send_counts.sum(1).tolist(), copies)
        return cls(group, rank, world, send, recv, copies, ends[:recv_counts.numel()].view(world, -1),
                   ends[recv_counts.numel():])

    def send_rows(self, dst: int) -> slice:
        start = sum(self.send[:dst])
        return slice(start, start + self.send[dst])

    def peer_rows(self) -> int:
        """Rows one exchange there and back brings this rank from the others."""
        return sum(self.recv) - self.recv[self.rank] + sum(self.send) - self.send[self.rank]

    def recv_rows(self, src: int) -> slice:
        start = sum(self.recv[:src])
        return slice(start, start + self.recv[src])

    def copy_rows(self, src: int) -> slice:
        start = sum(self.copies[:src])
        return slice(start, start + self.copies[src])

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> list:
        """Start sending ``send`` to ``dst`` and receiving ``recv`` from ``src`` (empty ones
        are skipped: both sides know the counts)."""
        ops = []
        if send.shape[0]:
            ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(self.group, dst), self.group))
        if recv.shape[0]:
            ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(self.group, src), self.group))
        return dist.batch_isend_irecv(ops) if ops else []


def _pipeline(plan: _Plan, outgoing: torch.Tensor, incoming: torch.Tensor, compute) -> torch.Tensor:
    """Send ``outgoing``'s rows for each rank there, run ``compute(src, rows)`` on the rows
    of each source (own rank first, then in arrival order) and send each result back;
    returns the results of ``outgoing``'s rows, in its order. ``incoming`` receives the
    sources' rows (kept for the backward pass)."""
    rank, world = plan.rank, plan.world
    incoming[plan.recv_rows(rank)] = outgoing[plan.send_rows(rank)]
    arrivals = [plan.exchange(outgoing[plan.send_rows((rank + s) % world)], (rank + s) % world,
                              incoming[plan.recv_rows((rank - s) % world)], (rank - s) % world)
                for s in range(1, world)]
    returned = outgoing.new_empty(outgoing.shape[0], outgoing.shape[1])
    returned[plan.send_rows(rank)] = compute(rank, incoming[plan.recv_rows(rank)])
    replies = []
    for s in range(1, world):
        src, dst = (rank - s) % world, (rank + s) % world
        for request in arrivals[s - 1]:
            request.wait()
        result = compute(src, incoming[plan.recv_rows(src)])
        # result goes back to src; dst returns ours at the same step
        replies.append((result, plan.exchange(result, src, returned[plan.send_rows(dst)], dst)))
    for _, requests in replies:
        for request in requests:
            request.wait()
    return returned


def _swap(plan: _Plan, outgoing: torch.Tensor, incoming: torch.Tensor, back: bool = False) -> None:
    """``outgoing``'s rows for each rank into ``incoming``, as ``_pipeline`` moves them
    (``back``: the other way, each source's rows returned to it); waits for them."""
    there, here = (plan.recv_rows, plan.send_rows) if back else (plan.send_rows, plan.recv_rows)
    rank, world = plan.rank, plan.world
    incoming[here(rank)] = outgoing[there(rank)]
    steps = [plan.exchange(outgoing[there((rank + s) % world)], (rank + s) % world,
                           incoming[here((rank - s) % world)], (rank - s) % world)
             for s in range(1, world)]
    for requests in steps:
        for request in requests:
            request.wait()


def _grouped_swiglu(x_rows, w13, offs, act, h13=None, backend: str = "") -> None:
    """``act = swiglu(grouped_mm(x_rows, w13.transpose(1, 2), offs))``, and ``h13`` the
    product when given: one launch with SwiGLU in the GEMM's epilogue where grouped_mm runs
    Triton, else those ops. No autograd (the callers are autograd functions)."""
    b = w13.transpose(1, 2)
    if runs_triton(x_rows, b, offs, backend):
        kernels.grouped_mm_rows(x_rows, b, offs, act, epilogue="swiglu", h=h13)
        return
    product = grouped_mm(x_rows, b, offs, backend=backend)
    if h13 is not None:
        h13.copy_(product)
    act.copy_(swiglu(product))


def _grouped_swiglu_vjp(dy, w2, offs, h13, backend: str = "", out=None) -> torch.Tensor:
    """SwiGLU's backward at the forward's products ``h13`` of the gradient ``grouped_mm(dy,
    w2, offs)`` of its output (into ``out`` when given): in the GEMM's epilogue where
    grouped_mm runs Triton."""
    out = torch.empty_like(h13) if out is None else out
    if runs_triton(dy, w2, offs, backend):
        kernels.grouped_mm_rows(dy, w2, offs, out, epilogue="swiglu_vjp", h=h13)
        return out
    _, swiglu_vjp = torch.func.vjp(swiglu, h13)
    return out.copy_(swiglu_vjp(grouped_mm(dy, w2, offs, backend=backend))[0])


def _weight_grads(needs: tuple, w13, w2, plan: _Plan, x_rows, act, dy, dh13) -> tuple:
    """``(dw13, dw2)`` (None where autograd needs none) from every source's received rows
    (source-major, expert-sorted within): ``dw2[e] = Σ dyᵀ act`` and ``dw13[e] = Σ dh13ᵀ x``
    over expert e's rows. Where grouped_mm runs Triton, one launch per weight sums each
    expert's segments of every source (``kernels.grouped_mm_k(..., sources=W)``): not a
    launch, a whole-gradient write and an add per source."""
    grads = []
    for need, left, right, w in ((needs[0], dh13, x_rows, w13), (needs[1], dy, act, w2)):
        if not need:
            grads.append(None)
        elif runs_triton(left.t(), right, plan.segment_ends):
            grads.append(torch.empty_like(w))
            kernels.grouped_mm_k(left.t(), right, plan.segment_ends, grads[-1], sources=plan.world)
        else:
            grads.append(torch.zeros_like(w))
            for src in range(plan.world):
                rows = plan.copy_rows(src)
                if rows.stop > rows.start:
                    grads[-1] += grouped_mm(left[rows].t(), right[rows], plan.offs[src])
    return tuple(grads)


class _ExpertPipeline(torch.autograd.Function):
    """``rows`` (this rank's tokens, one row per token and rank holding one of its experts,
    sorted by that rank), their experts there (``ids``: local ids, -1 where the expert is
    elsewhere) and ``weights`` (0 there) -> per row, the weighted sum of the expert MLP
    outputs of its copies, computed on the rank owning them (DeepEP's layout: a token
    travels once to each rank, however many of its experts live there)."""

    @staticmethod
    def forward(ctx, rows, weights, w13, w2, ids, plan: _Plan):
        k, local = ids.shape[1], w13.shape[0]
        copies = sum(plan.copies)
        received = rows.new_empty(copies, rows.shape[1])  # every source's copies, expert-sorted
        keep_h = any(ctx.needs_input_grad[:4])
        h13 = rows.new_empty(copies, w13.shape[1]) if keep_h else None
        act = rows.new_empty(copies, w13.shape[1] // 2)
        out = rows.new_empty(copies, rows.shape[1]) if ctx.needs_input_grad[1] else None
        # each row's experts and weights (fp32, ids exact), before the rows themselves
        meta = torch.empty(sum(plan.recv), 2 * k, device=rows.device)
        _swap(plan, torch.cat([ids.float(), weights.float()], 1), meta)
        pos = torch.empty(meta.shape[0] * k, dtype=torch.int32, device=rows.device)

        def experts(src, x_rows):
            mine, r = plan.copy_rows(src), plan.recv_rows(src)
            if mine.stop == mine.start:
                return x_rows.new_zeros(x_rows.shape)
            src_pos = pos[r.start * k:r.stop * k]  # kept for the backward pass
            src_pos.copy_(_sort(meta[r, :k].long(), local)[0])
            received[mine] = _permute(x_rows, src_pos, k, mine.stop - mine.start)
            offs = plan.offs[src]
            _grouped_swiglu(received[mine], w13, offs, act[mine], None if h13 is None else h13[mine])
            y = grouped_mm(act[mine], w2.transpose(1, 2), offs)
            if out is not None:
                out[mine] = y
            return _unpermute(y, src_pos, k, x_rows.shape[0], meta[r, k:])

        back = _pipeline(plan, rows.contiguous(), rows.new_empty(sum(plan.recv), rows.shape[1]),
                         experts)
        counters.record(OP, "pipelined", plan.peer_rows() * rows.shape[1] * rows.element_size()
                        + (sum(plan.recv) - plan.recv[plan.rank]) * 2 * k * meta.element_size())
        # act (the down GEMM's input) for w2's gradient: kept, as autograd keeps silu's output
        ctx.save_for_backward(received, h13, act if ctx.needs_input_grad[3] else None, out, meta,
                              pos, w13, w2)
        ctx.plan, ctx.weights_dtype = plan, weights.dtype
        return back

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_back):
        received, h13, act, out, meta, pos, w13, w2 = ctx.saved_tensors
        plan, k = ctx.plan, meta.shape[1] // 2
        dh13 = torch.empty_like(h13)
        grad_copies = torch.empty_like(received)  # the down GEMMs' output gradients
        grad_meta = meta.new_zeros(meta.shape[0], k)  # of each received row's weights

        def experts_backward(src, dy):
            mine, r = plan.copy_rows(src), plan.recv_rows(src)
            if mine.stop == mine.start:
                return dy.new_zeros(dy.shape)
            src_pos, offs = pos[r.start * k:r.stop * k], plan.offs[src]
            if out is not None:  # d weight = <dy of the row, its copy's output>
                dots = (out[mine][src_pos.clamp(min=0).long()].float()
                        * dy.float().repeat_interleave(k, 0)).sum(-1)
                grad_meta[r] = torch.where(src_pos >= 0, dots, 0.0).view(-1, k)
            grad_copies[mine] = _permute(dy, src_pos, k, mine.stop - mine.start, meta[r, k:])
            dx = grouped_mm(_grouped_swiglu_vjp(grad_copies[mine], w2, offs, h13[mine],
                                                out=dh13[mine]), w13, offs)
            return _unpermute(dx, src_pos, k, dy.shape[0])

        # every rank runs the exchanges, whatever it needs, so the ranks stay in step
        grad_rows = _pipeline(plan, grad_back.contiguous(),
                              grad_back.new_empty(sum(plan.recv), grad_back.shape[1]), experts_backward)
        grad_weights = meta.new_empty(sum(plan.send), k)
        _swap(plan, grad_meta, grad_weights, back=True)
        counters.record(OP, "pipelined", plan.peer_rows() * grad_back.shape[1] * grad_back.element_size()
                        + (sum(plan.send) - plan.send[plan.rank]) * k * grad_weights.element_size())
        # the weight gradients once every source's rows are in (one launch each)
        return (grad_rows, grad_weights.to(ctx.weights_dtype),
                *_weight_grads(ctx.needs_input_grad[2:4], w13, w2, plan, received, act, grad_copies,
                               dh13), None, None)


class Pipelined(Backend):
    """Split by source rank with async P2P (see the module docstring)."""

    name = "pipelined"

    def not_supported_reasons(self, call: ExpertsCall) -> list[str]:
        backend = str(dist.get_backend(call.group)).lower()
        if "gloo" not in backend and "nccl" not in backend:
            return [f"needs point-to-point sends (gloo or NCCL), the group's backend is {backend}"]
        return _padded_reasons(call)

    def run(self, call: ExpertsCall) -> torch.Tensor:
        x, topk_idx, w13, group = call.x, call.topk_idx, call.w13, call.group
        world, rank, local, k = call.agree()
        _, header = _sort(topk_idx, local * world)
        # a row per token and rank holding one of its experts (none for a dropped copy)
        owner = torch.where(topk_idx >= 0, topk_idx // local, world).long()
        held = x.new_zeros(x.shape[0], world + 1, dtype=torch.int32).scatter_(1, owner, 1)[:, :world]
        sent, received = exchange_counts(OP, topk_idx, header, group, rows=held.sum(0))
        plan = _Plan.from_counts(group, rank, sent[:, :local], received[:, :local], x.device,
                                 rows=(sent[:, local].tolist(), received[:, local].tolist()))
        rows = sum(plan.send)
        dst, token = torch.nonzero_static(held.t(), size=rows).unbind(1)  # by rank, then token
        there = owner[token] == dst[:, None]
        ids = torch.where(there, topk_idx[token] % local, -1)
        weights = torch.where(there, call.topk_weights[token], 0)
        # row of each (token, rank), -1 where none: the permutation kernels move the rows
        # (and sum each token's rows back in fp32, in a fixed order)
        row_of = (held.t().flatten().cumsum(0) - 1).view(world, -1).t()
        pos = torch.where(held > 0, row_of, -1).to(torch.int32).flatten()
        back = _ExpertPipeline.apply(_Permute.apply(x, pos, world, rows), weights, w13, call.w2, ids,
                                     plan)
        return _Unpermute.apply(back, held.new_ones(held.shape, dtype=torch.float32), pos, world)


# ---- fused: symmetric memory ------------------------------------------------------------------


def _by_owner(table: torch.Tensor, local: int) -> tuple[np.ndarray, np.ndarray]:
    """``table`` (host ``[W, E]``, every rank's copies per expert) as ``[src, owner,
    expert]``: the copies, and where each (owner, expert) block starts in src's sorted copies."""
    world, host = table.shape[0], table.numpy().astype(np.int64)
    staged = host.cumsum(1) - host
    return host.reshape(world, world, local), staged.reshape(world, world, local)


def _groups(table: torch.Tensor, ranks: list[int], local: int) -> tuple:
    """The first GEMM's row blocks of each rank view in ``ranks``, own rank first: rows
    ``[src, expert, row in src's staged copies, row in the view's received rows, rows]``
    (int64 ``[G, 5]``, empty blocks left out, one view's blocks after another), their runs
    (``kernels.block_runs``: ``[R, 3]``, first block counted from the view's first), and
    how many blocks and runs each view has. ``table``: host int ``[W, E]``, every rank's
    copies per expert (a rank's copies are sorted by destination, then expert; the received
    rows are source-major). Whole-table numpy ops for every view at once: the host issues
    the first GEMM only after this (a Python loop over the blocks cost ~5 ms per call at
    W=8 with 32 experts per rank; torch ops ~0.4 ms, numpy ~0.1 ms on a CPU core)."""
    world = table.shape[0]
    counts, staged = _by_owner(table, local)
    by_owner = counts.transpose(1, 0, 2).reshape(world, -1)  # [owner, src * local + expert]
    local_starts = (by_owner.cumsum(1) - by_owner).reshape(world, world, local)  # [owner, src, expert]
    owner = np.asarray(ranks)[:, None]
    src = (owner + np.arange(world)) % world  # per view: its rank, rank + 1, ...
    shape = (len(ranks), world, local)
    blocks = np.stack([np.broadcast_to(src[..., None], shape), np.broadcast_to(np.arange(local), shape),
                       staged[src, owner], local_starts[owner, src], counts[src, owner]], axis=-1)
    kept = blocks[..., 4] > 0
    blocks, per_view = blocks[kept], kept.reshape(len(ranks), -1).sum(1)
    view_starts = per_view.cumsum() - per_view
    runs = gemm_peers.block_runs(blocks, view_starts[per_view > 0])  # no run crosses views
    view_of_run = np.repeat(np.arange(len(ranks)), per_view)[runs[:, 0]]
    runs[:, 0] -= view_starts[view_of_run]
    return (blocks, runs, per_view.tolist(),
            np.bincount(view_of_run, minlength=len(ranks)).tolist())


def _fused_exchange(bufs, outgoing, first_bs, second_bs, table: torch.Tensor, meta: int,
                    desc: list[int], keep_h: bool = False, h13s: list | None = None,
                    copy_back: bool = True):
    """``outgoing`` rows (per rank view, sorted like its copies) go to the ranks owning
    their experts, which compute ``epilogue(rows @ first_b[e]) @ second_b[e]`` and write the
    results straight back; one view per process, or all W in a loopback. ``epilogue`` runs
    in the gather GEMM. The forward (no ``h13s``): ``first_b = w13ᵀ``, swiglu,
    ``second_b = w2ᵀ``, the ``[rows, 2I]`` product kept only with ``keep_h``. The backward:
    ``w2``, the SwiGLU vector-Jacobian product at the forward's products ``h13s`` (per
    view), ``w13``. Returns per view ``(back, received, first product (None when not
    kept), the epilogue's output, bytes from peers)``: the results of its own rows in their
    order, the rows it received (source-major) and what the epilogue made of them.
    ``copy_back=False``: ``back`` is a view of this rank's region 2, valid until this rank's
    next exchange on the group's buffer (a peer writes there only after our next stage); for
    a caller that consumes it at once, not for one that autograd saves.

    Two epochs per call. Epoch 1: stage the rows (after DONE of the last call), READY;
    ``C.gathering`` copies each source's block of rows for this rank's experts (one
    contiguous block per source) into ``received`` and raises GATHERED per source (the copy
    engine on a GPU), while the gather GEMM multiplies each source's rows once its flag is
    up, own rank first; DONE. Epoch 2: the push GEMM writes each source's results into the
    source's region 2 (past every rank's staged rows; free, since the epoch-1 stage waited
    for every peer's DONE of the last call), READY; each rank waits for every owner's READY
    and reads its region 2; DONE. Each routed row crosses once each way.
    """
    world, local = table.shape[0], first_bs[0].shape[0]
    hidden, dtype = outgoing[0].shape[1], outgoing[0].dtype
    counts, staged = _by_owner(table, local)
    region2_rows = int(counts.sum((1, 2)).max())  # where region 2 starts in every rank's data
    region2 = region2_rows * hidden
    # per owner: the rows each source sends it, and where that block starts in the source's
    # sorted copies
    per_sources = counts.sum(2).T.tolist()
    firsts = staged[:, :, 0].T.tolist()
    launchers = C.TRITON_LAUNCHERS
    row_blocks, runs, blocks_per_view, runs_per_view = _groups(table, [buf.rank for buf in bufs],
                                                               local)
    # one copy for both tables (a pageable .to("cuda") would make each view's host wait for
    # the last view's GEMM)
    tables = host_to_device(torch.from_numpy(np.concatenate([row_blocks.ravel(), runs.ravel()])
                                             .astype(np.int32)), outgoing[0].device)
    split = row_blocks.size
    group_tables = list(zip(tables[:split].view(-1, 5).split(blocks_per_view),
                            tables[split:].view(-1, 3).split(runs_per_view)))
    run_rows = np.split(runs[:, 2], np.cumsum(runs_per_view)[:-1])
    epochs = [buf.next_epoch() for buf in bufs]
    for buf, x, epoch in zip(bufs, outgoing, epochs):
        C.stage(launchers, buf, x, epoch, meta, desc)
    states = []
    for buf, x, first_b, epoch, rows, group_table, h13 in zip(
            bufs, outgoing, first_bs, epochs, run_rows, group_tables, h13s or [None] * len(bufs)):
        rank, rows = buf.rank, rows.tolist()
        per_source = per_sources[rank]
        received = x.new_empty(sum(rows), hidden)
        width = first_b.shape[2]
        # forward: swiglu of the [gate | up] products; backward: their gradients
        product = x.new_empty(sum(rows), width) if h13 is None and keep_h else None
        mid = x.new_empty(sum(rows), width // 2 if h13 is None else 2 * width)
        blocks = []
        for src in ((rank + step) % world for step in range(world)):
            n, first = per_source[src], firsts[rank][src]
            at = sum(per_source[:src])
            staged = buf.data(dtype, (first + n) * hidden, rank=src)[first * hidden:]
            if n:
                blocks.append((src, received[at:at + n], staged.view(n, hidden)))
        with C.gathering(buf, blocks, epoch, meta, copy_engine=x.is_cuda):
            gemm_peers.grouped_mm_peers(received, first_b, mid, *group_table, rows, buf.pad_table,
                                     rank, world, epoch, buf.timeout_ns, push=False,
                                     epilogue="swiglu" if h13 is None else "swiglu_vjp",
                                     h=product if h13 is None else h13)
        peer_rows = sum(per_source) - per_source[rank]
        states.append((received, product, mid, group_table, rows, peer_rows))
    C.release(launchers, bufs, epochs, OP, [state[:3] for state in states])  # Nones skipped
    epochs = [buf.next_epoch() for buf in bufs]
    for buf, x, second_b, epoch, (_, _, mid, group_table, rows, _) in zip(
            bufs, outgoing, second_bs, epochs, states):
        gemm_peers.grouped_mm_peers(mid, second_b, x, *group_table, rows, buf.pad_table, buf.rank,
                                 world, epoch, buf.timeout_ns, push=True, c_row=region2_rows)
        launchers.signal_peers(buf.pad_table, layout.READY, buf.rank, world, epoch, -1)
    outs = []
    for buf, x, epoch, (received, product, mid, *_, peer_rows) in zip(bufs, outgoing, epochs,
                                                                       states):
        launchers.wait_flags(buf.pad_table, layout.READY, buf.rank, world, epoch, buf.timeout_ns,
                             layout.TIMEOUT_READY, meta)
        back = buf.data(dtype, region2 + x.numel())[region2:].view(x.shape)
        back = back.clone() if copy_back else back
        pushed_here = x.shape[0] - per_sources[buf.rank][buf.rank]
        outs.append((back, received, product, mid,
                     (peer_rows + pushed_here) * hidden * x.element_size()))
    C.release(launchers, bufs, epochs, OP, [out[0] for out in outs])  # NaN where a wait failed
    return outs


def _fused_forward(bufs, sorted_xs, w13s, w2s, table, meta, desc, keep_h: bool = False,
                   copy_back: bool = True):
    return _fused_exchange(bufs, sorted_xs, [w.transpose(1, 2) for w in w13s],
                           [w.transpose(1, 2) for w in w2s], table, meta, desc, keep_h=keep_h,
                           copy_back=copy_back)


def _fused_meta(hidden: int, w13: torch.Tensor, num_experts: int, k: int, dtype) -> tuple[int, list[int]]:
    return (symmetric.fingerprint(OP, dtype, hidden, tuple(w13.shape[1:]), num_experts, k),
            symmetric.describe_words(0, dtype, (hidden, w13.shape[1], num_experts, k), 0))


def _fused_nbytes(table: torch.Tensor, hidden: int, dtype: torch.dtype) -> int:
    """Every rank's data region: its staged copies, then region 2 (the same size)."""
    return 2 * int(table.sum(1).max()) * hidden * dtype.itemsize


def _fused_buffer(plan: _Plan, rows: torch.Tensor):
    """The group's symmetric buffer, large enough for an exchange of ``rows``."""
    return get_buffer(plan.group, _fused_nbytes(plan.table, rows.shape[1], rows.dtype), rows.device)


class _FusedExperts(torch.autograd.Function):
    """The fused expert MLP; its backward is the same exchange over the output gradients
    (``_fused_exchange`` with w2, the SwiGLU vector-Jacobian product in the gather GEMM's
    epilogue, and w13), the weight gradients computed where the experts live."""

    @staticmethod
    def forward(ctx, sorted_x, w13, w2, plan: _Plan):
        table, k = plan.table, plan.k
        buf = _fused_buffer(plan, sorted_x)
        meta, desc = _fused_meta(sorted_x.shape[1], w13, table.shape[1], k, sorted_x.dtype)
        (back, received, h13, act, nbytes), = _fused_forward([buf], [sorted_x.contiguous()], [w13],
                                                             [w2], table, meta, desc,
                                                             keep_h=any(ctx.needs_input_grad[:3]),
                                                             copy_back=plan.keep_back)
        counters.record(OP, "fused", nbytes)
        # act (the push GEMM's input) for w2's gradient: kept, as autograd keeps silu's output
        ctx.save_for_backward(received, h13, act if ctx.needs_input_grad[2] else None, w13, w2)
        ctx.plan, ctx.meta, ctx.desc = plan, meta, desc
        return back

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_back):
        received, h13, act, w13, w2 = ctx.saved_tensors
        plan = ctx.plan
        # a fingerprint of its own: a rank still in the forward pass cannot pass for one here
        meta = symmetric.fingerprint("backward", ctx.meta)
        buf = _fused_buffer(plan, grad_back)
        (grad_sorted, grad_received, _, dh13, nbytes), = _fused_exchange(
            [buf], [grad_back.contiguous()], [w2], [w13], plan.table, meta, ctx.desc, h13s=[h13])
        counters.record(OP, "fused", nbytes)
        return (grad_sorted, *_weight_grads(ctx.needs_input_grad[1:3], w13, w2, plan, received, act,
                                            grad_received, dh13),
                None)


class Fused(Backend):
    """Symmetric memory, both grouped GEMMs fused with the exchange (module docstring)."""

    name = "fused"

    def not_supported_reasons(self, call: ExpertsCall) -> list[str]:
        world = dist.get_world_size(call.group)
        reasons = C.triton_reasons(CollectiveCall(OP, call.x, 0, world, call.group))
        if call.x.dtype not in REDUCE_DTYPES:
            reasons.append(f"the fused kernels take float32, float16 or bfloat16, not {call.x.dtype}")
        return reasons + _padded_reasons(call)

    def run(self, call: ExpertsCall) -> torch.Tensor:
        x, topk_idx, w13, group = call.x, call.topk_idx, call.w13, call.group
        world, rank, local, k = call.agree()
        E = local * world
        pos, header = _sort(topk_idx, E)
        table = torch.empty(world * (E + 1), dtype=header.dtype, device=header.device)
        C.all_gather_single(table, header, group=group)
        table = checked_counts(OP, table.view(world, -1).cpu(), E, {rank: topk_idx})  # one host read
        plan = _Plan.from_counts(group, rank, table[rank].view(world, local),
                                 table[:, rank * local:(rank + 1) * local], x.device)
        plan.table, plan.k = table, k
        # the results are weighted and summed at once; kept only for topk_weights' gradient
        plan.keep_back = torch.is_grad_enabled() and call.topk_weights.requires_grad
        sorted_x = _Permute.apply(x, pos, k, sum(plan.send))
        back = _FusedExperts.apply(sorted_x, w13, call.w2, plan)
        return _Unpermute.apply(back, call.topk_weights, pos, k)


def _fused_loopback(xs, topk_idxs, topk_weights, w13s, w2s) -> list:
    world, local, k = len(xs), w13s[0].shape[0], topk_idxs[0].shape[1]
    hidden, dtype, E = xs[0].shape[1], xs[0].dtype, local * world
    sorts = [_sort(idx, E) for idx in topk_idxs]
    table = checked_counts(f"{OP}_loopback", torch.stack([header for _, header in sorts]).cpu(), E,
                           dict(enumerate(topk_idxs)))  # one host read
    sorted_xs = [_permute(x.contiguous(), pos, k, int(table[r].sum()))
                 for r, (x, (pos, _)) in enumerate(zip(xs, sorts))]
    bufs = get_loopback_buffers(world, _fused_nbytes(table, hidden, dtype), xs[0].device)
    meta, desc = _fused_meta(hidden, w13s[0], local * world, k, dtype)
    outs = _fused_forward(bufs, sorted_xs, w13s, w2s, table, meta, desc, copy_back=False)
    for *_, nbytes in outs:
        counters.record(OP, "fused", nbytes)
    return [_unpermute(back, pos, k, x.shape[0], w)
            for (back, *_), (pos, _), x, w in zip(outs, sorts, xs, topk_weights)]


# fused is chosen only when asked for (backend= or FUSEDPAR_BACKEND) until GPU timings back it
BACKENDS = Dispatcher(OP, [Pipelined(), Fused(), Reference()])


@_eager_under_compile
def moe_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, group=None, *,
                max_tokens_per_rank: int | None = None, backend: str | None = None):
    """The expert-parallel SwiGLU expert MLP; with every rank's tokens and experts in one
    process it is ``experts_dense(x, topk_idx, topk_weights, cat(w13s), cat(w2s))``. Here::

        recv_x, tokens_per_expert, handle = moe_dispatch(x, topk_idx, topk_weights, E, group)
        offs = tokens_per_expert.cumsum(0).int()
        h = swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs))
        return moe_combine(grouped_mm(h, w2.transpose(1, 2), offs), handle)

    ``w13 [E_local, 2I, H]`` / ``w2 [E_local, H, I]``: this rank's experts (global expert
    ``rank * E_local + e``). Gradients for x, w13, w2 and topk_weights.

    ``max_tokens_per_rank=M``: nothing is read on the host (``moe_dispatch``'s padded layout,
    then ``grouped_mm(recv_x, w, masked_m=tokens_per_expert)``), so the layer can be
    captured in a CUDA graph; the same limits and errors as ``moe_dispatch`` with M. Only
    the ``reference`` backend takes it (the others size their exchanges on the host).

    Backends: ``fused`` (symmetric memory: the first grouped GEMM multiplies each source's
    rows as soon as the copy engine has brought them, own rank first; the second writes straight
    into the source ranks' buffers; the backward the same over the gradients; only when
    asked for),
    ``pipelined`` (the default: the exchange split by source rank, async P2P overlapping the
    expert GEMMs, own tokens first) and
    ``reference`` (the unfused ops above; the default with ``max_tokens_per_rank``).
    Under ``torch.autocast``, x, w13 and w2 are cast to its dtype first, as ``torch.matmul``'s
    inputs are (``topk_weights`` keep theirs).
    """
    x, w13, w2 = autocast_inputs(x, w13, w2)
    group = resolve_group(group)
    check_expert_weights(OP, x, w13, w2)
    world = dist.get_world_size(group)
    check_routing(OP, x, topk_idx, topk_weights, w13.shape[0] * world, world, max_tokens_per_rank)
    call = ExpertsCall(x, topk_idx, topk_weights, w13, w2, group, max_tokens_per_rank)
    with autocast_off(x):
        return BACKENDS.select(call, backend or "").run(call)


def moe_experts_loopback(xs: list, topk_idxs: list, topk_weights: list, w13s: list, w2s: list, *,
                         backend: str | None = None) -> list:
    """Every rank's part of ``moe_experts`` in this process: rank r passes ``xs[r]``,
    ``topk_idxs[r]``, ``topk_weights[r]`` and holds experts ``w13s[r]`` / ``w2s[r]``; returns
    each rank's output, the same as ``experts_dense(xs[r], topk_idxs[r], topk_weights[r],
    cat(w13s), cat(w2s))``. Forward only; for single-device benchmarks and tests.
    Backends: ``fused`` (the default; loopback symmetric buffers, see ``moe_experts``) and
    ``reference``, the unfused ops over loopback symmetric buffers::

        dispatched = moe_dispatch_loopback(xs, topk_idxs, topk_weights, E)
        ys = [grouped_mm(swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs)),
                         w2.transpose(1, 2), offs)      # offs = tokens_per_expert.cumsum(0)
              for (recv_x, tokens_per_expert, _), w13, w2 in zip(dispatched, w13s, w2s)]
        return moe_combine_loopback(ys, [handle for _, _, handle in dispatched])
    """
    from .moe import moe_combine_loopback, moe_dispatch_loopback

    op = f"{OP}_loopback"
    world = len(xs)
    if world < 1 or not len(topk_idxs) == len(topk_weights) == len(w13s) == len(w2s) == world:
        raise ValueError(f"fusedpar.{op}: xs, topk_idxs, topk_weights, w13s and w2s must hold one "
                         f"entry per simulated rank; got {len(xs)}, {len(topk_idxs)}, "
                         f"{len(topk_weights)}, {len(w13s)}, {len(w2s)}")
    for r, (x, idx, w, w13, w2) in enumerate(zip(xs, topk_idxs, topk_weights, w13s, w2s)):
        check_expert_weights(op, x, w13, w2)
        check_routing(op, x, idx, w, w13.shape[0] * world, world)
        if w13.shape != w13s[0].shape:
            raise ValueError(f"fusedpar.{op}: w13s[{r}] is {tuple(w13.shape)} but w13s[0] "
                             f"{tuple(w13s[0].shape)}; every rank holds as many experts of one size")
    if backend not in (None, "", "fused", "reference"):
        raise BackendNotSupportedError(f"fusedpar.{op}: backend={backend!r}; choose 'fused' or "
                                       "'reference' (the unfused ops)")
    if backend in (None, "", "fused"):
        with torch.no_grad():
            return _fused_loopback(xs, topk_idxs, topk_weights, w13s, w2s)
    dispatched = moe_dispatch_loopback(xs, topk_idxs, topk_weights, w13s[0].shape[0] * world)
    ys = []
    with torch.no_grad():
        for (recv_x, tokens_per_expert, _), w13, w2 in zip(dispatched, w13s, w2s):
            offs = tokens_per_expert.cumsum(0).to(torch.int32)
            h = swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs))
            ys.append(grouped_mm(h, w2.transpose(1, 2), offs))
    return moe_combine_loopback(ys, [handle for _, _, handle in dispatched])
