"""``fusedpar bench``."""

from __future__ import annotations

import pytest
import torch

from tests.cli.common import run_cli


@pytest.mark.timeout(120)
def test_bench_passes_arguments_to_pytest_and_says_why_nothing_was_timed():
    res = run_cli(["bench", "--collect-only", "-k", "loopback"], timeout=110)
    lines = res.stdout.strip().splitlines()
    assert lines, res.stderr
    # --benchmark-only would skip the communication-volume checks, which run on CPU too
    assert lines[0].startswith("+ ") and "-m pytest" in lines[0] and "--benchmark-only" not in lines[0]
    assert lines[0].endswith("--collect-only -k loopback")
    if not torch.cuda.is_available():
        assert lines[-1].startswith("fusedpar bench: nothing was timed: there is no CUDA GPU "
                                    "here"), res.stdout
        assert "On a GPU this times" in lines[-1] and "torchrun" in lines[-1]


@pytest.mark.timeout(200)
def test_bench_runs_the_communication_volume_checks():
    res = run_cli(["bench", "-k", "test_loopback_volume and bench_ring_attention"], timeout=190)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed" in res.stdout, res.stdout
