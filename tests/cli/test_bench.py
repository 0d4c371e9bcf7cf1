"""``fusedpar bench``."""

from __future__ import annotations

import pytest
import torch

from tests.cli.common import run_cli


@pytest.mark.timeout(120)
def test_bench_passes_arguments_to_pytest():
    res = run_cli(["bench", "--collect-only", "-p", "no:randomly"], timeout=110)
    first = res.stdout.splitlines()[0]
    assert first.startswith("+ ") and "-m pytest" in first and "--benchmark-only" in first
    assert first.endswith("--collect-only -p no:randomly")


@pytest.mark.skipif(torch.cuda.is_available(), reason="says why nothing was timed: CPU only")
@pytest.mark.timeout(120)
def test_bench_without_a_gpu_says_why_nothing_was_timed():
    res = run_cli(["bench", "-k", "loopback"], timeout=110)
    assert res.stdout.strip(), res.stderr
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("fusedpar bench: nothing was timed: there is no CUDA GPU here"), res.stdout
    assert "On a GPU this times" in last and "torchrun" in last
