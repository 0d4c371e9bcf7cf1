"""The SwiGLU expert MLP's maths: ``swiglu``, ``experts_dense`` (the whole MLP as a plain
loop over experts, in one process), and the grouped-GEMM pieces the exchanging backends
build it from over expert-sorted rows (SwiGLU in the GEMM's epilogue forward and backward,
the weight gradients)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ...kernels import grouped_mm as gemm_kernels
from .. import float8_scales
from ..grouped_mm import grouped_mm, runs_triton
from ..scaled_grouped_mm import float8_grouped_mm, float8_weight_grad
from .experts_call import ExchangePlan


def swiglu(h13: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[.., 2I]`` tensor whose first half is the gate (w1) and
    second half the up projection (w3), as Hugging Face's ``gate_up_proj`` stores them."""
    gate, up = h13.chunk(2, dim=-1)
    return F.silu(gate) * up


def experts_dense(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The expert MLP as a plain loop over experts (Hugging Face ``MixtralExperts``)::

        y = zeros_like(x)
        for e in range(E):
            token, slot = where(topk_idx == e)
            out = swiglu(x[token] @ w13[e].T) @ w2[e].T
            y.index_add_(0, token, (out * topk_weights[token, slot, None]).to(x.dtype))

    ``x [T, H]``, ``topk_idx [T, k]`` (``-1`` = dropped), ``w13 [E, 2I, H]``, ``w2 [E, H, I]``.
    The oracle of ``moe_experts`` and the forward of ``fusedpar.nn.MoEBlock``.
    """
    y = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_idx == e)
        if token.numel() == 0:
            continue
        out = swiglu(x[token] @ w13[e].t()) @ w2[e].t()
        y = y.index_add(0, token, (out * topk_weights[token, slot, None]).to(x.dtype))
    return y


def float8_swiglu_mlp(a, a_cast, w13, w2, offs, recipe: str) -> tuple:
    """The expert MLP of expert-sorted rows through fp8 casts, with autograd: ``(h13, act,
    y)``, the same as::

        gemm = partial(float8_grouped_mm, offs=offs, recipe=recipe, out_dtype=a.dtype)
        h13 = gemm(a, w13.transpose(1, 2), a_cast=a_cast)
        act = swiglu(h13)
        y = gemm(act, w2.transpose(1, 2))

    ``a_cast``: ``(data, scale)``, the rows as an fp8 exchange brought them (the first GEMM
    multiplies them as they are); ``a`` their values (``dequantize_float8``), which the
    backward casts as the recipe says."""
    gemm = partial(float8_grouped_mm, offs=offs, recipe=recipe, out_dtype=a.dtype)
    h13 = gemm(a, w13.transpose(1, 2), a_cast=a_cast)
    act = swiglu(h13)
    return h13, act, gemm(act, w2.transpose(1, 2))


def grouped_swiglu(x_rows, w13, offs, act, h13=None, backend: str = "") -> None:
    """``act = swiglu(grouped_mm(x_rows, w13.transpose(1, 2), offs))``, and ``h13`` the
    product when given: one launch with SwiGLU in the GEMM's epilogue where grouped_mm runs
    Triton, else those ops. No autograd (the callers are autograd functions)."""
    b = w13.transpose(1, 2)
    if runs_triton(x_rows, b, offs, backend):
        gemm_kernels.grouped_mm_rows(x_rows, b, offs, act, epilogue="swiglu", h=h13)
        return
    product = grouped_mm(x_rows, b, offs, backend=backend)
    if h13 is not None:
        h13.copy_(product)
    act.copy_(swiglu(product))


def grouped_swiglu_vjp(dy, w2, offs, h13, backend: str = "", out=None) -> torch.Tensor:
    """SwiGLU's backward at the forward's products ``h13`` of the gradient ``grouped_mm(dy,
    w2, offs)`` of its output (into ``out`` when given): in the GEMM's epilogue where
    grouped_mm runs Triton, else ``torch.func.vjp(swiglu, h13)``."""
    out = torch.empty_like(h13) if out is None else out
    if runs_triton(dy, w2, offs, backend):
        gemm_kernels.grouped_mm_rows(dy, w2, offs, out, epilogue="swiglu_vjp", h=h13)
        return out
    _, swiglu_vjp = torch.func.vjp(swiglu, h13)
    return out.copy_(swiglu_vjp(grouped_mm(dy, w2, offs, backend=backend))[0])


def weight_grads(needs: tuple, w13, w2, plan: ExchangePlan, x_rows, act, dy, dh13) -> tuple:
    """``(dw13, dw2)`` (None where autograd needs none) from every source's received rows
    (source-major, expert-sorted within): ``dw2[e] = Σ dyᵀ act`` and ``dw13[e] = Σ dh13ᵀ x``
    over expert e's rows. Where grouped_mm runs Triton, one launch per weight sums each
    expert's segments of every source (``grouped_mm_k(..., sources=W)``), rather than a
    launch, a whole-gradient write and an add per source."""
    grads = []
    for need, left, right, w in ((needs[0], dh13, x_rows, w13), (needs[1], dy, act, w2)):
        if not need:
            grads.append(None)
        elif runs_triton(left.t(), right, plan.segment_ends):
            grads.append(torch.empty_like(w))
            gemm_kernels.grouped_mm_k(left.t(), right, plan.segment_ends, grads[-1], sources=plan.world)
        else:
            grads.append(torch.zeros_like(w))
            for src in range(plan.world):
                rows = plan.copy_rows(src)
                if rows.stop > rows.start:
                    grads[-1] += grouped_mm(left[rows].t(), right[rows], plan.offs[src])
    return tuple(grads)


def expert_major(plan: ExchangePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, offs)``: the received copies (source-major, expert-sorted within) in expert
    order, each expert's copies in source order (``moe_dispatch``'s recv_x order), and the
    int32 cumulative ends of the experts' rows there. On the device, no host read."""
    ends = plan.segment_ends  # (source, expert) segments, source-major
    world, local = plan.offs.shape
    rows = torch.arange(sum(plan.copies), device=ends.device, dtype=ends.dtype)
    segment = torch.searchsorted(ends, rows, right=True)
    order = torch.argsort(segment % local * world + segment // local, stable=True)
    per_segment = torch.diff(ends, prepend=ends.new_zeros(1))
    return order, per_segment.view(world, local).sum(0).cumsum(0).to(torch.int32)


def float8_weight_grads(needs: tuple, w13, w2, plan: ExchangePlan, x_rows, act, dy, dh13, recipe: str) -> tuple:
    """``weight_grads`` as ``float8_swiglu_mlp``'s backward computes them (``recipe``'s casts,
    ``float8_weight_grad``) over every source's rows in expert order (``expert_major``): the
    same groups, casts and sums as the unfused ops over ``moe_dispatch``'s recv_x."""
    r, (order, offs) = float8_scales.recipe(recipe), expert_major(plan)
    return tuple(float8_weight_grad(r, right[order], left[order], offs, w.dtype).transpose(1, 2) if need
                 else None for need, left, right, w in ((needs[0], dh13, x_rows, w13), (needs[1], dy, act, w2)))
