"""The ``triton`` ring: K/V read from the peers' symmetric memory by copy kernels, a side
stream ahead of the attention kernels; a plan per call signature."""

from __future__ import annotations

import weakref

import torch

from ...comm import counters, get_buffer, layout as pad_layout
from ...kernels import flash_attention as kernels
from ...kernels import signal as signal_kernels
from .. import protocol
from ..flash_attention import KERNEL_DTYPES
from .blocks import key_ranges
from .call import OP, RingCall, nbytes
from .pipelined import Pipelined

class TritonRing(Pipelined):
    """Symmetric memory, each peer's K/V crossing the link once per call: every rank stages
    its K/V in its symmetric buffer and raises READY; then, per ring step, a copy kernel
    waits for the step's source (bounded, fingerprint checked) and copies the K/V rows this
    rank's queries can see into one of two local slots (counting the bytes), while the
    attention kernel of the previous step folds its slot into fp32 online-softmax state
    (own K/V first; causally masked blocks are neither copied nor computed). On GPU the
    copies run on a side stream, so step s+1's copy overlaps step s's attention. The last
    attention launch ends the call (DONE to the peers, NaN outputs on failure). Per call
    signature a plan (``RingPlan``) holds the launches, slots and state; a call without packed
    documents may be captured in a CUDA graph. The backward pass is the pipelined ring's
    (K/V and dK/dV once around the ring)."""

    name = "triton"

    def not_supported_reasons(self, call: RingCall) -> list[str]:
        reasons = protocol.triton_reasons(call)
        if call.q.dtype not in KERNEL_DTYPES:
            reasons.append(f"dtype {call.q.dtype} (the kernel takes float32, float16, bfloat16)")
        return reasons

    def plan(self, call: RingCall) -> RingPlan:
        """The calls of ``call``'s signature on the group's buffer (the plan's ``buf``)."""
        buf = get_buffer(call.group, 2 * nbytes(call.k), call.q.device)
        return RingPlan(call, [buf])

    def forward(self, call: RingCall):
        return self.plan(call)(call.q, call.k, call.v, call.cu_seqlens)

    def run_views(self, bufs, qs, ks, vs, call: RingCall):
        """``[(out, lse)]`` per rank view in ``bufs`` (one, or all W for loopback)."""
        return RingPlan(call, bufs, any_strides=True).run_views(qs, ks, vs)


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
    return protocol.side_stream(device) if device.type == "cuda" else None


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
    """One rank view's part of ``RingPlan``: its staged K/V, copy and step launches in order."""

    def __init__(self, ring: RingPlan, call: RingCall, buf, q: torch.Tensor, workspace):
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
        stats = protocol.stats_tensor(ring.device)
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


class RingPlan:
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

