"""``.ci/gpu all [--dry-run] [--only STAGE ...] [-k EXPR] [-- PYTEST_ARGS]``: everything a lent
GPU machine should run, from a bare checkout, in stages by priority, each under its own time
limit, within one lease's call (9 minutes):

1. ``build``: the extension (where not built) and ``fusedpar info``;
2. ``tests``: the GPU tests that run in the pytest process and the extension's build checks;
3. ``headline``: one case per op at its flagship shape next to its baseline (``HEADLINE``),
   each with a profile of one call;
4. ``shared``: the GPU tests on ranks spawned onto the one GPU (tests/gpu/conftest.py), slow
   (the ranks time-slice the GPU): the time left but ``bench``'s budget;
5. ``bench``: the remaining benchmark rows.

A stage gets ``min(its budget, the time left)``. ``INTERRUPT_S`` (at most a quarter of its
limit) before its limit its process group gets SIGINT (pytest stops and prints its summary),
at its limit SIGTERM (every thread's stack: .ci/lease_stage.py), then SIGKILL. Every pytest
stage loads ``lease_stage``, which prints each failure's traceback and each slow test's
seconds the moment they are known, splits the tests by whether they use a pool of spawned
ranks (``--ranks``), and bounds each test (``--max-timeout``: pytest-timeout's signal method;
a pool wait is a poll, and an interrupted one retires its pool, tests/dist_pool.py). After
each stage ``$OUT`` holds
its log, the rows and profiles written so far (``results.tar.gz``) and ``summary.txt`` (each
stage's wall time, how it ended, what it ran and where it stopped, the Triton compiles it made:
``triton_compiles.py``), so a run cut short still returns what it did: 7 files, the device
tool brings back 8. ``FUSEDPAR_COMMIT=<sha>`` names the commit measured (a copied tree has no
git metadata). A ``.cache/triton`` folder in the checkout (carried) seeds Triton's cache
first, and the cache hits tell whether it served the JIT. CI's ahead-of-time compiles cannot
seed it: Triton's cache key hashes ``libtriton.so``, which differs between the Python 3.11
build of triton 3.6.0 that CI compiles with and the Python 3.12 build of the GPU image; a
seed must come from the image's own wheel, with the JIT's specializations.

A later lease can take another slice: ``--only`` runs the build and the stages named,
``-k EXPR`` narrows every pytest stage's selection (and-ed with its own), and arguments after
``--`` go to every pytest stage (last wins: ``-- --max-timeout=300``). For example::

    .ci/gpu all --only shared -k 'shared_ranks and not ring_attention'
    .ci/gpu all --only shared bench -- --deselect tests/gpu/test_gpu_pool.py

``--dry-run`` runs nothing: it prints the stages, their limits and commands.

The GPU image has no torchao: the float8 rows and tests skip without it. Carry its wheel
(``pip download --no-deps --only-binary=:all: --python-version 3.12 ... torchao==0.18.*``
into an ignored ``.whl``, ``carry=[".whl"]``) and install it first:
``pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOTAL_S = 540  # one lease's call: 10 minutes, less the transfers and a margin
MIN_STAGE_S = 10  # a stage with less time left than this is skipped
INTERRUPT_S = 12  # SIGINT this long before a stage's limit (at most a quarter of it)
KILL_AFTER_S = 3  # SIGKILL this long after the SIGTERM at its limit
PY = shlex.quote(os.environ.get("PYTHON", "python3"))

# one case per op at its flagship shape, the baseline first (benchmarks/targets.py), the
# auto row (what a user gets, judged against the baselines run before it) last
HEADLINE = [
    "bench_all_gather.py::test_loopback[4096x8192-torch.cat]",
    "bench_all_gather.py::test_loopback[4096x8192-triton]",
    "bench_all_gather.py::test_loopback[4096x8192-triton.graph]",
    "bench_all_gather.py::test_loopback[4096x8192-cuda]",
    "bench_all_gather.py::test_loopback[4096x8192-auto]",
    "bench_reduce_scatter.py::test_loopback[4096x8192-torch.stack.sum]",
    "bench_reduce_scatter.py::test_loopback[4096x8192-triton]",
    "bench_reduce_scatter.py::test_loopback[4096x8192-triton.graph]",
    "bench_reduce_scatter.py::test_loopback[4096x8192-cuda]",
    "bench_reduce_scatter.py::test_loopback[4096x8192-auto]",
    "bench_all_gather_matmul.py::test_loopback[8192x8192x1280-torch.matmul]",
    "bench_all_gather_matmul.py::test_loopback[8192x8192x1280-triton]",
    "bench_all_gather_matmul.py::test_loopback[8192x8192x1280-triton.graph]",
    # the GEMM under late flags (its on-time run is the copy-engine row), and the tile choice
    "bench_all_gather_matmul.py::test_loopback[8192x8192x1280-triton.copy_engine]",
    "bench_all_gather_matmul.py::test_loopback[8192x8192x1280-triton.late_flags]",
    "bench_gemm_tiles.py::test_gemm_tiles[all_gather_matmul-8192x8192x1280-128x256]",
    "bench_gemm_tiles.py::test_gemm_tiles[all_gather_matmul-8192x8192x1280-128x128]",
    "bench_all_gather_matmul.py::test_loopback[8192x8192x1280-auto]",
    "bench_matmul_reduce_scatter.py::test_loopback[8192x3584x8192-torch.matmul]",
    "bench_matmul_reduce_scatter.py::test_loopback[8192x3584x8192-triton]",
    "bench_matmul_reduce_scatter.py::test_loopback[8192x3584x8192-triton.graph]",
    "bench_matmul_reduce_scatter.py::test_loopback[8192x3584x8192-auto]",
    "bench_scaled_matmul.py::test_loopback[8192x8192x1280-torch.matmul.bf16-tensorwise]",
    "bench_scaled_matmul.py::test_loopback[8192x8192x1280-torch._scaled_mm-tensorwise]",
    "bench_scaled_matmul.py::test_loopback[8192x8192x1280-triton-tensorwise]",
    "bench_scaled_matmul.py::test_loopback[8192x8192x1280-triton.rs-tensorwise]",
    "bench_grouped_mm.py::test_scaled_grouped_mm[torch._scaled_grouped_mm-skewed]",
    "bench_grouped_mm.py::test_scaled_grouped_mm[fusedpar.triton-skewed]",
    # a ~1B Llama's training step, ~6-10 s a case, bf16 and float8 (its torch.compile row: the
    # bench stage); before the ops the lease of 2026-11-27 measured
    "bench_train.py::test_step[torch]",
    "bench_train.py::test_step[auto]",
    "bench_train.py::test_step[float8.tensorwise]",
    "bench_train.py::test_step[float8.rowwise]",
    "bench_flash_attention.py::test_kernel[16384-causal-fwd-sdpa_flash]",
    "bench_flash_attention.py::test_kernel[16384-causal-fwd-triton]",
    "bench_flash_attention.py::test_kernel[16384-causal-fwd+bwd-sdpa_flash]",
    "bench_flash_attention.py::test_kernel[16384-causal-fwd+bwd-triton]",
    "bench_flash_attention.py::test_kernel[16384-causal-fwd+bwd-auto]",
    "bench_ring_attention.py::test_loopback[32768-causal-monolithic]",
    "bench_ring_attention.py::test_loopback[32768-causal-loopback]",
    "bench_grouped_mm.py::test_grouped_mm[torch._grouped_mm-skewed]",
    "bench_grouped_mm.py::test_grouped_mm[fusedpar.triton-skewed]",
    "bench_grouped_mm.py::test_grouped_mm[auto-skewed]",
    "bench_moe_dispatch.py::test_loopback[unpadded-128]",
    "bench_moe_dispatch.py::test_loopback[padded_graph-128]",
    "bench_moe.py::test_loopback[mixtral-unfused]",
    "bench_moe.py::test_loopback[mixtral-fused]",
]
HEADLINE_IDS = " ".join(shlex.quote(f"benchmarks/{case}") for case in HEADLINE)
PYTEST = f"{PY} -m pytest -v -rs --tb=short -p no:cacheprovider -p triton_compiles -p lease_stage"
BENCH = f"{PYTEST} --benchmark-only --max-timeout=45"
# every test directory, tests/gpu first (no argument may hold another: pytest would merge
# them and lose this order); the AOT compiles stay in CI (collecting test_aot.py starts them)
TEST_PATHS = ("tests/test_build.py tests/gpu $(ls -d tests/*/ | grep -v -e '^tests/gpu/$' "
              "-e __pycache__) tests/test_*.py --ignore=tests/kernels/test_aot.py")
# spawned ranks: the rows against symm_mem.fused_*, the graph replays, then the fp8 rows first (the stage is
# slow and is often cut), then tests/gpu's other files and the other directories
FIRST_SHARED = ("tests/gpu/test_gpu_shared_rows.py", "tests/gpu/test_gpu_graphs.py",
                "tests/gpu/test_gpu_ring_graphs.py", "tests/gpu/test_gpu_shared_fp8_rows.py")
SHARED_PATHS = (f"tests/test_build.py {' '.join(FIRST_SHARED)} $(ls tests/gpu/test_*.py | grep -v "
                + " ".join(f"-e {p.split('/')[-1]}" for p in FIRST_SHARED)
                + ") " + TEST_PATHS.split(" tests/gpu ", 1)[1])


@dataclasses.dataclass
class Stage:
    name: str
    budget_s: float | None  # None: the time left less the budgets of the stages after it
    what: str
    command: str  # shell; a pytest stage's ends in pytest's options and paths
    keyword: str | None = None  # a pytest stage's own -k ("": none); None: not pytest

    def shell(self, keyword: str | None = None, extra: list[str] = ()) -> str:
        """The command; a pytest stage's narrowed to ``keyword`` (a -k expression, and-ed
        with its own) and given ``extra`` arguments."""
        if self.keyword is None:
            return self.command
        given = [k for k in (self.keyword, keyword) if k]
        both = " and ".join(f"({k})" for k in given) if len(given) == 2 else "".join(given)
        return " ".join([self.command] + ([f"-k {shlex.quote(both)}"] if both else [])
                        + [shlex.quote(a) for a in extra])


STAGES = [
    Stage("build", 60, "build fusedpar._C (where not built) and fusedpar info",
          f"[ -f fusedpar/_build_info.py ] || TORCH_CUDA_ARCH_LIST=${{TORCH_CUDA_ARCH_LIST:-9.0a}} "
          f"{PY} setup.py -q build_ext --inplace && {PY} -m fusedpar info"),
    Stage("tests", 100, "GPU tests in the pytest process and the build checks",
          f"{PYTEST} --max-timeout=60 --ranks=in-process {TEST_PATHS}", "gpu or build"),
    Stage("headline", 160, "headline rows, one per op at its flagship shape, with profiles",
          f"FUSEDPAR_BENCH_PROFILE=1 {BENCH} {HEADLINE_IDS}", ""),
    Stage("shared", None, "GPU tests on ranks spawned onto the one GPU",
          f"{PYTEST} --max-timeout=90 --ranks=spawned {SHARED_PATHS}", "gpu or build"),
    Stage("bench", 60, "the remaining benchmark rows",
          f"{BENCH} benchmarks " + " ".join(f"--deselect {shlex.quote('benchmarks/' + c)}"
                                             for c in HEADLINE), ""),
]


def stage_limit(stages: list[Stage], i: int, left: float) -> float:
    """Stage ``i``'s limit with ``left`` seconds left."""
    if stages[i].budget_s is not None:
        return min(stages[i].budget_s, left)
    return max(left - sum(s.budget_s or 0 for s in stages[i + 1:]), 0)


def outcome(log: str) -> str:
    """What a pytest stage ran, from its ``-v`` log: counts per outcome of the tests selected
    and the last test finished (where it was cut, the next one is where it stopped)."""
    collected = re.search(r"collected (\d+) items?(?: / \d+ deselected)?(?: / (\d+) selected)?", log)
    if not collected:
        return "collected nothing: see its log"
    counts: dict[str, int] = {}
    last = None
    for match in re.finditer(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", log, re.MULTILINE):
        counts[match[2]] = counts.get(match[2], 0) + 1
        last = match[1]
    ran = ", ".join(f"{n} {word.lower()}" for word, n in counts.items()) or "no test finished"
    return (f"{ran} of {collected[2] or collected[1]} selected"
            + (f"; last finished: {last}" if last else ""))


def compiles(path: Path) -> str:
    """The Triton compiles a stage made (written by the triton_compiles plugin)."""
    if not path.exists():
        return "no Triton compile recorded"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    hits = sum(r["cache_hit"] for r in rows)
    seconds = sum(r["us"] for r in rows if not r["cache_hit"]) / 1e6
    slow = sorted((r for r in rows if not r["cache_hit"]), key=lambda r: -r["us"])[:3]
    top = ", ".join(f"{r['name']} {r['us'] / 1e6:.1f} s" for r in slow)
    return (f"Triton: {len(rows) - hits} compiles ({seconds:.1f} s), {hits} cache hits"
            + (f"; slowest: {top}" if top else ""))


def pack(results: Path, out: Path) -> None:
    """``out/results.tar.gz``: every row and profile written so far (replaced atomically)."""
    tmp = out / "results.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        if results.exists():
            tar.add(results, arcname="results")
    tmp.replace(out / "results.tar.gz")


def run_stage(command: str, limit: float, log: Path, env: dict) -> tuple[str, float]:
    """Run ``command`` under ``limit`` seconds, its output in ``log``. A stage past its limit
    gets SIGINT, SIGTERM, then SIGKILL (module docstring), its process group each time, and
    whatever of the group is left (spawned ranks) SIGKILL. ``(status, wall seconds)``."""
    start = time.monotonic()
    steps = [(None, limit - min(INTERRUPT_S, limit / 4)), (signal.SIGINT, limit),
             (signal.SIGTERM, limit + KILL_AFTER_S)]
    code = sent = None
    with log.open("w") as f:
        # SIGINT's default action in the stage even where this script was started ignoring it
        proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        for sig, until in steps:
            if sig is not None:
                signal_group(proc, sig)
                sent = sig
            try:
                code = proc.wait(timeout=max(until - (time.monotonic() - start), 0))
                break
            except subprocess.TimeoutExpired:
                continue
        if sent is not None:
            signal_group(proc, signal.SIGKILL)
            if code is None:
                sent, code = signal.SIGKILL, proc.wait()
    status = f"exit {code}" if sent is None else \
        f"cut at its limit of {limit:.0f} s ({sent.name} ended it)"
    return status, time.monotonic() - start


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the whole group has exited
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=".ci/gpu all", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="print the stages, limits and commands; run nothing")
    parser.add_argument("--total", type=float, default=TOTAL_S, help="seconds for all stages")
    parser.add_argument("--only", nargs="+", choices=[s.name for s in STAGES[1:]],
                        help="run the build and these stages only")
    parser.add_argument("-k", dest="keyword", help="narrow every pytest stage to the tests "
                        "matching this pytest -k expression (and-ed with the stage's own)")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for every pytest stage")
    args = parser.parse_args(argv)
    stages = [s for s in STAGES if s.name == "build" or not args.only or s.name in args.only]
    fixed = sum(s.budget_s or 0 for s in stages)
    print(f".ci/gpu all: {len(stages)} stages in at most {args.total:.0f} s "
          f"({fixed:.0f} s budgeted, the open one takes the rest)")
    if args.dry_run:
        left = args.total
        for i, s in enumerate(stages):
            limit = stage_limit(stages, i, left)
            left -= limit
            print(f"- {s.name}: up to {limit:.0f} s: {s.what}\n"
                  f"    $ {s.shell(args.keyword, args.pytest_args)}")
        return 0 if fixed <= args.total else 1

    out = Path(os.environ.get("OUT", "/tmp/fusedpar-gpu"))
    work = Path(os.environ.get("WORK", "/tmp/fusedpar-gpu-work"))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", FUSEDPAR_BENCH_RESULTS=str(work / "results"),
               TRITON_CACHE_DIR=str(work / "triton-cache"), FUSEDPAR_EXPECT_EXTENSION="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / ".ci"),
                                                        os.environ.get("PYTHONPATH")])))
    seed = ROOT / ".cache" / "triton"
    if seed.is_dir() and not (work / "triton-cache").exists():
        shutil.copytree(seed, work / "triton-cache")
    deadline = time.monotonic() + args.total
    summary: list[str] = []
    for i, s in enumerate(stages):
        left = deadline - time.monotonic()
        limit = stage_limit(stages, i, left)
        if limit < MIN_STAGE_S:
            summary.append(f"{s.name}: skipped, {max(left, 0):.0f} s left ({s.what})")
        else:
            env["FUSEDPAR_TRITON_COMPILE_LOG"] = str(work / f"{s.name}.compiles.jsonl")
            status, wall = run_stage(s.shell(args.keyword, args.pytest_args), limit,
                                     out / f"{s.name}.log", env)
            log = (out / f"{s.name}.log").read_text(errors="replace")
            ran = outcome(log) if s.keyword is not None else "see its log"
            summary.append(f"{s.name}: {wall:.0f} s, {status}; {ran}; "
                           f"{compiles(work / f'{s.name}.compiles.jsonl')}")
            print("\n".join(log.splitlines()[-15:]))
        print(summary[-1], flush=True)
        (out / "summary.txt").write_text("\n".join(summary) + "\n")
        pack(work / "results", out)
    print("\n== .ci/gpu all summary ==\n" + "\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
