"""matmul_reduce_scatter (sum): fusedpar backends next to what a user would pick instead
(DESIGN.md §6).

* ``test_loopback`` (one GPU, no torchrun): every rank of a W=8 matmul_reduce_scatter in one
  process (``matmul_reduce_scatter_loopback``: the triton GEMMs write their partials into
  loopback symmetric buffers, a reduction kernel sums each rank's chunk), against W
  ``torch.matmul`` calls of the same per-rank GEMM (``A_r @ B_r``, the reduction left out).
  Target: >= 0.9x torch.matmul's TFLOP/s.
* ``test_torchrun`` (``torchrun --nproc-per-node N -m pytest benchmarks``): each backend
  against the unfused cuBLAS matmul then NCCL ``reduce_scatter_tensor``, and against torch
  ``symm_mem.fused_matmul_reduce_scatter`` (async-TP). Targets: >= 1.0x symm_mem, >= 1.2x
  unfused.
* ``test_loopback_volume_is_the_lower_bound``: not a timing; runs on CPU too.

``shape`` is ``M x K x N``: each rank's A is ``[M, K]`` (K: its shard of the contraction),
its B ``[K, N]``, its output the ``[M / W, N]`` chunk of the sum over ranks of A_r @ B_r,
scattered along dim 0, bf16; the Llama-3-70B TP=8 projections (attention out: K=1024, MLP
down: K=3584) and one odd small shape. Each case checks its result once before it is timed
(error against an fp64 sum at most 2x that of the same-dtype torch baseline); do_bench
quantiles go to ``results/matmul_reduce_scatter.csv`` with TFLOP/s, % of the session's
``matmul_roofline`` and the speedups over the baselines in ``notes``. Targets are printed
and recorded, never asserted.
"""

import warnings

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.errors import BackendNotSupportedError

OP = "matmul_reduce_scatter"
W_LOOPBACK = 8
DTYPE = torch.bfloat16
SHAPES = [(8192, 1024, 8192), (8192, 3584, 8192), (1000 * W_LOOPBACK, 1032, 1288)]  # M, K, N
PEDANTIC = dict(rounds=10, warmup_rounds=2, iterations=1)  # fixed: identical on every rank
FUSEDPAR = ("reference", "pipelined", "triton")
SYMM_MEM = "symm_mem.fused_matmul_reduce_scatter"
UNFUSED = "matmul+nccl"
LOOPBACK_TARGETS = {"torch.matmul": 0.9}  # fused TFLOP/s over the baseline's, at least
DIST_TARGETS = {SYMM_MEM: 1.0, UNFUSED: 1.2}

# torch 2.13+ names it reduce_scatter_single; older ones reduce_scatter_tensor
_nccl_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# median ms per (mode, shape, world, backend), None where it could not run: the speedups
_MEDIANS: dict[tuple, float | None] = {}


def _name(shape) -> str:
    return "x".join(map(str, shape))


def _operands(m, k, n, rank, device, dtype=DTYPE, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``A [m, k]`` and ``B [k, n]``, reproducible on any rank."""
    g = torch.Generator(device=device)
    g.manual_seed(7919 * seed + rank)
    a = torch.randn(m, k, generator=g, device=device).to(dtype)
    b = (torch.randn(k, n, generator=g, device=device) * k ** -0.5).to(dtype)
    return a, b


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _rel_err(out: torch.Tensor, ref64: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref64).norm() / ref64.norm()).item()


def _tflops(flops: int, median_ms: float) -> float:
    return flops / (median_ms * 1e-3) / 1e12


def _speedups(key, median, targets, report_target, label) -> dict:
    """``notes`` entries comparing ``median`` with each measured baseline of ``key``."""
    notes = {}
    for baseline, target in targets.items():
        base = _MEDIANS.get((*key, baseline))
        if base is None:
            notes[f"vs_{baseline}"] = "n/a"
            report_target(f"{label}: vs {baseline}: n/a (the baseline did not run)")
            continue
        ratio = base / median
        verdict = "met" if ratio >= target else "MISSED"
        notes[f"vs_{baseline}"] = f"{ratio:.3f}x (target >= {target}x: {verdict})"
        report_target(f"{label}: {ratio:.3f}x {baseline} (target >= {target}x: {verdict})")
    return notes


class _Unavailable(Exception):
    pass


# ---- single GPU: loopback --------------------------------------------------------------------


def _loopback_measure(backend, shape, device, gpu_times):
    """Check one loopback case once, then time it: ``(fn, (median, p20, p80), bytes_moved)``."""
    world = W_LOOPBACK
    m, k, n = shape
    As, Bs = zip(*[_operands(m, k, n, r, device) for r in range(world)])
    As, Bs = list(As), list(Bs)
    bytes_moved = None
    products = [a @ b for a, b in zip(As, Bs)]
    torch_outs = torch.stack(products).sum(0).chunk(world, 0)  # bf16 partials, one rounding
    del products
    if backend == "torch.matmul":
        def fn():  # the same W per-rank GEMMs, the reduction left out
            return [torch.matmul(a, b) for a, b in zip(As, Bs)]
        outs = torch_outs
    else:
        def fn():
            return fusedpar.ops.matmul_reduce_scatter_loopback(As, Bs, "sum", 0)
        try:
            with fusedpar.comm.count_bytes() as counter:
                outs = fn()
        except BackendNotSupportedError as e:
            raise _Unavailable(str(e)) from e
        bytes_moved = counter.total()
    ref64 = torch.zeros(m, n, dtype=torch.float64, device=device)
    for a, b in zip(As, Bs):
        ref64 += a.double() @ b.double()
    ref64 = ref64.chunk(world, 0)
    assert len(outs) == world
    for rank, out in enumerate(outs):
        assert out.shape == (m // world, n) and out.dtype == DTYPE
        err, torch_err = _rel_err(out, ref64[rank]), _rel_err(torch_outs[rank], ref64[rank])
        assert err <= max(2 * torch_err, 1e-6), \
            f"simulated rank {rank}: error {err:.3g}, torch {torch_err:.3g}"
    del outs, torch_outs, ref64
    return fn, gpu_times(fn), bytes_moved


@pytest.mark.parametrize("backend", ["torch.matmul", "triton"])  # the baseline first
@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_loopback(benchmark, gpu, gpu_times, record_row, synced, matmul_roofline, report_target,
                  shape, backend):
    world = W_LOOPBACK
    benchmark.group = f"{OP} {_name(shape)} bf16 loopback W={world}"
    key = ("loopback", shape, world)
    try:
        fn, (median, p20, p80), bytes_moved = _loopback_measure(backend, shape, gpu, gpu_times)
    except _Unavailable as e:
        _MEDIANS[(*key, backend)] = None
        pytest.skip(str(e))
    _MEDIANS[(*key, backend)] = median
    m, k, n = shape
    tflops = _tflops(2 * m * k * n * world, median)
    notes = dict(mode="loopback", tflops=f"{tflops:.1f}", roofline_tflops=f"{matmul_roofline:.1f}",
                 pct_roofline=f"{100 * tflops / matmul_roofline:.1f}")
    if backend != "torch.matmul":
        for baseline in LOOPBACK_TARGETS:  # a -k selection may have left the baseline out
            if (*key, baseline) not in _MEDIANS:
                try:
                    _MEDIANS[(*key, baseline)] = _loopback_measure(baseline, shape, gpu,
                                                                   gpu_times)[1][0]
                except _Unavailable:
                    _MEDIANS[(*key, baseline)] = None
        notes.update(_speedups(key, median, LOOPBACK_TARGETS, report_target,
                               f"{OP} {_name(shape)} loopback W={world} {backend}"))
    chunk_bytes = (m // world) * n * DTYPE.itemsize
    record_row(OP, backend, shape, DTYPE, world, median, p20, p80,
               algo_bytes=world * m * n * DTYPE.itemsize, bytes_moved=bytes_moved,
               lower_bound=world * (world - 1) * chunk_bytes, **notes)
    benchmark.extra_info.update(do_bench_median_ms=median, p20_ms=p20, p80_ms=p80, **notes)
    benchmark.pedantic(synced(fn), **PEDANTIC)


# ---- several GPUs: torchrun ------------------------------------------------------------------


def _unfused_case(a, b, group):
    world = dist.get_world_size(group)
    product = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    out = torch.empty(a.shape[0] // world, b.shape[1], dtype=a.dtype, device=a.device)

    def unfused():
        torch.matmul(a, b, out=product)
        _nccl_reduce_scatter(out, product, group=group)
        return out
    return unfused


def _case(backend, a, b, group):
    """``(fn, note)`` for one case; raises ``_Unavailable`` with the reason it cannot run."""
    if backend in FUSEDPAR:
        return (lambda: fusedpar.ops.matmul_reduce_scatter(a, b, "sum", 0, group,
                                                           backend=backend)), "fusedpar"
    if backend == UNFUSED:
        return _unfused_case(a, b, group), f"torch.matmul then dist.{_nccl_reduce_scatter.__name__}"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        raise _Unavailable(f"torch.distributed._symmetric_memory: {e}") from e
    op_name = backend.removeprefix("symm_mem.")
    if not hasattr(torch.ops.symm_mem, op_name):
        raise _Unavailable(f"torch {torch.__version__} has no torch.ops.symm_mem.{op_name}")
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9; a no-op after
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
    op = getattr(torch.ops.symm_mem, op_name)
    return (lambda: op(a, b, "sum", 0, group.group_name)), \
        "async-TP: per-chunk cuBLAS + copy-engine P2P + reduce"


def _dist_measure(backend, shape, group, device, gpu_times, agree):
    """Check one torchrun case once, then time it: ``(fn, (median, p20, p80), bytes_moved,
    note)``; ``_Unavailable`` (on every rank alike) if it cannot run."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    m, k, n = shape
    reason = None if m % world == 0 else f"M={m} is not divisible by the world size {world}"
    if not agree(reason is None):
        raise _Unavailable(reason)
    a, b = _operands(m, k, n, rank, device)
    ref64 = torch.zeros(m // world, n, dtype=torch.float64, device=device)
    for r in range(world):
        a_r, b_r = _operands(m, k, n, r, device)
        ref64 += a_r.chunk(world, 0)[rank].double() @ b_r.double()
    del a_r, b_r
    nccl_err = _rel_err(_unfused_case(a, b, group)(), ref64)
    out, bytes_moved, note = None, None, None
    try:
        fn, note = _case(backend, a, b, group)
        with fusedpar.comm.count_bytes() as counter:
            out = fn()
        torch.cuda.synchronize()
        if note == "fusedpar":
            bytes_moved = counter.total()
    except (_Unavailable, BackendNotSupportedError) as e:
        reason = f"{backend}: {_first_line(e)}"
    except RuntimeError as e:  # torch's symm_mem ops refuse what the machine lacks
        if not backend.startswith("symm_mem."):
            raise
        reason = f"{backend}: {_first_line(e)}"
    if not agree(reason is None):
        raise _Unavailable(reason or f"{backend} cannot run on another rank")
    err = _rel_err(out, ref64) if out.shape == ref64.shape else float("inf")
    # the fused sum must be as good as the unfused one's (2x); torch's own just bf16-accurate
    bound = max(2 * nccl_err, 1e-6) if note == "fusedpar" else max(2 * nccl_err, 1e-2)
    assert agree(err <= bound), \
        f"{backend}: error {err:.3g} vs unfused {nccl_err:.3g} on rank {rank}"
    del out, ref64
    return fn, gpu_times(fn), bytes_moved, note


DIST_BACKENDS = [UNFUSED, SYMM_MEM, *FUSEDPAR]  # the baselines first


@pytest.mark.parametrize("backend", DIST_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_torchrun(benchmark, dist_gpu, gpu_times, record_row, agree, synced, matmul_roofline,
                  report_target, shape, backend):
    group, device = dist_gpu
    world = dist.get_world_size(group)
    benchmark.group = f"{OP} {_name(shape)} bf16 W={world}"
    key = ("torchrun", shape, world)
    try:
        fn, (median, p20, p80), bytes_moved, note = _dist_measure(backend, shape, group, device,
                                                                  gpu_times, agree)
    except _Unavailable as e:
        _MEDIANS[(*key, backend)] = None
        pytest.skip(str(e))
    _MEDIANS[(*key, backend)] = median
    m, k, n = shape
    tflops = _tflops(2 * m * k * n, median)  # per GPU: each rank multiplies all M rows
    notes = dict(mode="torchrun", impl=note, tflops=f"{tflops:.1f}",
                 roofline_tflops=f"{matmul_roofline:.1f}",
                 pct_roofline=f"{100 * tflops / matmul_roofline:.1f}")
    if backend in FUSEDPAR:
        for baseline in DIST_TARGETS:  # a -k selection may have left a baseline out
            if (*key, baseline) not in _MEDIANS:
                try:
                    _MEDIANS[(*key, baseline)] = _dist_measure(baseline, shape, group, device,
                                                               gpu_times, agree)[1][0]
                except _Unavailable:
                    _MEDIANS[(*key, baseline)] = None
        notes.update(_speedups(key, median, DIST_TARGETS, report_target,
                               f"{OP} {_name(shape)} W={world} {backend}"))
    record_row(OP, backend, shape, DTYPE, world, median, p20, p80,
               algo_bytes=m * n * DTYPE.itemsize, bytes_moved=bytes_moved,
               lower_bound=(world - 1) * (m // world) * n * DTYPE.itemsize, **notes)
    benchmark.extra_info.update(do_bench_median_ms=median, p20_ms=p20, p80_ms=p80, **notes)
    benchmark.pedantic(synced(fn), **PEDANTIC)


# ---- communication volume (no timing; CPU too) -----------------------------------------------


@pytest.mark.parametrize("a_shape,scatter_dim,n,dtype", [
    ((16, 16), 0, 24, torch.bfloat16),
    ((3, 16, 8), 1, 12, torch.float32),  # 3-D, scattered along dim 1
    ((8, 24), 0, 40, torch.float16),
], ids=["16x16-N24-bf16", "3x16x8-dim1-N12-fp32", "8x24-N40-fp16"])
def test_loopback_volume_is_the_lower_bound(local_device, a_shape, scatter_dim, n, dtype):
    """Each of the W simulated ranks reads the W-1 peers' partial products of its own
    ``[M / W, N]`` chunk: W (W-1) chunk bytes, nothing more. Small integers keep every
    partial exact in the dtype, so the fp32 sum rounds once, as the fp64 reference."""
    world = W_LOOPBACK
    k = a_shape[-1]
    As, Bs = [], []
    for r in range(world):
        g = torch.Generator(device=local_device)
        g.manual_seed(4000 + r)
        As.append(torch.randint(-2, 3, a_shape, generator=g, device=local_device).to(dtype))
        Bs.append(torch.randint(-2, 3, (k, n), generator=g, device=local_device).to(dtype))
    try:
        with fusedpar.comm.count_bytes() as counter:
            outs = fusedpar.ops.matmul_reduce_scatter_loopback(As, Bs, "sum", scatter_dim)
    except BackendNotSupportedError as e:
        pytest.skip(str(e))
    expected = sum(a.double() @ b.double() for a, b in zip(As, Bs)).to(dtype)
    expected = expected.chunk(world, scatter_dim)
    for rank, out in enumerate(outs):
        assert torch.equal(out, expected[rank]), f"simulated rank {rank}"
    chunk_bytes = _nbytes(expected[0])
    assert counter.total() == world * (world - 1) * chunk_bytes
