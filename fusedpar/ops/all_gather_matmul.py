"""``fusedpar.ops.all_gather_matmul``: gather A along a leading dim and multiply by each B,
with the gather hidden behind the GEMM (torch ``symm_mem.fused_all_gather_matmul`` schema)."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist

from ..comm import (counters, get_buffer, get_loopback_buffers, group_name, resolve_group, symmetric,
                    torch_symm_unsupported_reason)
from ..kernels import all_gather as all_gather_kernels
from ..kernels import gemm_peers
from ..kernels import signal as signal_kernels
from . import protocol
from .calls import CollectiveCall, MatmulCall, check_matmul_inputs, moved_shape
from .all_gather import DISPATCHER as ALL_GATHER
from .reduce_scatter import DISPATCHER as REDUCE_SCATTER, reduce_scatter
from .backend import Backend, Dispatcher, Plans, autocast_inputs, autocast_off
from .registry import EXAMPLE_WORLD, register

OP = "all_gather_matmul"
# torch's symm_mem.fused_all_gather_matmul schema, plus a keyword-only backend: a call with
# torch's argument list works unchanged
SCHEMA = ("(Tensor A_shard, Tensor[] Bs, int gather_dim, str group_name, *, bool return_A=True, "
          "str backend=\"\") -> (Tensor?, Tensor[])")


def _check(a, bs, dim: int, world: int) -> int:
    """``check_matmul_inputs``; gathering A's last dim (K-sharded A), the Bs have W times A's K."""
    k_sharded = isinstance(a, torch.Tensor) and a.dim() in (2, 3) and dim % a.dim() == a.dim() - 1
    return check_matmul_inputs(OP, a, bs, dim, "gather_dim",
                               k=a.shape[-1] * world if k_sharded else None)


def _gather_k_then_matmul(call: MatmulCall, gather_backend: str):
    """A gathered along K (its last dim) by fusedpar's ``all_gather`` on ``gather_backend``,
    then one matmul per B: every output element needs all of K, so there is no GEMM to
    overlap the gather with."""
    gather = CollectiveCall("all_gather", call.x, call.dim, call.world_size, call.group)
    gathered = ALL_GATHER.select(gather, gather_backend).run(gather)
    outs = [torch.matmul(gathered, b) for b in call.bs]
    return (gathered if call.return_a else None), outs


class Reference(Backend):
    """All-gather A (``dist.all_gather_single``), then one matmul per B."""

    name = "reference"

    def run(self, call: MatmulCall):
        if call.last_dim:
            return _gather_k_then_matmul(call, self.name)
        world, a = call.world_size, call.rows()
        protocol.raise_on_mismatch(call)
        gathered = torch.empty(world * a.numel(), dtype=a.dtype, device=a.device)
        protocol.all_gather_single(gathered, a.contiguous().view(-1), group=call.group)
        gathered = gathered.view(world * a.shape[0], a.shape[1])
        counters.record(OP, self.name, (world - 1) * a.numel() * a.element_size())
        outs = [call.unflatten(gathered @ b, world) for b in call.bs]
        return (call.unflatten(gathered, world) if call.return_a else None), outs


class Pipelined(Backend):
    """W steps around a ring: the shard received at step s is sent on at step s+1 while
    the GEMMs of step s run (async P2P: gloo on CPU, NCCL's stream on GPU); own shard first.
    Shards land straight in the gathered buffer, so A_gathered costs no extra copy. A
    K-sharded A (gathered along its last dim): step s adds ``A_src @ B[K rows of src]`` to
    an fp32 sum while the next shard travels."""

    name = "pipelined"

    def run(self, call: MatmulCall):
        if call.last_dim:
            return self._run_k_sharded(call)
        group, world = call.group, call.world_size
        rank, left, right = protocol.ring_neighbours(group)
        protocol.raise_on_mismatch(call)
        a = call.rows()
        m = a.shape[0]
        gathered = torch.empty(world * m, a.shape[1], dtype=a.dtype, device=a.device)
        gathered[rank * m:(rank + 1) * m].copy_(a)
        outs = [torch.empty(world * m, b.shape[1], dtype=a.dtype, device=a.device) for b in call.bs]
        for step in range(world):
            src = (rank - step) % world
            current = gathered[src * m:(src + 1) * m]
            if step < world - 1:
                nxt = (src - 1) % world
                requests = protocol.exchange(current, gathered[nxt * m:(nxt + 1) * m], left, right, group)
            for out, b in zip(outs, call.bs):
                torch.matmul(current, b, out=out[src * m:(src + 1) * m])
            if step < world - 1:
                for request in requests:
                    request.wait()
        counters.record(OP, self.name, (world - 1) * a.numel() * a.element_size())
        outs = [call.unflatten(out, world) for out in outs]
        return (call.unflatten(gathered, world) if call.return_a else None), outs

    def _run_k_sharded(self, call: MatmulCall):
        group, world = call.group, call.world_size
        rank, left, right = protocol.ring_neighbours(group)
        protocol.raise_on_mismatch(call)
        a = call.x.flatten(0, -2)  # [rows, k]
        rows, k = a.shape
        shards = torch.empty(world, rows, k, dtype=a.dtype, device=a.device)
        shards[rank].copy_(a)
        sum_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
        sums = [torch.zeros(rows, b.shape[1], dtype=sum_dtype, device=a.device) for b in call.bs]
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                requests = protocol.exchange(shards[src], shards[(src - 1) % world], left, right, group)
            for total, b in zip(sums, call.bs):
                total += shards[src] @ b[src * k:(src + 1) * k]
            if step < world - 1:
                for request in requests:
                    request.wait()
        counters.record(OP, self.name, (world - 1) * a.numel() * a.element_size())
        lead = call.x.shape[:-1]
        outs = [total.to(a.dtype).view(*lead, -1) for total in sums]
        gathered = shards.permute(1, 0, 2).reshape(*lead, world * k) if call.return_a else None
        return gathered, outs


class Triton(Backend):
    """Every rank stages its shard at its own slot of its data region (rows ``rank * m``
    of a gathered A) and raises READY (one kernel, ``signal.stage_kernel``, which also
    resets this call's GATHERED flags). Each peer's staged shard is then copied into the
    same rows of the local gathered A (the data region itself, or the returned A_gathered,
    which the stage also wrote the own shard to), raising this rank's ``GATHERED + src`` flag
    after it, while one persistent Triton GEMM multiplies each shard's rows as soon as its
    flag is up, own shard first in rank-rotated order (the grouped GEMM's peers kernel with
    one expert and a block per shard; TMA loads on Hopper), and NaN-fills the outputs of a
    failed call at its end. On a GPU in a group the copies run on a side stream
    (``protocol.gathering``: a one-program READY wait, copy-engine copies with
    ``stream_write_value32`` flags, then DONE right after the last copy) and the GEMM's
    resident grid leaves that stream an SM; on CPU and in a loopback one pull kernel copies
    them before the GEMM and raises DONE. Each peer shard crosses once; nothing is copied
    twice when A_gathered is not returned. Further Bs reuse the gathered A with a plain
    matmul. Nothing depends on a host value a replay would freeze: a call can be captured
    in a CUDA graph.
    """

    name = "triton"

    def not_supported_reasons(self, call):
        return protocol.fused_dtype_reasons(call) + protocol.triton_reasons(call)

    def run(self, call: MatmulCall):
        return self.plan(call)(call.x, call.bs)

    def plan(self, call: MatmulCall):
        if call.last_dim:  # K-sharded: the symmetric-memory all_gather, then the matmuls
            make = call.maker()
            return lambda A, Bs: _gather_k_then_matmul(make(A, Bs), self.name)
        a, world, dim = call.rows(), call.world_size, call.dim
        buf = get_buffer(call.group, world * a.numel() * a.element_size(), a.device)
        views = Gather(call, [buf], copy_engine=a.is_cuda and world > 1)  # a group of one copies nothing
        unflatten = unflattener(call)

        def run(A, Bs):
            gathered, outs = views.run_one(shard_rows(A, dim), Bs)
            return (None if gathered is None else unflatten(gathered)), [unflatten(o) for o in outs]

        return run

    def run_views(self, bufs, a_rows, call: MatmulCall, copy_engine: bool, delays=None):
        """``[(gathered or None, [outs])]`` per rank view, rows in gathered order (not
        unflattened); gathered None without ``call.return_a``. ``delays``: see
        ``all_gather_matmul_loopback``."""
        return Gather(call, bufs, copy_engine).run(a_rows, [call.bs] * len(bufs), delays)


def shard_rows(a: torch.Tensor, dim: int) -> torch.Tensor:
    """``MatmulCall.rows`` of ``a``, contiguous: the rows with ``dim`` first, ``[rows, K]``."""
    rows = a if dim == 0 and a.dim() == 2 else a.movedim(dim, 0).flatten(0, -2)
    return rows if rows.is_contiguous() else rows.contiguous()


def unflattener(call: MatmulCall):
    """``call.unflatten(t, W)`` for every call of ``call``'s signature (none of its
    tensors kept): the identity for a 2-D A gathered along dim 0."""
    if call.dim == 0 and call.x.dim() == 2:
        return lambda t: t
    shape, dim, world = call.x.shape, call.dim, call.world_size
    return lambda t: t.view(moved_shape(shape, dim, world, t.shape[-1])).movedim(0, dim).contiguous()


class _View:
    """One rank view's part of ``Gather``: its buffer, its data region as the gathered
    staged rows (``[W * m, k]``: A, or what the GEMM's A is a view of), its own slot of it,
    its peers' slots, its block tables."""

    def __init__(self, buf, dtype, world: int, m: int, k: int):
        self.buf, self.pad_table, self.rank = buf, buf.pad_table, buf.rank
        self.region = buf.data(dtype, world * m * k).view(world * m, k)
        self.own = slice(buf.rank * m, (buf.rank + 1) * m)
        self.slot = self.region[self.own]
        sources, (self.blocks, self.runs, self.run_rows) = _shard_blocks(buf.rank, world, m, buf.device)
        # each peer's staged rows: (src, its slot of src's data region), in the GEMM's order
        self.peers = [(src, buf.data(dtype, world * m * k, rank=src).view(world * m, k)[src * m:(src + 1) * m])
                      for src in sources if src != buf.rank]


class Gather:
    """The triton backend's calls of one signature on one set of rank views (one, or W in a
    loopback): the views (``_View``), the fingerprint and the GEMM's launch, made once.

    The staged rows are A's (``[m, K]``), or, given ``staged`` (``(dtype, k)``: a subclass's
    rows of ``k`` elements of ``dtype``, e.g. all_gather_scaled_matmul's fp8 bytes and row
    scales as int32 words), what the subclass's ``_gemm`` reads the GEMM's operands from.
    ``operands``: what the GEMMs multiply the gathered rows by (here the Bs)."""

    def __init__(self, call: MatmulCall, bufs, copy_engine: bool, staged: tuple | None = None):
        a, world = call.rows(), call.world_size
        self.world, self.m = world, a.shape[0]
        self.dtype, self.k = staged or (a.dtype, a.shape[1])
        self.device = a.device
        self.copy_engine, self.return_a = copy_engine, call.return_a
        self.meta, self.desc, self.op = call.fingerprint(), call.description(), call.op
        self.width = call.bs[0].shape[1]  # the first B's: the peers kernel's output
        self.out_dtypes = [a.dtype] * len(call.bs)
        self.views = [_View(buf, self.dtype, world, self.m, self.k) for buf in bufs]
        self.gemm = self._launch(call)
        self.sms = signal_kernels.sm_count(a.device)
        self.timeout_ns = bufs[0].timeout_ns  # a plan lives until the settings change
        self.moved = (world - 1) * self.m * self.k * self.dtype.itemsize

    def _launch(self, call: MatmulCall):
        """The GEMM's launch for this signature, made once."""
        return gemm_peers.GatherLaunch(self.views[0].region, call.bs[0], self.views[0].run_rows)

    def run(self, a_rows, operands, delays=None) -> list:
        """Every view's ``(gathered or None, outs)`` (``a_rows``, ``operands``: one per view):
        all stage before any gathers, so one process can play every rank."""
        for view in self.views:
            view.buf.next_epoch(graphable=True, kernel_advances=True)
        gathered = [self._stage(view, a) for view, a in zip(self.views, a_rows)]
        results = [self._multiply(view, g, ops, delays)
                   for view, g, ops in zip(self.views, gathered, operands)]
        for view in self.views:
            view.buf.finish(self.op)
        return results

    def run_one(self, a, operands):
        """``run`` of a group's one view (following its buffer if it grew since)."""
        view = self.views[0]
        if not view.buf.live:
            view = self.views[0] = _View(symmetric.follow(view.buf), self.dtype, self.world, self.m, self.k)
        view.buf.next_epoch(graphable=True, kernel_advances=True)
        result = self._multiply(view, self._stage(view, a), operands, None)
        view.buf.finish(self.op)
        return result

    def _stage(self, view: _View, a: torch.Tensor):
        """Stage ``a`` at the view's slot (and in the returned A_gathered): the gathered A or None."""
        view.buf.publish(self.desc)  # before READY: what peers read after a mismatch
        g = torch.empty(self.world * self.m, self.k, dtype=self.dtype, device=self.device) \
            if self.return_a else None
        signal_kernels.stage(a, view.slot, view.pad_table, view.rank, self.world, self.meta,
                             self.timeout_ns, out=None if g is None else g[view.own], gather=True,
                             sms=self.sms)
        return g

    def _multiply(self, view: _View, g, operands, delays):
        """Gather the peers' rows into the view's gathered rows and multiply them by every B."""
        a_all = view.region if g is None else g
        rows = self.world * self.m
        out = torch.empty(rows, self.width, dtype=self.out_dtypes[0], device=self.device)
        if self.copy_engine:
            blocks = [(src, a_all[src * self.m:(src + 1) * self.m], staged) for src, staged in view.peers]
            with protocol.gathering(view.buf, blocks, 0, self.meta, True, delays, signal_done=True):
                self._gemm(view, a_all, g, operands, out)
        else:
            if view.peers:
                all_gather_kernels.all_gather_pull(a_all, a_all, view.pad_table, view.rank, self.world, 0,
                                                   self.meta, 1, self.m * self.k, self.timeout_ns,
                                                   protocol.stats_tensor(self.device), slots=True)
            self._gemm(view, a_all, g, operands, out)
        counters.record(self.op, "triton", self.moved)
        rest = self._rest(a_all, operands) if len(self.out_dtypes) > 1 else []  # most calls: one B
        if g is None:  # the GEMM NaN-filled what it read from: the gathered A
            for further in rest:
                signal_kernels.poison_if_failed(view.buf.pad(), further)
        return g, [out, *rest]

    def _gemm(self, view: _View, a_all, g, bs, out) -> None:
        """The peers kernel's launch: ``out = a_all @ bs[0]`` as the rows land."""
        self.gemm(a_all, bs[0], out, view.blocks, view.runs, view.run_rows, view.pad_table,
                  view.rank, self.world, self.timeout_ns, gathered=g)

    def _rest(self, a_all, bs) -> list:
        """The further Bs' products on the gathered A, once it is all here."""
        return [torch.matmul(a_all, b) for b in bs[1:]]


@functools.lru_cache(maxsize=64)
def _shard_blocks(rank: int, world: int, m: int, device: torch.device):
    """``(sources, tables)`` for a gathered A of ``world`` shards of ``m`` rows: the shards in
    the order they are multiplied (own first, rank-rotated), and the peers kernel's tables:
    blocks ``(src, expert 0, -, local_row src * m, m)`` on the device, their runs there, and
    the runs' rows on the host. The same every call: made once."""
    sources = [(rank + step) % world for step in range(world)]
    table = np.array([(src, 0, 0, src * m, m) for src in sources], dtype=np.int64)
    runs = gemm_peers.block_runs(table)
    as_device = lambda t: torch.from_numpy(t.astype(np.int32)).to(device)  # noqa: E731
    return sources, (as_device(table), as_device(runs), runs[:, 2].tolist())


def symm_mem_reasons(call: MatmulCall, op: str) -> list[str]:
    """Why torch's async-TP op ``torch.ops.symm_mem.<op>`` cannot run ``call``: CUDA tensors
    in a group whose ranks torch symmetric memory serves (collective, agreed and cached per
    group), in a torch that has the op."""
    if call.x.device.type != "cuda":
        return [f"torch.ops.symm_mem.{op} needs CUDA tensors"]
    if call.group is None:
        return [f"torch.ops.symm_mem.{op} needs a process group (a loopback call has none)"]
    reason = torch_symm_unsupported_reason(call.x.device, call.group)
    if reason:
        return [reason]
    import torch.distributed._symmetric_memory  # noqa: F401 - registers torch.ops.symm_mem

    if not hasattr(torch.ops.symm_mem, op):
        return [f"torch {torch.__version__} has no torch.ops.symm_mem.{op}"]
    return []


class SymmMem(Backend):
    """torch's async-TP op ``torch.ops.symm_mem.fused_all_gather_matmul`` (same schema)."""

    name = "symm_mem"

    def not_supported_reasons(self, call):
        return symm_mem_reasons(call, "fused_all_gather_matmul")

    def run(self, call: MatmulCall):
        gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(
            call.x, call.bs, call.dim, call.group.group_name, return_A=call.return_a)
        return gathered, list(outs)


DISPATCHER = Dispatcher(OP, [Triton(), Pipelined(), Reference(), SymmMem()])  # vendor's last
PLANS = Plans(OP)


@torch.library.custom_op("fusedpar::all_gather_matmul", mutates_args=(), schema=SCHEMA)
def _all_gather_matmul_op(A_shard, Bs, gather_dim, group_name, *, return_A=True, backend=""):
    key = (A_shard.shape, A_shard.stride(), A_shard.dtype, A_shard.device, gather_dim, group_name,
           return_A, backend, *[(b.shape, b.stride(), b.dtype, b.device) for b in Bs])
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.make(key, A_shard.device, lambda: _plan(A_shard, Bs, gather_dim, group_name,
                                                             return_A, backend))
    return plan(A_shard, Bs)


def _plan(A_shard, Bs, gather_dim, group_name, return_A, backend):
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    call = MatmulCall(OP, A_shard, _check(A_shard, Bs, gather_dim, world), world, group, Bs, return_A)
    return DISPATCHER.select(call, backend).plan(call)


@_all_gather_matmul_op.register_fake
def _(A_shard, Bs, gather_dim, group_name, *, return_A=True, backend=""):
    world = dist.get_world_size(resolve_group(group_name))
    dim = _check(A_shard, Bs, gather_dim, world)

    shape = list(A_shard.shape)
    shape[dim] *= world  # K-sharded: the gathered K
    gathered = A_shard.new_empty(shape) if return_A else None
    return gathered, [A_shard.new_empty(shape[:-1] + [b.shape[1]]) for b in Bs]


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    _, bs, ctx.dim, ctx.group_name = inputs
    ctx.backend = keyword_only_inputs["backend"]
    ctx.save_for_backward(output[0], *bs)
    # an unused output (often A_gathered) gets None, not zeros: no reduce-scatter of zeros
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_gathered, grad_outs):
    gathered, *bs = ctx.saved_tensors
    pairs = [(g, b) for g, b in zip(grad_outs, bs) if g is not None]
    # sum_i dY_i @ B_i^T, reduce-scattered back to the shards: one fused op
    dys = torch.cat([g for g, _ in pairs], dim=-1)
    bts = torch.cat([b.t() for _, b in pairs], dim=0)
    # through torch.ops: matmul_reduce_scatter's module imports this one (its backward is ours)
    with autocast_off(dys):
        grad_a = torch.ops.fusedpar.matmul_reduce_scatter(dys, bts, "sum", ctx.dim, ctx.group_name,
                                                          ctx.backend)
    if grad_gathered is not None:
        grad_a = grad_a + reduce_scatter(grad_gathered, "sum", ctx.dim, ctx.group_name,
                                         backend=REDUCE_SCATTER.carry(ctx.backend))
    rows = gathered.flatten(0, -2).t()
    grad_bs = [None if g is None else rows @ g.flatten(0, -2) for g in grad_outs]
    return grad_a, grad_bs, None, None


_all_gather_matmul_op.register_autograd(_backward, setup_context=_setup_context)


class _Differentiable(torch.autograd.Function):
    """The op with the formulas above, as eager training calls it. torch.library's autograd
    wrapper flattens the B and output lists with pytree on every call: ~230 of the 320
    Python calls of a call with weights that need grads; varargs here need none."""

    @staticmethod
    def forward(ctx, A_shard, gather_dim, group_name, return_A, backend, *Bs):
        gathered, outs = _all_gather_matmul_op(A_shard, list(Bs), gather_dim, group_name,
                                               return_A=return_A, backend=backend)
        _setup_context(ctx, (A_shard, Bs, gather_dim, group_name), {"backend": backend},
                       (gathered, outs))
        return gathered, *outs

    @staticmethod
    def backward(ctx, grad_gathered, *grad_outs):
        grad_a, grad_bs, _, _ = _backward(ctx, grad_gathered, grad_outs)
        return grad_a, None, None, None, None, *grad_bs


def all_gather_matmul_loopback(a_shards: list[torch.Tensor], Bs: list[torch.Tensor],
                               gather_dim: int = 0, *, return_A: bool = True,
                               copy_engine: bool = False, copy_delays: list[int] | None = None):
    """Every rank's part of ``all_gather_matmul`` in this process (rank r's shard is
    ``a_shards[r]``; every rank multiplies by the same ``Bs``) over a loopback buffer, with
    the ``triton`` backend's GEMM as a group runs it. Returns each rank's ``(A_gathered or
    None, outs)``. For single-device benchmarks and tests of the protocol.

    The peers' shards are copied in stream order before each view's GEMM (one GPU has no
    link to overlap them with), or with ``copy_engine`` (CUDA) as a group copies them: on
    the side stream while the view's GEMM spins on their flags; ``copy_delays``: per peer
    shard (in the order the GEMM takes them), GPU cycles the side stream sleeps before that
    copy (flags raised late: the GEMM under real overlap, for benchmarks)."""
    if not a_shards:
        raise ValueError(f"fusedpar.{OP}_loopback: a_shards must hold one tensor per simulated rank")
    first = a_shards[0]
    for r, a in enumerate(a_shards):
        if a.shape != first.shape or a.dtype != first.dtype or a.device != first.device:
            raise ValueError(f"fusedpar.{OP}_loopback: a_shards[{r}] differs from a_shards[0]")
    if (copy_engine or copy_delays) and not first.is_cuda:
        raise ValueError(f"fusedpar.{OP}_loopback: copy_engine / copy_delays need CUDA tensors; "
                         f"a_shards are on {first.device}")
    world = len(a_shards)
    if copy_delays is not None and len(copy_delays) != world - 1:
        raise ValueError(f"fusedpar.{OP}_loopback: copy_delays needs one value per peer shard "
                         f"({world - 1}), got {len(copy_delays)}")
    call = MatmulCall(OP, first, check_matmul_inputs(OP, first, Bs, gather_dim, "gather_dim"),
                      world, None, Bs, return_A)
    if call.last_dim:
        raise ValueError(f"fusedpar.{OP}_loopback: gather_dim={gather_dim} is A's last dim; the "
                         "loopback runs the fused row gather only (gather a leading dim)")
    backend = DISPATCHER.select(call, "triton")
    rows = [shard_rows(a, call.dim) for a in a_shards]
    bufs = get_loopback_buffers(world, world * rows[0].numel() * rows[0].element_size(), first.device)
    results = backend.run_views(bufs, rows, call, copy_engine=copy_engine or bool(copy_delays),
                                delays=copy_delays)
    unflatten = unflattener(call)
    return [((unflatten(g) if return_A else None), [unflatten(o) for o in outs]) for g, outs in results]


def all_gather_matmul(A_shard: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int, group=None,
                      *, return_A: bool = True, backend: str | None = None):
    """All-gather ``A_shard`` along ``gather_dim`` and multiply it by every B; the same as::

        A = torch.cat(dist_all_gather(A_shard, group), dim=gather_dim)   # every rank's shard
        return (A if return_A else None), [A @ B for B in Bs]

    ``A_shard``: 2-D or 3-D; ``Bs``: ``[K, N_i]`` matrices sharing the gather (q/k/v,
    gate/up). A leading ``gather_dim`` is what the fused backends overlap with the GEMM;
    the last (a K-sharded A, ``K = W * A_shard.shape[-1]``) is gathered first on ``triton``
    and ``reference`` (every output element needs all of K) and summed shard by shard while
    the next one travels on ``pipelined``. Outputs are contiguous (torch's
    ``symm_mem.fused_all_gather_matmul`` returns ``movedim`` views for a leading
    ``gather_dim`` other than 0; a view out of a model makes FSDP2 warn). fp32, fp16 or bf16. ``group`` and ``backend`` as in
    ``fusedpar.ops.all_gather`` (backends: ``triton``, ``pipelined``, ``reference``,
    ``symm_mem``: torch's ``fused_all_gather_matmul`` itself, CUDA groups only).
    Differentiable: ``dA_shard = matmul_reduce_scatter(dY, Bᵀ)`` along ``gather_dim`` and
    ``dB = A_gatheredᵀ dY`` (A_gathered is kept from the forward pass). Under ``torch.autocast``, A and the Bs are
    cast to its dtype first, as ``torch.matmul``'s inputs are.
    """
    A_shard, *Bs = autocast_inputs(A_shard, *Bs)
    b_grads = torch.is_grad_enabled() and any([b.requires_grad for b in Bs])
    keep_a = return_A or b_grads  # B's gradient needs A_gathered
    with autocast_off(A_shard):
        if ((b_grads or torch.is_grad_enabled() and A_shard.requires_grad)
                and not torch.compiler.is_compiling()):
            gathered, *outs = _Differentiable.apply(A_shard, gather_dim, group_name(group), keep_a,
                                                    backend or "", *Bs)
        else:  # no grads, or traced: the op (its registered autograd is what torch.compile sees)
            gathered, outs = _all_gather_matmul_op(A_shard, Bs, gather_dim, group_name(group),
                                                   return_A=keep_a, backend=backend or "")
    return (gathered if return_A else None), outs


register(DISPATCHER, (all_gather_matmul, all_gather_matmul_loopback), checks="fusedpar.testing.matmul",
         example=lambda device: MatmulCall(
             OP, torch.zeros(2 * EXAMPLE_WORLD, 8, device=device), 0, EXAMPLE_WORLD, None,
             [torch.zeros(8, 4, device=device)]))
