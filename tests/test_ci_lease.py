"""``.ci/gpu all``: the staged run of a GPU lease (.ci/gpu_all.py), tested on CPU: the dry run
of the real stages, the orchestration on stand-in stages (limits, cut-offs, skips, what $OUT
holds after each stage), the headline cases existing, and the Triton compile log."""

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    """A script of .ci/ as a module (registered: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(f"ci_{name}", ROOT / ".ci" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpu_all():
    return _load("gpu_all")


def test_dry_run_walks_the_stages_within_the_lease(gpu_all):
    run = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), "all", "--dry-run"], cwd=ROOT,
                         env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    stages = [line.split(":")[0][2:] for line in run.stdout.splitlines() if line.startswith("- ")]
    assert stages == ["build", "tests", "headline", "bench"]
    limits = [float(line.split("up to ")[1].split(" s")[0])
              for line in run.stdout.splitlines() if line.startswith("- ")]
    assert sum(limits) <= 540 and all(limit > 0 for limit in limits)
    assert "setup.py" in run.stdout and "fusedpar info" in run.stdout
    assert "-k 'gpu or build'" in run.stdout and "FUSEDPAR_BENCH_PROFILE=1" in run.stdout


def test_budgets_over_the_total_fail_the_dry_run(gpu_all, capsys):
    assert gpu_all.main(["--dry-run", "--total", "100"]) == 1


def test_stages_are_cut_skipped_and_reported(gpu_all, tmp_path, monkeypatch):
    """A stage past its limit is killed with its children; the next one still runs in the
    time left; one with too little time left is skipped; $OUT holds each log, the summary and
    the packed rows as each stage ends."""
    out, work = tmp_path / "out", tmp_path / "work"
    pid = tmp_path / "child.pid"
    Stage = gpu_all.Stage
    monkeypatch.setattr(gpu_all, "STAGES", [
        Stage("first", 5, "writes a row", f"mkdir -p {work}/results && echo row > {work}/results/x.csv"),
        Stage("stuck", 1, "hangs", f"sleep 60 & echo $! > {pid}; wait"),
        Stage("after", 5, "runs in the time left, not its budget", "echo ran; sleep 60"),
        Stage("last", None, "nothing left for it", "echo never"),
    ])
    monkeypatch.setattr(gpu_all, "MIN_STAGE_S", 0.5)
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("WORK", str(work))
    start = time.monotonic()
    assert gpu_all.main(["--total", "4"]) == 0
    assert time.monotonic() - start < 20
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("first: ") and "exit 0" in summary[0]
    assert summary[1].startswith("stuck: ") and "cut at its limit of 1 s" in summary[1]
    assert summary[2].startswith("after: ") and "cut at its limit of " in summary[2]
    assert float(summary[2].split("limit of ")[1].split(" s")[0]) < 4  # the time left, not its 5 s
    assert summary[3].startswith("last: skipped")
    assert (out / "after.log").read_text() == "ran\n" and not (out / "last.log").exists()
    with pytest.raises(ProcessLookupError):  # the stuck stage's child was killed too
        os.kill(int(pid.read_text()), 0)
    with tarfile.open(out / "results.tar.gz") as tar:
        assert tar.extractfile("results/x.csv").read() == b"row\n"


def test_outcome_reads_a_verbose_pytest_log(gpu_all):
    log = "\n".join([
        "collected 5 items",
        "tests/gpu/test_a.py::test_one PASSED                [ 20%]",
        "tests/gpu/test_a.py::test_two SKIPPED (no CUDA)     [ 40%]",
        "tests/gpu/test_a.py::test_three FAILED              [ 60%]",
        "tests/gpu/test_a.py::test_four PASSED               [ 80%]",
    ])
    assert gpu_all.outcome(log) == ("2 passed, 1 skipped, 1 failed of 5 collected; "
                                    "last finished: tests/gpu/test_a.py::test_four")
    assert gpu_all.outcome("") == "no test finished of ? collected"


def test_headline_cases_exist_one_op_each(gpu_all):
    """Every headline case is a benchmark that pytest collects (no drift from the suites),
    and every op of the issue's list has one."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *[f"benchmarks/{c}" for c in gpu_all.HEADLINE]],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert collected == [f"benchmarks/{c}" for c in gpu_all.HEADLINE], run.stdout + run.stderr
    suites = {c.split("::")[0] for c in gpu_all.HEADLINE}
    assert {f"bench_{op}.py" for op in ("all_gather", "reduce_scatter", "all_gather_matmul",
                                        "matmul_reduce_scatter", "flash_attention", "ring_attention",
                                        "grouped_mm", "moe_dispatch", "moe")} == suites


def test_triton_compile_log(gpu_all, tmp_path):
    plugin = _load("triton_compiles")
    path = tmp_path / "compiles.jsonl"
    listener = plugin.record(str(path))
    times = types.SimpleNamespace(total=2_500_000)
    listener(src=None, metadata={"name": "_gemm"}, metadata_group={}, times=times, cache_hit=False)
    listener(src=None, metadata={"name": "_pull"}, metadata_group={}, times=types.SimpleNamespace(total=9),
             cache_hit=True)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"name": "_gemm", "us": 2_500_000, "cache_hit": False},
        {"name": "_pull", "us": 9, "cache_hit": True}]
    assert gpu_all.compiles(path) == "Triton: 1 compiles (2.5 s), 1 cache hits; slowest: _gemm 2.5 s"
    assert gpu_all.compiles(tmp_path / "none") == "no Triton compile recorded"


def test_profiled_timing_writes_one_profile_per_timed_function(tmp_path, monkeypatch):
    """FUSEDPAR_BENCH_PROFILE=1 (the headline stage): each function a suite times is also
    profiled once, into results/profiles/<test>[_<n>].txt. GPU calls stood in for on CPU."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_conftest", ROOT / "benchmarks" / "conftest.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    import common

    monkeypatch.setattr(conf, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(conf, "_gpu_times", lambda fn: (fn(), 0.5, 1.5)[1:] + (2.0,))
    monkeypatch.setattr(conf, "_provenance", lambda: dict(device="GPU-A", torch="t", triton="tr",
                                                          date="d", commit="c"))
    monkeypatch.setattr(common, "gpu_profile", lambda fn: (0.4, [("kernel_a", 0.3, 2)]))
    timed = conf._profiled("test_loopback[4096x8192-triton]")
    assert timed(lambda: None) == (0.5, 1.5, 2.0)
    timed(lambda: None)
    files = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert files == ["test_loopback_4096x8192-triton_.txt", "test_loopback_4096x8192-triton__1.txt"]
    assert "kernel_a" in (tmp_path / "profiles" / files[0]).read_text()
