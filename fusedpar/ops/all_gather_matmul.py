"""``fusedpar.ops.all_gather_matmul``: gather A along a leading dim and multiply by each B,
with the gather hidden behind the GEMM (torch ``symm_mem.fused_all_gather_matmul`` schema)."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist

from ..comm import (counters, get_buffer, get_loopback_buffers, group_name, resolve_group,
                    torch_symm_unsupported_reason)
from ..kernels import gemm_peers
from . import protocol as C
from .calls import CollectiveCall, MatmulCall, check_matmul_inputs
from .all_gather import DISPATCHER as ALL_GATHER
from .reduce_scatter import DISPATCHER as REDUCE_SCATTER, reduce_scatter
from .backend import Backend, Dispatcher, autocast_inputs, autocast_off
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
        C.raise_on_mismatch(call)
        gathered = torch.empty(world * a.numel(), dtype=a.dtype, device=a.device)
        C.all_gather_single(gathered, a.contiguous().view(-1), group=call.group)
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
        rank, left, right = C.ring_neighbours(group)
        C.raise_on_mismatch(call)
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
                requests = C.exchange(current, gathered[nxt * m:(nxt + 1) * m], left, right, group)
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
        rank, left, right = C.ring_neighbours(group)
        C.raise_on_mismatch(call)
        a = call.x.flatten(0, -2)  # [rows, k]
        rows, k = a.shape
        shards = torch.empty(world, rows, k, dtype=a.dtype, device=a.device)
        shards[rank].copy_(a)
        sum_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
        sums = [torch.zeros(rows, b.shape[1], dtype=sum_dtype, device=a.device) for b in call.bs]
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                requests = C.exchange(shards[src], shards[(src - 1) % world], left, right, group)
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
    """Each peer's staged shard is copied into the local gathered buffer, raising this
    rank's ``GATHERED + src`` flag after it (``C.gathering``: on a GPU a side stream, the
    copy engine with ``stream_write_value32`` flags; on CPU and in a loopback, in stream
    order before the GEMM), while one persistent Triton GEMM multiplies each shard's rows
    as soon as its flag is up, own shard first in rank-rotated order (the grouped GEMM's
    peers kernel with one expert and a block per shard; TMA loads on Hopper). Each peer
    shard crosses once. Further Bs reuse the gathered A with a plain matmul.
    """

    name = "triton"

    def not_supported_reasons(self, call):
        return C.fused_dtype_reasons(call) + C.triton_reasons(call)

    def run(self, call: MatmulCall):
        if call.last_dim:  # K-sharded: the symmetric-memory all_gather, then the matmuls
            return _gather_k_then_matmul(call, self.name)
        a = call.rows()
        buf = get_buffer(call.group, a.numel() * a.element_size(), a.device)
        gathered, outs = self.run_views([buf], [a], call, copy_engine=a.is_cuda)[0]
        outs = [call.unflatten(out, call.world_size) for out in outs]
        return (call.unflatten(gathered, call.world_size) if call.return_a else None), outs

    def run_views(self, bufs, a_rows, call: MatmulCall, copy_engine: bool):
        """``[(gathered or None, [outs])]`` per rank view, rows in gathered order (not
        unflattened); gathered None without ``call.return_a`` (no NaN-fill launch for it)."""
        world, bs = call.world_size, call.bs
        meta = call.fingerprint()

        def gemm(buf, staged, epoch):
            rank, (m, k) = buf.rank, staged.shape
            new = dict(dtype=staged.dtype, device=staged.device)
            gathered = torch.empty(world * m, k, **new)
            outs = [torch.empty(world * m, b.shape[1], **new) for b in bs]
            sources, tables = _shard_blocks(rank, world, m, staged.device)
            blocks = [(src, gathered[src * m:(src + 1) * m],
                       buf.data(staged.dtype, staged.numel(), rank=src).view_as(staged))
                      for src in sources]
            with C.gathering(buf, blocks, epoch, meta, copy_engine):
                gemm_peers.grouped_mm_peers(gathered, bs[0].unsqueeze(0), outs[0], *tables,
                                              buf.pad_table, rank, world, epoch, buf.timeout_ns,
                                              push=False)
            counters.record(OP, self.name, (world - 1) * staged.numel() * staged.element_size())
            for b, out in zip(bs[1:], outs[1:]):
                torch.matmul(gathered, b, out=out)
            return (gathered if call.return_a else None), outs

        return C.run_staged(OP, C.TRITON_LAUNCHERS, bufs, a_rows, meta, call.description(), gemm)


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


@torch.library.custom_op("fusedpar::all_gather_matmul", mutates_args=(), schema=SCHEMA)
def _all_gather_matmul_op(A_shard, Bs, gather_dim, group_name, *, return_A=True, backend=""):
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    call = MatmulCall(OP, A_shard, _check(A_shard, Bs, gather_dim, world), world, group, Bs, return_A)
    return DISPATCHER.select(call, backend).run(call)


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


def all_gather_matmul_loopback(a_shards: list[torch.Tensor], Bs: list[torch.Tensor],
                               gather_dim: int = 0, *, return_A: bool = True):
    """Every rank's part of ``all_gather_matmul`` in this process (rank r's shard is
    ``a_shards[r]``; every rank multiplies by the same ``Bs``) over a loopback buffer, with
    the ``triton`` backend's GEMM as a group runs it; the peers' shards are copied in stream
    order before each view's GEMM (one GPU has no link to overlap them with, and a
    same-device copy may need the SMs a spinning GEMM holds). Returns each rank's
    ``(A_gathered or None, outs)``. For single-device benchmarks and tests of the protocol."""
    if not a_shards:
        raise ValueError(f"fusedpar.{OP}_loopback: a_shards must hold one tensor per simulated rank")
    first = a_shards[0]
    for r, a in enumerate(a_shards):
        if a.shape != first.shape or a.dtype != first.dtype or a.device != first.device:
            raise ValueError(f"fusedpar.{OP}_loopback: a_shards[{r}] differs from a_shards[0]")
    world = len(a_shards)
    call = MatmulCall(OP, first, check_matmul_inputs(OP, first, Bs, gather_dim, "gather_dim"),
                      world, None, Bs, return_A)
    if call.last_dim:
        raise ValueError(f"fusedpar.{OP}_loopback: gather_dim={gather_dim} is A's last dim; the "
                         "loopback runs the fused row gather only (gather a leading dim)")
    backend = DISPATCHER.select(call, "triton")
    rows = [MatmulCall(OP, a, call.dim, world, None, Bs).rows().contiguous() for a in a_shards]
    bufs = get_loopback_buffers(world, rows[0].numel() * rows[0].element_size(), first.device)
    results = backend.run_views(bufs, rows, call, copy_engine=False)
    return [((call.unflatten(g, world) if return_A else None), [call.unflatten(o, world) for o in outs])
            for g, outs in results]


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
    wants_grad = torch.is_grad_enabled() and any(b.requires_grad for b in Bs)
    with autocast_off(A_shard):
        gathered, outs = _all_gather_matmul_op(A_shard, list(Bs), gather_dim, group_name(group),
                                               return_A=return_A or wants_grad,
                                               backend=backend or "")
    return (gathered if return_A else None), outs


register(DISPATCHER, (all_gather_matmul, all_gather_matmul_loopback), checks="fusedpar.testing.matmul",
         example=lambda device: MatmulCall(
             OP, torch.zeros(2 * EXAMPLE_WORLD, 8, device=device), 0, EXAMPLE_WORLD, None,
             [torch.zeros(8, 4, device=device)]))
