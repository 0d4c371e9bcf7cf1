"""The README's training loop runs as written (torchrun, 2 CPU ranks: tp=2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _training_loop() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("\n## Training loop\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(240)
def test_readme_training_loop_runs_under_torchrun(tmp_path):
    (tmp_path / "train.py").write_text(_training_loop())
    # like a user's shell: the TP ops choose their non-interpreted backends on CPU
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "train.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=220)
    assert res.returncode == 0, res.stdout + res.stderr
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", res.stdout, re.M)]
    assert len(losses) == 10 and losses[-1] < losses[0], res.stdout
    assert (tmp_path / "checkpoint" / ".metadata").exists()
