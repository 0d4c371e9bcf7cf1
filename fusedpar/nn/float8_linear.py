"""Tensor-parallel float8 linears on the fused fp8 ops, giving torchao ``Float8Linear``'s
numbers (its recipes ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``; scales from
``fusedpar.ops.float8_scales``).

- :func:`column_parallel_float8`: ``y = all_gather(x, dim) @ Wᵀ`` for a weight shard
  ``[N / W, K]`` (sequence-parallel input): forward ``all_gather_scaled_matmul``; backward
  ``dx = scaled_matmul_reduce_scatter(dy, W)``, ``dW = dyᵀ @ x_gathered`` (tensorwise: the
  fp8 gathered x of the forward; rowwise: x scaled per column, gathered in fp8; with_gw_hp:
  x gathered in high precision).
- :func:`row_parallel_float8`: ``y = reduce_scatter(x @ Wᵀ, dim)`` for a weight shard
  ``[N, K / W]``: forward ``scaled_matmul_reduce_scatter``; backward
  ``dx = all_gather_scaled_matmul(dy, W)``, ``dW = dy_gatheredᵀ @ x``.

Scales whose amax spans a sharded axis take the maximum over the group, so every scale is
the one a single process computes on the whole tensor. Where torchao changes the arithmetic
(a rowwise GEMM outputs bfloat16 for fp32/fp16 models; without fast accumulation, i.e. in
the two backward GEMMs, it runs with unit scales and multiplies the row and column scales
into the bfloat16 product: ``addmm_float8_unwrapped``), these do the same.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm import group_name, resolve_group
from ..ops import all_gather, all_gather_scaled_matmul, scaled_matmul_reduce_scatter
from ..ops.float8_scales import Cast, Recipe, quantize, recipe as get_recipe, scaled_mm
from ..ops.scaled_matmul import gather_rows


def _out_dtype(rowwise: bool, orig: torch.dtype) -> torch.dtype:
    """torchao's ``_scaled_mm`` output dtype: bfloat16 for a rowwise GEMM of an fp32 / fp16 model."""
    return torch.bfloat16 if rowwise and orig in (torch.float16, torch.float32) else orig


def _q(t: torch.Tensor, cast: Cast, dim: int, r: Recipe, group):
    """``t`` cast as ``cast`` says: rowwise along ``dim`` (its amax over the group where
    ``group`` is given: ``dim`` sharded), else tensorwise (the amax always over the group:
    every rank holds a part of the tensor)."""
    return quantize(t, cast.dtype, dim if cast.rowwise else None, r.round_pow2, group)


def _local_gemm(a, b, sa, sb, rowwise: bool, orig: torch.dtype) -> torch.Tensor:
    """A weight-gradient GEMM as torchao runs it (no fast accumulation)."""
    if not rowwise:
        return scaled_mm(a, b, sa, sb, orig)
    one = torch.ones((), device=a.device)
    out = scaled_mm(a, b, one, one, torch.bfloat16)
    out *= sa.reshape(-1, 1) * sb.reshape(1, -1)
    return out.to(orig)


class _Column(torch.autograd.Function):
    """``x`` ``[m, K]`` (this rank's rows), ``weights`` each ``[N_i / W, K]``: one gather of
    ``x`` for every weight; outputs each ``[M, N_i / W]``, then the gathered fp8 ``x`` where
    ``return_gathered`` (not differentiable)."""

    @staticmethod
    def forward(ctx, x, name, r: Recipe, backend, return_gathered, *weights):
        group = resolve_group(name)
        orig = x.dtype
        xq, xs = _q(x, r.x, -1, r, None if r.x.rowwise else group)
        wqs = [_q(w.t(), r.w, 0, r, None if r.w.rowwise else group) for w in weights]
        keep = return_gathered or not r.x.rowwise  # tensorwise: dW reuses the gathered fp8 x
        gathered, ys = all_gather_scaled_matmul(xq, [q for q, _ in wqs], xs, [s for _, s in wqs], 0, group,
                                                out_dtypes=[_out_dtype(r.x.rowwise, orig)] * len(weights),
                                                return_A=keep, use_fast_accum=True, backend=backend)
        ctx.save_for_backward(x, gathered, xs, *weights)
        ctx.group, ctx.recipe, ctx.backend = group, r, backend
        if not return_gathered:
            return tuple(y.to(orig) for y in ys)
        ctx.mark_non_differentiable(gathered)
        return (*(y.to(orig) for y in ys), gathered)

    @staticmethod
    def backward(ctx, *grads):
        x, gathered, xs, *weights = ctx.saved_tensors
        group, r = ctx.group, ctx.recipe
        dx, dws, x_for_dw = None, [], None
        for dy, weight in zip(grads, weights):  # torchao's layers each, their dx summed
            if dy is None:
                dws.append(None)
                continue
            orig = dy.dtype
            dyq, dys = _q(dy, r.dy, -1, r, group)  # a row of dy spans N: sharded
            wq, ws = _q(weight.t(), r.w_for_dx, -1, r, group)  # [K, N / W] per row over N
            if r.dy.rowwise or r.w_for_dx.rowwise:  # unit scales into bf16, then the scales
                one = torch.ones((), device=dy.device)  # (torchao without fast accumulation)
                part = scaled_matmul_reduce_scatter(dyq, wq.t(), one, one, "sum", 0, group,
                                                    out_dtype=torch.bfloat16, backend=ctx.backend)
                rank, world = dist.get_rank(group), dist.get_world_size(group)
                rows = dys.expand(dy.shape[0], 1).chunk(world, 0)[rank]
                part *= rows * ws.reshape(1, -1)
                part = part.to(orig)
            else:
                part = scaled_matmul_reduce_scatter(dyq, wq.t(), dys, ws, "sum", 0, group, out_dtype=orig,
                                                    backend=ctx.backend)
            dx = part if dx is None else dx + part
            if r.dy_for_dw.dtype is None:  # high-precision weight gradient
                if x_for_dw is None:
                    x_for_dw = all_gather(x, 0, group)
                dws.append(dy.t() @ x_for_dw)
            elif not r.x_for_dw.rowwise:  # tensorwise: the forward's fp8 x, the dy cast above
                dws.append(_local_gemm(dyq.t(), gathered, dys, xs, False, orig))
            else:  # per column over all rows: dy's here, x's amax over the group, x gathered in fp8
                if x_for_dw is None:
                    xq0, xs0 = _q(x, r.x_for_dw, 0, r, group)
                    x_for_dw = gather_rows(xq0, group), xs0
                dyq0, dys0 = _q(dy, r.dy_for_dw, 0, r, None)
                dws.append(_local_gemm(dyq0.t(), x_for_dw[0], dys0, x_for_dw[1], True, orig))
        return (dx, None, None, None, None, *dws)


class _Row(torch.autograd.Function):
    """``x`` ``[M, K / W]`` (every row, this rank's K), ``weight`` ``[N, K / W]``."""

    @staticmethod
    def forward(ctx, x, weight, name, r: Recipe, backend):
        group = resolve_group(name)
        orig = x.dtype
        xq, xs = _q(x, r.x, -1, r, group)  # a row of x spans K: sharded
        wq, ws = _q(weight.t(), r.w, 0, r, group)  # [K / W, N] per column over K
        y = scaled_matmul_reduce_scatter(xq, wq, xs, ws, "sum", 0, group,
                                         out_dtype=_out_dtype(r.x.rowwise, orig), use_fast_accum=True,
                                         backend=backend)
        ctx.save_for_backward(x, weight, xq, xs)
        ctx.group, ctx.recipe, ctx.backend = group, r, backend
        return y.to(orig)

    @staticmethod
    def backward(ctx, dy):
        x, weight, xq, xs = ctx.saved_tensors
        group, r, orig = ctx.group, ctx.recipe, dy.dtype
        dyq, dys = _q(dy, r.dy, -1, r, None if r.dy.rowwise else group)  # rows are local
        # [K / W, N] per row over N: local
        wq, ws = _q(weight.t(), r.w_for_dx, -1, r, None if r.w_for_dx.rowwise else group)
        rowwise = r.dy.rowwise or r.w_for_dx.rowwise
        keep = r.dy_for_dw.dtype is not None and not r.dy_for_dw.rowwise
        if rowwise:
            one = torch.ones((), device=dy.device)
            gathered, (dx,) = all_gather_scaled_matmul(dyq, [wq.t()], one, [one], 0, group,
                                                       out_dtypes=[torch.bfloat16], return_A=keep,
                                                       backend=ctx.backend)
            rows = gather_rows(dys.expand(dy.shape[0], 1).contiguous(), group)
            dx *= rows * ws.reshape(1, -1)
            dx = dx.to(orig)
        else:
            gathered, (dx,) = all_gather_scaled_matmul(dyq, [wq.t()], dys, [ws], 0, group, out_dtypes=[orig],
                                                       return_A=keep, backend=ctx.backend)
        if r.dy_for_dw.dtype is None:
            dw = all_gather(dy, 0, group).t() @ x
        elif not r.dy_for_dw.rowwise:  # tensorwise: the gathered fp8 dy, the forward's fp8 x
            dw = _local_gemm(gathered.t(), xq, dys, xs, False, orig)
        else:  # per column over all rows: dy's amax over the group, gathered in fp8; x's here
            dyq0, dys0 = _q(dy, r.dy_for_dw, 0, r, group)
            xq0, xs0 = _q(x, r.x_for_dw, 0, r, None)
            dw = _local_gemm(gather_rows(dyq0, group).t(), xq0, dys0, xs0, True, orig)
        return dx, dw, None, None, None


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, 0).reshape(-1, x.shape[-1])


def _unrows(y: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """``y`` ``[rows, N]`` (``dim`` first, flattened) back to ``like``'s layout, ``dim`` resized."""
    lead = [s for i, s in enumerate(like.shape[:-1]) if i != dim]
    return y.view(y.shape[0] // math.prod(lead), *lead, y.shape[-1]).movedim(0, dim)


def column_parallel_float8(x: torch.Tensor, weight: torch.Tensor, dim: int, group=None, *,
                           recipe: str = "tensorwise", backend: str | None = None) -> torch.Tensor:
    """``all_gather(x, dim, group) @ weight.T`` in float8 as torchao's ``Float8Linear``
    computes it with ``recipe``: ``x`` ``[..., K]`` this rank's part of ``dim``; ``weight``
    ``[N / W, K]`` this rank's rows. Differentiable in ``x`` and ``weight``."""
    (y,), _ = column_parallel_float8_outputs(x, [weight], dim, group, recipe=recipe, backend=backend)
    return y


def column_parallel_float8_outputs(x: torch.Tensor, weights: list[torch.Tensor], dim: int, group=None, *,
                                   recipe: str = "tensorwise", backend: str | None = None,
                                   return_gathered: bool = False):
    """``[column_parallel_float8(x, w, ...) for w in weights]`` with one gather of ``x``
    (q/k/v, gate/up), and the gathered fp8 ``x`` in ``x``'s layout where
    ``return_gathered`` (else None): ``(outputs, gathered)``."""
    dim = dim % x.dim()
    outs = _Column.apply(_rows(x, dim), group_name(group), get_recipe(recipe), backend or "",
                         return_gathered, *weights)
    ys = [_unrows(y, x, dim) for y in outs[:len(weights)]]
    return ys, _unrows(outs[-1], x, dim) if return_gathered else None


def row_parallel_float8(x: torch.Tensor, weight: torch.Tensor, dim: int, group=None, *,
                        recipe: str = "tensorwise", backend: str | None = None) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T, dim, group)`` in float8 as torchao's ``Float8Linear``
    computes it with ``recipe`` (partials summed in float32): ``x`` ``[..., K / W]`` this
    rank's columns; ``weight`` ``[N, K / W]``. Differentiable in ``x`` and ``weight``."""
    dim = dim % x.dim()
    rows = _rows(x, dim)
    y = _Row.apply(rows, weight, group_name(group), get_recipe(recipe), backend or "")
    return _unrows(y, x, dim)
