"""``fusedpar info``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import fusedpar
from fusedpar import _extension
from tests.cli.common import ROOT, run_cli


@pytest.fixture(scope="module")
def info_json():
    # without TRITON_INTERPRET, like a user's shell (conftest sets it for this process)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "fusedpar", "info", "--json"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.timeout(180)
def test_info_json_keys_and_versions(info_json):
    assert set(info_json) >= {"fusedpar", "python", "torch", "triton", "nvcc", "gpu", "extension",
                              "backends", "symmetric_memory"}
    assert info_json["fusedpar"]["version"] == fusedpar.__version__
    assert info_json["torch"]["version"] == torch.__version__
    assert info_json["torch"]["cuda_runtime"] == torch.version.cuda
    assert info_json["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    import triton

    assert info_json["triton"]["version"] == triton.__version__
    assert info_json["triton"]["mode"] == "compiled"
    assert set(info_json["symmetric_memory"]) == {"shm", "torch", "loopback"}
    assert info_json["symmetric_memory"]["loopback"]["available"] is True


@pytest.mark.timeout(180)
def test_info_tells_the_truth_here(info_json):
    gpu = info_json["gpu"]
    assert gpu["available"] is torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert gpu["count"] == 0 and gpu["devices"] == []
        assert info_json["symmetric_memory"]["torch"]["available"] is False
    # why the torch symmetric-memory backend is unavailable: the ops' own check, verbatim
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = fusedpar.comm.torch_symm_unsupported_reason(device)
    assert info_json["symmetric_memory"]["torch"]["reasons"] == ([reason] if reason else [])
    module, reason = _extension.load()
    ext = info_json["extension"]
    assert ext["loaded"] is (module is not None)
    assert ext["load_error"] == reason
    assert ext["cuda_ops_unavailable_reason"] == _extension.cuda_ops_unavailable_reason()
    assert ext["build_info"] == _extension.build_info()
    shm_ok = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    assert info_json["symmetric_memory"]["shm"]["available"] is shm_ok


@pytest.mark.timeout(180)
def test_info_lists_every_backend_of_every_op(info_json):
    backends = info_json["backends"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert backends["device"] == device and "group=None" in backends["evaluated_as"]
    assert list(backends["ops"]) == [spec.name for spec in fusedpar.ops.registry.specs()]
    for spec in fusedpar.ops.registry.specs():
        op, entry = spec.name, backends["ops"][spec.name]["backends"]
        assert list(entry) == spec.backends
        if spec.example is None:  # needs a process group: listed, not evaluated
            assert backends["ops"][op]["call"].startswith("not evaluated here")
            assert all(st == {"available": None, "reasons": []} for st in entry.values())
            continue
        if spec.oracle is not None:  # the plain-torch oracle runs anywhere
            assert entry[spec.oracle] == {"available": True, "reasons": []}
        assert any(st["available"] for st in entry.values()), (op, entry)  # something runs
        for st in entry.values():
            assert st["available"] == (not st["reasons"])  # unavailable always says why
        if device == "cpu" and "triton" in entry:  # compiled mode on CPU: needs the interpreter
            assert not entry["triton"]["available"]
            assert "TRITON_INTERPRET=1" in entry["triton"]["reasons"][0]
        if device == "cpu" and "cuda" in entry:
            assert entry["cuda"]["reasons"] == ["the CUDA kernels need CUDA tensors"]


@pytest.mark.timeout(180)
def test_info_text_under_the_interpreter():
    res = run_cli(["info"], timeout=120, env={"TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stderr
    assert "mode: interpreter" in res.stdout
    if not torch.cuda.is_available():
        assert "GPU       none" in res.stdout
        assert re.search(r"^\s+triton\s+available$", res.stdout, re.M), res.stdout
