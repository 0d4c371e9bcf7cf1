"""``fusedpar.ops.matmul_reduce_scatter``: A @ B reduce-scattered over ranks along a leading
dim, the reduction hidden behind the GEMM (torch ``symm_mem.fused_matmul_reduce_scatter``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import counters, group_name, resolve_group
from . import _collective as C
from .all_gather_matmul import BACKENDS as ALL_GATHER_MATMUL
from .all_gather_matmul import MatmulCall, all_gather_matmul, check_matmul_inputs
from .backend import Backend, Dispatcher

OP = "matmul_reduce_scatter"
REDUCE_OPS = ("sum", "avg")


def _check(a, b, reduce_op, dim, world) -> int:
    dim = check_matmul_inputs(OP, a, [b], dim, "scatter_dim")
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"fusedpar.{OP}: reduce_op={reduce_op!r}; supported: {', '.join(REDUCE_OPS)}")
    if a.shape[dim] % world:
        raise ValueError(
            f"fusedpar.{OP}: A.shape[{dim}] = {a.shape[dim]} is not divisible by the world size "
            f"{world}; pad scatter_dim {dim} of A to a multiple of {world}"
        )
    return dim


def _out_shape(call: MatmulCall) -> list[int]:
    shape = list(call.x.shape[:-1]) + [call.bs[0].shape[1]]
    shape[call.dim] //= call.world_size
    return shape


def _chunk_out(call: MatmulCall, rows: torch.Tensor) -> torch.Tensor:
    """This rank's ``[rows, N]`` block (scattered dim first) in the caller's layout."""
    shape = _out_shape(call)
    lead = [shape[call.dim]] + [s for i, s in enumerate(shape[:-1]) if i != call.dim]
    return rows.view(*lead, shape[-1]).movedim(0, call.dim).contiguous()


class Reference(Backend):
    """One matmul, then ``dist.reduce_scatter_single`` of the product."""

    name = "reference"

    def run(self, call: MatmulCall):
        world = call.world_size
        C.raise_on_mismatch(call)
        product = call.rows() @ call.bs[0]  # [W * m_chunk, N]: rank r's chunk is block r
        out = torch.empty(product.numel() // world, dtype=product.dtype, device=product.device)
        C.reduce_scatter_single(out, product.view(-1), group=call.group)
        if call.reduce_op == "avg":  # gloo has no AVG
            out.div_(world)
        counters.record(OP, self.name, (world - 1) * out.numel() * out.element_size())
        return _chunk_out(call, out.view(-1, product.shape[1]))


class Pipelined(Backend):
    """A ring reduce-scatter of the W row chunks of A @ B: at step s a rank computes the
    partial product of chunk ``(rank - s - 1) % W`` while the running sum of the previous
    chunk travels to its right neighbour; the last step leaves its own chunk. Partial sums
    add in fp32 and are rounded to the output dtype once per hop (as a ring collective)."""

    name = "pipelined"

    def run(self, call: MatmulCall):
        group, world = call.group, call.world_size
        rank = dist.get_rank(group)
        right = dist.get_global_rank(group, (rank + 1) % world)
        left = dist.get_global_rank(group, (rank - 1) % world)
        C.raise_on_mismatch(call)
        chunks = call.rows().reshape(world, -1, call.x.shape[-1])
        b = call.bs[0]
        divisor = world if call.reduce_op == "avg" else 1
        acc = chunks[(rank - 1) % world] @ b
        if world == 1:
            acc = acc / divisor
        incoming = torch.empty_like(acc)
        for step in range(1, world):
            requests = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, acc, right, group),
                dist.P2POp(dist.irecv, incoming, left, group),
            ])
            partial = chunks[(rank - step - 1) % world] @ b
            for request in requests:
                request.wait()
            total = partial.float() + incoming.float()
            if step == world - 1:
                total /= divisor
            acc = total.to(partial.dtype)
        counters.record(OP, self.name, (world - 1) * acc.numel() * acc.element_size())
        return _chunk_out(call, acc)


BACKENDS = Dispatcher(OP, [Pipelined(), Reference()])


@torch.library.custom_op("fusedpar::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int,
                              group_name: str, backend: str) -> torch.Tensor:
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    dim = _check(A, B, reduce_op, scatter_dim, world)
    call = MatmulCall(OP, A, dim, world, group, [B], reduce_op=reduce_op)
    return BACKENDS.select(call, backend).run(call)


@_matmul_reduce_scatter_op.register_fake
def _(A, B, reduce_op, scatter_dim, group_name, backend):
    world = dist.get_world_size(resolve_group(group_name))
    dim = _check(A, B, reduce_op, scatter_dim, world)
    return A.new_empty(_out_shape(MatmulCall(OP, A, dim, world, None, [B])))


def _setup_context(ctx, inputs, output):
    a, b, ctx.reduce_op, ctx.dim, ctx.group_name, ctx.backend = inputs
    ctx.save_for_backward(a, b)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    if ctx.reduce_op == "avg":
        grad = grad / dist.get_world_size(resolve_group(ctx.group_name))
    grad_gathered, (grad_a,) = all_gather_matmul(
        grad, [b.t()], ctx.dim, ctx.group_name, return_A=True,
        backend=ALL_GATHER_MATMUL.carry(ctx.backend))
    grad_b = a.reshape(-1, a.shape[-1]).t() @ grad_gathered.reshape(-1, grad.shape[-1])
    return grad_a, grad_b, None, None, None, None


_matmul_reduce_scatter_op.register_autograd(_backward, setup_context=_setup_context)


def matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str = "sum",
                          scatter_dim: int = 0, group=None, *, backend: str | None = None):
    """Multiply ``A`` by ``B`` and reduce-scatter the product along ``scatter_dim``; the
    same as::

        fusedpar.ops.reduce_scatter(A @ B, reduce_op, scatter_dim, group)
        # = (sum over ranks of A_r @ B_r).chunk(W, scatter_dim)[rank]   ("avg": / W)

    ``A``: 2-D or 3-D ``[..., K]`` (K is this rank's shard of the contraction),
    ``A.shape[scatter_dim]`` divisible by the world size; ``B``: ``[K, N]``. fp32, fp16 or
    bf16. Backends: ``pipelined``, ``reference``. Differentiable:
    ``dA = all_gather_matmul(dY, Bᵀ)`` and ``dB = Aᵀ all_gather(dY)``.
    """
    return _matmul_reduce_scatter_op(A, B, reduce_op, scatter_dim, group_name(group), backend or "")
