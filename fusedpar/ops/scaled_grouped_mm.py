"""``fusedpar.ops.scaled_grouped_mm``: ``grouped_mm`` on fp8 operands with fp32 rowwise
scales applied in the epilogue (the ``torch._scaled_grouped_mm`` contract), and
``float8_grouped_mm``, its differentiable entry on high-precision tensors (torchao's
float8 MoE recipes: the casts, then a scaled grouped GEMM forward and backward)."""

from __future__ import annotations

import torch

from ..kernels import grouped_mm as kernels
from ..kernels.interpreter import triton_device_reasons
from . import float8_scales
from . import grouped_mm as plain
from .backend import Backend, Dispatcher
from .grouped_mm import GroupedCall, group_ranges, zero_past, check_inputs, check_offs
from .registry import EXAMPLE_WORLD, register

OP = "scaled_grouped_mm"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float32)


class ScaledCall(GroupedCall):
    """A ``GroupedCall`` on fp8 ``a`` and ``b`` with their fp32 scales (``scale_shapes``)."""

    def __init__(self, a, b, offs, masked_m, out_dtype, scale_a, scale_b):
        super().__init__(a, b, offs, masked_m, out_dtype)
        self.scale_a, self.scale_b = scale_a, scale_b

    def cache_key(self) -> tuple:
        return (*super().cache_key(), self.b.dtype, _col_major(self.b), _row_major(self.a),
                self.a.shape[-1] % 16 == 0, self.b.shape[-1] % 16 == 0)

    def describe(self) -> str:
        return (f"a {tuple(self.a.shape)} {self.a.dtype} x b {tuple(self.b.shape)} {self.b.dtype} "
                f"-> {self.out_dtype} on {self.a.device.type}, {self.groups} groups")


def scale_shapes(call: GroupedCall) -> tuple[tuple, tuple]:
    """The shapes of ``scale_a`` and ``scale_b`` (torch._scaled_grouped_mm's): one scale per
    row of each group's A and per column of its B."""
    a, b, groups = call.a, call.b, call.groups
    if call.k_grouped:  # a [M, K] x b [K, N]: each group's own rows of a and columns of b
        return (groups * a.shape[0],), (groups * b.shape[1],)
    if call.n_grouped:  # a [E, M, K] x b [K, N]
        return (groups, a.shape[1]), (b.shape[1],)
    if call.batched:  # a [E, M, K] x b [E, K, N]
        return (groups, a.shape[1]), (groups, b.shape[2])
    return (a.shape[0],), (groups, b.shape[2])  # a [T, K] x b [E, K, N]


def _check_dtypes(a, b, out_dtype) -> None:
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FP8:
            raise TypeError(f"fusedpar.{OP}: {name} is {t.dtype}; it takes float8_e4m3fn or "
                            f"float8_e5m2 operands with fp32 scales: cast with fusedpar.ops."
                            f"float8_scales.quantize, or call fusedpar.ops.float8_grouped_mm on "
                            f"the high-precision tensors")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"fusedpar.{OP}: out_dtype={out_dtype}; give torch.bfloat16 or torch.float32")


def check_scaled(a, b, scale_a, scale_b, offs, out_dtype) -> ScaledCall:
    """Shapes, dtypes and devices of a call, scales included."""
    batched = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 3 and b.dim() == 3
    masked_m = None
    if batched and offs is None:  # every row of every a[g] (the contract has no counts)
        masked_m = torch.full((a.shape[0],), a.shape[1], dtype=torch.int32, device=a.device)
    check_inputs(a, b, offs, masked_m, out_dtype, op=OP, check_dtypes=_check_dtypes)
    call = ScaledCall(a, b, offs, masked_m, out_dtype, scale_a, scale_b)
    for name, scale, shape in zip(("scale_a", "scale_b"), (scale_a, scale_b), scale_shapes(call)):
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"fusedpar.{OP}: {name} must be a Tensor, got {type(scale).__name__}")
        if scale.dtype != torch.float32 or tuple(scale.shape) != shape or scale.device != a.device:
            operand = "a" if name == "scale_a" else "b"
            raise ValueError(
                f"fusedpar.{OP}: {name} must be float32 {shape} on {a.device} (one dequantisation "
                f"multiplier per {'row' if operand == 'a' else 'column'} of each group of {operand}, "
                f"torch._scaled_grouped_mm's layout), got {scale.dtype} {tuple(scale.shape)} on "
                f"{scale.device}; a tensorwise scale s: s.expand({', '.join(map(str, shape))}).contiguous()")
    return call


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) >= max(t.shape[-1], 1)


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) >= max(t.shape[-2], 1)


def _needs_k16(call: ScaledCall, what: str) -> list[str]:
    """``torch._scaled_mm`` and ``torch._scaled_grouped_mm`` on CUDA need K and N multiples
    of 16."""
    k, n = call.a.shape[-1], call.b.shape[-1]
    if call.k_grouped:
        k = None  # each group's K: checked per group where the sizes are read
    bad = [f"{name}={v}" for name, v in (("K", k), ("N", n)) if v is not None and v % 16]
    return [f"{what} on CUDA needs K and N multiples of 16, got {', '.join(bad)}: pad a's columns "
            "and b's rows (K) or b's columns (N) with zeros to the next multiple of 16"] if bad else []


class Reference(Backend):
    """A ``torch._scaled_mm`` per group (reads ``offs`` on the host); empty groups and the
    rows past ``offs[-1]`` are zeros."""

    name = "reference"

    def not_supported_reasons(self, call: ScaledCall) -> list[str]:
        if call.a.device.type != "cuda":
            return []
        reasons = _needs_k16(call, "torch._scaled_mm")
        capability = torch.cuda.get_device_capability(call.a.device)
        if capability < (8, 9):
            reasons.append(f"torch._scaled_mm on CUDA needs compute capability 8.9+, this GPU has "
                           f"{capability[0]}.{capability[1]}")
        if torch.float8_e5m2 == call.a.dtype == call.b.dtype:
            reasons.append("torch._scaled_mm on CUDA does not multiply e5m2 by e5m2")
        return reasons

    def run(self, call: ScaledCall) -> torch.Tensor:
        out = call.a.new_zeros(call.out_shape(), dtype=call.out_dtype)
        a, b, sa, sb = call.a, call.b, call.scale_a, call.scale_b
        M, N = a.shape[-2], b.shape[-1]
        for g, (start, end) in enumerate(group_ranges(call)):
            if (call.k_grouped or call.n_grouped) and a.device.type == "cuda" and (end - start) % 16:
                what = "K" if call.k_grouped else "columns of b"
                raise ValueError(f"fusedpar.{OP}: group {g} spans {what} {start}:{end}, not a multiple "
                                 "of 16 as torch._scaled_mm on CUDA needs; pad each group to a multiple "
                                 "of 16 or use backend='triton'")
            if call.k_grouped:
                pieces = (out[g], a[:, start:end], b[start:end], sa[g * M:(g + 1) * M], sb[g * N:(g + 1) * N])
            elif call.n_grouped:
                pieces = (out[:, start:end], a[g], b[:, start:end], sa[g], sb[start:end])
            elif call.batched:
                pieces = (out[g], a[g], b[g], sa[g], sb[g])
            else:
                pieces = (out[start:end], a[start:end], b[g], sa[start:end], sb[g])
            dst, x, y, sx, sy = pieces
            if dst.numel() and x.shape[1]:
                dst.copy_(float8_scales.scaled_mm(x, y, sx.reshape(-1, 1), sy.reshape(1, -1), call.out_dtype))
        return out


class Triton(Backend):
    """``grouped_mm``'s persistent kernels with fp8 dots and the scales in the epilogue."""

    name = "triton"

    def not_supported_reasons(self, call: ScaledCall) -> list[str]:
        return triton_device_reasons(call.a.device) or float8_scales.fp8_tensor_core_reasons(call.a)

    def run(self, call: ScaledCall) -> torch.Tensor:
        out = torch.empty(call.out_shape(), dtype=call.out_dtype, device=call.a.device)
        a, b, sa, sb = call.a, call.b, call.scale_a.contiguous(), call.scale_b.contiguous()
        if call.n_grouped:  # out[:, cols g] = a[g] @ b[:, cols g], transposed: rows of bᵀ
            out_t = torch.empty(out.shape[::-1], dtype=out.dtype, device=out.device)
            kernels.grouped_mm_rows(b.t().contiguous(), a.transpose(1, 2), call.offs.contiguous(), out_t,
                                    scales=(sb, sa))
            out.copy_(out_t.t())
        elif call.k_grouped:
            kernels.grouped_mm_k(a, b, call.offs.contiguous(), out, scales=(sa, sb))
        elif call.batched:
            kernels.grouped_mm_rows(a.reshape(-1, a.shape[-1]), b, call.masked_m, out.view(-1, out.shape[-1]),
                                    pad_rows=a.shape[1], scales=(sa.view(-1), sb))
        else:
            kernels.grouped_mm_rows(a, b, call.offs.contiguous(), out, scales=(sa, sb))
        return out


class Torch(Backend):
    """``torch._scaled_grouped_mm`` (CUDA, compute capability 9.0+, e4m3 x e4m3 -> bf16),
    then zeros in the rows past ``offs[-1]``, which it leaves unwritten."""

    name = "torch"

    def not_supported_reasons(self, call: ScaledCall) -> list[str]:
        if not hasattr(torch, "_scaled_grouped_mm"):
            return [f"torch {torch.__version__} has no torch._scaled_grouped_mm"]
        if call.a.device.type != "cuda":
            return [f"torch._scaled_grouped_mm has only CUDA kernels (torch {torch.__version__}), "
                    f"not {call.a.device.type}"]
        reasons = []
        capability = torch.cuda.get_device_capability(call.a.device)
        if capability < (9, 0):
            reasons.append(f"torch._scaled_grouped_mm needs compute capability 9.0+, this GPU has "
                           f"{capability[0]}.{capability[1]}")
        if call.a.dtype != torch.float8_e4m3fn or call.b.dtype != torch.float8_e4m3fn:
            reasons.append(f"torch._scaled_grouped_mm takes float8_e4m3fn operands only, got "
                           f"{call.a.dtype} x {call.b.dtype} (the tensorwise recipe's e5m2 gradients)")
        if call.out_dtype != torch.bfloat16:
            reasons.append(f"torch._scaled_grouped_mm writes bfloat16 only, not {call.out_dtype}")
        if not _row_major(call.a) or not _col_major(call.b):
            reasons.append("torch._scaled_grouped_mm needs a row-major a and a column-major b "
                           "(b.transpose(-2, -1).contiguous().transpose(-2, -1))")
        if call.k_grouped or call.n_grouped:
            reasons.append(f"groups along {'K' if call.k_grouped else 'the columns of b'}: "
                           "torch._scaled_grouped_mm asserts on the device (fatal to the CUDA context) "
                           "that each group spans a multiple of 16 bytes, and the group sizes are on "
                           "the device (reading them is a host sync); the triton backend takes any sizes")
        return reasons + _needs_k16(call, "torch._scaled_grouped_mm")

    def run(self, call: ScaledCall) -> torch.Tensor:
        out = torch._scaled_grouped_mm(call.a, call.b, call.scale_a, call.scale_b, call.offs,
                                       out_dtype=call.out_dtype)
        if call.offs is not None:  # the rows form: rows past offs[-1]
            zero_past(out[None], call.offs.contiguous(), call.groups - 1)
        return out


DISPATCHER = Dispatcher(OP, [Triton(), Reference(), Torch()])  # vendor backend after ours


@torch.library.custom_op("fusedpar::scaled_grouped_mm", mutates_args=())
def _scaled_grouped_mm_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                          offs: torch.Tensor | None, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    call = check_scaled(a, b, scale_a, scale_b, offs, out_dtype)
    check_offs(call)
    return DISPATCHER.select(call, backend).run(call)


@_scaled_grouped_mm_op.register_fake
def _(a, b, scale_a, scale_b, offs, out_dtype, backend):
    call = check_scaled(a, b, scale_a, scale_b, offs, out_dtype)
    return a.new_empty(call.out_shape(), dtype=out_dtype)


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.bfloat16,
                      backend: str | None = None) -> torch.Tensor:
    """``grouped_mm`` of fp8 operands with rowwise scales, the ``torch._scaled_grouped_mm``
    contract; the same as::

        start = 0
        for g, end in enumerate(offs.tolist()):           # a [T, K] x b [E, K, N] -> [T, N]
            out[start:end] = torch._scaled_mm(a[start:end], b[g], scale_a[start:end, None],
                                              scale_b[g][None], out_dtype=out_dtype)
            start = end                                   # rows past offs[-1]: zeros

    i.e. ``(a[rows g].float() * scale_a[rows g, None]) @ (b[g].float() * scale_b[g])`` rounded
    once to ``out_dtype``. The other forms, with the scales torch takes: ``a [M, K]`` x ``b [K,
    N]`` grouped along K (``scale_a [E*M]``, ``scale_b [E*N]``: each group's own rows and
    columns, the weight gradient's form), ``a [E, M, K]`` x ``b [K, N]`` grouped along N
    (``scale_a [E, M]``, ``scale_b [N]``) and batched ``a [E, M, K]`` x ``b [E, K, N]`` with
    ``offs=None`` (``scale_a [E, M]``, ``scale_b [E, N]``). Scales are fp32 dequantisation
    multipliers (the reciprocal of torchao's ``Float8TrainingTensor._scale``). Empty groups
    are fine.

    ``a``, ``b``: float8_e4m3fn or float8_e5m2 (each its own); ``out_dtype``: bf16 or fp32.
    Not differentiable (fp8 operands): ``float8_grouped_mm`` casts high-precision tensors and
    differentiates through this op. Backends: ``triton`` (the persistent grouped GEMM with
    fp8 ``tl.dot``, fp32 accumulation, the scales in the epilogue: the accumulated products
    times ``scale_a * scale_b``; no host sync), ``reference`` (the loop above; on CUDA K and
    N multiples of 16) and ``torch`` (``torch._scaled_grouped_mm``: CUDA sm_90+, e4m3 only,
    bf16 out, a row-major, b column-major). Bad ``offs`` raise on CPU, trip a device-side
    assert on CUDA.
    """
    return _scaled_grouped_mm_op(a, b, scale_a, scale_b, offs, out_dtype, backend or "")


# ---- float8 training: torchao's recipes on the expert GEMM --------------------------------------


def quantize_per_group(x: torch.Tensor, dtype: torch.dtype, offs: torch.Tensor, round_pow2: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``float8_scales.quantize`` of each group of rows of ``x [T, C]`` along its rows: one
    scale per (group, column), ``[E, C]`` for ``offs`` int32 cumulative row ends of E groups
    (torchao's per-group colwise cast of the weight gradient's operands,
    ``torch_to_float8_per_group_colwise``); rows past ``offs[-1]`` are cast with a scale of
    their own, which is not returned. No host read."""
    E = offs.shape[0]
    with torch.no_grad():
        xf = x.detach().float()
        rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
        gid = torch.searchsorted(offs, rows, right=True).clamp(max=E)[:, None].expand_as(xf)
        amax = xf.new_zeros(E + 1, x.shape[1]).scatter_reduce_(0, gid, xf.abs(), "amax")
        s = float8_scales.amax_to_scale(amax, dtype, round_pow2)
        top = torch.finfo(dtype).max
        data = (xf * s.gather(0, gid)).clamp(-top, top).to(dtype)
    return data, s[:E].reciprocal()


def cast_operand(x: torch.Tensor, cast: float8_scales.Cast, round_pow2: bool, *shape: int):
    """``x`` cast per ``cast`` along its last dim (rowwise) or whole (tensorwise), with the
    scales as ``scaled_grouped_mm`` takes them (``shape``: reshaped, or the tensorwise one
    expanded): how the recipes cast each GEMM operand (the fused expert MLP casts its
    weights and rows with it too)."""
    data, scale = float8_scales.quantize(x, cast.dtype, -1 if cast.rowwise else None, round_pow2)
    return data, scale.reshape(shape) if cast.rowwise else scale.expand(shape).contiguous()


class _Float8GroupedMM(torch.autograd.Function):
    """out = a @ b per group through fp8 casts (``float8_grouped_mm``); the backward casts
    the output gradient per the recipe and runs dgrad and wgrad as scaled grouped GEMMs."""

    @staticmethod
    def forward(ctx, a, b, offs, recipe, out_dtype, backend, a_cast=None):
        r = float8_scales.recipe(recipe)
        T, (E, _, N) = a.shape[0], b.shape
        # a_cast: a's cast, already made (an fp8 dispatch's rows; ``a`` their dequantised values)
        aq, sa = a_cast or cast_operand(a, r.x, r.round_pow2, T)
        # b's columns per expert, column-major as torch._scaled_grouped_mm takes it
        bq_t, sb = cast_operand(b.transpose(1, 2), r.w, r.round_pow2, E, N)
        ctx.recipe, ctx.backend = r, backend
        ctx.save_for_backward(a, b, offs)
        return scaled_grouped_mm(aq, bq_t.transpose(1, 2), sa, sb, offs, out_dtype=out_dtype, backend=backend)

    @staticmethod
    def backward(ctx, grad):
        r, backend = ctx.recipe, ctx.backend
        a, b, offs = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[:2]
        grad_a = grad_b = None
        if need_a:
            grad_a = float8_grad_input(r, grad, b, offs, a.dtype, backend)
        if need_b:
            grad_b = float8_weight_grad(r, a, grad, offs, b.dtype, backend)
        return grad_a, grad_b, None, None, None, None, None


def _backward_dtype(a_dtype: torch.dtype, b_dtype: torch.dtype) -> torch.dtype:
    """The dtype the scaled GEMMs of ``float8_grouped_mm``'s backward write (then cast to
    the gradient's)."""
    return torch.float32 if torch.float32 in (a_dtype, b_dtype) else torch.bfloat16


def float8_grad_input(r: float8_scales.Recipe, grad: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                      a_dtype: torch.dtype, backend: str = "") -> torch.Tensor:
    """a's gradient in ``float8_grouped_mm(a, b, offs)``'s backward at the output gradient
    ``grad [T, N]``, cast as recipe ``r`` says: ``[T, K]`` in ``a_dtype``, the same as::

        grouped_mm(grad, b.transpose(1, 2), offs)   # through fp8 casts

    ``grad`` per row (``r.dy``), ``b [E, K, N]`` per expert and row of K, over N, where
    rowwise (``r.w_for_dx``)."""
    gq, sg = cast_operand(grad, r.dy, r.round_pow2, grad.shape[0])
    bq, sbt = cast_operand(b, r.w_for_dx, r.round_pow2, b.shape[0], b.shape[1])
    return scaled_grouped_mm(gq, bq.transpose(1, 2), sg, sbt, offs, out_dtype=_backward_dtype(a_dtype, b.dtype),
                             backend=backend).to(a_dtype)


def float8_weight_grad(r: float8_scales.Recipe, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor,
                       b_dtype: torch.dtype, backend: str = "") -> torch.Tensor:
    """b's gradient in ``float8_grouped_mm(a, b, offs)``'s backward at the output gradient
    ``grad [T, N]``, cast as recipe ``r`` says: ``[E, K, N]`` in ``b_dtype``, the same as::

        grouped_mm(a.t(), grad, offs)   # per group of rows (groups along K), through fp8 casts
    """
    E, K, N = offs.shape[0], a.shape[1], grad.shape[1]
    if r.dy_for_dw.dtype is None:  # in high precision
        return plain.grouped_mm(a.t(), grad.to(a.dtype), offs,
                                backend=plain.DISPATCHER.carry(backend)).to(b_dtype)
    acc = _backward_dtype(a.dtype, b_dtype)
    # gradᵀ @ a per group of rows (groups along K)
    if r.dy_for_dw.rowwise:  # each operand scaled per column of each group
        gq, sg = quantize_per_group(grad, r.dy_for_dw.dtype, offs, r.round_pow2)
        aq, sa = quantize_per_group(a, r.x_for_dw.dtype, offs, r.round_pow2)
        sg, sa = sg.reshape(-1), sa.reshape(-1)
    else:
        gq, sg = cast_operand(grad, r.dy_for_dw, r.round_pow2, E * N)
        aq, sa = cast_operand(a, r.x_for_dw, r.round_pow2, E * K)
    grad_b = scaled_grouped_mm(gq.t(), aq, sg, sa, offs, out_dtype=acc, backend=_k_backend(backend))
    return grad_b.transpose(1, 2).to(b_dtype)


def _k_backend(backend: str) -> str:
    """The weight gradient's backend: ``torch`` declines groups along K (see ``Torch``), so
    with it the weight gradient takes the default choice."""
    return "" if backend == Torch.name else backend


def float8_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *, recipe: str = "rowwise",
                      out_dtype: torch.dtype = torch.bfloat16, backend: str | None = None,
                      a_cast: tuple | None = None) -> torch.Tensor:
    """``grouped_mm(a, b, offs)`` (``a [T, K]`` x ``b [E, K, N]``, an MoE layer's expert
    GEMM) computed through float8 casts, differentiable in ``a`` and ``b``; with the default
    ``recipe="rowwise"`` the same as::

        aq, sa = quantize(a, e4m3, -1, round_pow2=True)                   # per token (row)
        bq, sb = quantize(b.transpose(1, 2), e4m3, -1, round_pow2=True)   # per expert, column
        out = scaled_grouped_mm(aq, bq.transpose(1, 2), sa[:, 0], sb[..., 0], offs)

    (``quantize``: ``fusedpar.ops.float8_scales``, torchao's casts). ``recipe`` names
    torchao's recipes (``float8_scales.RECIPES``): ``"rowwise"`` is torchao's float8 MoE
    training (``torchao.prototype.moe_training`` FP8_ROWWISE, ``_Float8GroupedMM``): the
    backward casts the output gradient per row, b per expert and row (K) for the input
    gradient, and the gradient and ``a`` per column of each group for the weight gradient;
    all three GEMMs run in fp8 e4m3 (``scaled_grouped_mm``), scales rounded to powers of 2.
    ``"rowwise_with_gw_hp"``: b tensorwise for the input gradient, the weight gradient
    ``grouped_mm(a.t(), grad, offs)`` in the inputs' precision. ``"tensorwise"`` (torchao's
    Float8Linear recipes; its MoE training has none but rowwise): one scale per tensor, e4m3
    forward, e5m2 output gradient. Gradients come out in a's and b's dtypes.

    ``backend``: the ``scaled_grouped_mm`` backend the GEMMs run on (``torch`` takes e4m3
    only, so not ``"tensorwise"``, and declines the weight gradient's groups along K, which
    then takes the default backend). ``a_cast``: ``(data, scale)``, a's forward cast made
    already (``moe_dispatch(..., float8=)``'s rows: the forward multiplies them as they
    are; ``a`` holds their dequantised values, which the backward casts as the recipe says).
    """
    r = float8_scales.recipe(recipe)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != 2 or b.dim() != 3:
        raise ValueError("fusedpar.float8_grouped_mm: takes a [T, K] and b [E, K, N] (an MoE expert "
                         "GEMM); for other forms cast with float8_scales.quantize and call scaled_grouped_mm")
    if a.dtype in FP8 or b.dtype in FP8:
        raise TypeError("fusedpar.float8_grouped_mm: a and b are the high-precision tensors (it casts "
                        "them); for fp8 operands call scaled_grouped_mm")
    if backend == Torch.name and r.dy.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fusedpar.float8_grouped_mm: recipe={recipe!r} casts gradients to "
                         f"{r.dy.dtype}, which backend 'torch' (torch._scaled_grouped_mm, e4m3 only) "
                         "cannot take; use recipe='rowwise' or another backend")
    plain.check_inputs(a, b, offs)
    return _Float8GroupedMM.apply(a, b, offs, recipe, out_dtype, backend or "", a_cast)


register(DISPATCHER, (scaled_grouped_mm, float8_grouped_mm), checks="fusedpar.testing.scaled_grouped_mm_cases",
         example=lambda device: ScaledCall(
    torch.zeros(2 * EXAMPLE_WORLD, 16, device=device).to(torch.float8_e4m3fn),
    torch.zeros(2, 16, 16, device=device).to(torch.float8_e4m3fn).transpose(1, 2),
    torch.tensor([4, 8], dtype=torch.int32, device=device), None, torch.bfloat16,
    torch.ones(2 * EXAMPLE_WORLD, device=device), torch.ones(2, 16, device=device)))
