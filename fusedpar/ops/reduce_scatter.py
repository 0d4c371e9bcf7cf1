"""``fusedpar.ops.reduce_scatter``: sum (or average) over ranks, each keeping one slice of ``dim``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import counters, group_name, resolve_group
from . import protocol
from .calls import CollectiveCall, REDUCE_DTYPES, check_dim, check_dtype, check_scatter
from .backend import Backend, Dispatcher, Plans
from .registry import EXAMPLE_WORLD, register

OP = "reduce_scatter"


def _out_shape(x: torch.Tensor, dim: int, world: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] //= world
    return shape


def _check(x, reduce_op: str, dim: int, world: int) -> int:
    dim = check_dim(OP, x, dim)
    check_dtype(OP, x, REDUCE_DTYPES)
    check_scatter(OP, reduce_op, "op", "x", x.shape[dim], dim, "dim", world)
    return dim


class Reference(Backend):
    """``dist.reduce_scatter_single`` over ``[W, outer, inner]`` (W moved to the front; on
    gloo, ``protocol.reduce_scatter_single``'s all-to-all and rank-order sum)."""

    name = "reference"

    def run(self, call: CollectiveCall) -> torch.Tensor:
        x, world = call.x, call.world_size
        protocol.raise_on_mismatch(call)
        chunks = x.reshape(call.outer, world, -1).transpose(0, 1).contiguous()
        out = torch.empty(_out_shape(x, call.dim, world), dtype=x.dtype, device=x.device)
        protocol.reduce_scatter_single(out.view(-1), chunks.view(-1), group=call.group)
        if call.reduce_op == "avg":  # gloo has no AVG
            out.div_(world)
        counters.record(OP, self.name, (world - 1) * out.numel() * x.element_size())
        return out


class Symmetric(protocol.SymmetricBackend):
    """Stage the input in symmetric memory; one kernel sums every rank's slice in fp32."""

    def pull(self, call, buf, staged, epoch, meta, ends):
        x, world, outer = call.x, call.world_size, call.outer
        inner = x.numel() // (outer * world)
        out = torch.empty(_out_shape(x, call.dim, world), dtype=x.dtype, device=x.device)
        stats = protocol.stats_tensor(x.device)
        divisor = float(world) if call.reduce_op == "avg" else 1.0
        self.launchers.reduce_scatter_pull(out, buf.pad_table, buf.rank, world, epoch, meta, outer,
                                           inner, buf.timeout_ns, stats, divisor, **ends)
        counters.record(OP, self.name, stats)
        return out


DISPATCHER = Dispatcher(OP, [*protocol.symmetric_backends(Symmetric), Reference()])


PLANS = Plans(OP)


@torch.library.custom_op("fusedpar::reduce_scatter", mutates_args=())
def _reduce_scatter_op(x: torch.Tensor, reduce_op: str, dim: int, group_name: str,
                       backend: str) -> torch.Tensor:
    key = (x.shape, x.stride(), x.dtype, x.device, reduce_op, dim, group_name, backend)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.make(key, x.device, lambda: _plan(x, reduce_op, dim, group_name, backend))
    return plan(x)


def _plan(x, reduce_op, dim, group_name, backend):
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    call = CollectiveCall(OP, x, _check(x, reduce_op, dim, world), world, group, reduce_op)
    return DISPATCHER.select(call, backend).plan(call)


@_reduce_scatter_op.register_fake
def _(x, reduce_op, dim, group_name, backend):
    world = dist.get_world_size(resolve_group(group_name))
    return x.new_empty(_out_shape(x, _check(x, reduce_op, dim, world), world))


def _setup_context(ctx, inputs, output):
    _, ctx.reduce_op, ctx.dim, ctx.group_name, ctx.backend = inputs


def _backward(ctx, grad):
    # through torch.ops: all_gather's module imports this one (its backward is ours)
    dx = torch.ops.fusedpar.all_gather(grad, ctx.dim, ctx.group_name, ctx.backend)
    if ctx.reduce_op == "avg":
        dx = dx / dist.get_world_size(resolve_group(ctx.group_name))
    return dx, None, None, None, None


_reduce_scatter_op.register_autograd(_backward, setup_context=_setup_context)


def reduce_scatter(x: torch.Tensor, op: str = "sum", dim: int = 0, group=None, *,
                   backend: str | None = None) -> torch.Tensor:
    """Reduce ``x`` over ranks and keep this rank's slice of ``dim``; the same as::

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        total = x.clone(); dist.all_reduce(total, group=group)      # "sum"
        out = total.chunk(world, dim=dim)[rank]                     # "avg": / world

    ``x.shape[dim]`` must be divisible by the world size. Symmetric-memory backends, and every
    backend where gloo carries the data, sum in fp32 in rank order and round once (NCCL in
    its own order). ``group`` and ``backend`` as in ``all_gather``.
    Differentiable: the gradient is ``all_gather(grad, dim, group)`` (``/ W`` for "avg").
    """
    return _reduce_scatter_op(x, op, dim, group_name(group), backend or "")


def reduce_scatter_loopback(xs: list[torch.Tensor], op: str = "sum", dim: int = 0, *,
                            backend: str = "triton") -> list[torch.Tensor]:
    """Every rank's part of ``reduce_scatter`` in this process (rank r's input is
    ``xs[r]``) over a loopback buffer; returns each rank's output. For benchmarks/tests."""
    if xs:
        _check(xs[0], op, dim, len(xs))
    return protocol.run_loopback(DISPATCHER, xs, dim, backend, REDUCE_DTYPES, reduce_op=op)


register(DISPATCHER, (reduce_scatter, reduce_scatter_loopback), checks="fusedpar.testing.collectives",
         example=lambda device: CollectiveCall(
             OP, torch.zeros(2 * EXAMPLE_WORLD, 8, device=device), 0, EXAMPLE_WORLD, None, "sum"))
