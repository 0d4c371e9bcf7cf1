"""Benchmark rows of the fused matmuls in a real process group on one GPU: W=2 ranks spawned
onto cuda:0 in a gloo world (tests/gpu/conftest.py, ``.ci/gpu all``'s ``shared`` stage) run
fusedpar's triton ``all_gather_matmul`` and ``matmul_reduce_scatter`` through the group path
(symmetric memory, copy-engine copies on a side stream, the GEMM spinning on their flags)
next to torch's async-TP op and the unfused collective + cuBLAS in the same group, and write
one row per case through the benchmarks' row writer (benchmarks/conftest.py ``_record_row``:
``results/<op>_shared_gpu.csv``, the device named, as every row). Skipped without a GPU.

The baselines. NCCL refuses ranks that share a GPU, so the group is gloo's, and the unfused
rows are what such a group offers, said in each row's ``impl``:

- ``gloo+matmul`` / ``matmul+gloo``: fusedpar's ``reference`` backend: the collective through
  host copies (gloo moves CPU tensors) before / after cuBLAS. What a user of this group gets
  without symmetric memory: slow by construction (device-host copies, loopback TCP).
- ``triton all_gather+matmul`` / ``matmul+triton reduce_scatter``: fusedpar's symmetric-memory
  collective (triton) before / after cuBLAS: the unfused op on the fused op's own transport,
  so the ratio is what the fusion alone buys.
- ``symm_mem.fused_all_gather_matmul`` / ``symm_mem.fused_matmul_reduce_scatter``: torch's
  async-TP ops on the same group (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``); where this
  torch refuses them, no row, and a warning says why.

What the rows mean. The ranks' kernels time-slice the GPU (no MPS): a kernel spinning on a
flag another rank raises holds the GPU until its slice ends, and W GEMMs share one GPU's
SMs. So a row prices the group path under time slicing (that it runs, and how the paths
compare there), not what W GPUs over NVLink do: no target (benchmarks/targets.py), and ops
of their own (``*_shared_gpu``), apart from the loopback and torchrun rows and out of the
tuning defaults. Each case is one task of the ranks on a fresh group (``CASES``: the fused
op first; its row is written as soon as it returns, so a stage cut midway keeps the rows
before): checked once against an fp64 oracle, as the torchrun suites check theirs; then each
call starts after a barrier and is timed on the host until this rank's GPU finished it, as
many calls as fit ``BUDGET_S`` (``MIN_CALLS`` to ``MAX_CALLS``, agreed by the ranks); each
quantile is the slowest rank's. ``tflops``, ``gbps`` and the byte counts stand for all W
ranks (the one GPU does all their work), as in loopback rows.
"""

import functools
import importlib.util
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fusedpar
from tests.ops.collective_cases import subgroup

pytestmark = [pytest.mark.gpu, pytest.mark.multirank, pytest.mark.timeout(600)]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
WORLD = 2
AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
AG8, RS8 = "all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"  # fp8, rowwise scales
SHAPES = {AG: (8192, 8192, 1280), RS: (8192, 3584, 8192)}  # M x K x N: the headline shapes
SHAPES.update({AG8: SHAPES[AG], RS8: SHAPES[RS]})
BUDGET_S, MIN_CALLS, MAX_CALLS = 1.0, 3, 20  # timed calls per case


def _benchmarks_importable() -> None:
    """benchmarks/ on sys.path: its modules import each other as top-level modules."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))


@functools.cache
def _row_writer():
    """benchmarks/conftest.py's ``_record_row``, the suites' row writer (a conftest is not
    importable by name: loaded from its file, as tests/test_bench_report.py does)."""
    _benchmarks_importable()
    spec = importlib.util.spec_from_file_location("fusedpar_bench_conftest",
                                                  BENCHMARKS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._record_row


# ---- on every rank ---------------------------------------------------------------------------


def _agree(ok: bool, group) -> bool:
    """True on every rank iff ``ok`` on every rank (gloo, a host tensor)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _device() -> torch.device:
    """cuda:0 of the shared-GPU ranks (the CPU where there is none: the harness's own checks)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _call_ms(fn, group) -> float:
    """One call of ``fn`` started with every rank's after a barrier: the host's wall time
    until this rank's GPU has finished it."""
    _sync()
    dist.barrier(group)
    start = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - start) * 1e3


def _times(fn, group) -> tuple[float, float, float]:
    """``(median, p20, p80)`` ms of ``fn`` (module docstring), the same on every rank."""
    estimate = torch.tensor([_call_ms(fn, group)], dtype=torch.float64)  # a warm-up too
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX, group=group)
    calls = int(min(MAX_CALLS, max(MIN_CALLS, BUDGET_S * 1e3 / max(estimate.item(), 1e-3))))
    times = torch.tensor([_call_ms(fn, group) for _ in range(calls)], dtype=torch.float64)
    q = torch.quantile(times, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
    dist.all_reduce(q, op=dist.ReduceOp.MAX, group=group)
    return tuple(q.tolist())


def _all_gather_matmul_cases(shape, rank, world, group, device):
    """``({label: make_case}, check)``: ``make_case() -> (fn, note)`` as ``common.run_case``
    takes it (note ``"fusedpar"``: count its bytes); ``check(result, torch_op) -> (ok, what)``
    (``torch_op``: torch's own op ran it)."""
    from bench_all_gather_matmul import SYMM_MEM, _shard, _weight
    from common import rel_err, symm_mem_op

    m, k, n = shape
    a = _shard(m // world, k, rank, device)
    b = _weight(k, n, device)
    expected = torch.cat([_shard(m // world, k, r, device) for r in range(world)], 0)
    ref64 = expected.double() @ b.double()
    bound = max(2 * rel_err(expected @ b, ref64), 1e-6)

    def unfused():
        gathered = fusedpar.ops.all_gather(a, 0, group, backend="triton")
        return gathered, [torch.matmul(gathered, b)]

    def symm_mem():
        _, op = symm_mem_op(SYMM_MEM, enable_for=group)
        return (lambda: op(a, [b], 0, group.group_name)), "torch"

    cases = {
        "gloo+matmul": lambda: (lambda: fusedpar.ops.all_gather_matmul(
            a, [b], 0, group, backend="reference"), "fusedpar"),
        "triton all_gather+matmul": lambda: (unfused, "fusedpar"),
        SYMM_MEM: symm_mem,
        "triton": lambda: (lambda: fusedpar.ops.all_gather_matmul(
            a, [b], 0, group, backend="triton"), "fusedpar"),
    }

    def check(result, torch_op=False):  # one bound for all, as the torchrun suite's
        gathered, (out,) = result
        if not torch.equal(gathered, expected):
            return False, "wrong A_gathered"
        err = rel_err(out, ref64) if out.shape == ref64.shape else float("inf")
        return err <= bound, f"error {err:.3g} > {bound:.3g}"
    return cases, check


def _matmul_reduce_scatter_cases(shape, rank, world, group, device):
    """As ``_all_gather_matmul_cases``, for matmul_reduce_scatter."""
    from bench_matmul_reduce_scatter import SYMM_MEM, _operands
    from common import rel_err, symm_mem_op

    m, k, n = shape
    a, b = _operands(m, k, n, rank, device)
    ref64 = torch.zeros(m // world, n, dtype=torch.float64, device=device)
    partials = []
    for r in range(world):
        a_r, b_r = _operands(m, k, n, r, device)
        mine = a_r.chunk(world, 0)[rank]
        ref64 += mine.double() @ b_r.double()
        partials.append(mine @ b_r)
    # torch in bf16: the partials summed, one rounding (the loopback suite's bound)
    bf16_err = rel_err(torch.stack(partials).sum(0), ref64)
    del a_r, b_r, mine, partials

    def symm_mem():
        _, op = symm_mem_op(SYMM_MEM, enable_for=group)
        return (lambda: op(a, b, "sum", 0, group.group_name)), "torch"

    cases = {
        "matmul+gloo": lambda: (lambda: fusedpar.ops.matmul_reduce_scatter(
            a, b, "sum", 0, group, backend="reference"), "fusedpar"),
        "matmul+triton reduce_scatter": lambda: (lambda: fusedpar.ops.reduce_scatter(
            torch.matmul(a, b), "sum", 0, group, backend="triton"), "fusedpar"),
        SYMM_MEM: symm_mem,
        "triton": lambda: (lambda: fusedpar.ops.matmul_reduce_scatter(
            a, b, "sum", 0, group, backend="triton"), "fusedpar"),
    }

    def check(out, torch_op=False):
        err = rel_err(out, ref64) if out.shape == ref64.shape else float("inf")
        # fusedpar's sums as good as torch's in bf16 (2x); torch's own op just bf16-accurate
        bound = max(2 * bf16_err, 1e-2 if torch_op else 1e-6)
        return err <= bound, f"error {err:.3g} > {bound:.3g}"
    return cases, check


def _row(op: str, shape, label: str) -> dict:
    """Case ``label`` of ``op`` on a fresh group of the ranks: ``{"backend", "times",
    "bytes_moved"}``, the times agreed by the ranks, or ``{"backend", "reason"}`` where it
    cannot run here (on every rank alike)."""
    _benchmarks_importable()
    from common import Unavailable, run_case

    rank, world, device = dist.get_rank(), dist.get_world_size(), _device()
    group = subgroup()  # a fresh group: its symmetric buffer starts clean
    try:
        if op in (AG8, RS8):  # bench_scaled_matmul's case, checked there against float64
            from bench_scaled_matmul import _dist_measure

            fn, moved, _ = _dist_measure(op, label, shape, "rowwise", group, device,
                                         lambda ok: _agree(ok, group))
        else:
            make = _all_gather_matmul_cases if op == AG else _matmul_reduce_scatter_cases
            cases, check = make(shape, rank, world, group, device)
            fn, note, result, moved = run_case(label, cases[label], lambda ok: _agree(ok, group))
            ok, what = check(result, torch_op=note == "torch")
            assert _agree(ok, group), f"{op} {label} on the shared GPU: {what} (rank {rank})"
            del result
    except Unavailable as e:
        return {"backend": label, "reason": str(e)}
    row = {"backend": label, "times": _times(fn, group), "bytes_moved": moved}
    _sync()
    dist.barrier(group)
    return row


# ---- the test: in the pytest process ---------------------------------------------------------

IMPL = {
    "gloo+matmul": "fusedpar reference: gloo all_gather via host copies, then cuBLAS "
                   "(NCCL refuses ranks sharing a GPU)",
    "matmul+gloo": "fusedpar reference: cuBLAS, then gloo reduce_scatter via host copies "
                   "(NCCL refuses ranks sharing a GPU)",
    "triton all_gather+matmul": "fusedpar all_gather (triton, symmetric memory), then cuBLAS",
    "matmul+triton reduce_scatter": "cuBLAS, then fusedpar reduce_scatter (triton, symmetric memory)",
    "symm_mem.fused_all_gather_matmul": "torch async-TP: copy-engine shards + cuBLAS",
    "symm_mem.fused_matmul_reduce_scatter": "torch async-TP: per-chunk cuBLAS + copy-engine P2P + reduce",
    (AG, "triton"): "fusedpar triton: copy-engine shards, the GEMM spinning on their flags",
    (RS, "triton"): "fusedpar triton: the GEMM's partials in symmetric memory, each peer's "
                    "copied on the copy engine once flagged, one summing pass",
    (AG8, "triton"): "fusedpar triton: fp8 rows and row scales on the copy engine, the fp8 GEMM "
                     "spinning on their flags, scales in its epilogue",
    (RS8, "triton"): "fusedpar triton: the fp8 GEMM's float32 partials in symmetric memory, summed "
                     "as they are flagged, rounded once",
    (AG8, "reference"): "fusedpar reference: the fp8 bytes and row scales all-gathered by gloo via host "
                        "copies, then torch._scaled_mm (NCCL refuses ranks sharing a GPU)",
    (RS8, "reference"): "fusedpar reference: torch._scaled_mm into float32, then gloo's reduce-scatter via "
                        "host copies (NCCL refuses ranks sharing a GPU)",
    "symm_mem.fused_all_gather_scaled_matmul": "torch async-TP, fp8: copy-engine shards + _scaled_mm",
    "symm_mem.fused_scaled_matmul_reduce_scatter": "torch async-TP, fp8: per-chunk _scaled_mm + P2P + reduce",
    "all_gather_matmul.bf16": "fusedpar all_gather_matmul (auto backend) on the bf16 operands",
    "matmul_reduce_scatter.bf16": "fusedpar matmul_reduce_scatter (auto backend) on the bf16 operands",
}


# each op's cases in the order they run (the fused op first: a case cut by the stage's time
# limit loses the rows after it only)
CASES = {AG: ["triton", "triton all_gather+matmul", "symm_mem.fused_all_gather_matmul",
              "gloo+matmul"],
         RS: ["triton", "matmul+triton reduce_scatter", "symm_mem.fused_matmul_reduce_scatter",
              "matmul+gloo"],
         # fp8 (bench_scaled_matmul's cases, rowwise scales): the bf16 op beside, in the same group
         AG8: ["triton", "symm_mem.fused_all_gather_scaled_matmul", "all_gather_matmul.bf16", "reference"],
         RS8: ["triton", "symm_mem.fused_scaled_matmul_reduce_scatter", "matmul_reduce_scatter.bf16",
               "reference"]}


@pytest.mark.parametrize("op", [AG, RS])
def test_gpu_shared_fused_matmul_rows(gpu_pools, op):
    shared_rows(gpu_pools, op)


def shared_rows(gpu_pools, op: str) -> None:
    """Each case of ``op`` runs on the ranks (one pool task each) and its row is written at
    once; a case torch cannot run here is left out with a warning saying why. The fp8 ops'
    rows (test_gpu_shared_fp8_rows.py) have dtype float8_e4m3fn; what crosses ranks is A's
    fp8 rows and their scales (the all-gather) or float32 partials (the reduce-scatter)."""
    shape = SHAPES[op]
    record_row = _row_writer()
    m, k, n = shape
    # the bytes of a row of the [M, ...] tensor that crosses ranks
    row_bytes = {AG: k * 2, RS: n * 2, AG8: k + 4, RS8: n * 4}[op]
    dtype = torch.float8_e4m3fn if op in (AG8, RS8) else torch.bfloat16
    missing, measured = [], []
    for label in CASES[op]:
        row = gpu_pools(WORLD).run(_row, op, shape, label, timeout=300)[0]  # times: agreed
        if "reason" in row:
            missing.append(row["reason"][:300])
            continue
        median = row["times"][0]
        moved = None if row["bytes_moved"] is None else WORLD * row["bytes_moved"]
        record_row(f"{op}_shared_gpu", row["backend"], shape, dtype, WORLD, *row["times"],
                   algo_bytes=WORLD * m * row_bytes, bytes_moved=moved,
                   lower_bound=WORLD * (WORLD - 1) * (m // WORLD) * row_bytes,
                   mode="shared_gpu", impl=IMPL.get((op, row["backend"])) or IMPL[row["backend"]],
                   ranks_per_gpu=WORLD,
                   tflops=f"{2 * m * k * n * WORLD / (median * 1e-3) / 1e12:.1f}")
        measured.append(label)
    if missing:
        warnings.warn(f"{op} shared-GPU rows not measured: " + "; ".join(missing), stacklevel=1)
    assert "triton" in measured, f"{op}: fusedpar's triton backend did not run: {missing}"
