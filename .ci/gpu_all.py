"""``.ci/gpu all [--dry-run]``: everything a lent GPU machine should run, from a bare checkout,
in stages by priority, each under its own time limit, within one lease's call (9 minutes).

1. build the extension (where not built) and ``fusedpar info``;
2. the GPU tests (names containing "gpu", the shared-GPU-rank tests of tests/gpu/ included)
   and the extension's build checks against this torch;
3. the headline rows: one case per op at its flagship shape next to its baseline
   (``HEADLINE``), each with a profile of one call;
4. the remaining benchmark rows, while time is left.

A stage gets ``min(its budget, the time left)``; one cut at its limit is killed with its
processes and the next stage starts. After each stage ``$OUT`` holds its log, the rows and
profiles written so far (``results.tar.gz``) and ``summary.txt`` (each stage's wall time,
what it ran and skipped, the Triton compiles it made), so a run cut short still returns what
it did. The benchmark rows go to ``$WORK/results`` and are packed, since the device tool
brings back at most 8 files. ``FUSEDPAR_COMMIT=<sha>`` names the commit measured (a copied
tree has no git metadata). The summary gives each stage's Triton compiles and their time
(``triton_compiles.py``). A ``.cache/triton`` folder in the checkout (carried) seeds Triton's
cache first, and the cache hits tell whether it served the JIT. CI's ahead-of-time compiles
cannot seed it: Triton's cache key hashes ``libtriton.so``, which differs between the
Python 3.11 build of triton 3.6.0 that CI compiles with and the Python 3.12 build of the
GPU image; a seed must come from the image's own wheel, with the JIT's specializations.
``--dry-run`` runs nothing: it prints the stages, their budgets and commands.
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
PY = shlex.quote(os.environ.get("PYTHON", "python3"))

# one case per op at its flagship shape, the baseline first (benchmarks/targets.py), the
# auto row (what a user gets, judged against the baselines run before it) last
HEADLINE = [
    "bench_all_gather.py::test_loopback[4096x8192-torch.cat]",
    "bench_all_gather.py::test_loopback[4096x8192-triton]",
    "bench_all_gather.py::test_loopback[4096x8192-cuda]",
    "bench_all_gather.py::test_loopback[4096x8192-auto]",
    "bench_reduce_scatter.py::test_loopback[4096x8192-torch.stack.sum]",
    "bench_reduce_scatter.py::test_loopback[4096x8192-triton]",
    "bench_reduce_scatter.py::test_loopback[4096x8192-cuda]",
    "bench_reduce_scatter.py::test_loopback[4096x8192-auto]",
    "bench_all_gather_matmul.py::test_loopback[8192x8192x1280-torch.matmul]",
    "bench_all_gather_matmul.py::test_loopback[8192x8192x1280-triton]",
    "bench_all_gather_matmul.py::test_loopback[8192x8192x1280-auto]",
    "bench_matmul_reduce_scatter.py::test_loopback[8192x3584x8192-torch.matmul]",
    "bench_matmul_reduce_scatter.py::test_loopback[8192x3584x8192-triton]",
    "bench_matmul_reduce_scatter.py::test_loopback[8192x3584x8192-auto]",
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
PYTEST = f"{PY} -m pytest -v -rs -p no:cacheprovider -p triton_compiles"
BENCH = f"{PYTEST} --benchmark-only --timeout=150"


@dataclasses.dataclass
class Stage:
    name: str
    budget_s: float | None  # None: whatever is left
    what: str
    command: str


STAGES = [
    Stage("build", 150, "build fusedpar._C (where not built) and fusedpar info",
          f"[ -f fusedpar/_build_info.py ] || TORCH_CUDA_ARCH_LIST=${{TORCH_CUDA_ARCH_LIST:-9.0a}} "
          f"{PY} setup.py -q build_ext --inplace && {PY} -m fusedpar info"),
    # the build checks, then the shared-GPU-rank tests (the path never run on a GPU), then
    # the others; no argument holds another (pytest would merge them and lose this order)
    Stage("tests", 180, "GPU tests (shared-GPU ranks included) and build checks",
          f"{PYTEST} --timeout=90 -k 'gpu or build' tests/test_build.py tests/gpu "
          "$(ls -d tests/*/ | grep -v -e '^tests/gpu/$' -e __pycache__) tests/test_*.py"),
    Stage("headline", 150, "headline rows, one per op at its flagship shape, with profiles",
          f"FUSEDPAR_BENCH_PROFILE=1 {BENCH} {HEADLINE_IDS}"),
    Stage("bench", None, "the remaining benchmark rows",
          f"{BENCH} benchmarks " + " ".join(f"--deselect {shlex.quote('benchmarks/' + c)}"
                                             for c in HEADLINE)),
]


def outcome(log: str) -> str:
    """What a pytest stage ran, from its ``-v`` log: counts per outcome and the last test
    started (where it was cut, that is where it stopped)."""
    counts: dict[str, int] = {}
    last = None
    collected = next((line.split()[1] for line in log.splitlines()
                      if line.startswith("collected ")), None)
    for line in log.splitlines():
        for word in ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"):
            if f" {word}" in line and "::" in line:
                counts[word] = counts.get(word, 0) + 1
                last = line.split(" ")[0]
                break
    ran = ", ".join(f"{n} {word.lower()}" for word, n in counts.items()) or "no test finished"
    return f"{ran} of {collected or '?'} collected" + (f"; last finished: {last}" if last else "")


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


def run_stage(stage: Stage, limit: float, out: Path, env: dict) -> tuple[str, float]:
    """Run one stage under ``limit`` seconds, its output in ``out/<name>.log``; a stage past
    its limit is killed with every process it started. ``(status, wall seconds)``."""
    start = time.monotonic()
    with (out / f"{stage.name}.log").open("w") as log:
        proc = subprocess.Popen(["bash", "-c", stage.command], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = f"exit {proc.wait(timeout=limit)}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            status = f"cut at its limit of {limit:.0f} s"
    return status, time.monotonic() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=".ci/gpu all", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="print the stages, budgets and commands; run nothing")
    parser.add_argument("--total", type=float, default=TOTAL_S, help="seconds for all stages")
    parser.add_argument("--only", nargs="*", help="run only these stages (names)")
    args = parser.parse_args(argv)
    stages = [s for s in STAGES if not args.only or s.name in args.only]
    fixed = sum(s.budget_s or 0 for s in stages)
    print(f".ci/gpu all: {len(stages)} stages in at most {args.total:.0f} s "
          f"({fixed:.0f} s budgeted, the last takes what is left)")
    if args.dry_run:
        left = args.total
        for s in stages:
            limit = left if s.budget_s is None else min(s.budget_s, left)
            left -= limit
            print(f"- {s.name}: up to {limit:.0f} s: {s.what}\n    $ {s.command}")
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
    for s in stages:
        left = deadline - time.monotonic()
        limit = left if s.budget_s is None else min(s.budget_s, left)
        if limit < MIN_STAGE_S:
            summary.append(f"{s.name}: skipped, {max(left, 0):.0f} s left ({s.what})")
        else:
            env["FUSEDPAR_TRITON_COMPILE_LOG"] = str(work / f"{s.name}.compiles.jsonl")
            status, wall = run_stage(s, limit, out, env)
            log = (out / f"{s.name}.log").read_text(errors="replace")
            ran = outcome(log) if re.search(r"^collected \d+", log, re.M) else "see its log"
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
