"""What all_gather and reduce_scatter share: the call description, input checks, the
symmetric-memory protocol their ``triton`` and ``cuda`` backends run, and availability.

Protocol of one call (epoch e = this rank's EPOCH word + 1) on every rank, in stream order:
  1. wait DONE[p] >= e-1 for every peer p: nobody still reads our data region;
  2. copy the input into our data region; publish its fingerprint; raise READY[me] = e
     in every peer's pad (Triton: steps 1-2 are one kernel, ``signal.stage_kernel``, which
     also stores e in EPOCH);
  3. the pull kernel: per source, wait READY[src] >= e, compare fingerprints, read;
  4. raise DONE[me] = e in every peer's pad, NaN-fill the outputs of a failed call (Triton:
     the pull kernel's last program, ``signal.end_call``); surface any recorded timeout or
     mismatch (``SymmetricBuffer.finish``).
Step 1 of the next call, not a barrier at the end of this one, protects the buffer, so a
rank returns as soon as its own pulls are done. Every value a call's kernels compare comes
from the device (EPOCH) or is the same at every call of one signature (fingerprints), so a
call can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .. import _extension
from ..comm import counters, layout, symmetric
from .calls import CollectiveCall, REDUCE_DTYPES, check_dim, check_dtype
from .backend import Backend
from ..kernels import all_gather as all_gather_kernels
from ..kernels import csrc as csrc_launchers
from ..kernels import reduce_scatter as reduce_scatter_kernels
from ..kernels import signal as signal_kernels
from ..kernels.interpreter import triton_device_reasons



def _triton_stage(buf, x: torch.Tensor, dst: torch.Tensor, meta: int, gather: bool) -> None:
    signal_kernels.stage(x if x.is_contiguous() else x.contiguous(), dst, buf.pad_table, buf.rank,
                         buf.world_size, meta, buf.timeout_ns, gather=gather,
                         sms=signal_kernels.sm_count(x.device))


def _cuda_stage(buf, x: torch.Tensor, dst: torch.Tensor, meta: int, gather: bool) -> None:
    """Steps 1-2 with the CUDA kernels: a wait, a copy, a signal (the epoch advanced first)."""
    if gather:
        raise NotImplementedError("the CUDA launchers do not stage for a fused gather")
    csrc_launchers.wait_flags(buf.pad_table, layout.DONE, buf.rank, buf.world_size, -1,
                              buf.timeout_ns, layout.TIMEOUT_DONE)
    dst.copy_(x)
    csrc_launchers.signal_peers(buf.pad_table, layout.READY, buf.rank, buf.world_size, 0, meta)


# A launcher set: ``stage(buf, x, dst, meta, gather)`` (steps 1-2), whether its stage advances
# the epoch on the device itself (``advances``), the keyword arguments with which its pull
# kernels end the call (step 4; none: ``release`` does), and the kernels.
TRITON_LAUNCHERS = SimpleNamespace(
    stage=_triton_stage, advances=True, pull_ends_call={"ends_call": True},
    wait_flags=signal_kernels.wait_flags,
    signal_peers=signal_kernels.signal_peers,
    all_gather_pull=all_gather_kernels.all_gather_pull,
    reduce_scatter_pull=reduce_scatter_kernels.reduce_scatter_pull,
)
CUDA_LAUNCHERS = SimpleNamespace(
    stage=_cuda_stage, advances=False, pull_ends_call={},
    wait_flags=csrc_launchers.wait_flags,
    signal_peers=csrc_launchers.signal_peers,
    all_gather_pull=csrc_launchers.all_gather_pull,
    reduce_scatter_pull=csrc_launchers.reduce_scatter_pull,
)

# dist.all_gather_single / reduce_scatter_single replace the *_tensor names in torch 2.13+.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- collectives and point-to-point transfers whose every wait is bounded -----------------
# The process group's own timeout (30 minutes on gloo by default) is not fusedpar's: each wait
# below gives up after FUSEDPAR_TIMEOUT with a FusedparTimeoutError naming what it waited for.


def host_staged(group, t: torch.Tensor) -> bool:
    """Whether ``t`` travels through a host copy on ``group``: a CUDA tensor on a group whose
    CUDA transfers are gloo's, which sends and gathers CPU tensors only (a shared-GPU world,
    as NCCL refuses ranks sharing a GPU). Correct there, never fast."""
    if not t.is_cuda:
        return False
    backend = str(dist.get_backend(group)).lower()  # "gloo", "nccl" or "cpu:gloo,cuda:nccl"
    if ":" in backend:
        backend = dict(part.split(":") for part in backend.split(",")).get("cuda", "")
    return backend == "gloo"


def _collective(start, what: str, group, out: torch.Tensor, *inputs: torch.Tensor) -> None:
    """``start(out, *inputs)``, an async collective writing ``out``, with a bounded wait;
    through host copies where ``host_staged``."""
    if not host_staged(group, out):
        symmetric.bounded_wait(start(out, *inputs), what, group)
        return
    host = out.to("cpu", copy=True)  # a copy: an in-place collective reads it
    symmetric.bounded_wait(start(host, *(x.to("cpu", copy=True) for x in inputs)), what, group)
    out.copy_(host)


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """``dist.all_gather_single(out, x, group)``, bounded."""
    _collective(lambda o, i: _all_gather_single(o, i, group=group, async_op=True),
                "an all-gather", group, out, x)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """``dist.reduce_scatter_single(out, x, group)`` (sum), bounded. Where gloo carries it
    (CPU tensors, host-staged ones): ``all_to_all_single`` (the same bytes), then a sum in
    fp32 in rank order, rounded once, as the symmetric backends sum; gloo's own ring sums in
    x's dtype, each chunk from another rank, which no single process reproduces."""
    if x.is_cuda and not host_staged(group, x):
        _collective(lambda o, i: _reduce_scatter_single(o, i, group=group, async_op=True),
                    "a reduce-scatter", group, out, x)
        return
    parts = x.new_empty((dist.get_world_size(group), out.numel()))
    all_to_all_single(parts, x, group)
    total = parts[0].to(torch.float32, copy=True)
    for part in parts[1:]:
        total += part
    out.copy_(total.view(out.shape))


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, group, out_splits=None, in_splits=None) -> None:
    """``dist.all_to_all_single(out, x, out_splits, in_splits, group)``, bounded."""
    _collective(lambda o, i: dist.all_to_all_single(o, i, out_splits, in_splits, group=group,
                                                    async_op=True),
                "an all-to-all", group, out, x)


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """``dist.all_reduce(t, op, group)``, bounded."""
    _collective(lambda o: dist.all_reduce(o, op=op, group=group, async_op=True), "an all-reduce",
                group, t)


class BoundedWork:
    """An async send or receive whose ``wait()`` is bounded as the collectives above are;
    a staged receive copies its host buffer into ``into`` when it completes."""

    def __init__(self, work, what: str, group, into: tuple | None = None):
        self.work, self.what, self.group, self.into = work, what, group, into

    def wait(self) -> None:
        symmetric.bounded_wait(self.work, self.what, self.group)
        if self.into is not None:
            target, host = self.into
            target.copy_(host)


def p2p(ops: list, group) -> list[BoundedWork]:
    """``dist.batch_isend_irecv(ops)``, each request's wait bounded; tensors that
    ``host_staged`` says so travel as host copies."""
    peers = ", ".join(f"{'send to' if op.op is dist.isend else 'receive from'} rank {op.peer}"
                      for op in ops)
    hosts = [op.tensor.to("cpu", copy=True) if host_staged(group, op.tensor) else None for op in ops]
    sent = [op if host is None else dist.P2POp(op.op, host, op.peer, op.group, op.tag)
            for op, host in zip(ops, hosts)]
    return [BoundedWork(work, f"a point-to-point exchange ({peers})", group,
                        None if host is None or op.op is not dist.irecv else (op.tensor, host))
            for work, op, host in zip(dist.batch_isend_irecv(sent), ops, hosts)]


def ring_neighbours(group) -> tuple[int, int, int]:
    """``(rank, left, right)``: this rank in ``group`` and its ring neighbours' global ranks
    (what ``dist.P2POp`` takes)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return (rank, dist.get_global_rank(group, (rank - 1) % world),
            dist.get_global_rank(group, (rank + 1) % world))


def exchange(send: torch.Tensor, recv: torch.Tensor, left: int, right: int, group):
    """Start sending ``send`` to the right neighbour and receiving ``recv`` from the left;
    each returned request's ``wait()`` is bounded."""
    return p2p([dist.P2POp(dist.isend, send, right, group), dist.P2POp(dist.irecv, recv, left, group)],
               group)


def fused_dtype_reasons(call: CollectiveCall) -> list[str]:
    """The fused GEMM kernels take fp32, fp16 and bf16 (the plain-torch backends take more)."""
    if call.x.dtype in REDUCE_DTYPES:
        return []
    return [f"the fused kernels take float32, float16 or bfloat16, not {call.x.dtype}"]


# ---- availability -----------------------------------------------------------------------


def triton_reasons(call: CollectiveCall) -> list[str]:
    device = call.x.device
    reasons = triton_device_reasons(device)
    if reasons or device.type not in ("cpu", "cuda"):
        return reasons
    if device.type == "cpu":
        reason = symmetric.shm_unsupported_reason(call.group) if call.group is not None else None
    else:
        reason = symmetric.torch_symm_unsupported_reason(device, call.group)  # collective, cached
    return [reason] if reason else []


def cuda_reasons(call: CollectiveCall) -> list[str]:
    if call.x.device.type != "cuda":
        return ["the CUDA kernels need CUDA tensors"]
    reasons = []
    reason = _extension.cuda_ops_unavailable_reason()
    if reason:
        reasons.append(reason)
    reason = symmetric.torch_symm_unsupported_reason(call.x.device, call.group)
    if reason:
        reasons.append(reason)
    return reasons


# ---- the symmetric-memory protocol --------------------------------------------------------


def stats_tensor(device) -> torch.Tensor:
    """Where a pull kernel adds the bytes it read from peers: a new counter while a
    ``count_bytes()`` block is open, else the device's scratch word (nothing allocated)."""
    if counters.counting():
        return torch.zeros(1, dtype=torch.int64, device=device)
    if device not in _scratch:
        _scratch[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return _scratch[device]


_scratch: dict = {}


def begin(bufs, launchers, graphable: bool = False) -> list[int]:
    """Start a call on each rank view (``SymmetricBuffer.next_epoch``): the epochs (offsets)
    its kernels take. A call that stages with ``launchers`` next lets its stage advance
    the device's epoch where it can."""
    return [buf.next_epoch(graphable, kernel_advances=launchers.advances) for buf in bufs]


def stage(launchers, buf, x: torch.Tensor, epoch: int, meta: int, desc: list[int], *,
          gather: bool = False) -> torch.Tensor:
    """Steps 1-2 (after ``begin``): wait until peers are done with our data region, copy
    ``x`` in, publish its description and fingerprint, raise READY; ``gather``: also set the
    GATHERED flags for this call (``gathering``). Returns the staged view."""
    view = buf.data(x.dtype, x.numel()).view(x.shape)
    buf.publish(desc)  # before READY, in stream order
    launchers.stage(buf, x, view, meta, gather)
    return view


def _tensors(nest):
    if isinstance(nest, torch.Tensor):
        yield nest
    elif isinstance(nest, (tuple, list)):
        for item in nest:
            yield from _tensors(item)


def release(launchers, bufs, epochs, op: str, outs) -> None:
    """Step 4 where the op's last kernel does not end the call itself: tell every peer we
    are done reading, NaN-fill the floating-point outputs of a view whose waits failed
    (``outs``: per view, a tensor or a nest of tuples/lists of them), then surface recorded
    failures (see ``SymmetricBuffer.finish``: at once on CPU, at the next call on CUDA unless
    FUSEDPAR_SYNC_ERRORS=1)."""
    for buf, epoch in zip(bufs, epochs):
        launchers.signal_peers(buf.pad_table, layout.DONE, buf.rank, buf.world_size, epoch, -1)
    for buf, out in zip(bufs, outs):
        for tensor in _tensors(out):
            signal_kernels.poison_if_failed(buf.pad(), tensor)
    for buf in bufs:
        buf.finish(op)


def run_staged(op: str, launchers, bufs, xs, meta: int, desc: list[int], pull,
               graphable: bool = False, pull_ends_call: bool = False) -> list[torch.Tensor]:
    """Run steps 1-4 above for each rank view in ``bufs`` (one, or all W for loopback).

    Each phase runs for every view before the next phase starts, so one process can play
    all ranks: by the time any view waits, every view has signalled.
    ``pull(buf, staged_x, epoch) -> out`` launches the op's pull kernel; ``pull_ends_call``:
    that kernel does step 4's device work (``signal.end_call``). ``graphable``: nothing
    ``pull`` does depends on host values a replay would freeze, so the call may be captured
    in a CUDA graph.
    """
    epochs = begin(bufs, launchers, graphable)
    staged = [stage(launchers, buf, x, epoch, meta, desc) for buf, x, epoch in zip(bufs, xs, epochs)]
    outs = [pull(buf, view, epoch) for buf, view, epoch in zip(bufs, staged, epochs)]
    if pull_ends_call:
        for buf in bufs:
            buf.finish(op)
    else:
        release(launchers, bufs, epochs, op, outs)
    return outs


_side_streams: dict = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The high-priority stream the copy-engine copies of the fused ops run on (one per device)."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device, priority=-1)
    return _side_streams[device]


_symm_ops = []  # torch's _SymmetricMemory, imported at the first flag write


def write_flag(pad: torch.Tensor, word: int, value: int) -> None:
    """A stream-ordered flag write that needs no SM (cuStreamWriteValue32), so it lands
    while a persistent GEMM holds every SM; a plain memset under CUDA-graph capture."""
    if not _symm_ops:
        from torch._C._distributed_c10d import _SymmetricMemory

        _symm_ops.append(_SymmetricMemory)
    flags = pad.view(torch.uint32)
    if torch.cuda.is_current_stream_capturing():
        _symm_ops[0].memset32(flags, offset=word, val=value, count=1)
    else:
        _symm_ops[0].stream_write_value32(flags, word, value)


@contextlib.contextmanager
def gathering(buf, blocks, epoch: int, meta: int, copy_engine: bool, delays=None,
              signal_done: bool = False):
    """Copy each source's staged rows into a local tensor, setting this rank's
    ``GATHERED + src`` flag to 1 after each (the call's stage set them to 0, its own to 1:
    ``stage(..., gather=True)``); the body launches the consumer, which waits on those
    flags. ``blocks``: ``[(src, local tensor, src's staged rows)]`` in the order the consumer
    reaches them; an own block (src = this rank) is copied first, on the current stream.

    One program then waits for every peer's READY flag and checks its fingerprint, so a
    failure is in STATUS before the consumer reads that source. With ``copy_engine`` (CUDA)
    that wait, the peers' copies and their flag writes run on ``side_stream`` (copy engine,
    ``stream_write_value32``): they need no SM but the wait's one, so a consumer that leaves
    one SM free can spin on the flags while they land, and own rows need no peer; the current
    stream waits for the side stream when the body is done. ``delays``: per peer block, GPU
    cycles the side stream sleeps before its copy (flags raised late, for benchmarks).
    ``signal_done`` (with a copy engine): the side stream raises DONE in every peer's pad
    right after the last copy (one program), not after the body.
    Without a copy engine (CPU, loopback) they run in stream order before the body. The
    copies cannot be made conditional on a device value (a stream wait on a memory value has
    no timeout), so after a failed wait they bring unsynchronised rows: the call's last
    kernel NaN-fills its outputs."""
    def copy(src, dst, rows):
        dst.copy_(rows)
        if copy_engine:
            write_flag(buf.pad(), layout.GATHERED + src, 1)

    for block in blocks:
        if block[0] == buf.rank:
            copy(*block)
    main = torch.cuda.current_stream() if copy_engine else None
    side = side_stream(buf.device) if copy_engine else None
    if side is not None:
        side.wait_stream(main)
    peers = [block for block in blocks if block[0] != buf.rank]
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        signal_kernels.wait_flags(buf.pad_table, layout.READY, buf.rank, buf.world_size, epoch,
                                  buf.timeout_ns, layout.TIMEOUT_READY, meta)
        for i, block in enumerate(peers):
            if delays:
                torch.cuda._sleep(delays[i])
            copy(*block)
        if signal_done:
            signal_kernels.signal_peers(buf.pad_table, layout.DONE, buf.rank, buf.world_size, epoch, -1)
    if not copy_engine:  # the copies precede the body in stream order: one fill raises every
        # flag (that of a source without a block is never waited for)
        buf.pad()[layout.GATHERED : layout.GATHERED + buf.world_size].fill_(1)
    try:
        yield
    finally:  # also when the body raises: the copies write into tensors the caller frees
        if side is not None:
            main.wait_stream(side)


class SymmetricBackend(Backend):
    """A backend running the protocol above with one launcher set (Triton or CUDA);
    subclasses implement ``pull``."""

    def __init__(self, name: str, launchers, reasons):
        self.name, self.launchers, self._reasons = name, launchers, reasons

    def not_supported_reasons(self, call):
        return self._reasons(call)

    def run(self, call: CollectiveCall) -> torch.Tensor:
        return self.plan(call)(call.x)

    def plan(self, call: CollectiveCall):
        """Every call of ``call``'s signature: the buffer, fingerprint and description are
        looked up and computed once."""
        x = call.x
        bufs = [symmetric.get_buffer(call.group, x.numel() * x.element_size(), x.device)]
        meta, desc, make = call.fingerprint(), call.description(), call.maker()

        def run(x):
            if not bufs[0].live:  # grown since: its successor
                bufs[0] = symmetric.follow(bufs[0])
            return self._run(bufs, [x], make(x), meta, desc)[0]

        return run

    def run_views(self, bufs, xs, call: CollectiveCall) -> list[torch.Tensor]:
        return self._run(bufs, xs, call, call.fingerprint(), call.description())

    def _run(self, bufs, xs, call, meta: int, desc: list[int]) -> list[torch.Tensor]:
        ends = self.launchers.pull_ends_call
        return run_staged(call.op, self.launchers, bufs, xs, meta, desc,
                          lambda buf, staged, epoch: self.pull(call, buf, staged, epoch, meta, ends),
                          graphable=True, pull_ends_call=bool(ends))

    def pull(self, call, buf, staged, epoch, meta, ends: dict) -> torch.Tensor:
        """Launch the op's pull kernel; ``ends``: its launcher's keyword arguments that make
        it end the call."""
        raise NotImplementedError


def symmetric_backends(cls) -> list[SymmetricBackend]:
    """An op's ``triton`` and ``cuda`` backends: its ``SymmetricBackend`` subclass ``cls``
    on each launcher set."""
    return [cls("triton", TRITON_LAUNCHERS, triton_reasons), cls("cuda", CUDA_LAUNCHERS, cuda_reasons)]


# (op, group name) pairs whose inputs every rank has been seen to agree on
_checked: set[tuple[str, str]] = set()


def raise_on_mismatch(call: CollectiveCall) -> None:
    """Reference and pipelined backends: all-gather fingerprints and descriptions (one tiny
    collective and a host read) and raise a ValueError naming what differs across ranks.

    It runs on the first call of each op on each group, and on every call under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (as torch checks its own collectives' shapes across
    ranks only then): a check per call would stall the host on every layer. The decision
    depends only on what every rank of an SPMD program shares (the call count, the debug
    level), never on local inputs, so every rank runs the collective or none does.
    """
    key = (call.op, call.group.group_name)
    if key in _checked and dist.get_debug_level() != dist.DebugLevel.DETAIL:
        return
    x, world = call.x, call.world_size
    words = [call.fingerprint(), *call.description()]
    mine = torch.tensor(words, dtype=torch.int64, device=x.device)
    everyone = torch.empty(world * len(words), dtype=torch.int64, device=x.device)
    all_gather_single(everyone, mine, group=call.group)
    rank = dist.get_rank(call.group)
    for r, theirs in enumerate(everyone.view(world, -1).tolist()):
        if theirs[0] != words[0]:
            raise ValueError(symmetric.mismatch_message(call.op, rank, r, call.group.group_name,
                                                        words[1:], theirs[1:]))
    _checked.add(key)  # after the check: a failed one fails on every rank, which all retry it


def run_loopback(dispatcher, xs, dim: int, backend: str, dtypes, **extra) -> list[torch.Tensor]:
    """Every rank's part of a collective in this process, over a loopback buffer."""
    op = dispatcher.op
    if backend not in ("triton", "cuda"):
        raise ValueError(f"fusedpar.{op}_loopback: backend must be 'triton' or 'cuda', got {backend!r}")
    if len(xs) < 1:
        raise ValueError(f"fusedpar.{op}_loopback: xs must hold one tensor per simulated rank")
    first = xs[0]
    for r, x in enumerate(xs):
        if x.shape != first.shape or x.dtype != first.dtype or x.device != first.device:
            raise ValueError(
                f"fusedpar.{op}_loopback: xs[{r}] is {tuple(x.shape)} {x.dtype} on {x.device}, "
                f"xs[0] is {tuple(first.shape)} {first.dtype} on {first.device}; they must match"
            )
    call = CollectiveCall(op, first, check_dim(op, first, dim), len(xs), **extra)
    check_dtype(op, first, dtypes)
    chosen = dispatcher.select(call, backend)
    bufs = symmetric.get_loopback_buffers(len(xs), first.numel() * first.element_size(), first.device)
    return chosen.run_views(bufs, xs, call)
