"""The fp8 fused matmuls on a GPU: the Triton fp8 GEMM of the ``triton`` backends (real
launches: wgmma on sm_90) and torch's ``symm_mem`` scaled ops against the reference, in
loopback and on the shared-GPU ranks (tests/gpu/conftest.py). Skipped without a GPU
(written without one: not yet run)."""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops.scaled_matmul import AG, ROWWISE, RS
from fusedpar.testing import scaled_matmul as cases
from fusedpar.testing.cases import same

pytestmark = [pytest.mark.gpu, pytest.mark.multirank, pytest.mark.timeout(600)]

NEEDS_FP8 = "needs a GPU with fp8 tensor cores (compute capability 8.9+)"


def _fp8_gpu() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(NEEDS_FP8)
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("world", [2, 4])
def test_loopback_triton_is_exact_on_a_gpu(world):
    """The check cases (exact fp8 data, power-of-2 scales, K = 32: the Triton GEMM's masked
    tiles) bit for bit against float64 torch, outputs in bf16 and fp32; the reduce-scatter
    also as a group call runs it (``side_stream``: the partials copied while the GEMMs run,
    ``reduce_chunks`` rounding the float32 sums) and scattering the output's columns."""
    device = _fp8_gpu()
    extra = [cases.ScaledCase(RS, "columns rowwise", (2, 3, 32), 2, (16 * world,), ROWWISE, "avg", 9)]
    for case in cases.cases(world) + extra:
        for dtype in (torch.bfloat16, torch.float32):
            inputs = case.inputs(dtype, world, device)
            expected = case.expected(inputs, dtype)
            outs = case.loopback(inputs, "triton")
            assert same(outs, expected), (case.label, dtype)
            if case.op == RS:
                a, bs, a_scales, b_scales, _ = (list(x) for x in zip(*inputs))
                outs = fusedpar.ops.scaled_matmul_reduce_scatter_loopback(
                    a, [b[0] for b in bs], a_scales, [s[0] for s in b_scales], case.reduce_op, case.dim,
                    out_dtype=dtype, side_stream=True)
                torch.cuda.synchronize()
                assert same(outs, expected), (case.label, dtype, "side stream")


def test_triton_gemm_within_scaled_mm_error_at_a_real_shape():
    """A 1024 x 2048 x 1536 GEMM (several K steps, full wgmma tiles), random data, rowwise
    and tensorwise: error against float64 at most 2x ``torch._scaled_mm``'s plus 1e-6."""
    device = _fp8_gpu()
    from fusedpar.ops.float8_scales import quantize
    from fusedpar.ops.scaled_matmul import triton_gemm

    torch.manual_seed(0)
    x = torch.randn(1024, 2048, device=device)
    w = torch.randn(2048, 1536, device=device) / 45
    for rowwise in (False, True):
        a, sa = quantize(x, torch.float8_e4m3fn, -1 if rowwise else None)
        b, sb = quantize(w, torch.float8_e4m3fn, 0 if rowwise else None)
        exact = (a.double() * sa.double()) @ (b.double() * sb.double())
        torch_out = torch._scaled_mm(a, b.t().contiguous().t(), sa, sb, out_dtype=torch.bfloat16)
        ours = triton_gemm(a, b, sa, sb, torch.bfloat16)
        torch_err = (torch_out.double() - exact).abs().max()
        assert (ours.double() - exact).abs().max() <= 2 * torch_err + 1e-6, rowwise


def _group_backends_agree():
    device = torch.device("cuda", torch.cuda.current_device())
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for case in cases.cases(world):
        args = case.inputs(torch.bfloat16, world, device)[rank]
        ref = case.call(args, None, "reference")
        for backend in ("triton", "symm_mem", "pipelined"):
            try:
                got = case.call(args, None, backend)
            except fusedpar.errors.BackendNotSupportedError as e:
                results[(case.label, backend)] = f"skipped: {e}"
                continue
            if case.op == AG:
                same = all(torch.equal(o.cpu(), r.cpu()) for o, r in zip(got[1], ref[1]))
            else:  # float32 sums in another order: within one bf16 rounding
                same = torch.allclose(got.float().cpu(), ref.float().cpu(), rtol=2 ** -7, atol=0)
            results[(case.label, backend)] = same
    return results


def test_group_backends_equal_the_reference(gpu_pools):
    _fp8_gpu()
    for results in gpu_pools(2).run(_group_backends_agree):
        assert any(v is True for k, v in results.items() if k[1] == "triton"), results
        assert all(v is True or str(v).startswith("skipped") for v in results.values()), results
        # torch's ops may refuse the machine (multicast): shown, never passed silently
        print({k: v for k, v in results.items() if str(v).startswith("skipped")})
