"""``.ci/gpu all``: the staged run of a GPU lease (.ci/gpu_all.py), tested on CPU: the dry run
of the real stages, the orchestration on stand-in stages (limits, cut-offs in their order of
signals, skips, what $OUT holds after each stage), the headline cases existing, the pytest
plugin of its stages (.ci/lease_stage.py) on stand-in tests, the Triton compile log, and a
pool wait cut by a test's timeout."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import pytest

from tests.dist_pool import WorkerPool

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


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs a second after it was killed (a killed process
    that init has not reaped yet is a zombie)."""
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        except FileNotFoundError:
            return False
        time.sleep(0.02)
    return True


def _dry_run(*args):
    """The dry run's stages: ``[(name, limit, command)]``."""
    run = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), "all", "--dry-run", *args], cwd=ROOT,
                         env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    return [(line.split(":")[0][2:], float(line.split("up to ")[1].split(" s")[0]),
             lines[i + 1].strip()[2:]) for i, line in enumerate(lines) if line.startswith("- ")]


def test_dry_run_walks_the_stages_within_the_lease(gpu_all):
    stages = _dry_run()
    names, limits, commands = zip(*stages)
    assert names == ("build", "tests", "headline", "shared", "bench")
    assert sum(limits) <= 540 and all(limit >= 60 for limit in limits)
    assert len(names) + 2 <= 8  # a log each, summary.txt and results.tar.gz: the tool returns 8
    build, tests, headline, shared, bench = commands
    assert "setup.py" in build and "fusedpar info" in build
    for command in commands[1:]:  # every pytest stage reports as it goes and bounds each test
        assert "-p lease_stage" in command and "--max-timeout=" in command, command
    assert "--ranks=in-process" in tests and "--ranks=spawned" in shared
    assert "-k 'gpu or build'" in tests and "-k 'gpu or build'" in shared
    assert "FUSEDPAR_BENCH_PROFILE=1" in headline and "--deselect" in bench
    # the spawned-rank rows and graph replays run before the stage's other tests
    assert shared.index("tests/gpu/test_gpu_shared_rows.py") < shared.index("$(ls tests/gpu/")


def test_a_later_slice_of_the_spawned_rank_tests(gpu_all):
    """--only keeps the build; -k narrows the stage's own selection; arguments after -- go to
    pytest; the open stage with no stage after it takes every second the build leaves."""
    stages = _dry_run("--only", "shared", "-k", "shared_ranks", "--", "--max-timeout=300")
    assert [(name, limit) for name, limit, _ in stages] == [("build", 60), ("shared", 480)]
    assert stages[1][2].endswith("-k '(gpu or build) and (shared_ranks)' --max-timeout=300")
    assert "-k" not in stages[0][2]


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
        Stage("build", 5, "writes a row", f"mkdir -p {work}/results && echo row > {work}/results/x.csv"),
        Stage("stuck", 1, "hangs", f"sleep 60 & echo $! > {pid}; wait"),
        Stage("after", 5, "runs in the time left, not its budget", "trap '' INT; echo ran; sleep 60"),
        Stage("last", None, "nothing left for it", "echo never"),
    ])
    monkeypatch.setattr(gpu_all, "MIN_STAGE_S", 0.5)
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("WORK", str(work))
    start = time.monotonic()
    assert gpu_all.main(["--total", "4"]) == 0
    assert time.monotonic() - start < 20
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("build: ") and "exit 0" in summary[0]
    assert summary[1].startswith("stuck: ") and "cut at its limit of 1 s" in summary[1]
    assert summary[2].startswith("after: ") and "cut at its limit of " in summary[2]
    assert float(summary[2].split("limit of ")[1].split(" s")[0]) < 4  # the time left, not its 5 s
    assert summary[3].startswith("last: skipped")
    assert (out / "after.log").read_text() == "ran\n" and not (out / "last.log").exists()
    assert not _running(int(pid.read_text()))  # the stuck stage's child was killed too
    with tarfile.open(out / "results.tar.gz") as tar:
        assert tar.extractfile("results/x.csv").read() == b"row\n"


@pytest.mark.parametrize("traps, ended_by", [
    ("trap 'echo got INT; exit 0' INT", "SIGINT"),                   # pytest stops, prints its summary
    ("trap '' INT; trap 'echo got TERM; exit 0' TERM", "SIGTERM"),  # deaf to SIGINT
    ("trap '' INT TERM", "SIGKILL"),                                 # deaf to both
])
def test_a_cut_stage_gets_sigint_then_sigterm_then_sigkill(gpu_all, tmp_path, monkeypatch, traps,
                                                           ended_by):
    """SIGINT a quarter of the limit (at most INTERRUPT_S) before it, SIGTERM at the limit,
    SIGKILL KILL_AFTER_S later; the group's leftovers (here a background sleep) killed."""
    monkeypatch.setattr(gpu_all, "KILL_AFTER_S", 0.3)
    log, pid = tmp_path / "stage.log", tmp_path / "child.pid"
    status, wall = gpu_all.run_stage(f"{traps}; sleep 30 & echo $! > {pid}; wait", 3, log,
                                     dict(os.environ))
    assert status == f"cut at its limit of 3 s ({ended_by} ended it)"
    assert log.read_text() == {"SIGINT": "got INT\n", "SIGTERM": "got TERM\n", "SIGKILL": ""}[ended_by]
    assert 2.25 <= wall < 3 + 0.3 + 1  # the SIGINT at 2.25 s; never far past the limit
    assert not _running(int(pid.read_text()))


def test_outcome_reads_a_verbose_pytest_log(gpu_all):
    log = "\n".join([
        "collecting ... collected 9 items / 4 deselected / 5 selected",
        "tests/gpu/test_a.py::test_one PASSED                [ 20%]",
        "tests/gpu/test_a.py::test_two SKIPPED (no CUDA)     [ 40%]",
        "tests/gpu/test_a.py::test_three FAILED              [ 60%]",
        "LEASE FAILED tests/gpu/test_a.py::test_three (1.0 s)",  # the plugin's lines: not counted
        "tests/gpu/test_a.py::test_four PASSED               [ 80%]",
        "LEASE SLOW 6.0 s tests/gpu/test_a.py::test_four",
        "FAILED tests/gpu/test_a.py::test_three - AssertionError",  # nor pytest's summary
    ])
    assert gpu_all.outcome(log) == ("2 passed, 1 skipped, 1 failed of 5 selected; "
                                    "last finished: tests/gpu/test_a.py::test_four")
    assert gpu_all.outcome("collected 28 items\n") == "no test finished of 28 selected"
    assert gpu_all.outcome("ImportError while loading conftest") == "collected nothing: see its log"


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
                                        "grouped_mm", "moe_dispatch", "moe", "train", "scaled_matmul",
                                        "gemm_tiles")} == suites


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
    profiled once, device and host, into results/profiles/<test>[_<n>].txt. GPU calls stood in
    for on CPU."""
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
    monkeypatch.setattr(conf.torch.cuda, "synchronize", lambda: None)

    def host_work():  # the host side of a call: a named function the host profile must show
        return sum(range(20000))

    timed = conf._profiled("test_loopback[4096x8192-triton]")
    assert timed(host_work) == (0.5, 1.5, 2.0)
    timed(host_work)
    files = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert files == ["test_loopback_4096x8192-triton_.txt", "test_loopback_4096x8192-triton__1.txt"]
    text = (tmp_path / "profiles" / files[0]).read_text()
    assert "kernel_a" in text
    host = text.split("# host: one call's Python functions by their own time (cProfile)\n")[1]
    assert "test_ci_lease.py:" in host and "(host_work)" in host
    node = types.SimpleNamespace(fspath=ROOT / "benchmarks" / "bench_reduce_scatter.py",
                           name="test_loopback[4096x8192-triton]")
    assert conf.profile_name(node) == "reduce_scatter_test_loopback[4096x8192-triton]"


PLUGIN_TESTS = """
import time

import pytest


def test_fails():
    assert 1 + 1 == 3, "rank 1 saw 3"


@pytest.fixture
def broken():
    raise RuntimeError("setup broke")


def test_errors(broken):
    pass


def test_slow():
    time.sleep(0.3)


@pytest.mark.timeout(600)
def test_marked_for_minutes(pools):
    time.sleep(30)


def test_hangs(tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent / "hanging").touch()
    time.sleep(30)
"""


def _plugin_pytest(tmp_path, *args, **popen):
    """pytest with the lease_stage plugin on the stand-in tests (a ``pools`` fixture of their
    own stands for the spawned ranks), in its own process group, with SIGINT's default action
    (a shell's background job, as CI may run this suite, starts with SIGINT ignored, and an
    ignored signal stays ignored across exec: pytest would sleep through the cut)."""
    (tmp_path / "conftest.py").write_text("import pytest\n\n@pytest.fixture\ndef pools():\n    return 1\n")
    (tmp_path / "test_standin.py").write_text(PLUGIN_TESTS)
    env = dict(os.environ, PYTHONPATH=str(ROOT / ".ci"))
    return subprocess.Popen([sys.executable, "-m", "pytest", "-v", "--tb=short", "-p", "no:cacheprovider",
                             "-p", "lease_stage", f"--basetemp={tmp_path / 'base'}", *args,
                             "test_standin.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


def test_plugin_reports_failures_slow_tests_and_caps_timeouts(tmp_path):
    """Each failure and error with its traceback, as it happens; a line per slow test; a
    marker's 600 s timeout cut to --max-timeout; --ranks picks by the pool fixture."""
    proc = _plugin_pytest(tmp_path, "--report-slow=0.2", "--max-timeout=1", "-k", "not hangs")
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, log
    run = log.split("short test summary info")[0]  # printed before pytest's own summary
    failed = run.split("LEASE FAILED test_standin.py::test_fails (")[1].split("LEASE end of")[0]
    assert "assert 1 + 1 == 3" in failed and "AssertionError: rank 1 saw 3" in failed
    assert "LEASE ERROR at setup of test_standin.py::test_errors" in run and "setup broke" in run
    assert re.search(r"^LEASE SLOW 0\.[3-9] s test_standin.py::test_slow$", run, re.MULTILINE), run
    timed_out = run.split("LEASE FAILED test_standin.py::test_marked_for_minutes (")[1]
    assert "Timeout" in timed_out.split("LEASE end of")[0]
    assert "LEASE SLOW" not in run.split("test_slow")[0]  # the fast ones: no line

    chosen = {}
    for ranks in ("spawned", "in-process"):
        proc = _plugin_pytest(tmp_path, "--collect-only", "-qq", f"--ranks={ranks}")
        chosen[ranks] = [line.split("::")[1] for line in proc.communicate(timeout=60)[0].splitlines()
                         if "::" in line]
    assert chosen == {"spawned": ["test_marked_for_minutes"],
                      "in-process": ["test_fails", "test_errors", "test_slow", "test_hangs"]}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_plugin_says_where_a_cut_stage_stopped(tmp_path, sig):
    """SIGINT (the stage's first): the test it stopped and its frame, then pytest's summary of
    the failures so far; SIGTERM: every thread's stack, the hanging test's frame in it."""
    proc = _plugin_pytest(tmp_path, "-k", "fails or hangs")
    deadline = time.monotonic() + 60
    while not (tmp_path / "hanging").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.killpg(proc.pid, sig)
    log = proc.communicate(timeout=60)[0]
    assert "LEASE FAILED test_standin.py::test_fails" in log  # printed before the cut
    if sig == signal.SIGINT:
        stopped = log.split("LEASE INTERRUPTED in test_standin.py::test_hangs after ")[1]
        assert "in test_hangs\n    time.sleep(30)\nE   KeyboardInterrupt" in stopped, log
        assert "_pytest" not in stopped.split("short test summary info")[0], log  # the test's frames
        assert "FAILED test_standin.py::test_fails - AssertionError" in stopped, log
        assert proc.returncode == 2, log  # pytest's "interrupted"
    else:
        assert proc.returncode == -signal.SIGTERM
        assert re.search(r'File ".*test_standin.py", line \d+ in test_hangs', log), log


def _sleep(seconds):
    time.sleep(seconds)


def test_a_timeout_inside_a_pool_wait_retires_the_pool(tmp_path):
    """pytest-timeout's signal method raises inside ``WorkerPool.run``'s wait: its ranks still
    run the task (the next run would get its results), so the pool is closed at once."""
    pool = WorkerPool(1, tmp_path)

    def timeout(signum, frame):
        raise TimeoutError("the test's timeout")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            pool.run(_sleep, 30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert pool.broken and not any(p.is_alive() for p in pool.procs)
    assert time.monotonic() - start < 10  # killed, not waited for


def _raise_on_rank_1(seconds):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1's bad input")
    time.sleep(seconds)  # rank 0: as if waiting in a collective rank 1 never joins


def test_a_raising_rank_does_not_hold_the_pool_until_its_deadline(tmp_path, monkeypatch):
    """One rank raises while another would wait for it: the pool reports rank 1's error after
    ``FAILURE_GRACE_S``, not the task's timeout, and is retired."""
    from tests import dist_pool

    monkeypatch.setattr(dist_pool, "FAILURE_GRACE_S", 1)
    pool = WorkerPool(2, tmp_path)
    start = time.monotonic()
    with pytest.raises(dist_pool.PoolError, match=r"(?s)rank 1 raised.*rank 1's bad input.*ranks \[0\] did not finish"):
        pool.run(_raise_on_rank_1, 60, timeout=120)
    assert time.monotonic() - start < 20 and pool.broken
