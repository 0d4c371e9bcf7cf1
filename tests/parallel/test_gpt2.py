"""Hugging Face GPT-2 (tiny ``GPT2LMHeadModel``) under ``fusedpar.parallelize`` on 4 CPU ranks,
beyond test_parallelize's HF cases (dp_shard=4, tp=2 x dp_shard=2 with and without activation
checkpointing, cp=2 x dp_shard=2, HSDP): pp=2 x dp_shard=2 matches the single process over 5
AdamW steps, and a DCP checkpoint saved at tp=2 x dp_shard=2 (the fused q/k/v kept whole, the
other Conv1D projections split) loads at dp_shard=4, cp=2 x dp_shard=2 and pp=2 x dp_shard=2,
each continuing with the saved model's losses. The model is untied: pp's first and last
stages live on other ranks (the tied head is test_parallelize's)."""

import copy

import pytest
import torch

import fusedpar
from fusedpar.parallel import checkpoint
from tests.parallel.parallel_cases import LR, batches, clean_name, reference_backends, train_curve
from tests.parallel.test_pipeline import _check_pipelines, _model

pytest.importorskip("transformers")

SAVE_AT = 2  # steps before the checkpoint


def _pipeline_and_resharded_checkpoint(path: str) -> set[str]:
    checked = _check_pipelines([("hf-gpt2", 2, dict(pp=2, dp_shard=2))])[0]
    data = batches(steps=SAVE_AT + 2)
    with reference_backends():
        saved = fusedpar.parallelize(_model("hf-gpt2", 2), {"tp": 2, "dp_shard": 2})
        opt = torch.optim.AdamW(saved.parameters(), lr=LR)
        train_curve(saved, opt, data[:SAVE_AT])
        checkpoint.save(path, saved, opt)
        want = train_curve(saved, opt, data[SAVE_AT:])
        for config in ({"dp_shard": 4}, {"cp": 2, "dp_shard": 2}, {"pp": 2, "dp_shard": 2}):
            fresh = _model("hf-gpt2", 2)
            with torch.no_grad():  # nothing of the saved model's values survives but the load
                for p in fresh.parameters():
                    p.normal_()
            model = fusedpar.parallelize(copy.deepcopy(fresh), config)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            checkpoint.load(path, model, opt)
            got = train_curve(model, opt, data[SAVE_AT:])
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, c=config: f"loaded at {c}: {m}")
    return checked


@pytest.mark.timeout(600)
def test_gpt2_pipeline_and_checkpoint_across_configs(pools, tmp_path):
    checked = pools(4).run(_pipeline_and_resharded_checkpoint, str(tmp_path / "ckpt"), timeout=500)
    names = {clean_name(n) for n in _model("hf-gpt2", 2).state_dict()}
    assert set().union(*checked) == names  # the pp ranks' gradients cover every parameter
