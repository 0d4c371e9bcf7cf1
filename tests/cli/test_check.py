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

SECTIONS = ("distributed:", "tensor parallel:", "loopback:")
COLLECTIVES = ("all_gather dim=0", "all_gather dim=1", "reduce_scatter sum", "reduce_scatter avg")
MATMULS = ("all_gather_matmul dim=1", "all_gather_matmul dim=0", "matmul_reduce_scatter sum",
           "matmul_reduce_scatter avg")
DTYPES = ("float32", "float16", "bfloat16")
TP_OP = "tp=2 block (SP)"


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


def _registered_titles() -> set[str]:
    """The op name of every check case of every registered op (the report's first word)."""
    from fusedpar.cli.check import registered_cases

    return {case.title() for _, case in registered_cases(2)}


@pytest.mark.timeout(180)
def test_check_two_ranks_all_correct():
    """Every registered op (the fp8 ones too, as they land) has check cases and a correct row
    per backend that runs here, read from the registry: no op is left out of the report."""
    from fusedpar.ops import registry

    before = set(glob.glob("/dev/shm/fusedpar_*"))
    start = time.monotonic()
    res = run_cli(["check", "--world-size", "2"], timeout=150, env={"TRITON_INTERPRET": "0"})
    elapsed = time.monotonic() - start
    assert res.returncode == 0, res.stdout + res.stderr
    assert "world size 2" in res.stdout and "device cpu" in res.stdout
    sections = _sections(res.stdout)
    dist_rows, tp_rows, lb_rows = (sections[k] for k in ("distributed", "tensor parallel",
                                                         "loopback"))
    assert all(spec.checks for spec in registry.specs()), [s.name for s in registry.specs() if not s.checks]
    titles = _registered_titles()
    assert {"flash_attention", "grouped_mm", "moe_dispatch", "moe_combine", "ring_attention",
            "moe_experts"} <= titles
    assert {r[0].split(" ")[0] for r in dist_rows} == titles, res.stdout
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
    for r in dist_rows + tp_rows + lb_rows:
        assert r[4].startswith("yes"), r
        if r[6] != "0":  # an op that moves bytes: never less than the lower bound
            assert _bytes(r[5]) >= _bytes(r[6]) > 0, r
    exact = [r for r in dist_rows if r[0].split(" ")[0] in ("all_gather", "reduce_scatter",
                                                             "all_gather_matmul", "matmul_reduce_scatter")]
    assert all(r[4] == "yes" and r[7] == "1.00" for r in exact + lb_rows)  # bit for bit, at the bound
    # the local ops move nothing; the attention and expert rows are forward + backward
    assert all(r[5] == r[6] == "0" for r in dist_rows if r[0].split(" ")[0] in ("flash_attention", "grouped_mm"))
    for r in dist_rows + tp_rows:
        if "max err" in r[4]:
            assert float(re.search(r"max err (\S+)\)", r[4]).group(1)) <= 5e-5, r
    # the TP=2 block: every fused-matmul backend, within atol 1e-5 of the single process
    assert sorted(r[1] for r in tp_rows) == ["pipelined", "reference", "triton"], res.stdout
    lower_bound = 8 * 1 * 2 * 4 * 32 * 4  # (2 gathers + 2 reduce-scatters) x 2 of [2, 4, 32] fp32
    assert all(_bytes(r[5]) == _bytes(r[6]) == lower_bound for r in tp_rows), tp_rows
    # moe_experts on 2 ranks: fused and reference a row per routed copy, there and back,
    # forward and backward (the busiest rank's)
    ranks = [ep_case(rank, 2, "cpu")[3] for rank in range(2)]
    fused = max(2 * (c_in + c_out) * 16 * 4 for (_, c_in), (_, c_out) in ranks)
    assert any(r[0].startswith("moe_experts") and r[1] == "fused" and _bytes(r[5]) == fused
               for r in dist_rows), res.stdout
    assert f"OK: all {len(dist_rows) + len(tp_rows) + len(lb_rows)} results match" in res.stdout
    assert not set(glob.glob("/dev/shm/fusedpar_*")) - before
    assert elapsed < 120, elapsed


@pytest.mark.timeout(180)
def test_check_backend_filter():
    res = run_cli(["check", "--world-size", "2", "--backends", "reference"], timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    sections = _sections(res.stdout)
    assert sections["distributed"] and {r[1] for r in sections["distributed"]} == {"reference"}
    # every op with a reference backend (ring_attention has none)
    assert {r[0].split(" ")[0] for r in sections["distributed"]} == _registered_titles() - {"ring_attention"}
    assert [r[:2] for r in sections["tensor parallel"]] == [(TP_OP, "reference")]
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
    rows = sections["distributed"]
    exact = [r for r in rows if "max err" not in r[4]]  # compared with torch.equal, which rank 1 now fails
    assert exact and all(r[4] == "NO (ranks [1])" for r in exact), res.stdout
    assert {r[0].split(" ")[0] for r in rows} == _registered_titles() - {"ring_attention"}
    others = [r for r in rows if r not in exact] + sections["tensor parallel"] + sections["loopback"]
    assert all(r[4].startswith("yes") for r in others), res.stdout  # within a tolerance
    assert f"FAILED: {len(exact)} of {len(exact) + len(others)} results differ from the reference" \
        in res.stdout
