"""fusedpar.ops.scaled_grouped_mm and float8_grouped_mm: every form and backend against
plain torch (per-group ``torch._scaled_mm`` and fp64 products of the dequantised operands),
torchao's float8 MoE casts and recipe, errors."""

import importlib

import pytest
import torch

import fusedpar
from fusedpar.ops import float8_scales, grouped_mm
from fusedpar.ops.scaled_grouped_mm import float8_grouped_mm, scaled_grouped_mm
from tests.ops.collective_cases import cpu_backends, cpu_row_scales

sgm = importlib.import_module("fusedpar.ops.scaled_grouped_mm")  # the module (fusedpar.ops exports the function)
BACKENDS = cpu_backends("scaled_grouped_mm")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _fp8_ints(shape, dtype, seed):
    """Small integers, exact in e4m3 and e5m2: products and their sums are exact in fp32."""
    return torch.randint(-4, 5, shape, generator=_gen(seed)).float().to(dtype)


def _pow2(shape, seed):
    """Power-of-2 scales: scaling is exact, so every order of the arithmetic agrees."""
    return torch.exp2(torch.randint(-3, 4, shape, generator=_gen(seed)).float())


def _oracle(form, a, b, sa, sb, offs):
    """The docstring's loop in fp64 on the dequantised operands (plain torch)."""
    a64, b64, sa, sb = a.double(), b.double(), sa.double(), sb.double()
    if form == "batched":
        return (a64 * sa[..., None]) @ (b64 * sb[:, None, :])
    ends = offs.tolist()
    ranges = list(zip([0] + ends[:-1], ends))
    if form == "rows":
        out = a64.new_zeros(a.shape[0], b.shape[2])  # rows past offs[-1]: zeros
        for g, (s, e) in enumerate(ranges):
            out[s:e] = (a64[s:e] * sa[s:e, None]) @ (b64[g] * sb[g])
        return out
    if form == "k":
        M, N = a.shape[0], b.shape[1]
        return torch.stack([(a64[:, s:e] * sa[g * M:(g + 1) * M, None]) @ (b64[s:e] * sb[g * N:(g + 1) * N])
                            for g, (s, e) in enumerate(ranges)])
    out = a64.new_zeros(a.shape[1], b.shape[1])  # columns past offs[-1]: zeros
    for g, (s, e) in enumerate(ranges):
        out[:, s:e] = (a64[g] * sa[g][:, None]) @ (b64[:, s:e] * sb[s:e])
    return out


# (form, a, b, offs): odd sizes, empty groups, rows / columns past offs[-1]; b of the rows
# form column-major per group (torch's contract) and row-major
def _case(form, a_dtype, b_dtype, seed):
    T, K, N, E = 15, 24, 20, 4
    if form in ("rows", "rows_b_row_major"):
        b = _fp8_ints((E, N, K), b_dtype, seed + 1).transpose(1, 2)
        if form == "rows_b_row_major":
            b = b.contiguous()
        return "rows", _fp8_ints((T, K), a_dtype, seed), b, torch.tensor([3, 3, 12, 13], dtype=torch.int32)
    if form == "k":
        return form, _fp8_ints((6, 13), a_dtype, seed), _fp8_ints((13, N), b_dtype, seed + 1), \
            torch.tensor([4, 4, 13], dtype=torch.int32)
    if form == "columns":
        return form, _fp8_ints((3, 6, K), a_dtype, seed), _fp8_ints((K, 11), b_dtype, seed + 1), \
            torch.tensor([2, 2, 9], dtype=torch.int32)
    return form, _fp8_ints((3, 5, K), a_dtype, seed), _fp8_ints((3, K, 7), b_dtype, seed + 1), None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("a_dtype,b_dtype", [(E4M3, E4M3), (E5M2, E5M2), (E5M2, E4M3)])
def test_every_form_is_exact(backend, a_dtype, b_dtype):
    """Exact inputs (small integers, power-of-2 scales): every form equals the fp64 loop
    bitwise in fp32 and rounded once in bf16, and the reference backend's ``torch._scaled_mm``
    per group; the rows past offs[-1] and empty groups are zeros."""
    for i, name in enumerate(("rows", "rows_b_row_major", "k", "columns", "batched")):
        form, a, b, offs = _case(name, a_dtype, b_dtype, seed=10 * i)
        call = sgm.ScaledCall(a, b, offs, None, torch.float32, None, None)
        if form == "batched":
            call.masked_m = torch.full((3,), 5, dtype=torch.int32)
        sa_shape, sb_shape = sgm.scale_shapes(call)
        sa, sb = _pow2(sa_shape, 100 + i), _pow2(sb_shape, 200 + i)
        want = _oracle(form, a, b, sa, sb, offs)
        for out_dtype in (torch.float32, torch.bfloat16):
            out = scaled_grouped_mm(a, b, sa, sb, offs, out_dtype=out_dtype, backend=backend)
            assert out.dtype == out_dtype and out.shape == want.shape, (name, out.shape)
            assert torch.equal(out, want.to(out_dtype)), (name, out_dtype, (out.double() - want).abs().max())


@pytest.mark.parametrize("a_dtype,b_dtype", [(E4M3, E4M3), (E5M2, E4M3)])
def test_random_values_within_one_rounding_of_fp64(a_dtype, b_dtype):
    """Random fp8 values and scales: each backend within one bf16 rounding (and fp32
    summation-order error) of the fp64 loop, the rows form and groups along K."""
    for i, name in enumerate(("rows", "k")):
        form, a, b, offs = _case(name, a_dtype, b_dtype, seed=i)
        a = (torch.randn(a.shape, generator=_gen(i)) * 3).to(a_dtype)
        b = (torch.randn(b.shape, generator=_gen(i + 5)) * 3).to(b_dtype)
        call = sgm.ScaledCall(a, b, offs, None, torch.float32, None, None)
        sa_shape, sb_shape = sgm.scale_shapes(call)
        sa = torch.rand(sa_shape, generator=_gen(7)) + 0.25
        sb = torch.rand(sb_shape, generator=_gen(8)) + 0.25
        want = _oracle(form, a, b, sa, sb, offs)
        for backend in BACKENDS:
            out32 = scaled_grouped_mm(a, b, sa, sb, offs, out_dtype=torch.float32, backend=backend)
            torch.testing.assert_close(out32.double(), want, rtol=1e-5, atol=1e-4)
            out16 = scaled_grouped_mm(a, b, sa, sb, offs, backend=backend)
            # one bf16 ulp: the interpreter's fp32 -> bf16 cast truncates (feasibility_cpu.md §1)
            torch.testing.assert_close(out16.double(), want, rtol=2 ** -7, atol=1e-3)


def _torchao_rowwise(a, b, offs, grad):
    """torchao's FP8_ROWWISE MoE recipe (``_Float8GroupedMM``) on CPU: its torch casts
    (``tensor_to_scale`` / ``to_fp8_saturated``, per group for the weight gradient as
    ``torch_to_float8_per_group_colwise`` casts, which cannot take an empty group), then a
    ``torch._scaled_mm`` per group in fp32: (out, grad_a, grad_b)."""
    ao = pytest.importorskip("torchao.float8.float8_utils")
    moe = pytest.importorskip("torchao.prototype.moe_training.utils")
    from torchao.float8.config import ScalingGranularity

    def cast(x, dim):
        s = ao.tensor_to_scale(x, E4M3, scaling_granularity=ScalingGranularity.AXISWISE,
                               axiswise_dim=dim, round_scales_to_power_of_2=True)
        return ao.to_fp8_saturated(x.float() * s, E4M3), s.reciprocal()

    def mm(x, y, sx, sy):
        return torch._scaled_mm(x.contiguous(), y.t().contiguous().t(), sx.reshape(-1, 1).contiguous(),
                                sy.reshape(1, -1).contiguous(), out_dtype=torch.float32)

    ends = offs.tolist()
    ranges = list(zip([0] + ends[:-1], ends))

    def rows_loop(x, y, sx, sy):
        return torch.cat([mm(x[s:e], y[g], sx[s:e], sy[g]) for g, (s, e) in enumerate(ranges)]
                         + [x.new_zeros(x.shape[0] - ends[-1], y.shape[2], dtype=torch.float32)])

    aq, sa = cast(a, -1)
    bq, sb = cast(b, 1)  # per expert and column, over K: [E, 1, N]
    out = rows_loop(aq, bq, sa, sb)
    gq, sg = cast(grad, -1)
    bq_t, sbt = moe.torch_to_3d_rowwise_float8_transpose_rhs(b.transpose(1, 2).contiguous().transpose(1, 2),
                                                             E4M3, round_scales_to_power_of_2=True)
    grad_a = rows_loop(gq, bq_t, sg, sbt.reciprocal())
    grad_b = torch.zeros(b.shape, dtype=torch.float32)
    for g, (s, e) in enumerate(ranges):
        if e > s:  # each group's columns scaled over its rows
            (gq_g, sg_g), (aq_g, sa_g) = cast(grad[s:e], 0), cast(a[s:e], 0)
            grad_b[g] = mm(gq_g.t(), aq_g, sg_g, sa_g).t()
    return out, grad_a, grad_b


def test_per_group_cast_is_torchaos():
    """``quantize_per_group`` gives torchao's per-group colwise cast bit for bit; an empty
    group (which torchao's torch version cannot take) and the rows past offs[-1] change
    nothing in the others."""
    moe = pytest.importorskip("torchao.prototype.moe_training.utils")
    x = torch.randn(13, 9, generator=_gen(1)) * torch.arange(1, 14)[:, None]
    for dtype in (E4M3, E5M2):
        data, scale = sgm.quantize_per_group(x, dtype, torch.tensor([4, 4, 11], dtype=torch.int32), True)
        want, want_s = moe.torch_to_float8_per_group_colwise(x[:11], torch.tensor([4, 11], dtype=torch.int32),
                                                             dtype, round_scales_to_power_of_2=True)
        assert torch.equal(data[:11].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(scale[[0, 2]], want_s.reciprocal().view(2, 9))


@cpu_row_scales
@pytest.mark.parametrize("backend", BACKENDS)
def test_float8_grouped_mm_rowwise_is_torchaos_moe_recipe(backend):
    """``recipe="rowwise"``: output, input and weight gradients equal torchao's FP8_ROWWISE
    MoE recipe computed with torchao's own casts and per-group ``torch._scaled_mm`` (bitwise
    on the reference backend, whose arithmetic is that; within fp32 summation order on
    triton). Token counts per expert 5, 0, 9, 3, one row past offs[-1]; bf16 inputs."""
    offs = torch.tensor([5, 0, 9, 3], dtype=torch.int32).cumsum(0).to(torch.int32)
    a = (torch.randn(18, 32, generator=_gen(3)) * 2).bfloat16().requires_grad_()
    b = torch.randn(4, 32, 48, generator=_gen(4)).bfloat16().requires_grad_()
    grad = torch.randn(18, 48, generator=_gen(5)).bfloat16()
    out = float8_grouped_mm(a, b, offs, out_dtype=torch.float32, backend=backend)
    out.backward(grad)
    want_out, want_ga, want_gb = _torchao_rowwise(a.detach(), b.detach(), offs, grad.float())
    # the gradients torchao returns are out_dtype (bf16 here: a's dtype)
    pairs = ((out, want_out), (a.grad, want_ga.bfloat16()), (b.grad, want_gb.bfloat16()))
    for got, want in pairs:
        if backend == "reference":
            assert torch.equal(got, want.to(got.dtype))
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-4)
    # the fp8 result is fp8-close to the bf16 grouped GEMM
    exact = grouped_mm(a.detach().float(), b.detach().float(), offs)
    assert (out - exact).norm() / exact.norm() < 0.06


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise_with_gw_hp"])
def test_float8_grouped_mm_other_recipes(recipe):
    """tensorwise (e4m3 forward, e5m2 gradient, one scale per tensor) and rowwise_with_gw_hp
    (b tensorwise for dgrad, wgrad in high precision): the backends agree, and each result is
    the per-group GEMM of the recipe's casts (``float8_scales.quantize``) in fp64."""
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)
    a0 = torch.randn(12, 16, generator=_gen(6))
    b0 = torch.randn(3, 16, 32, generator=_gen(7))
    grad = torch.randn(12, 32, generator=_gen(8))
    r = float8_scales.recipe(recipe)
    results = {}
    for backend in BACKENDS:
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        out = float8_grouped_mm(a, b, offs, recipe=recipe, out_dtype=torch.float32, backend=backend)
        out.backward(grad)
        results[backend] = (out, a.grad, b.grad)

    def deq(x, cast, dim):
        data, scale = float8_scales.quantize(x, cast.dtype, dim if cast.rowwise else None, r.round_pow2)
        return data.double() * scale.double()

    ranges = [(0, 4), (4, 4), (4, 11)]

    def loop(x, w):
        return torch.cat([x[s:e] @ w[g] for g, (s, e) in enumerate(ranges)] + [x.new_zeros(1, w.shape[2])])

    def k_loop(x, dy):  # the weight gradient: x[rows g]ᵀ @ dy[rows g]
        return torch.stack([x[s:e].t() @ dy[s:e] for s, e in ranges])

    want_out = loop(deq(a0, r.x, -1), deq(b0.transpose(1, 2), r.w, -1).transpose(1, 2))
    want_ga = loop(deq(grad, r.dy, -1), deq(b0, r.w_for_dx, -1).transpose(1, 2))
    if r.dy_for_dw.dtype is None:
        want_gb = k_loop(a0.double(), grad.double())
    else:
        want_gb = k_loop(deq(a0, r.x_for_dw, None), deq(grad, r.dy_for_dw, None))
    for backend, got in results.items():
        for g, w in zip(got, (want_out, want_ga, want_gb)):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=f"{backend}")


def test_bad_inputs_name_the_argument_and_the_fix():
    a = _fp8_ints((8, 16), E4M3, 0)
    b = _fp8_ints((2, 16, 16), E4M3, 1)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    sa, sb = torch.ones(8), torch.ones(2, 16)
    with pytest.raises(TypeError, match=r"a is torch.bfloat16.*float8_grouped_mm"):
        scaled_grouped_mm(a.bfloat16(), b, sa, sb, offs)
    with pytest.raises(TypeError, match=r"b is torch.float32"):
        scaled_grouped_mm(a, b.float(), sa, sb, offs)
    with pytest.raises(ValueError, match=r"scale_b must be float32 \(2, 16\).*got torch.float32 \(16,\)"):
        scaled_grouped_mm(a, b, sa, torch.ones(16), offs)
    with pytest.raises(ValueError, match=r"scale_a must be float32 \(8,\).*\(8, 1\).*expand"):
        scaled_grouped_mm(a, b, torch.ones(8, 1), sb, offs)
    with pytest.raises(ValueError, match=r"scale_a must be float32.*got torch.bfloat16"):
        scaled_grouped_mm(a, b, sa.bfloat16(), sb, offs)
    with pytest.raises(TypeError, match=r"out_dtype=torch.float16"):
        scaled_grouped_mm(a, b, sa, sb, offs, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"offs\[1\] = 9"):
        scaled_grouped_mm(a, b, sa, sb, torch.tensor([3, 9], dtype=torch.int32))
    with pytest.raises(fusedpar.errors.BackendNotSupportedError, match=r"torch._scaled_grouped_mm has only CUDA"):
        scaled_grouped_mm(a, b, sa, sb, offs, backend="torch")
    with pytest.raises(ValueError, match=r"unknown recipe 'fp8'"):
        float8_grouped_mm(a.float(), b.float(), offs, recipe="fp8")
    with pytest.raises(ValueError, match=r"recipe='tensorwise' casts gradients to torch.float8_e5m2.*'torch'"):
        float8_grouped_mm(a.float(), b.float(), offs, recipe="tensorwise", backend="torch")
    with pytest.raises(TypeError, match=r"high-precision"):
        float8_grouped_mm(a, b, offs)
    # K not a multiple of 16, where CUDA's _scaled_mm needs it (the reason the CUDA
    # backends give; the GPU tests check they refuse)
    odd = sgm.ScaledCall(_fp8_ints((8, 20), E4M3, 0), _fp8_ints((2, 20, 16), E4M3, 1), offs, None,
                         torch.bfloat16, sa, sb)
    (reason,) = sgm._needs_k16(odd, "torch._scaled_mm")
    assert "K=20" in reason and "pad" in reason and "N=" not in reason


def test_fake_tensor_shapes_without_running():
    """The fake impl gives the output of every form (torch.compile traces through it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(10, 32, dtype=E4M3)
        b = torch.empty(3, 32, 48, dtype=E4M3)
        out = torch.ops.fusedpar.scaled_grouped_mm(a, b, torch.empty(10), torch.empty(3, 48),
                                                   torch.empty(3, dtype=torch.int32), torch.float32, "")
        assert out.shape == (10, 48) and out.dtype == torch.float32
