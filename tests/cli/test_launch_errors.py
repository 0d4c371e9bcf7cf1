"""What ``fusedpar train`` (and every spawning command) says when a run cannot go on: the
mistakes it can see are refused before any rank is spawned, and a failure on the ranks is
reported by its first root cause, once."""

from __future__ import annotations

import time

import pytest
import torch

from fusedpar.cli import launch, main, train


def _dcp_style_failure(group, device, spec):
    """What DCP raises on every rank when a key is missing: a BaseException whose message
    nests each rank's traceback."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        raise RuntimeError("Missing key in checkpoint state_dict: model.w13.")
    except RuntimeError as e:
        failure = (e, traceback.extract_tb(e.__traceback__))
    raise CheckpointException("load", {r: failure for r in range(2)})


@pytest.mark.timeout(180)
def test_a_base_exception_on_every_rank_is_reported_once_by_its_root_cause():
    result, error = launch.spawn(_dcp_style_failure, {}, 2, "cpu", 150, "errtest", interpret=False)
    assert result is None
    assert "killed by a signal" not in error, error  # every rank raised: its traceback is there
    cause = "RuntimeError: Missing key in checkpoint state_dict: model.w13."
    assert f"ranks [0, 1]: {cause}" in error.splitlines(), error
    assert error.count("Traceback (most recent call last)") == 2, error  # the first rank's, up to
    # its root cause (the outer one and its first nested rank's)


def test_root_cause_of_a_chain_is_its_first_exception():
    text = ("Traceback (most recent call last):\n  File \"a.py\", line 1, in f\n"
            "KeyError: 'w13'\n\nThe above exception was the direct cause of the following "
            "exception:\n\nTraceback (most recent call last):\n  File \"b.py\", line 2, in g\n"
            "ValueError: bad checkpoint\n")
    assert launch.root_cause(text)[0] == "KeyError: 'w13'"


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    """A checkpoint of the dense model at step 2, as --save writes it (one process here)."""
    from fusedpar.parallel import checkpoint

    path = tmp_path_factory.mktemp("dense") / "ck"
    tcfg = train.TrainConfig()
    checkpoint.save(path, train.build_model(tcfg, "cpu"), extra={"step": torch.tensor(2)})
    return str(path)


@pytest.mark.parametrize("argv, env, message", [
    (["--moe", "--steps", "4"], {}, "the checkpoint is not of this run's Mixtral-style MoE model "
     "(it lacks model.model.layers.0.mlp."),
    (["--steps", "2"], {}, "the checkpoint is at step 2 and --steps is 2: ask for more steps "
     "(--steps > 2)"),
    (["--steps", "4"], {"FUSEDPAR_BACKEND": "pipelind"}, "FUSEDPAR_BACKEND='pipelind' names no "
     "fusedpar backend; choose one of"),
])
def test_train_refuses_before_spawning(dense_checkpoint, capsys, monkeypatch, argv, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    start = time.monotonic()
    code = main(["train", "--resume", dense_checkpoint, "--no-compare", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "resume without --moe" in err or "--moe" not in argv
    assert time.monotonic() - start < 30  # no rank was started


def test_train_resume_from_nothing_names_the_folder(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "none"), "--no-compare"]) == 2
    assert "no checkpoint there" in capsys.readouterr().err
