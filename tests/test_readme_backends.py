"""The README says which backend each op runs under plain torchrun on CPU ranks (no
interpreter); ``fusedpar info`` in such a process (TRITON_INTERPRET unset) must agree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_claim() -> tuple[dict[str, str], str]:
    """({op: backend} the README names for plain CPU ranks, the other ops' backend)."""
    text = " ".join(ROOT.joinpath("README.md").read_text().split())
    m = re.search(r"Under plain `torchrun` on CPU ranks .*?not run: (.*?); the other ops `(\w+)`", text)
    assert m, "README: the sentence on the backends under plain torchrun on CPU is missing"
    named = {}
    for clause in m.group(1).split(";"):  # "`a`, `b` and `c` run `x`" or "`a` runs `y` (...)"
        ops, backend = re.match(r"\s*(.*?) runs? `(\w+)`", clause).groups()
        named.update({op: backend for op in re.findall(r"`(\w+)`", ops)})
    return named, m.group(2)


@pytest.mark.timeout(150)
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CPU-only claim")
def test_readme_names_the_backends_plain_cpu_ranks_run():
    named, other = readme_claim()
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSEDPAR_BACKEND")}
    out = subprocess.run([sys.executable, "-m", "fusedpar", "info"], capture_output=True,
                         text=True, timeout=140, env=env, cwd=ROOT).stdout
    runs = dict(re.findall(r"^  (\w+): .*\n    runs: (\w+)", out, flags=re.M))
    assert runs, out
    for op, backend in runs.items():  # the ops info evaluates without a process group
        assert backend == named.get(op, other), (op, backend)
    assert {"all_gather_matmul", "matmul_reduce_scatter", "ring_attention"} <= set(runs) & set(named)
