"""Benchmark setup (docs/design.md §6), shared by ``benchmarks/bench_*.py``.

Without a GPU every timing case skips (no number is ever invented) and Triton kernels run
in the interpreter for the CPU-only communication-volume checks: TRITON_INTERPRET must be
set before any kernel module is imported, as in tests/conftest.py.

Modes: a single process runs the single-GPU *loopback* cases (every rank of a W-rank
collective in one process); ``torchrun --nproc-per-node N -m pytest benchmarks`` (WORLD_SIZE
> 1) runs the multi-GPU cases over NCCL, initialised here from torchrun's environment.
Helpers reach the suites as fixtures (``record_row``, ``gpu_times``, ``agree``, ...;
``matmul_roofline`` and ``report_target`` for the fused matmul ops); the plain code they
share (constants, checks, the torchrun case runner, the fused matmul rows) is in common.py.
"""

import csv
import datetime
import functools
import os
import re
import subprocess
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from report import CASE_NOTES  # noqa: E402 - benchmarks/ is on sys.path (pytest puts it there)
from targets import AUTO, AUTO_TARGET, BASELINES, auto_verdict, runs_baseline  # noqa: E402

NO_GPU = "no CUDA GPU: timings of interpreted kernels mean nothing"
RESULTS_DIR = Path(os.environ.get("FUSEDPAR_BENCH_RESULTS") or Path(__file__).parent / "results")
COLUMNS = ["op", "backend", "shape", "dtype", "world", "device", "median_ms", "p20_ms", "p80_ms",
           "gbps", "bytes_moved", "lower_bound", "torch", "triton", "cuda", "date", "commit", "notes"]


def pytest_collect_file(file_path, parent):
    """Collect ``bench_*.py`` here (the project's pytest config only names test_*.py)."""
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):  # named on the command line: pytest does it
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def world_size() -> int:
    """Ranks launched by torchrun (1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _distributed() else 0


@pytest.fixture(autouse=True)
def _fresh_settings():
    """fusedpar's environment settings read again around each case (as tests/conftest.py)."""
    from fusedpar.comm import settings

    settings.refresh()
    yield
    settings.refresh()


@pytest.fixture(scope="session")
def _nccl():
    """The NCCL world of a torchrun launch, or None; torn down at the end of the session."""
    if world_size() <= 1 or not torch.cuda.is_available():
        yield None
        return
    import torch.distributed as dist

    import fusedpar

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    yield dist.group.WORLD
    torch.cuda.synchronize(device)
    dist.barrier()
    fusedpar.comm.release_buffers()
    dist.destroy_process_group()


@pytest.fixture
def gpu():
    """The device of a single-GPU (loopback) timing case; skips without a GPU or under torchrun."""
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    if world_size() > 1:
        pytest.skip("single-GPU loopback case: run it without torchrun")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="session")
def one_rank_group():
    """A process group of this process alone on its GPU (gloo for host tensors, NCCL for
    CUDA ones), for single-GPU cases of ops that take a group: they time one rank's compute
    path with no communication. Skips without a GPU or under torchrun."""
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    if world_size() > 1:
        pytest.skip("single-GPU case: run it without torchrun")
    import torch.distributed as dist

    import fusedpar

    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    torch.cuda.synchronize()
    fusedpar.comm.release_buffers()
    dist.destroy_process_group()


@pytest.fixture
def dist_gpu(_nccl):
    """``(group, device)`` of a multi-GPU timing case; skips unless launched by torchrun on GPUs."""
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    if _nccl is None:
        pytest.skip("multi-GPU case: launch with `torchrun --nproc-per-node N -m pytest benchmarks`")
    return _nccl, torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def local_device(_nccl):
    """Where untimed checks run: this rank's GPU, else the CPU (Triton interpreter)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- timing --------------------------------------------------------------------------------


def _agree(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (keeps torchrun ranks in step)."""
    if not _distributed():
        return ok
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _gpu_times(fn, warmup_ms: float = 25, rep_ms: float = 100) -> tuple[float, float, float]:
    """(median, p20, p80) in ms of ``fn`` on the current CUDA stream.

    One process: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each call).
    Under torchrun do_bench would pick a different repeat count on each rank and hang the
    collectives, so the same method runs with counts agreed across ranks, and each quantile
    is the slowest rank's.
    """
    if not _distributed():
        import triton.testing

        return tuple(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                             quantiles=[0.5, 0.2, 0.8]))
    import torch.distributed as dist

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = torch.tensor([start.elapsed_time(end) / 5], device="cuda")
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    n_warmup = max(1, int(warmup_ms / max(estimate.item(), 1e-3)))
    n_repeat = min(1000, max(5, int(rep_ms / max(estimate.item(), 1e-3))))
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")  # 256 MB, as do_bench
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    dist.barrier()
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)], dtype=torch.float64)
    q = torch.quantile(times, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).cuda()
    dist.all_reduce(q, op=dist.ReduceOp.MAX)
    return tuple(q.tolist())


# ---- result rows ---------------------------------------------------------------------------


@functools.cache
def git_commit() -> str:
    """The commit being measured: ``FUSEDPAR_COMMIT`` (for a copy of the tree without git
    metadata, as on a lent GPU machine), else git's HEAD with ``+dirty`` where tracked files
    differ from it, else ``unknown``."""
    if os.environ.get("FUSEDPAR_COMMIT"):
        return os.environ["FUSEDPAR_COMMIT"]
    root = Path(__file__).parent.parent

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _provenance() -> dict[str, str]:
    """What a result was measured on and with: the GPU, torch, triton, CUDA, the time (UTC)
    and the commit."""
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda or "",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit()}


_CASE_TIMES: dict[tuple, dict[str, tuple[float, float, float]]] = {}  # this run's rows per case


def _auto_notes(op, case, times, notes) -> dict[str, str]:
    """The notes judging an ``auto`` row's ``times`` (its ``notes``: what it chose) against
    the fastest baseline of its case recorded in this run (``targets.auto_verdict``; n/a
    where none was), the line also reported as a target."""
    rows = _CASE_TIMES.get(case, {})
    baselines = [b for b in BASELINES.get(op, {}) if b in rows]
    label = f"{op} {' '.join(str(part) for part in case)} {AUTO}"
    if not baselines:
        _report_target(f"{label}: vs the best baseline: n/a (no baseline row in this run)")
        return {"vs_best_baseline": "n/a"}
    best = min(baselines, key=lambda b: rows[b][0])
    verdict = auto_verdict(times, rows[best], runs_baseline(op, notes, best))
    text = f"{rows[best][0] / times[0]:.3f}x {best} (target >= {AUTO_TARGET}x within noise: {verdict})"
    _report_target(f"{label}: {text}")
    return {"vs_best_baseline": text}


def _record_row(op, backend, shape, dtype, world, median_ms, p20_ms, p80_ms, *, algo_bytes,
                bytes_moved=None, lower_bound=None, **extra) -> Path | None:
    """Append one measured row to ``results/<op>.csv`` (rank 0 only; header if the file is new).

    ``algo_bytes``: bytes of the full gathered (all_gather) / full unscattered input
    (reduce_scatter) tensor times the ranks this process plays, so ``gbps`` is the
    algorithm bandwidth. ``bytes_moved``: bytes received from peers as counted by
    fusedpar.comm (same scope), blank where nothing counts them. ``extra`` goes to ``notes``.
    The times are kept per case (shape, dtype, world, the notes of ``report.CASE_NOTES``); an
    ``auto`` row (backend ``AUTO``, what a user gets) is judged against the case's baselines
    recorded before it (``_auto_notes``).
    """
    case = ("x".join(map(str, shape)), str(dtype).replace("torch.", ""), world,
            *(f"{k}={extra[k]}" for k in CASE_NOTES if k in extra))
    _CASE_TIMES.setdefault(case, {})[backend] = (median_ms, p20_ms, p80_ms)
    if backend == AUTO:
        extra = {**extra, **_auto_notes(op, case, (median_ms, p20_ms, p80_ms), extra)}
    if _rank() != 0:
        return None
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{op}.csv"
    where = _provenance()
    row = {
        "op": op, "backend": backend, "shape": "x".join(map(str, shape)),
        "dtype": str(dtype).replace("torch.", ""), "world": world,
        "device": where["device"], "median_ms": f"{median_ms:.5f}",
        "p20_ms": f"{p20_ms:.5f}", "p80_ms": f"{p80_ms:.5f}",
        "gbps": f"{algo_bytes / (median_ms * 1e-3) / 1e9:.2f}",
        "bytes_moved": "" if bytes_moved is None else int(bytes_moved),
        "lower_bound": "" if lower_bound is None else int(lower_bound),
        **{key: where[key] for key in ("torch", "triton", "cuda", "date", "commit")},
        "notes": ";".join(f"{k}={v}" for k, v in extra.items()),
    }
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != COLUMNS:  # appended rows would land under the wrong columns
            raise ValueError(f"{path} has the columns {header}, not {COLUMNS}: "
                             "move it aside or add the missing columns")
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)
    return path


def _record_profile(op, backend, shape, median_ms, busy_ms, kernels, top: int = 15,
                    host: list[str] | None = None) -> Path | None:
    """Write where one call's GPU time goes (``common.gpu_profile``: its busy ms and the
    ``(name, ms, count)`` per kernel or copy) to ``results/profiles/<op>_<backend>_<shape>.txt``
    (rank 0 only; replaced each run): the ``top`` largest, each with its share of the busy
    time, next to the row's median; then ``host`` (``host_profile``'s lines), if given."""
    if _rank() != 0:
        return None
    stem = "_".join(part for part in (op, backend, "x".join(map(str, shape))) if part)
    path = RESULTS_DIR / "profiles" / f"{stem}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    where = _provenance()
    lines = [f"# {op} {backend} {'x'.join(map(str, shape))} on {where['device']}, "
             f"torch {where['torch']}, triton {where['triton']}, {where['date']}, "
             f"commit {where['commit']}",
             f"# median {median_ms:.3f} ms, GPU busy {busy_ms:.3f} ms (one profiled call); "
             "the kernels' sum exceeds busy where streams overlap",
             f"{'ms':>9} {'calls':>6} {'% busy':>7}  name"]
    lines += [f"{ms:9.3f} {n:6d} {100 * ms / busy_ms if busy_ms else 0:7.1f}  {event[:120]}"
              for event, ms, n in kernels[:top]]
    if len(kernels) > top:
        rest = kernels[top:]
        lines.append(f"{sum(ms for _, ms, _ in rest):9.3f} {sum(n for *_, n in rest):6d} "
                     f"{'':>7}  ({len(rest)} more names)")
    if host:
        lines += ["# host: one call's Python functions by their own time (cProfile)",
                  f"{'ms':>9} {'calls':>6}  function", *host]
    path.write_text("\n".join(lines) + "\n")
    return path


def host_profile(fn, top: int = 12) -> list[str]:
    """Where one call of ``fn`` spends its host time: the ``top`` functions by their own time
    under cProfile, the device synchronized before and after (a host sync inside ``fn``
    shows as the time of the call that waits). Finds what keeps the GPU waiting where a
    row's median is far above its GPU busy time."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    fn()
    torch.cuda.synchronize()
    profile.disable()
    stats = pstats.Stats(profile).stats  # {(file, line, name): (prim calls, calls, own s, cum s, callers)}
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [f"{own * 1e3:9.3f} {calls:6d}  {Path(file).name}:{line}({name})"
            for (file, line, name), (_, calls, own, _, _) in rows]


@pytest.fixture
def record_row():
    return _record_row


@pytest.fixture
def record_profile():
    return _record_profile


def _profiled(name: str):
    """``_gpu_times`` that also profiles each function it times once (``common.gpu_profile``
    on the device, ``host_profile`` on the host)
    into ``results/profiles/<name>[_<n>].txt``."""
    from common import gpu_profile

    stem = re.sub(r"[^\w.+-]", "_", name)
    count = 0

    def timed(fn, *args, **kwargs):
        nonlocal count
        times = _gpu_times(fn, *args, **kwargs)
        busy, kernels = gpu_profile(fn)
        _record_profile(stem + (f"_{count}" if count else ""), "", (), times[0], busy, kernels,
                        host=host_profile(fn))
        count += 1
        return times
    return timed


@pytest.fixture
def gpu_times(request):
    """``_gpu_times``; with ``FUSEDPAR_BENCH_PROFILE=1`` (``.ci/gpu all``'s headline rows), in
    suites that write no profile of their own, ``_profiled`` by ``profile_name``."""
    if os.environ.get("FUSEDPAR_BENCH_PROFILE") != "1" or "record_profile" in request.fixturenames:
        return _gpu_times
    return _profiled(profile_name(request.node))


def profile_name(node) -> str:
    """``<op>_<test id>`` of a benchmark test: suites share test names (``test_loopback[...]``
    in bench_all_gather.py and bench_reduce_scatter.py), so the suite's op comes first."""
    return f"{Path(str(node.fspath)).stem.removeprefix('bench_')}_{node.name}"


@pytest.fixture
def agree():
    return _agree


# ---- fused matmul ops: the roofline and the targets ------------------------------------------

ROOFLINE_SHAPE = (8192, 8192, 8192)  # M, K, N of the plain bf16 matmul timed as the roofline
_TARGET_LINES: list[str] = []


@pytest.fixture(scope="session")
def matmul_roofline(_nccl) -> float:
    """TFLOP/s of a plain bf16 ``torch.matmul`` of ROOFLINE_SHAPE (cuBLAS) on this GPU, timed
    once per session as the suites time everything else and recorded as its own row in
    ``results/matmul_roofline.csv``: the ceiling the matmul ops' ``pct_roofline`` is taken
    against. Under torchrun every rank times it at once (the slowest rank's quantiles)."""
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    m, k, n = ROOFLINE_SHAPE
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    a = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)  # never zeros
    b = torch.randn(k, n, generator=g, device="cuda").to(torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    median, p20, p80 = _gpu_times(lambda: torch.matmul(a, b, out=c))
    assert _agree(bool(torch.isfinite(c).all())), "roofline matmul: non-finite output"
    tflops = 2 * m * k * n / (median * 1e-3) / 1e12
    _record_row("matmul_roofline", "torch.matmul", ROOFLINE_SHAPE, torch.bfloat16, world_size(),
                median, p20, p80, algo_bytes=(m * k + k * n + m * n) * 2,
                mode="torchrun" if _distributed() else "single", tflops=f"{tflops:.1f}")
    del a, b, c
    return tflops


def _report_target(line: str) -> None:
    if _rank() == 0:
        _TARGET_LINES.append(line)
        print(line)


@pytest.fixture
def report_target():
    """``report_target(line)``: print a target's outcome now (seen with ``-s``) and again in
    the terminal summary (rank 0 only); targets are recorded, never asserted."""
    return _report_target


def pytest_terminal_summary(terminalreporter):
    if _TARGET_LINES:
        terminalreporter.section("fusedpar targets (recorded in the CSV notes, not asserted)")
        for line in _TARGET_LINES:
            terminalreporter.write_line(line)


@pytest.fixture
def synced():
    """``synced(fn)``: fn followed by a device sync, for pytest-benchmark's host timer."""
    def wrap(fn):
        def call():
            fn()
            torch.cuda.synchronize()
        return call
    return wrap
