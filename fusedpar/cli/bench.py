"""``fusedpar bench``: ``pytest benchmarks -q`` plus whatever arguments follow: the timing
cases (on a GPU) and the communication-volume checks (everywhere, CPU included; pytest's
``--benchmark-only`` would skip those: add it to run the timings alone). Needs
pytest-benchmark (``pip install 'fusedpar[bench]'``) and a fusedpar checkout (the suites live in ``benchmarks/``, beside the package)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import torch

import fusedpar

NO_GPU = ("fusedpar bench: nothing was timed: there is no CUDA GPU here, and timings of "
          "Triton's CPU interpreter mean nothing. On a GPU this times every op's fusedpar "
          "backends against the baselines (NCCL + cuBLAS, torch symm_mem, torch.matmul) in "
          "one-process loopback cases; `torchrun --nproc-per-node N -m pytest benchmarks` "
          "adds the multi-GPU cases. The communication-volume checks run here too.")


def add_parser(sub) -> None:
    sub.add_parser("bench", help="pytest benchmarks -q [extra pytest args]: timings on a GPU, "
                        "communication-volume checks everywhere",
                   add_help=False)


def _bench_dir() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(fusedpar.__file__)))
    return next((d for d in (os.path.join(root, "benchmarks"), os.path.abspath("benchmarks"))
                 if os.path.isdir(d)), None)


def run(extra: list[str]) -> int:
    missing = [name for name, module in (("pytest", "pytest"),
                                         ("pytest-benchmark", "pytest_benchmark"))
               if importlib.util.find_spec(module) is None]
    if missing:
        print(f"fusedpar bench: {' and '.join(missing)} not installed: "
              "pip install 'fusedpar[bench]'", file=sys.stderr)
        return 2
    bench_dir = _bench_dir()
    if bench_dir is None:
        print("fusedpar bench: no benchmarks/ folder: run it from a fusedpar checkout",
              file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "pytest", bench_dir, "-q", *extra]
    print("+ " + " ".join(cmd), flush=True)
    code = subprocess.call(cmd, cwd=os.path.dirname(bench_dir))
    if not torch.cuda.is_available():
        print(NO_GPU, flush=True)
    return code
