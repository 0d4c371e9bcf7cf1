"""./dev: what it prints while it sets up (the first run spends minutes installing and
building before the demo says anything). Runs a copy of the script in a scratch checkout
whose .venv/bin/python is a stub that only echoes what it is asked to do."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUB = "#!/bin/sh\necho \"python $*\"\n"


def scratch_checkout(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "dev", tmp_path / "dev")
    for name in ("setup.py", "pyproject.toml", "csrc/ops.cpp", "csrc/kernels/k.cu"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STUB)
    python.chmod(0o755)
    return tmp_path


def test_first_demo_says_what_it_sets_up_then_later_runs_are_quiet(tmp_path):
    checkout = scratch_checkout(tmp_path)
    first = subprocess.run(["./dev", "demo", "--steps", "1"], cwd=checkout, capture_output=True,
                           text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert "./dev: installing into .venv: torch==" in first.stderr
    assert "./dev: building fusedpar" in first.stderr
    assert first.stdout.strip().splitlines()[-1] == "python -m fusedpar train --steps 1"
    (checkout / "fusedpar").mkdir()
    (checkout / "fusedpar" / "_build_info.py").write_text("")  # what the real build writes
    again = subprocess.run(["./dev", "demo"], cwd=checkout, capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and again.stderr == "", again.stderr
    assert again.stdout.strip() == "python -m fusedpar train"
