"""fp8 scales as torchao's float8 training computes them, and its recipes, without importing
torchao (fusedpar imports without it; ``tests/ops/test_scaled_matmul.py`` checks these are
bit for bit torchao's).

A *scale* here is what ``torch._scaled_mm`` takes: the multiplier that turns fp8 values back
into real ones (``x ≈ data.float() * scale``), the reciprocal of torchao's ``_scale``. For a
tensor ``x`` and an fp8 ``dtype``::

    amax = x.abs().amax(dim, keepdim=True)          # dim None: the whole tensor
    s = (finfo(dtype).max / amax.double().clamp(min=1e-12)).float()   # torchao amax_to_scale
    if round_pow2: s = 2 ** floor(log2(s))
    data = (x.float() * s).clamp(-finfo.max, finfo.max).to(dtype)     # to_fp8_saturated
    scale = s.reciprocal()

``quantize(..., group=g)`` takes the amax over the ranks of ``g`` (an all-reduce MAX), so a
tensor split across ranks along the reduced axis gets the scale the whole tensor would:
what a tensor-parallel layer needs to give a single process's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import protocol

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
EPS = 1e-12  # torchao.float8.float8_utils.EPS


def check_fp8(op: str, name: str, t) -> None:
    """``t`` is an fp8 tensor (e4m3fn or e5m2), else a TypeError naming ``name`` and the fix."""
    if not isinstance(t, torch.Tensor) or t.dtype not in FP8_DTYPES:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"fusedpar.{op}: {name} is {got}; it must be torch.float8_e4m3fn or "
                        f"torch.float8_e5m2 (quantize it first: fusedpar.ops.float8_scales.quantize)")


def fp8_tensor_core_reasons(t: torch.Tensor, fix: str = "") -> list[str]:
    """Why ``t``'s GPU cannot multiply fp8 (compute capability below 8.9: sm_80 is refused
    rather than emulated); [] off CUDA. ``fix``: what to use instead, appended."""
    if not t.is_cuda:
        return []
    major, minor = torch.cuda.get_device_capability(t.device)
    if (major, minor) >= (8, 9):
        return []
    return [f"fp8 tensor cores need compute capability 8.9+ (Ada, Hopper); this GPU has {major}.{minor}{fix}"]


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, round_pow2: bool = False) -> torch.Tensor:
    """torchao's ``amax_to_scale``: ``finfo(dtype).max / amax`` in float64, as float32,
    rounded down to a power of 2 if ``round_pow2`` (torchao's multiplier, not ``_scaled_mm``'s)."""
    s = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s))) if round_pow2 else s


def quantize(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None, round_pow2: bool = False,
             group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)``: ``x`` in fp8 ``dtype`` and the ``_scaled_mm`` scale (float32; one
    element for ``dim`` None, else the amax's shape: ``x`` reduced along ``dim`` with
    keepdim). ``group``: the amax is the maximum over its ranks (each passes its part)."""
    if dtype not in FP8_DTYPES:
        raise TypeError(f"fusedpar quantize: dtype {dtype} is not an fp8 dtype; use one of {FP8_DTYPES}")
    with torch.no_grad():
        amax = x.abs().amax() if dim is None else x.abs().amax(dim, keepdim=True)
        amax = amax.float()
        if group is not None and dist.get_world_size(group) > 1:
            protocol.all_reduce(amax, group, dist.ReduceOp.MAX)
        s = amax_to_scale(amax, dtype, round_pow2)
        top = torch.finfo(dtype).max
        data = (x.detach().to(torch.float32) * s).clamp(-top, top).to(dtype)
    return data, s.reciprocal()


def _cpu_scaled_mm_takes_rows() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes rowwise scales (torch 2.11's
    asserts tensorwise ones). Asked once, at import: a traced call must not run it."""
    x = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(x, x.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


CPU_SCALED_MM_TAKES_ROWS = _cpu_scaled_mm_takes_rows()


def col_major(b: torch.Tensor) -> torch.Tensor:
    """``b`` column-major, as cuBLAS's fp8 GEMM takes it (a copy only if needed)."""
    return b if b.stride(0) == 1 else b.t().contiguous().t()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """``torch._scaled_mm`` of a ``[M, K]`` A and ``[K, N]`` B, any mix of scale layouts
    (``_scaled_mm`` wants both tensorwise or both rowwise: a tensorwise scale meeting a
    rowwise one is expanded, as torchao does), B column-major on CUDA. On CPU where torch's
    op takes no rowwise scales: ``((a.float() * a_scale) @ (b.float() * b_scale)).to(out_dtype)``,
    what torch 2.14's CPU op computes."""
    a_rowwise, b_rowwise = a_scale.numel() > 1, b_scale.numel() > 1
    if a_rowwise != b_rowwise:
        if b_rowwise:
            a_scale = a_scale.reshape(1, 1).expand(a.shape[0], 1).contiguous()
        else:
            b_scale = b_scale.reshape(1, 1).expand(1, b.shape[1]).contiguous()
    elif not a_rowwise:
        a_scale, b_scale = a_scale.reshape(()), b_scale.reshape(())
    rowwise = a_rowwise or b_rowwise
    a_scale = a_scale.reshape(a.shape[0], 1) if rowwise else a_scale
    if a.is_cuda:
        b = col_major(b)
    elif rowwise and not CPU_SCALED_MM_TAKES_ROWS:
        return ((a.float() * a_scale) @ (b.float() * b_scale.reshape(1, -1))).to(out_dtype)
    return torch._scaled_mm(a.contiguous(), b, a_scale.contiguous(), b_scale.contiguous(), out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


@dataclass(frozen=True)
class Cast:
    """How one GEMM operand is cast: its fp8 dtype, and whether its scale is per row of the
    matrix as the GEMM takes it (A: per row; B ``[K, N]``: per column), else one for the
    tensor. ``dtype`` None: not cast (the GEMM runs in high precision)."""

    dtype: torch.dtype | None
    rowwise: bool = False


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Recipe:
    """torchao's ``Float8LinearConfig.from_recipe_name(name)`` for a linear ``y = x Wᵀ``:
    the casts of its three GEMMs' operands (``y = x @ Wᵀ``, ``dx = dy @ W``,
    ``dW = dyᵀ @ x``) and whether scales are rounded down to powers of 2."""

    name: str
    x: Cast
    w: Cast
    dy: Cast
    w_for_dx: Cast
    dy_for_dw: Cast
    x_for_dw: Cast
    round_pow2: bool


RECIPES = {
    "tensorwise": Recipe("tensorwise", Cast(E4M3), Cast(E4M3), Cast(E5M2), Cast(E4M3),
                         Cast(E5M2), Cast(E4M3), False),
    "rowwise": Recipe("rowwise", Cast(E4M3, True), Cast(E4M3, True), Cast(E4M3, True),
                      Cast(E4M3, True), Cast(E4M3, True), Cast(E4M3, True), True),
    "rowwise_with_gw_hp": Recipe("rowwise_with_gw_hp", Cast(E4M3, True), Cast(E4M3, True),
                                 Cast(E4M3, True), Cast(E4M3), Cast(None), Cast(None), True),
}


def recipe(name: str) -> Recipe:
    """The recipe called ``name`` (torchao's recipe names), or a ValueError listing them."""
    if name not in RECIPES:
        raise ValueError(f"fusedpar float8: unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name]
