"""scaled_grouped_mm on a GPU: the triton backend's fp8 wgmma kernels (which CI only
compiles: tests/kernels/test_aot.py) against torch._scaled_grouped_mm and fp64 of the
dequantised operands, every form; float8_grouped_mm against torchao's float8 MoE training
(torchao.prototype.moe_training's Triton casts + torch._scaled_grouped_mm); the refusals
the CUDA backends give. Skipped without a GPU."""

import importlib

import pytest
import torch

from fusedpar.errors import BackendNotSupportedError
from fusedpar.ops.scaled_grouped_mm import float8_grouped_mm, scaled_grouped_mm

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
requires_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA GPU of compute capability 9.0+ (fp8 wgmma, torch._scaled_grouped_mm)")
sgm = importlib.import_module("fusedpar.ops.scaled_grouped_mm")
E4M3 = torch.float8_e4m3fn


def _operands(form, T=1000, K=512, N=768, E=8, seed=0):
    """fp8 operands in torch's layouts (a row-major, b column-major), random scales, group
    sizes that are not multiples of 16 (rows form; multiples of 16 along K and N, where the
    reference needs them) with an empty group and rows past offs[-1]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cut = torch.randint(0, T - 7, (E - 1,), generator=g, device="cuda").sort().values
    offs = torch.cat([cut, cut.new_tensor([T - 7])]).to(torch.int32)
    offs[2] = offs[1]  # an empty group
    if form in ("k", "columns"):  # the reference's torch._scaled_mm per group needs multiples of 16
        offs = offs // 16 * 16
    if form == "rows":
        a = torch.randn(T, K, generator=g, device="cuda").to(E4M3)
        b = torch.randn(E, N, K, generator=g, device="cuda").to(E4M3).transpose(1, 2)
    elif form == "k":
        a = torch.randn(N, T, generator=g, device="cuda").to(E4M3)  # wgrad: gradᵀ [N, T]
        b = torch.randn(T, K, generator=g, device="cuda").to(E4M3)
    elif form == "columns":
        a = torch.randn(E, 64, K, generator=g, device="cuda").to(E4M3)
        b = torch.randn(K, T, generator=g, device="cuda").to(E4M3)
    else:
        a = torch.randn(E, 256, K, generator=g, device="cuda").to(E4M3)
        b = torch.randn(E, N, K, generator=g, device="cuda").to(E4M3).transpose(1, 2)
        offs = None
    call = sgm.ScaledCall(a, b, offs, None if offs is not None else torch.full((E,), 256, dtype=torch.int32,
                                                                             device="cuda"),
                          torch.bfloat16, None, None)
    sa_shape, sb_shape = sgm.scale_shapes(call)
    sa = torch.rand(sa_shape, generator=g, device="cuda") + 0.5
    sb = torch.rand(sb_shape, generator=g, device="cuda") + 0.5
    return a, b, sa, sb, offs


@requires_sm90
@pytest.mark.parametrize("form", ["rows", "k", "columns", "batched"])
def test_gpu_triton_within_one_rounding_of_the_reference(form):
    """The triton backend's bf16 output within one bf16 rounding of the reference backend's
    (a torch._scaled_mm per group) and of fp64; fp32 output within fp32 summation error."""
    a, b, sa, sb, offs = _operands(form)
    want = sgm.Reference().run(sgm.check_scaled(a, b, sa, sb, offs, torch.float32)).double()
    for out_dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -8)):
        out = scaled_grouped_mm(a, b, sa, sb, offs, out_dtype=out_dtype, backend="triton")
        torch.testing.assert_close(out.double(), want, rtol=rtol, atol=1e-2)


@requires_sm90
@pytest.mark.parametrize("form", ["rows", "batched"])
def test_gpu_triton_matches_torch_scaled_grouped_mm(form):
    """Against torch._scaled_grouped_mm (the torch backend), bf16 out: within one rounding."""
    a, b, sa, sb, offs = _operands(form)
    want = scaled_grouped_mm(a, b, sa, sb, offs, backend="torch").double()
    if offs is not None:
        assert not want[int(offs[-1]):].any()  # the torch backend zeroes the rows past offs[-1]
    out = scaled_grouped_mm(a, b, sa, sb, offs, backend="triton").double()
    torch.testing.assert_close(out, want, rtol=2 ** -7, atol=1e-2)


@requires_sm90
def test_gpu_float8_grouped_mm_is_torchaos_moe_training():
    """recipe='rowwise' against torchao's _to_fp8_rowwise_then_scaled_grouped_mm (its Triton
    casts and torch._scaled_grouped_mm, groups padded to 16 as it needs): output and both
    gradients within one bf16 rounding."""
    moe = pytest.importorskip("torchao.prototype.moe_training.fp8_grouped_mm")
    g = torch.Generator(device="cuda").manual_seed(1)
    T, K, N, E = 1024, 512, 1024, 8
    offs = (torch.arange(1, E + 1, device="cuda") * (T // E)).to(torch.int32)  # multiples of 16
    a = torch.randn(T, K, generator=g, device="cuda").bfloat16()
    b = torch.randn(E, N, K, generator=g, device="cuda").bfloat16().transpose(1, 2)
    grad = torch.randn(T, N, generator=g, device="cuda").bfloat16()
    results = []
    for fn in (lambda x, w: float8_grouped_mm(x, w, offs, backend="triton"),
               lambda x, w: moe._to_fp8_rowwise_then_scaled_grouped_mm(
                   x, w, offs, pad_token_groups_for_grouped_mm=False)):
        x, w = a.clone().requires_grad_(), b.detach().clone().requires_grad_()
        out = fn(x, w)
        out.backward(grad)
        results.append((out, x.grad, w.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)


@requires_sm90
def test_gpu_cuda_backends_refuse_with_reasons():
    """K not a multiple of 16 (the reference's torch._scaled_mm and torch._scaled_grouped_mm
    need it), e5m2 and a row-major b on the torch backend: refused naming the fix; the
    triton backend takes all of them."""
    a = torch.randn(64, 40, device="cuda").to(E4M3)
    b = torch.randn(2, 32, 40, device="cuda").to(E4M3).transpose(1, 2)
    offs = torch.tensor([30, 64], dtype=torch.int32, device="cuda")
    sa, sb = torch.ones(64, device="cuda"), torch.ones(2, 32, device="cuda")
    for backend in ("reference", "torch"):
        with pytest.raises(BackendNotSupportedError, match=r"K and N multiples of 16, got K=40.*pad"):
            scaled_grouped_mm(a, b, sa, sb, offs, backend=backend)
    a16, b16 = a[:, :32].contiguous(), b[:, :32].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(BackendNotSupportedError, match=r"float8_e4m3fn operands only"):
        scaled_grouped_mm(a16.to(torch.float8_e5m2), b16, sa, sb, offs, backend="torch")
    with pytest.raises(BackendNotSupportedError, match=r"column-major b"):
        scaled_grouped_mm(a16, b16.contiguous(), sa, sb, offs, backend="torch")
    assert scaled_grouped_mm(a, b, sa, sb, offs, backend="triton").shape == (64, 32)


@requires_sm90
def test_gpu_float8_dispatch_casts_as_torchao():
    """moe_dispatch(float8="rowwise") on CUDA (the loopback of 4 simulated ranks): the
    permutation kernel's cast (cvt with round to nearest even, fp64 scale division) gives
    float8_scales.quantize's bytes and scales bit for bit, and the rows come back through a
    bf16 combine within e4m3 rounding."""
    from fusedpar.ops import float8_scales
    from fusedpar.ops.moe import moe_combine_loopback, moe_dispatch_loopback

    g = torch.Generator(device="cuda").manual_seed(2)
    world, T, H, k, E = 4, 33, 200, 2, 8
    xs = [(torch.randn(T, H, generator=g, device="cuda") * 10 ** (r - 2)).bfloat16() for r in range(world)]
    idxs = [torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)]) for _ in range(world)]
    ws = [torch.ones(T, k, device="cuda") for _ in range(world)]
    results = moe_dispatch_loopback(xs, idxs, ws, E, float8="rowwise")
    casts = [float8_scales.quantize(x, E4M3, -1, True) for x in xs]
    ys = []
    for r, ((data, scale), per_expert, _) in enumerate(results):
        # recv_x's rows: (local expert, source, token) order, as moe_dispatch's docstring says
        order = [(s, t) for e in range(r * (E // world), (r + 1) * (E // world))
                 for s in range(world) for t in range(T) for _ in range(int((idxs[s][t] == e).sum()))]
        want_data = torch.stack([casts[s][0][t] for s, t in order])
        want_scale = torch.stack([casts[s][1][t, 0] for s, t in order])
        assert int(per_expert.sum()) == len(order)
        assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
        assert torch.equal(scale, want_scale)
        ys.append((data.float() * scale[:, None]).bfloat16())
    for out, x in zip(moe_combine_loopback(ys, [h for *_, h in results]), xs):
        torch.testing.assert_close(out.float(), 2 * x.float(), rtol=2 ** -3, atol=1e-6)
