"""``fusedpar info | demo | bench`` through ``python -m fusedpar`` in subprocesses."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fusedpar
from fusedpar import _extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout, env=None, **kwargs):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "fusedpar", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=full_env, **kwargs)


# ---- info -------------------------------------------------------------------------------


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
    for op, dispatcher in fusedpar.ops.DISPATCHERS.items():
        entry = backends["ops"][op]["backends"]
        assert list(entry) == dispatcher.names
        assert entry["reference"] == {"available": True, "reasons": []}
        for st in entry.values():
            assert st["available"] is not st["reasons"]  # unavailable always says why
        if device == "cpu" and "triton" in entry:  # compiled mode on CPU: needs the interpreter
            assert not entry["triton"]["available"]
            assert "TRITON_INTERPRET=1" in entry["triton"]["reasons"][0]
        if device == "cpu" and "cuda" in entry:
            assert entry["cuda"]["reasons"] == ["the CUDA kernels need CUDA tensors"]


@pytest.mark.timeout(180)
def test_info_text_under_the_interpreter():
    res = _run(["info"], timeout=120, env={"TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stderr
    assert "mode: interpreter" in res.stdout
    if not torch.cuda.is_available():
        assert "GPU       none" in res.stdout
        assert re.search(r"^\s+triton\s+available$", res.stdout, re.M), res.stdout


# ---- demo -------------------------------------------------------------------------------

SECTIONS = ("distributed:", "tensor parallel:", "loopback:")
COLLECTIVES = ("all_gather dim=0", "all_gather dim=1", "reduce_scatter sum", "reduce_scatter avg")
MATMULS = ("all_gather_matmul dim=1", "all_gather_matmul dim=0", "matmul_reduce_scatter sum",
           "matmul_reduce_scatter avg")
DTYPES = ("float32", "float16", "bfloat16")
TP_OP = "tp=2 block (SP)"


def _sections(stdout):
    """{'distributed': rows, 'tensor parallel': rows, 'loopback': rows}, each row a tuple
    of its 8 cells (op, backend, shape, dtype, correct, bytes moved, lower bound, ratio)."""
    out, current = {}, None
    for line in stdout.splitlines():
        if line.startswith(SECTIONS):
            current = out.setdefault(line.split(":")[0], [])
            continue
        cells = tuple(c.strip() for c in line.split(" | "))
        if current is not None and len(cells) == 8 and cells[0] != "op":
            current.append(cells)
    return out


def _bytes(cell):
    return int(cell.replace(",", ""))


@pytest.mark.timeout(180)
def test_demo_two_ranks_all_correct():
    before = set(glob.glob("/dev/shm/fusedpar_*"))
    start = time.monotonic()
    res = _run(["demo", "--world-size", "2"], timeout=150, env={"TRITON_INTERPRET": "0"})
    elapsed = time.monotonic() - start
    assert res.returncode == 0, res.stdout + res.stderr
    assert "world size 2" in res.stdout and "device cpu" in res.stdout
    sections = _sections(res.stdout)
    dist_rows, tp_rows, lb_rows = (sections[k] for k in ("distributed", "tensor parallel",
                                                         "loopback"))
    for ops, backends in ((COLLECTIVES, ("reference", "triton")),
                          (MATMULS, ("triton", "pipelined", "reference"))):
        for op in ops:
            for backend in backends:
                for dtype in DTYPES:
                    assert any(r[:2] == (op, backend) and r[3] == dtype for r in dist_rows), \
                        (op, backend, dtype, res.stdout)
            for dtype in DTYPES:  # loopback: the triton kernels, every rank in one process
                assert any(r[:2] == (op, "triton") and r[3] == dtype for r in lb_rows), \
                    (op, dtype, res.stdout)
    # the 3-D gather feeds two Bs (q/k-style); the fused ops' shapes name A and every B
    assert any(r[0] == "all_gather_matmul dim=1" and r[2] == "(2, 3, 40) @ 40x24, 40x8"
               for r in dist_rows), res.stdout
    assert any(r[0] == "matmul_reduce_scatter avg" and r[2] == "(6, 40) @ 40x24"
               for r in dist_rows), res.stdout
    for r in dist_rows + lb_rows:
        assert r[4] == "yes", r  # bit for bit
        assert r[5] == r[6] and r[7] == "1.00", r  # bytes moved == the lower bound here
    # the TP=2 block: every fused-matmul backend, within atol 1e-5 of the single process
    assert sorted(r[1] for r in tp_rows) == ["pipelined", "reference", "triton"], res.stdout
    lower_bound = 8 * 1 * 2 * 4 * 32 * 4  # (2 gathers + 2 reduce-scatters) x 2 of [2, 4, 32] fp32
    for r in tp_rows:
        assert r[0] == TP_OP and r[2] == "(2, 8, 32)" and r[3] == "float32", r
        m = re.fullmatch(r"yes \(max err (\S+)\)", r[4])
        assert m and float(m.group(1)) <= 1e-5, r
        assert _bytes(r[6]) == lower_bound, r
        assert _bytes(r[5]) == lower_bound and r[7] == "1.00", r
    assert len(dist_rows) == 60 and len(tp_rows) == 3 and len(lb_rows) == 24
    assert "OK: all 87 results match the reference (84 bit for bit, 3 within atol 1e-05)" \
        in res.stdout
    assert "BLOCK_N = 32 here" in res.stdout  # the pull-mode re-read rule is explained
    assert not set(glob.glob("/dev/shm/fusedpar_*")) - before
    assert elapsed < 120, elapsed


@pytest.mark.timeout(180)
def test_demo_backend_filter():
    res = _run(["demo", "--world-size", "2", "--backends", "reference"], timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    sections = _sections(res.stdout)
    assert sections["distributed"] and {r[1] for r in sections["distributed"]} == {"reference"}
    assert {r[0] for r in sections["distributed"]} == set(COLLECTIVES + MATMULS)
    assert [r[:2] for r in sections["tensor parallel"]] == [(TP_OP, "reference")]
    assert not sections["loopback"]


@pytest.mark.timeout(60)
def test_demo_invalid_backend_is_a_clear_error():
    res = _run(["demo", "--backends", "reference,nccl"], timeout=60)
    assert res.returncode == 2
    assert "unknown backend(s) 'nccl'" in res.stderr and "choose from" in res.stderr
    assert "reference" in res.stderr and "triton" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.timeout(60)
def test_unknown_command_and_arguments_are_errors():
    assert _run(["frobnicate"], timeout=60).returncode == 2
    res = _run(["info", "--bogus"], timeout=60)
    assert res.returncode == 2 and "--bogus" in res.stderr


# A sitecustomize.py on PYTHONPATH runs in the demo's parent and in every spawned rank: it
# breaks rank 1 after the fact, the way a real bug would.
_BREAK = textwrap.dedent("""
    import os
    how = os.environ.get("FUSEDPAR_TEST_BREAK")
    if how:
        import torch
        import torch.distributed as dist

        def rank1():
            return dist.is_initialized() and dist.get_rank() == 1

        if how == "raise":
            real = dist.all_gather_object
            def all_gather_object(*args, **kwargs):
                if rank1():
                    raise RuntimeError("injected failure on rank 1")
                return real(*args, **kwargs)
            dist.all_gather_object = all_gather_object
        elif how in ("die", "hang"):
            real = dist.all_gather_object
            def all_gather_object(*args, **kwargs):
                if rank1():
                    if how == "die":
                        os._exit(3)
                    import time
                    time.sleep(3600)
                return real(*args, **kwargs)
            dist.all_gather_object = all_gather_object
        elif how == "wrong":
            real_equal = torch.equal
            torch.equal = lambda a, b: real_equal(a, b) and not rank1()
""")


def _broken_demo(tmp_path, how, timeout=100):
    (tmp_path / "sitecustomize.py").write_text(_BREAK)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return _run(["demo", "--world-size", "2", "--timeout", str(timeout)], timeout=150,
                env={"PYTHONPATH": path, "FUSEDPAR_TEST_BREAK": how})


@pytest.mark.timeout(180)
def test_demo_a_failing_rank_exits_nonzero_with_its_traceback(tmp_path):
    before = set(glob.glob("/dev/shm/fusedpar_*"))
    start = time.monotonic()
    res = _broken_demo(tmp_path, "raise")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "a rank failed" in res.stderr and "Traceback" in res.stderr
    assert "injected failure on rank 1" in res.stderr
    assert time.monotonic() - start < 60  # rank 0 was killed, not waited for
    assert not set(glob.glob("/dev/shm/fusedpar_*")) - before


@pytest.mark.timeout(180)
def test_demo_a_dying_rank_exits_nonzero(tmp_path):
    start = time.monotonic()
    res = _broken_demo(tmp_path, "die")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "rank 1 exited with status 3" in res.stderr
    assert time.monotonic() - start < 60


@pytest.mark.timeout(180)
def test_demo_a_stalled_rank_is_killed_at_the_timeout(tmp_path):
    start = time.monotonic()
    res = _broken_demo(tmp_path, "hang", timeout=15)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "did not finish within 15 s; killed them" in res.stderr
    assert time.monotonic() - start < 60


@pytest.mark.timeout(180)
def test_demo_a_wrong_result_exits_nonzero(tmp_path):
    res = _broken_demo(tmp_path, "wrong")
    assert res.returncode == 1, res.stdout + res.stderr
    sections = _sections(res.stdout)
    rows = sections["distributed"]  # compared with torch.equal, which rank 1 now fails
    assert rows and all(r[4] == "NO (ranks [1])" for r in rows), res.stdout
    assert {r[0] for r in rows} == set(COLLECTIVES + MATMULS)
    assert all(r[4].startswith("yes") for r in sections["tensor parallel"] + sections["loopback"])
    assert "FAILED: 60 of 87 results differ from the reference" in res.stdout


# ---- bench ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_bench_passes_arguments_to_pytest():
    res = _run(["bench", "--collect-only", "-p", "no:randomly"], timeout=110)
    first = res.stdout.splitlines()[0]
    assert first.startswith("+ ") and "-m pytest" in first and "--benchmark-only" in first
    assert first.endswith("--collect-only -p no:randomly")
