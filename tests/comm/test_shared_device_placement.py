"""Ranks sharing one GPU: torch symmetric memory refuses them with the reason and the fix,
unless TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 opts in (then with a notice). Placement
faked on CPU: the GPU runs of this mode are in tests/gpu/."""

import warnings

import pytest
import torch
import torch.distributed as dist

from fusedpar.comm import symmetric

ENV = symmetric.OVERLAPPING_DEVICES


def test_ranks_on_distinct_devices_need_no_opt_in(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert symmetric.shared_device_reason(["h:0", "h:1", "h:2", "h:3"], "g") == ""


def test_shared_device_refused_with_the_ranks_and_the_fix(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    reason = symmetric.shared_device_reason(["h:0", "h:1", "h:1", "h:0"], "g")
    assert reason.startswith("ranks [0, 3] share cuda:0: ")
    assert "one GPU per rank" in reason and "torch.cuda.set_device(local_rank)" in reason
    assert f"{ENV}=1" in reason
    # the verdict crosses exchange_strings (< 256 bytes) whole, even at 8 ranks on one GPU
    assert len(symmetric.shared_device_reason(["h:0"] * 8, "g" * 200).encode()) < 256


@pytest.mark.parametrize("value", ["0", ""])
def test_only_1_opts_in(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    assert symmetric.shared_device_reason(["h:0", "h:0"], "g") != ""


def test_opt_in_accepts_with_a_notice(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    with pytest.warns(UserWarning, match=r"ranks \[0, 1\] share cuda:0 in group 'g'.*correctness, not speed"):
        assert symmetric.shared_device_reason(["h:0", "h:0"], "g") == ""


def _verdict(opt_in_ranks):
    """torch symmetric memory's verdict for a 2-rank group faked onto one GPU, with the
    opt-in set on ``opt_in_ranks``: ``(verdict, warnings)``, agreed by every rank."""
    import os

    if dist.get_rank() in opt_in_ranks:
        os.environ[ENV] = "1"
    else:
        os.environ.pop(ENV, None)
    group = dist.new_group([0, 1])
    peers = symmetric._peers
    symmetric._peers = lambda g: ["host:0", "host:0"]
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            verdict = symmetric.torch_symm_unsupported_reason(torch.device("cuda"), group)
    finally:  # the pool serves other tests
        symmetric._peers = peers
        os.environ.pop(ENV, None)
    return verdict, [str(w.message) for w in seen if ENV in str(w.message)]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_group_verdict_is_agreed(pools):
    """The verdict is collective: opted in on every rank, the group is accepted (each rank
    warns); opted in on one rank only, every rank refuses it with the same reason."""
    pool = pools(2)
    both = pool.run(_verdict, [0, 1])
    one = pool.run(_verdict, [1])
    assert [v for v, _ in both] == [None, None]
    assert all(len(notes) == 1 and "share cuda:0" in notes[0] for _, notes in both)
    assert one[0][0] == one[1][0] and one[0][0].startswith("ranks [0, 1] share cuda:0")
