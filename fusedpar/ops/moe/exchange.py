"""What every MoE exchange shares (``moe_dispatch``, ``moe_combine``, each ``moe_experts``
backend): the routing checks, the sort of each token's copies by expert, the permutation
of rows into that order and back (with autograd), and the exchange of per-expert counts
with its check of the expert ids. Triton kernels (``kernels.moe_permute``) on CUDA and in
the interpreter, torch elsewhere."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.groups import host_collective_device
from ...kernels import moe_permute as permute_kernels
from ...kernels.interpreter import interpreting
from .. import float8_scales, protocol
from .routing import expert_counts

SCALE_BYTES = 4  # a float8 row's fp32 scale travels after its fp8 bytes

#: The exchange ops size their buffers from routing counts read on the host and return
#: data-dependent row counts, so ``torch.compile`` does not trace into them: it breaks the
#: graph there and runs them eagerly (autograd intact); the rest of a compiled model
#: (routing included) is traced.
eager_under_compile = torch.compiler.disable

#: The flag a rank sends after its per-expert counts when its topk_idx holds an id outside
#: ``[-1, E)`` (``sort_by_expert`` sets it). The ids are checked on the device: a host read of
#: topk_idx would synchronise, and would fail only the rank holding it while its peers wait
#: in the exchange; with the flag every rank raises the same error where it reads the
#: exchanged counts.
INVALID_IDS = permute_kernels.INVALID_IDS


def check_routing(op: str, x, topk_idx, topk_weights, num_experts: int, world: int,
                  max_tokens_per_rank: int | None = None) -> None:
    """Shapes and dtypes (the expert ids are checked on the device: ``sort_by_expert`` flags
    them)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"fusedpar.{op}: x must be a [tokens, hidden] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"fusedpar.{op}: topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"fusedpar.{op}: topk_idx must be [tokens, k] = [{x.shape[0]}, k], got "
                         f"{tuple(topk_idx.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise ValueError(f"fusedpar.{op}: topk_weights has shape {tuple(topk_weights.shape)} but "
                         f"topk_idx {tuple(topk_idx.shape)}; they must match")
    if not topk_weights.is_floating_point():
        raise TypeError(f"fusedpar.{op}: topk_weights must be floating point, got {topk_weights.dtype}")
    if num_experts < 1 or num_experts % world:
        raise ValueError(f"fusedpar.{op}: num_experts={num_experts} is not divisible by the ep "
                         f"group size {world}; each rank must hold the same number of experts")
    if max_tokens_per_rank is not None and (not isinstance(max_tokens_per_rank, int)
                                            or max_tokens_per_rank < 1):
        raise ValueError(f"fusedpar.{op}: max_tokens_per_rank={max_tokens_per_rank!r} must be a "
                         "positive int (or None for an unpadded recv_x)")


# ---- sort and permutation ---------------------------------------------------------------------


def _kernels_run_on(device: torch.device) -> bool:
    return (device.type == "cuda") != interpreting()


def sort_by_expert(topk_idx, num_experts, flag_value: int = 0):
    """``(pos, header)``: each copy's row in the expert-sorted buffer (-1: dropped), int32
    ``[T*k]``; int32 ``[E + 1]``: the copies per expert, then ``flag_value``, or
    ``INVALID_IDS`` if topk_idx holds an id outside ``[-1, E)`` (no host read). Plain torch::

        pos = argsort(where(idx < 0, E, idx), stable=True).argsort(); pos[idx < 0] = -1
    """
    if _kernels_run_on(topk_idx.device):
        return permute_kernels.sort_by_expert(topk_idx, num_experts, flag_value)
    flat = topk_idx.reshape(-1)
    order = torch.argsort(torch.where(flat < 0, num_experts, flat), stable=True)
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(flat.numel(), device=flat.device)
    bad = ((flat < -1) | (flat >= num_experts)).any()
    flag = torch.where(bad, INVALID_IDS, torch.full((1,), flag_value, dtype=torch.int32, device=flat.device))
    return (torch.where(flat < 0, -1, pos).to(torch.int32),
            torch.cat([expert_counts(flat, num_experts, torch.int32), flag]))


def _kernel_weights(weights):
    """Routing weights as the permutation kernels read them: fp32, contiguous ``[T*k]``."""
    return None if weights is None else weights.reshape(-1).float().contiguous()


def permute(x, pos, k, rows, weights=None):
    """``out[pos[i]] = x[i // k] (* weights[i], in fp32)``: ``[rows, H]``, other rows zero.
    No autograd (``Permute`` has it)."""
    if _kernels_run_on(x.device):
        return permute_kernels.gather_rows(x.contiguous(), pos, k, rows, _kernel_weights(weights))
    kept = pos >= 0
    src = x[torch.arange(pos.numel(), device=x.device)[kept] // k]
    if weights is not None:
        src = (src.float() * weights.reshape(-1)[kept].float()[:, None]).to(x.dtype)
    out = x.new_zeros(rows, x.shape[1])
    out[pos[kept].long()] = src
    return out


def unpermute(y, pos, k, tokens, weights=None):
    """``out[t] = sum_j weights[t, j] * y[pos[t*k+j]]`` (weights 1 when None), fp32 sums.
    No autograd (``Unpermute`` has it)."""
    if _kernels_run_on(y.device):
        return permute_kernels.combine_rows(y.contiguous(), pos, k, tokens, _kernel_weights(weights))
    kept = pos >= 0
    w = kept.float() if weights is None else torch.where(kept, weights.reshape(-1).float(), 0.0)
    rows = y[pos.clamp(min=0).long()].float() * w[:, None]
    return rows.view(tokens, k, -1).sum(1).to(y.dtype)


def float8_cast(recipe: str) -> float8_scales.Cast:
    """The per-token cast of ``recipe``'s GEMM input (``float8_scales.RECIPES``): dispatch
    casts each row by itself, so only a rowwise input cast can travel."""
    cast = float8_scales.recipe(recipe).x
    if not cast.rowwise:
        raise ValueError(f"fusedpar.moe_dispatch: float8={recipe!r} casts the input with one scale per "
                         "tensor, which needs every rank's tokens; dispatch casts each token by "
                         "itself: use float8='rowwise' (or 'rowwise_with_gw_hp')")
    return cast


def pack_float8(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """``x [T, H]`` cast per row as ``recipe`` casts a GEMM input (``float8_scales.quantize``
    along H), as uint8 rows ``[T, H + 4]``: the fp8 bytes, then the fp32 scale's bytes (gloo
    has no float8 dtype; one row carries both, so one exchange moves them)."""
    cast = float8_cast(recipe)
    data, scale = float8_scales.quantize(x, cast.dtype, -1, float8_scales.recipe(recipe).round_pow2)
    return torch.cat([data.view(torch.uint8), scale.view(torch.uint8)], dim=1)


def unpack_float8(rows: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of ``pack_float8``'s rows (``[..., H + 4]`` uint8): fp8 ``[..., H]``
    and fp32 ``[...]`` (a zero row, the padding, has scale 0)."""
    H = rows.shape[-1] - SCALE_BYTES
    data = rows[..., :H].contiguous().view(float8_cast(recipe).dtype)
    return data, rows[..., H:].contiguous().view(torch.float32).squeeze(-1)


def dequantize_float8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale`` per row (``unpack_float8``'s pair) in ``dtype``: the values the fp8
    rows stand for (exact: fp8 times a power of 2, in fp32, then ``dtype``)."""
    return (data.float() * scale[:, None]).to(dtype)


def permute_float8(x, pos, k, rows, recipe: str) -> torch.Tensor:
    """``permute`` of ``pack_float8(x, recipe)``'s rows: ``[rows, H + 4]`` uint8. Where the
    kernels run, each copy is cast as it is gathered (one pass over x's copies; on CUDA from
    compute capability 8.9, where Triton casts to e4m3)."""
    if _kernels_run_on(x.device) and (x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) >= (8, 9)):
        return permute_kernels.gather_rows_float8(x.contiguous(), pos, k, rows, float8_cast(recipe).dtype,
                                                  float8_scales.recipe(recipe).round_pow2)
    return permute(pack_float8(x, recipe), pos, k, rows)


class Permute(torch.autograd.Function):
    """``permute(x, pos, k, rows)``: each token's kept copies into the expert-sorted buffer;
    the backward sums each token's copies' gradients back (``unpermute``)."""

    @staticmethod
    def forward(ctx, x, pos, k, rows):
        ctx.save_for_backward(pos)
        ctx.k, ctx.tokens = k, x.shape[0]
        return permute(x, pos, k, rows)

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        return unpermute(grad, pos, ctx.k, ctx.tokens), None, None, None


class Unpermute(torch.autograd.Function):
    """``unpermute(y, pos, k, T, weights)``: ``out[t] = sum_j w[t, j] * y[pos[t*k+j]]``;
    gradients for y and the weights."""

    @staticmethod
    def forward(ctx, y, weights, pos, k):
        # y only for the weights' gradient (fused moe_experts' y is a view of a buffer)
        ctx.save_for_backward(y if ctx.needs_input_grad[1] else None, weights, pos)
        ctx.k, ctx.rows = k, y.shape[0]
        return unpermute(y, pos, k, weights.shape[0], weights)

    @staticmethod
    def backward(ctx, grad):
        y, weights, pos = ctx.saved_tensors
        k, kept = ctx.k, pos >= 0
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:  # the permutation kernel: no host read of pos
            grad_y = permute(grad, pos, k, ctx.rows, weights)
        if ctx.needs_input_grad[1]:
            rows = y[pos.clamp(min=0).long()].float()
            dots = (rows * grad.repeat_interleave(k, 0).float()).sum(-1)
            grad_w = torch.where(kept, dots, 0.0).view_as(weights).to(weights.dtype)
        return grad_y, grad_w, None, None


# ---- counts: exchanged, checked, read on the host ----------------------------------------------


def all_to_all_rows(x, send, recv, group):
    """``dist.all_to_all_single`` of ``x``'s rows, ``send[d]`` rows to rank d and ``recv[s]``
    from rank s (host ints), into a new tensor."""
    out = x.new_empty(sum(recv), *x.shape[1:])
    protocol.all_to_all_single(out, x.contiguous(), group, recv, send)
    return out


def invalid_ids_error(op: str, flags: torch.Tensor, num_experts: int, topk_idxs: dict):
    """The error of an exchange in which a rank flagged expert ids out of range (``flags``:
    host ints, one per rank), else None. ``topk_idxs``: rank -> topk_idx of the ranks this
    process plays; the message gives the offending rank's id range when it is one of them
    (a host read, on the error path only)."""
    bad = (flags == INVALID_IDS).nonzero().flatten().tolist()
    if not bad:
        return None
    span = ""
    if bad[0] in topk_idxs:
        lo, hi = torch.stack(torch.aminmax(topk_idxs[bad[0]])).tolist()
        span = f" (its ids span [{lo}, {hi}])"
    return ValueError(f"fusedpar.{op}: rank {bad[0]}'s topk_idx holds expert ids outside "
                      f"[0, {num_experts}){span}; -1 marks a dropped copy")


def checked_counts(op: str, table: torch.Tensor, num_experts: int,
                   topk_idxs: dict) -> torch.Tensor:
    """A host table of exchanged counts whose last column holds each row's sender's id flag
    (``sort_by_expert``'s headers, or rows of them), without that column (int64); raises if
    a rank flagged its ids (``invalid_ids_error``)."""
    error = invalid_ids_error(op, table[:, -1], num_experts, topk_idxs)
    if error is not None:
        raise error
    return table[:, :-1].long()


def exchange_counts(op: str, topk_idx: torch.Tensor, header: torch.Tensor, group,
                    rows: torch.Tensor | None = None):
    """``(sent, received)``, host int64 ``[W, E_local]``: this rank's copies per expert of each
    rank, and each rank's copies per expert of this rank (``all_to_all_single``), in one host
    read. ``header``: ``sort_by_expert``'s; its id flag goes to every rank with the counts, so
    if any rank's topk_idx holds an id out of range, every rank raises here. ``rows`` (``[W]``,
    optional): a count per rank exchanged with them, as one more column of both."""
    world, rank, E = dist.get_world_size(group), dist.get_rank(group), header.numel() - 1
    local = E // world
    extra = [] if rows is None else [rows.to(header.dtype).view(world, 1)]
    sent = torch.cat([header[:E].view(world, local), *extra,
                      header[E:].view(1, 1).expand(world, 1)], 1)
    host = torch.stack([sent, all_to_all_rows(sent, [1] * world, [1] * world, group)]).cpu()
    return host[0, :, :-1].long(), checked_counts(op, host[1], E, {rank: topk_idx})


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, in a copy that does not wait for the stream: a plain
    ``.to("cuda")`` of pageable memory synchronises the stream (the host then waits for
    every kernel already queued)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def check_same_everywhere(op: str, group, values: list[int], names: str) -> None:
    """One tiny all-gather: every rank passed the same ``values`` (hidden size, k, ...); one
    host read where the group's small collectives run on the GPU (NCCL alone)."""
    device = host_collective_device(group)
    mine = host_to_device(torch.tensor(values, dtype=torch.int64), device)
    everyone = torch.empty(dist.get_world_size(group) * len(values), dtype=torch.int64, device=device)
    protocol.all_gather_single(everyone, mine, group=group)
    for r, theirs in enumerate(everyone.view(-1, len(values)).tolist()):
        if theirs != values:
            raise ValueError(f"fusedpar.{op}: rank {dist.get_rank(group)} passed ({names}) = "
                             f"{tuple(values)} but rank {r} passed {tuple(theirs)}; every rank of "
                             "the ep group must agree")
