"""``fusedpar check``: every op on every backend, and how a failing rank is reported."""

from __future__ import annotations

import glob
import os
import re
import textwrap
import time

import pytest

from fusedpar.cli import main
from fusedpar.testing.parallel import ep_case
from tests.cli.common import run_cli

SECTIONS = ("distributed:", "tensor parallel:", "context / expert parallel:", "loopback:")
COLLECTIVES = ("all_gather dim=0", "all_gather dim=1", "reduce_scatter sum", "reduce_scatter avg")
MATMULS = ("all_gather_matmul dim=1", "all_gather_matmul dim=0", "matmul_reduce_scatter sum",
           "matmul_reduce_scatter avg")
DTYPES = ("float32", "float16", "bfloat16")
TP_OP = "tp=2 block (SP)"
CP_OP = "ring_attention cp=2 (zigzag, causal)"
EP_OP = "moe_experts ep=2 (4 experts, top-2)"


def _sections(stdout):
    """{'distributed': rows, 'tensor parallel': rows, ...} (by section title), each row a tuple
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
def test_check_two_ranks_all_correct():
    before = set(glob.glob("/dev/shm/fusedpar_*"))
    start = time.monotonic()
    res = run_cli(["check", "--world-size", "2"], timeout=150, env={"TRITON_INTERPRET": "0"})
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
    # ring_attention (every backend) on a cp group, moe_experts on an ep group: fwd + bwd
    cp_ep_rows = sections["context / expert parallel"]
    assert [r[:2] for r in cp_ep_rows] == [(CP_OP, b) for b in ("pipelined_sdpa", "triton", "pipelined",
                                                               "ulysses", "allgather_kv")] \
        + [(EP_OP, b) for b in ("pipelined", "fused", "reference")], res.stdout
    for r in cp_ep_rows:
        m = re.fullmatch(r"yes \(max err (\S+)\)", r[4])
        assert m and float(m.group(1)) <= 1e-5, r
        assert _bytes(r[5]) >= _bytes(r[6]) > 0, r
    kv_bytes = 2 * 1 * 8 * 2 * 16 * 4  # k and v parts [1, 8, 2, 16] fp32
    assert all(_bytes(r[6]) == 2 * kv_bytes for r in cp_ep_rows[:5])
    assert cp_ep_rows[2][5] == f"{3 * kv_bytes:,}"  # pipelined: K/V ring again in backward
    # moe_experts: there and back, forward and backward, fused and reference a row per routed
    # copy, pipelined a row per token and rank + k=2 fp32 ids and weights in, k gradients
    # back; the table shows the rank that moved the most, with its bound
    row = 16 * 4
    ranks = [ep_case(rank, 2, "cpu")[3] for rank in range(2)]
    moved = {"fused": [2 * (c_in + c_out) * row for (_, c_in), (_, c_out) in ranks],
             "pipelined": [2 * (r_in + r_out) * row + r_in * 16 + r_out * 8
                           for (r_in, _), (r_out, _) in ranks]}
    moved["reference"] = moved["fused"]
    for r in cp_ep_rows[5:]:
        busiest = moved[r[1]].index(max(moved[r[1]]))
        (r_in, c_in), (r_out, c_out) = ranks[busiest]
        assert (_bytes(r[5]), _bytes(r[6])) == (max(moved[r[1]]), 2 * (r_in + r_out) * row), r
    assert sum(r for (r, _), _ in ranks) < sum(c for (_, c), _ in ranks)  # a token sent once
    assert len(dist_rows) == 60 and len(tp_rows) == 3 and len(lb_rows) == 24
    assert "OK: all 95 results match the reference (84 bit for bit, 11 within atol 1e-05)" \
        in res.stdout
    assert not set(glob.glob("/dev/shm/fusedpar_*")) - before
    assert elapsed < 120, elapsed


@pytest.mark.timeout(180)
def test_check_backend_filter():
    res = run_cli(["check", "--world-size", "2", "--backends", "reference"], timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    sections = _sections(res.stdout)
    assert sections["distributed"] and {r[1] for r in sections["distributed"]} == {"reference"}
    assert {r[0] for r in sections["distributed"]} == set(COLLECTIVES + MATMULS)
    assert [r[:2] for r in sections["tensor parallel"]] == [(TP_OP, "reference")]
    # ring_attention has no reference backend; moe_experts only has one
    assert [r[:2] for r in sections["context / expert parallel"]] == [(EP_OP, "reference")]
    assert not sections["loopback"]


@pytest.mark.timeout(60)
def test_check_invalid_backend_is_a_clear_error():
    res = run_cli(["check", "--backends", "reference,nccl"], timeout=60)
    assert res.returncode == 2
    assert "unknown backend(s) 'nccl'" in res.stderr and "choose from" in res.stderr
    assert "reference" in res.stderr and "triton" in res.stderr
    assert "Traceback" not in res.stderr


def test_unknown_command_and_arguments_are_errors(capsys):
    for argv in (["frobnicate"], ["info", "--bogus"], ["check", "--bogus"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    assert "--bogus" in capsys.readouterr().err


# A sitecustomize.py on PYTHONPATH runs in the check's parent and in every spawned rank: it
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


FAST = 120


def _broken_check(tmp_path, how, timeout=300):
    """``check`` on 2 ranks, reference backends only (they break the same way, sooner). The
    default deadline is far above the ``FAST`` seconds a broken run may take, so a run that
    waited for it cannot pass for one that killed the other rank (contention on a 2-core CI
    machine has stretched a prompt run past 60 s)."""
    (tmp_path / "sitecustomize.py").write_text(_BREAK)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return run_cli(["check", "--world-size", "2", "--backends", "reference", "--timeout",
                    str(timeout)], timeout=150, env={"PYTHONPATH": path, "FUSEDPAR_TEST_BREAK": how})


@pytest.mark.timeout(180)
def test_check_a_failing_rank_exits_nonzero_with_its_traceback(tmp_path):
    before = set(glob.glob("/dev/shm/fusedpar_*"))
    start = time.monotonic()
    res = _broken_check(tmp_path, "raise")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "a rank failed" in res.stderr and "Traceback" in res.stderr
    assert "injected failure on rank 1" in res.stderr
    assert time.monotonic() - start < FAST  # rank 0 was killed, not waited for
    assert not set(glob.glob("/dev/shm/fusedpar_*")) - before


@pytest.mark.timeout(180)
def test_check_a_dying_rank_exits_nonzero(tmp_path):
    start = time.monotonic()
    res = _broken_check(tmp_path, "die")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "rank 1 exited with status 3" in res.stderr
    assert time.monotonic() - start < FAST


@pytest.mark.timeout(180)
def test_check_a_stalled_rank_is_killed_at_the_timeout(tmp_path):
    start = time.monotonic()
    res = _broken_check(tmp_path, "hang", timeout=6)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "did not finish within 6 s; killed them" in res.stderr
    assert time.monotonic() - start < 60


@pytest.mark.timeout(180)
def test_check_a_wrong_result_exits_nonzero(tmp_path):
    res = _broken_check(tmp_path, "wrong")
    assert res.returncode == 1, res.stdout + res.stderr
    sections = _sections(res.stdout)
    rows = sections["distributed"]  # compared with torch.equal, which rank 1 now fails
    assert rows and all(r[4] == "NO (ranks [1])" for r in rows), res.stdout
    assert {r[0] for r in rows} == set(COLLECTIVES + MATMULS)
    assert all(r[4].startswith("yes") for r in sections["tensor parallel"] + sections["loopback"]
               + sections["context / expert parallel"])
    assert "FAILED: 24 of 26 results differ from the reference" in res.stdout
