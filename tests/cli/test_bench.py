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
    assert lines[0].startswith("+ ") and "-m pytest" in lines[0] and "--benchmark-only" in lines[0]
    assert lines[0].endswith("--collect-only -k loopback")
    if not torch.cuda.is_available():
        assert lines[-1].startswith("fusedpar bench: nothing was timed: there is no CUDA GPU "
                                    "here"), res.stdout
        assert "On a GPU this times" in lines[-1] and "torchrun" in lines[-1]
