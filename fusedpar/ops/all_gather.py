"""``fusedpar.ops.all_gather``: concatenate every rank's tensor along ``dim``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import counters, group_name, resolve_group
from . import protocol
from .calls import CollectiveCall, GATHER_DTYPES, check_dim, check_dtype
from .backend import Backend, Dispatcher, Plans
from .registry import EXAMPLE_WORLD, register
from .reduce_scatter import reduce_scatter

OP = "all_gather"


def _out_shape(x: torch.Tensor, dim: int, world: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] *= world
    return shape


class Reference(Backend):
    """``dist.all_gather_single`` into ``[W, *x.shape]``, then move W next to ``dim``."""

    name = "reference"

    def run(self, call: CollectiveCall) -> torch.Tensor:
        x, world, outer = call.x, call.world_size, call.outer
        protocol.raise_on_mismatch(call)
        out = torch.empty(_out_shape(x, call.dim, world), dtype=x.dtype, device=x.device)
        # gather straight into the output when the rank blocks are its leading rows
        stacked = out if outer == 1 else torch.empty_like(out)
        protocol.all_gather_single(stacked.view(-1), x.contiguous().view(-1), group=call.group)
        if outer != 1:
            out.view(outer, world, -1).copy_(stacked.view(world, outer, -1).transpose(0, 1))
        # the ring algorithm's nominal volume: torch.distributed reports no traffic
        counters.record(OP, self.name, (world - 1) * x.numel() * x.element_size())
        return out


class Symmetric(protocol.SymmetricBackend):
    """Stage the input in symmetric memory; one kernel pulls every peer's shard."""

    def pull(self, call, buf, staged, epoch, meta, ends):
        x, world, outer = call.x, call.world_size, call.outer
        inner = x.numel() // outer
        # allocated in the final shape (a returned view would make FSDP2 and autograd warn)
        out = torch.empty(_out_shape(x, call.dim, world), dtype=x.dtype, device=x.device)
        stats = protocol.stats_tensor(x.device)
        self.launchers.all_gather_pull(out, staged, buf.pad_table, buf.rank, world, epoch, meta,
                                       outer, inner, buf.timeout_ns, stats, **ends)
        counters.record(OP, self.name, stats)
        return out


DISPATCHER = Dispatcher(OP, [*protocol.symmetric_backends(Symmetric), Reference()])
PLANS = Plans(OP)


@torch.library.custom_op("fusedpar::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, dim: int, group_name: str, backend: str) -> torch.Tensor:
    key = (x.shape, x.stride(), x.dtype, x.device, dim, group_name, backend)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.make(key, x.device, lambda: _plan(x, dim, group_name, backend))
    return plan(x)


def _plan(x, dim, group_name, backend):
    dim = check_dim(OP, x, dim)
    check_dtype(OP, x, GATHER_DTYPES)
    group = resolve_group(group_name)
    call = CollectiveCall(OP, x, dim, dist.get_world_size(group), group)
    return DISPATCHER.select(call, backend).plan(call)


@_all_gather_op.register_fake
def _(x, dim, group_name, backend):
    dim = check_dim(OP, x, dim)
    return x.new_empty(_out_shape(x, dim, dist.get_world_size(resolve_group(group_name))))


def _setup_context(ctx, inputs, output):
    _, ctx.dim, ctx.group_name, ctx.backend = inputs


def _backward(ctx, grad):
    return reduce_scatter(grad, "sum", ctx.dim, ctx.group_name, backend=ctx.backend), None, None, None


_all_gather_op.register_autograd(_backward, setup_context=_setup_context)


def all_gather(x: torch.Tensor, dim: int = 0, group=None, *, backend: str | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; the same as::

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        out = torch.cat(parts, dim=dim)

    ``group``: ProcessGroup, 1-D DeviceMesh, ``(mesh, axis_name)``, group name or None
    (world). ``backend``: ``"reference"``, ``"triton"`` or ``"cuda"``; by default the first
    that supports the call (``fusedpar info`` lists them). Every rank must pass the same
    shape and dtype; a difference raises ``ValueError``. Any layout is accepted.
    Differentiable: the gradient is ``reduce_scatter(grad, "sum", dim, group)``.
    """
    return _all_gather_op(x, dim, group_name(group), backend or "")


def all_gather_loopback(xs: list[torch.Tensor], dim: int = 0, *, backend: str = "triton") -> list[torch.Tensor]:
    """Every rank's part of ``all_gather`` in this process (rank r's input is ``xs[r]``)
    over a loopback symmetric buffer; returns each rank's output, which equals
    ``torch.cat(xs, dim)``. For single-device benchmarks and tests of the protocol."""
    return protocol.run_loopback(DISPATCHER, xs, dim, backend, GATHER_DTYPES)


register(DISPATCHER, (all_gather, all_gather_loopback), checks="fusedpar.testing.collectives",
         example=lambda device: CollectiveCall(
             OP, torch.zeros(2 * EXAMPLE_WORLD, 8, device=device), 0, EXAMPLE_WORLD))
