"""Running ``python -m fusedpar ...`` in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(args, timeout, env=None, **kwargs):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "fusedpar", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=full_env, **kwargs)
