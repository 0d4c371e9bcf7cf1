"""all_gather_scaled_matmul and scaled_matmul_reduce_scatter on 2 and 4 gloo ranks: bit for
bit against float64 plain torch on exact fp8 data (every scale layout, e4m3 and e5m2, odd
shapes, the bf16 ops' gather / scatter dims), within fp8 rounding of ``torch._scaled_mm``
on the gathered operands on random data, pipelined == reference, bytes moved == the lower
bound (<= 0.55x the bf16 op's), clear errors; the float8 scales are torchao's."""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops import registry, scaled_matmul
from fusedpar.ops.scaled_matmul import AG, ROWWISE, ROWWISE_GATHERED, ROWWISE_SHARD, RS, TENSORWISE
from fusedpar.testing import scaled_matmul as cases
from fusedpar.testing.cases import same
from tests.ops.collective_cases import (capture_errors, cpu_backends, cpu_row_scales, interpreter_cast_slack,
                                       poisoned_allocations)

pytestmark = [pytest.mark.timeout(300)]

AG_BACKENDS = cpu_backends(AG)
RS_BACKENDS = cpu_backends(RS)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _exact_cases(world):
    """The ``fusedpar check`` cases plus odd shapes, both fp8 dtypes, return_A=False and the
    last scatter dim."""
    extra = [
        cases.ScaledCase(AG, "odd 2-D e5m2", (3, 24), 0, (5, 7), ROWWISE_SHARD, "", 5),
        cases.ScaledCase(AG, "3-D dim=0 gathered rows", (2, 3, 8), 0, (3,), ROWWISE_GATHERED, "", 6),
        cases.ScaledCase(AG, "3-D dim=1 tensorwise", (1, 1, 8), 1, (1,), TENSORWISE, "", 7),
        cases.ScaledCase(RS, "3-D dim=1 rowwise", (2, world, 24), 1, (5,), ROWWISE, "sum", 8),
        cases.ScaledCase(RS, "odd e5m2 rowwise avg", (3 * world, 40), 0, (7,), ROWWISE, "avg", 12),
        cases.ScaledCase(RS, "columns", (5, 24), 1, (3 * world,), TENSORWISE, "sum", 9),
        cases.ScaledCase(RS, "3-D columns rowwise avg", (2, 3, 16), 2, (16 * world,), ROWWISE, "avg", 11),
        cases.ScaledCase(RS, "3-D dim=0 tensorwise avg", (world, 3, 8), 0, (7,), TENSORWISE, "avg", 10),
    ]
    return cases.cases(world) + extra


def _check_exact(every_case: bool):
    """``every_case``: the extra shapes and both output dtypes too (else the check cases in bf16)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = 0
    for case in _exact_cases(world) if every_case else cases.cases(world):
        backends = AG_BACKENDS if case.op == AG else RS_BACKENDS
        fp8 = E5M2 if "e5m2" in case.label else E4M3
        for dtype in (torch.bfloat16, torch.float32) if every_case else (torch.bfloat16,):
            inputs = [(*cases.scaled_inputs(case.op, case.a_shape, case.ns, case.a_mode, case.dim, r,
                                            world, case.salt, "cpu", fp8), dtype) for r in range(world)]
            expected = case.expected(inputs, dtype)[rank]
            available = registry.get(case.op).dispatcher.availability(
                case.availability_call(inputs[rank], world, dist.group.WORLD))
            for backend in backends:
                assert not available[backend], (case.label, backend, available[backend])
                with poisoned_allocations(), fusedpar.comm.count_bytes() as counter:
                    out = case.call(inputs[rank], None, backend)
                if case.op == AG:
                    assert out[0].dtype == fp8 and torch.equal(out[0].view(torch.uint8),
                                                               expected[0].view(torch.uint8)), case.label
                    for o, e in zip(out[1], expected[1]):
                        assert o.dtype == dtype and torch.equal(o, e), (case.label, backend, dtype)
                else:
                    assert out.dtype == dtype and torch.equal(out, expected), (case.label, backend, dtype)
                assert counter.total() == case.lower_bound(inputs[rank], world), (case.label, backend)
                checked += 1
    a, bs, a_scale, b_scales = cases.scaled_inputs(AG, (4, 16), (8,), ROWWISE_SHARD, 0, rank, world, 0,
                                                   "cpu")
    for backend in AG_BACKENDS:
        gathered, outs = fusedpar.ops.all_gather_scaled_matmul(a, bs, a_scale, b_scales, 0, return_A=False,
                                                               backend=backend)
        assert gathered is None and outs[0].shape == (4 * world, 8)
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_match_float64_torch_bit_for_bit_on_exact_data(pools, world):
    counts = pools(world).run(_check_exact, world == 2)
    assert counts[0] > 0 and len(set(counts)) == 1


def _gather(x, dim):
    parts = [torch.empty_like(x.view(torch.uint8)) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous().view(torch.uint8))
    return torch.cat(parts, dim).view(x.dtype)


def _check_random():
    """Random data: each backend within fp8-rounding of ``_scaled_mm`` on the gathered
    operands in float32 (the same GEMM, so error <= 2x torch's own vs float64 + 1 ulp),
    pipelined == reference bit for bit where the arithmetic is the same (the all-gather)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    x = torch.randn(2, 6, 48) * (rank + 1)
    a, a_scale = fusedpar.ops.float8_scales.quantize(x, E4M3, dim=-1)
    torch.manual_seed(99)
    w = torch.randn(48, 40)
    b, b_scale = fusedpar.ops.float8_scales.quantize(w, E4M3, dim=0)
    full_a, full_s = _gather(a, 1), _gather(a_scale, 1)
    exact = (full_a.double() * full_s.double()).flatten(0, 1) @ (b.double() * b_scale.double())
    torch_out = torch._scaled_mm(full_a.flatten(0, 1), b, full_s.flatten(0, 1), b_scale,
                                 out_dtype=torch.bfloat16)
    torch_err = (torch_out.double() - exact).abs().max()
    results = {}
    for backend in AG_BACKENDS:
        _, (out,) = fusedpar.ops.all_gather_scaled_matmul(a, [b], a_scale, [b_scale], 1, backend=backend)
        err = (out.flatten(0, 1).double() - exact).abs().max()
        assert err <= 2 * torch_err + interpreter_cast_slack(exact, torch.bfloat16, backend), \
            (backend, err, torch_err)
        results[backend] = out
    assert torch.equal(results["pipelined"], results["reference"])  # the same _scaled_mm per row block
    # the reduce-scatter: every rank's partial over its K shard, summed in float32, rounded once
    part, part_scale = fusedpar.ops.float8_scales.quantize(x.flatten(0, 1), E5M2)
    wk, wk_scale = fusedpar.ops.float8_scales.quantize(w + rank, E4M3, dim=0)
    partial = (part.double() * part_scale.double()) @ (wk.double() * wk_scale.double())
    total = partial.clone()
    dist.all_reduce(total)
    exact = total.chunk(world, 0)[rank]
    for backend in RS_BACKENDS:
        out = fusedpar.ops.scaled_matmul_reduce_scatter(part, wk, part_scale, wk_scale, backend=backend,
                                                        out_dtype=torch.float32)
        rel = ((out.double() - exact).abs().max() / exact.abs().max()).item()
        assert rel < 1e-6, (backend, rel)  # float32 sums of exact fp8 products
    return True


@cpu_row_scales
def test_random_data_within_fp8_rounding_of_scaled_mm(pools):
    assert pools(2).run(_check_random) == [True, True]


def _check_bytes_vs_bf16():
    world = dist.get_world_size()
    a16 = torch.ones(8, 64, dtype=torch.bfloat16)
    b16 = torch.ones(64, 16, dtype=torch.bfloat16)
    with fusedpar.comm.count_bytes() as bf16:
        fusedpar.ops.all_gather_matmul(a16, [b16], 0, backend="pipelined")
    ratios = {}
    for mode, scale in ((TENSORWISE, torch.ones(())), (ROWWISE_SHARD, torch.ones(8, 1))):
        with fusedpar.comm.count_bytes() as fp8:
            fusedpar.ops.all_gather_scaled_matmul(a16.to(E4M3), [b16.to(E4M3)], scale, [torch.ones(())], 0,
                                                  backend="pipelined")
        bound = cases.lower_bound(AG, mode, (a16.to(E4M3), None, scale), world)
        assert fp8.total() == bound
        ratios[mode] = fp8.total() / bf16.total()
    return ratios


def test_fp8_all_gather_moves_at_most_055x_the_bf16_bytes(pools):
    ratios = pools(2).run(_check_bytes_vs_bf16)[0]
    assert ratios[TENSORWISE] == 0.5  # fp8 bytes only: the tensorwise scale does not travel
    assert 0.5 < ratios[ROWWISE_SHARD] <= 0.55  # + one float32 scale per row of K=64 bytes


def _bad_inputs():
    a, b = torch.ones(4, 32).to(E4M3), torch.ones(32, 16).to(E4M3)
    one = torch.ones(())
    ag, rs = fusedpar.ops.all_gather_scaled_matmul, fusedpar.ops.scaled_matmul_reduce_scatter
    return capture_errors({
        "bf16 A": lambda: ag(a.bfloat16(), [b], one, [one], 0),
        "bf16 B": lambda: rs(a, b.bfloat16(), one, one),
        "A_scale shape": lambda: ag(a, [b], torch.ones(3, 1), [one], 0),
        "B_scale shape": lambda: ag(a, [b], one, [torch.ones(16, 1)], 0),
        "B_scale count": lambda: ag(a, [b, b], one, [one], 0),
        "scale dtype": lambda: rs(a, b, one.bfloat16(), one),
        "rs A_scale": lambda: rs(a, b, torch.ones(2, 1), one),
        "K gather": lambda: ag(a, [torch.ones(64, 16).to(E4M3)], one, [one], 1),
        "out dtype": lambda: rs(a, b, one, one, out_dtype=torch.int32),
        "backend": lambda: ag(a, [b], one, [one], 0, backend="symm_mem"),
    })


def test_bad_inputs_get_clear_errors(pools):
    errors = pools(2).run(_bad_inputs)[0]
    assert errors["bf16 A"][0] == "TypeError" and "A is torch.bfloat16" in errors["bf16 A"][1]
    assert "float8_e4m3fn" in errors["bf16 A"][1]
    assert errors["bf16 B"][0] == "TypeError" and "B is torch.bfloat16" in errors["bf16 B"][1]
    assert "A_scale has shape (3, 1)" in errors["A_scale shape"][1] and "(4, 1)" in errors["A_scale shape"][1]
    assert "B_scales[0] has shape (16, 1)" in errors["B_scale shape"][1] and "(1, 16)" in errors["B_scale shape"][1]
    assert "2 B(s) but 1 B scale" in errors["B_scale count"][1]
    assert "A_scale is torch.bfloat16" in errors["scale dtype"][1]
    assert "A_scale has shape (2, 1)" in errors["rs A_scale"][1]
    assert "gather_dim=1 is A's last dim" in errors["K gather"][1]
    assert "out dtype torch.int32" in errors["out dtype"][1]
    assert errors["backend"][0] == "BackendNotSupportedError" and "CUDA" in errors["backend"][1]


def test_k_multiple_of_16_is_checked_for_cuda_tensors():
    """The CUDA-only check, reached on CPU through the check function itself (the device is
    the only thing it reads)."""
    from fusedpar.ops import scaled_matmul as sm

    class FakeCuda(torch.Tensor):
        is_cuda = True

    a = torch.ones(4, 24).to(E4M3).as_subclass(FakeCuda)
    b = torch.ones(24, 16).to(E4M3).as_subclass(FakeCuda)
    with pytest.raises(ValueError, match="K and N multiples of 16, got K=24, N=16.*pad A's last dim"):
        sm._check_operands(RS, a, [b], torch.ones(()), [torch.ones(())], 0, "scatter_dim",
                           [torch.bfloat16])


def test_scales_are_torchaos():
    ao = pytest.importorskip("torchao.float8.float8_utils")
    torch.manual_seed(0)
    x = torch.randn(5, 7) * torch.logspace(-3, 3, 7)
    for dtype in (E4M3, E5M2):
        for round_pow2 in (False, True):
            for dim in (None, 0, -1):
                data, scale = fusedpar.ops.float8_scales.quantize(x, dtype, dim, round_pow2)
                from torchao.float8.config import ScalingGranularity

                gran = ScalingGranularity.TENSORWISE if dim is None else ScalingGranularity.AXISWISE
                ao_scale = ao.tensor_to_scale(x, dtype, scaling_granularity=gran, axiswise_dim=dim,
                                              round_scales_to_power_of_2=round_pow2)
                assert torch.equal(scale, ao_scale.reciprocal())
                assert torch.equal(data.view(torch.uint8),
                                   ao.to_fp8_saturated(x * ao_scale, dtype).view(torch.uint8))


def test_scaled_mm_where_cpu_takes_no_row_scales(monkeypatch):
    """Where torch's CPU ``_scaled_mm`` asserts tensorwise scales (torch 2.11), ``scaled_mm``
    multiplies the scaled operands in fp32: within fp32 rounding of float64, and of torch's
    own op where it takes rowwise scales, for every mix of scale layouts."""
    f8 = fusedpar.ops.float8_scales
    torch.manual_seed(0)
    a, b = (torch.randn(7, 64) * 8).to(E4M3), (torch.randn(33, 64) * 8).to(E4M3).t()
    rows, cols, one = torch.rand(7, 1) + 0.5, torch.rand(1, 33) + 0.5, torch.tensor(0.75)
    for sa, sb in ((rows, cols), (one, cols), (rows, one)):
        want = (a.double() * sa.double()) @ (b.double() * sb.double())
        torch_op = f8.scaled_mm(a, b, sa, sb, torch.float32) if f8.CPU_SCALED_MM_TAKES_ROWS else want
        monkeypatch.setattr(f8, "CPU_SCALED_MM_TAKES_ROWS", False)
        got = f8.scaled_mm(a, b, sa, sb, torch.float32)
        for other in (want, torch_op):
            torch.testing.assert_close(got.double(), other.double(), rtol=1e-6, atol=1e-6 * want.abs().max().item())
        assert torch.equal(f8.scaled_mm(a, b, sa, sb, torch.bfloat16), got.to(torch.bfloat16))
        monkeypatch.undo()


def test_registry_example_and_fake():
    for op in (AG, RS):
        spec = registry.get(op)
        call = spec.example("cpu")
        assert spec.dispatcher.availability(call)["reference"] == []
        assert "CUDA" in spec.dispatcher.availability(call)["symm_mem"][0]


@pytest.mark.parametrize("world", [2, 4])
def test_loopback_matches_float64_torch_bit_for_bit(world):
    """Every rank in one process through the ``*_loopback`` variants (triton: the overlapped
    protocols on loopback buffers and the Triton fp8 GEMMs, interpreted here); the
    reduce-scatter also on the extra shapes (3-D, the output's columns, e5m2) and in every
    output dtype (float32 sums rounded once)."""
    extra = [case for case in _exact_cases(world)[len(cases.cases(world)):] if case.op == RS]
    dtypes = [(torch.bfloat16,)] * len(cases.cases(world)) + [(torch.float32,), (torch.float16,)] * len(extra)
    for case, case_dtypes in zip(cases.cases(world) + extra, dtypes):
        fp8 = E5M2 if "e5m2" in case.label else E4M3
        for dtype in case_dtypes:
            inputs = [(*cases.scaled_inputs(case.op, case.a_shape, case.ns, case.a_mode, case.dim, r, world,
                                            case.salt, "cpu", fp8), dtype) for r in range(world)]
            expected = case.expected(inputs, dtype)
            with poisoned_allocations(), fusedpar.comm.count_bytes() as counter:
                outs = case.loopback(inputs, "triton")
            assert same(outs, expected), (case.label, dtype)  # dtypes, shapes and bits (fp8 A_gathered too)
            assert counter.total() == world * case.lower_bound(inputs[0], world), case.label


def test_triton_refuses_gpus_without_fp8_tensor_cores(monkeypatch):
    from fusedpar.ops import scaled_matmul as sm

    monkeypatch.setattr(sm.protocol, "triton_reasons", lambda call: [])  # as if Triton ran on a GPU here
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))

    class FakeCuda(torch.Tensor):
        is_cuda = True

    a = torch.ones(4, 16).to(E4M3).as_subclass(FakeCuda)
    call = sm.ScaledCall(AG, a, 0, 2, None, [torch.ones(16, 16).to(E4M3)], torch.ones(()), [torch.ones(())],
                         [torch.bfloat16])
    (reason,) = sm._triton_reasons(call)
    assert "compute capability 8.9+" in reason and "has 8.0" in reason and "pipelined" in reason


def _fake_shapes():
    """The fake impls (what torch.compile traces) give the real calls' shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    world = dist.get_world_size()
    a, bs, a_scale, b_scales = cases.scaled_inputs(AG, (2, world, 32), (16, 8), ROWWISE_SHARD, 1,
                                                   dist.get_rank(), world, 0, "cpu")
    name, ops = dist.group.WORLD.group_name, torch.ops.fusedpar

    def calls(a, b0, b1, sa, sb0, sb1):
        gathered, outs = ops.all_gather_scaled_matmul(a, [b0, b1], sa, [sb0, sb1], 1, name,
                                                      out_dtypes=[torch.bfloat16, torch.float32])
        scattered = ops.scaled_matmul_reduce_scatter(a, b0, sa, sb0, "sum", 1, name, out_dtype=torch.float32)
        return [(tuple(t.shape), t.dtype) for t in (gathered, *outs, scattered)]

    tensors = (a, bs[0], bs[1], a_scale, b_scales[0], b_scales[1])
    real = calls(*tensors)
    with FakeTensorMode() as mode:
        fake = calls(*[mode.from_tensor(t) for t in tensors])
    # torch 2.11 hands the kernel and the fake ScalarType[] as c10 codes, not dtypes
    codes = [torch.ops.prim.dtype(torch.empty(0, dtype=d)) for d in (torch.bfloat16, torch.float32)]
    op = scaled_matmul._ag_op
    kernel = op._init_fn(a, bs, a_scale, b_scales, 1, name, out_dtypes=codes)
    with FakeTensorMode() as mode:
        f = mode.from_tensor
        faked = op._abstract_fn(f(a), [f(b) for b in bs], f(a_scale), [f(s) for s in b_scales], 1, name,
                                out_dtypes=codes)
    from_codes = [[(tuple(t.shape), t.dtype) for t in (out[0], *out[1])] for out in (kernel, faked)]
    return real == fake and from_codes == [real[:3]] * 2


def test_fake_impls_match_the_real_calls(pools):
    assert pools(2).run(_fake_shapes) == [True, True]


# the failed call multiplies rows its peer never staged: scales of garbage may overflow
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("a_mode", [TENSORWISE, ROWWISE_SHARD, ROWWISE_GATHERED])
def test_triton_multiplies_the_rows_as_they_land_and_nans_a_failed_call(monkeypatch, a_mode):
    """The triton backend is the bf16 op's overlapped gather: one peers-kernel launch per
    rank (``GatherLaunch`` with the scales for its epilogue; row scales that travel are read
    from the staged rows, strided past each row's fp8 bytes), nothing gathered first. Rank 1
    publishing another fingerprint: rank 0's outputs and gathered A are NaN (the GEMM's last
    program), the call raises; the next call is right."""
    from fusedpar.kernels import gemm_peers, signal

    world = 2
    inputs = [cases.scaled_inputs(AG, (3, 2, 16), (8, 4), a_mode, 1, r, world, 5, "cpu")
              for r in range(world)]
    a, bs, a_scales, b_scales = (list(x) for x in zip(*inputs))
    launches = []
    real_launch = gemm_peers.GatherLaunch.__call__
    monkeypatch.setattr(gemm_peers.GatherLaunch, "__call__",
                        lambda self, a, b, c, *args, gathered=None, scales=None: launches.append((c, scales))
                        or real_launch(self, a, b, c, *args, gathered=gathered, scales=scales))
    results = fusedpar.ops.all_gather_scaled_matmul_loopback(a, bs[0], a_scales, b_scales[0], 1,
                                                               out_dtypes=[torch.bfloat16, torch.float32])
    assert len(launches) == world and all(scales is not None for _, scales in launches)
    sa, stride_sa, _, stride_sb = launches[0][1]
    assert stride_sb == (1 if b_scales[0][0].numel() > 1 else 0)
    # one scale (stride 0), the gathered rows' given scales, or each row's after its 16 bytes
    assert stride_sa == {TENSORWISE: 0, ROWWISE_GATHERED: 1, ROWWISE_SHARD: (16 + 4) // 4}[a_mode]
    expected = cases.ScaledCase(AG, "", (3, 2, 16), 1, (8, 4), a_mode, "", 5).expected(
        [(*x, torch.bfloat16) for x in inputs], torch.bfloat16)
    for (g, outs), (eg, eouts) in zip(results, expected):
        assert torch.equal(g.view(torch.uint8), eg.view(torch.uint8))
        assert torch.equal(outs[0], eouts[0]) and outs[1].dtype == torch.float32
        assert torch.equal(outs[1].bfloat16(), eouts[1])  # the same GEMM, rounded to bf16 once

    real_stage = signal.stage
    monkeypatch.setattr(signal, "stage", lambda x, dst, pad_table, rank, world, meta, *a, **k:
                        real_stage(x, dst, pad_table, rank, world, meta + rank, *a, **k))
    launches.clear()
    with pytest.raises(ValueError, match="rank 0 and rank 1 .* passed different inputs"):
        fusedpar.ops.all_gather_scaled_matmul_loopback(a, bs[0], a_scales, b_scales[0], 1)
    (out, _), _ = launches
    assert out.isnan().all()
    monkeypatch.undo()
    again = fusedpar.ops.all_gather_scaled_matmul_loopback(a, bs[0], a_scales, b_scales[0], 1)
    assert same(again, expected)


def _one_plan_per_signature():
    """A second call of a signature runs the first one's plan (no checks, no dispatch): right
    for new values (the reduce-scatter: of rows and of the output's columns)."""
    from fusedpar.ops import scaled_matmul as sm

    rank, world = dist.get_rank(), dist.get_world_size()
    made = []
    real_ag, real_rs = sm._ag_plan, sm._rs_plan
    sm._ag_plan = lambda *args: made.append(args[-1]) or real_ag(*args)
    sm._rs_plan = lambda *args: made.append(f"{args[5]} {args[-1]}") or real_rs(*args)
    try:
        for salt in (0, 1):
            a, bs, a_scale, b_scales = cases.scaled_inputs(AG, (5, 16), (8,), ROWWISE_SHARD, 0, rank, world,
                                                           salt, "cpu")
            gathered, (out,) = fusedpar.ops.all_gather_scaled_matmul(a, bs, a_scale, b_scales, 0,
                                                                     backend="triton")
            _, (expected,) = fusedpar.ops.all_gather_scaled_matmul(a, bs, a_scale, b_scales, 0,
                                                                   backend="reference")
            assert torch.equal(out, expected)
            a, bs, a_scale, b_scales = cases.scaled_inputs(RS, (2 * world, 16), (8,), ROWWISE, 0, rank, world,
                                                           salt, "cpu")
            for dim in (0, 1):
                out, expected = (fusedpar.ops.scaled_matmul_reduce_scatter(a, bs[0], a_scale, b_scales[0], "avg",
                                                                           dim, backend=backend)
                                 for backend in ("triton", "reference"))
                assert torch.equal(out, expected), dim
    finally:
        sm._ag_plan, sm._rs_plan = real_ag, real_rs
    return made


def test_the_triton_backend_plans_once_per_signature(pools):
    made = ["triton", "reference", "0 triton", "0 reference", "1 triton", "1 reference"]
    assert pools(2).run(_one_plan_per_signature) == [made] * 2


def _rs_loopback(inputs, dim, **kwargs):
    a, b, sa, sb = (list(x) for x in zip(*inputs))
    return fusedpar.ops.scaled_matmul_reduce_scatter_loopback(a, [x[0] for x in b], sa, [x[0] for x in sb], "sum",
                                                              dim, **kwargs)


@pytest.mark.parametrize("columns", [False, True])
def test_triton_reduce_scatter_overlaps_and_nans_a_failed_call(monkeypatch, columns):
    """The triton backend runs the bf16 op's protocol: per rank one ``ScatterLaunch`` (the
    SCALED GEMM into the float32 partials, READY per chunk) with A's row scales and B's
    column scales (stride 0: tensorwise) for its epilogue, then the pull, and no other GEMM
    or collective; scattering the output's columns, the GEMM's A is a row-major Bᵀ (B's
    column scales its row scales) and its B is Aᵀ (K-major). Rank 1 publishing another
    fingerprint: rank 0's output is NaN and the call raises; the next call is right."""
    from fusedpar.kernels import matmul_reduce_scatter as kernels
    from fusedpar.kernels import reduce_scatter as rs_kernels
    from fusedpar.ops import scaled_matmul as sm

    world, dim, ns = 2, (2 if columns else 1), ((4 * 2,) if columns else (12,))
    inputs = [cases.scaled_inputs(RS, (3, 2, 16), ns, ROWWISE, dim, r, world, 5, "cpu") for r in range(world)]
    for r in range(world):  # B's column scales
        inputs[r][3][0] = cases.pow2_scale((1, ns[0]), r, 1, "cpu")
    expected = cases.ScaledCase(RS, "", (3, 2, 16), dim, ns, ROWWISE, "sum", 5).expected(
        [(*x, torch.bfloat16) for x in inputs], torch.bfloat16)
    launches, pulled = [], []
    real_launch, real_pull = kernels.ScatterLaunch.__call__, rs_kernels.reduce_scatter_pull
    monkeypatch.setattr(kernels.ScatterLaunch, "__call__",
                        lambda self, a, b, p, pad_table, rank, epoch, meta, timeout_ns, scales=None:
                        launches.append((a, b, p.dtype, scales, self.kmajor))
                        or real_launch(self, a, b, p, pad_table, rank, epoch, meta, timeout_ns, scales))
    monkeypatch.setattr(rs_kernels, "reduce_scatter_pull",
                        lambda out, *args, **kwargs: pulled.append(out) or real_pull(out, *args, **kwargs))
    monkeypatch.setattr(sm, "triton_gemm", None)  # not called
    outs = _rs_loopback(inputs, dim)
    assert same(outs, expected)
    assert len(launches) == len(pulled) == world and all(p.dtype == torch.float32 for p in pulled)
    a, b, p_dtype, (sa, stride_sa, sb, stride_sb), kmajor = launches[1]
    assert p_dtype == torch.float32 and a.is_contiguous() and kmajor == columns
    if columns:  # Bᵀ @ Aᵀ: B's scales on the rows, A's on the columns
        assert torch.equal(a, inputs[1][1][0].t()) and b.shape == (16, 6)
        assert torch.equal(sa.reshape(-1), inputs[1][3][0].reshape(-1))
        assert torch.equal(sb.reshape(-1), inputs[1][2].reshape(-1))
    else:  # dim 1 first
        assert torch.equal(a.float(), inputs[1][0].movedim(1, 0).reshape(-1, 16).float())
        assert torch.equal(sa.reshape(-1), inputs[1][2].movedim(1, 0).reshape(-1))
        assert torch.equal(sb.reshape(-1), inputs[1][3][0].reshape(-1))
    assert stride_sa == stride_sb == 1

    monkeypatch.setattr(kernels.ScatterLaunch, "__call__",
                        lambda self, a, b, p, pad_table, rank, epoch, meta, *args:
                        real_launch(self, a, b, p, pad_table, rank, epoch, meta + rank, *args))
    pulled.clear()
    with pytest.raises(ValueError, match="passed different inputs"):
        _rs_loopback(inputs, dim)
    assert pulled[0].isnan().all()
    monkeypatch.undo()
    assert same(_rs_loopback(inputs, dim), expected)


def test_triton_reduce_scatter_empty_shapes():
    """Zero rows, zero K or zero columns, scattering rows or the output's columns: the
    loopback's triton backend gives the zero (or empty) result in the caller's layout."""
    world = 2
    for m, k, n, dim in ((0, 16, 8, 0), (0, 16, 8, 1), (4, 0, 8, 0), (4, 0, 8, 1), (4, 16, 0, 0)):
        a = [torch.ones(m, k).to(E4M3)] * world
        b = [torch.ones(k, n).to(E4M3)] * world
        one = [torch.ones(())] * world
        outs = fusedpar.ops.scaled_matmul_reduce_scatter_loopback(a, b, one, one, "sum", dim)
        shape = (m // world, n) if dim == 0 else (m, n // world)
        assert all(o.shape == shape and o.dtype == torch.bfloat16 and not o.any() for o in outs), (m, k, n, dim)
