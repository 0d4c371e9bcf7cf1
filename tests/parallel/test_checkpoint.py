"""DCP checkpoints of parallelized models: a round trip returns every shard bit for bit and
training continues with identical losses; a checkpoint saved at tp=2 x dp_shard=2 on 4
ranks loads at dp_shard=2 on 2 ranks and continues with the same losses; the full state
dict loads into the plain Hugging Face model and gives its loss."""

import copy
import logging
import os

import pytest
import torch

import fusedpar
from fusedpar.parallel import checkpoint
from tests.parallel.parallel_cases import (LR, TINY, batches, full, make_model, reference_backends,
                                           train_curve)

pytest.importorskip("transformers")

SAVE_AT = 2  # steps before the checkpoint; two after it (the second reads AdamW's restored state)


def _save_then_continue(path: str) -> list[float]:
    torch.set_num_threads(1)
    with reference_backends():  # DCP is what this checks; the fused backends are tested elsewhere
        return _save_then_continue_steps(path)


def _save_then_continue_steps(path: str) -> list[float]:
    data = batches(steps=SAVE_AT + 2)
    base = make_model("llama")
    model = fusedpar.parallelize(copy.deepcopy(base), {"tp": 2, "dp_shard": 2}, backend="reference")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for ids, labels, _ in data[:SAVE_AT]:
        ids, labels = fusedpar.parallel.shard_batch((ids, labels), model.fusedpar_mesh)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, model, opt)
    saved = {n: full(p).detach().clone() for n, p in model.named_parameters()}

    # round trip into a freshly initialised model of the same layout: bit for bit
    fresh = fusedpar.parallelize(make_model("llama", seed=7), {"tp": 2, "dp_shard": 2}, backend="reference")
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    checkpoint.load(path, fresh, fresh_opt)
    for n, p in fresh.named_parameters():
        assert p.placements == dict(model.named_parameters())[n].placements, n
        assert torch.equal(full(p), saved[n]), f"{n} differs after the DCP round trip"

    losses = [train_curve(m, o, data[SAVE_AT:]) for m, o in ((model, opt), (fresh, fresh_opt))]
    assert losses[0] == losses[1], losses  # identical, not just close

    # the full state dict loads into the plain Hugging Face model and gives its loss
    import transformers

    # quietly: torch's "2 sequential all_gather operations" warning on every rank is dropped
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    gathered = StateDictOptions(full_state_dict=True)
    assert _sequential_warnings(lambda: get_model_state_dict(model, options=gathered)) == 1
    state = {}
    assert _sequential_warnings(lambda: state.update(checkpoint.full_state_dict(model))) == 0
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=TINY["vocab_size"], hidden_size=TINY["hidden_size"],
        num_hidden_layers=TINY["num_layers"], num_attention_heads=TINY["num_heads"],
        num_key_value_heads=TINY["num_kv_heads"], intermediate_size=TINY["intermediate_size"],
        attn_implementation="sdpa", use_cache=False))
    hf.load_state_dict(state, strict=True)
    ids, labels, _ = data[0]
    plain = copy.deepcopy(base)
    plain.load_state_dict(state)
    torch.testing.assert_close(hf(input_ids=ids, labels=labels).loss, plain(ids, labels=labels).loss,
                               rtol=1e-5, atol=1e-6)
    return losses[0]


def _sequential_warnings(fn) -> int:
    """How many of DTensor's "N sequential ... operations" warnings ``fn()`` logs (torch
    warns once per mesh and process: its memo is emptied first)."""
    from torch.distributed.tensor import _redistribute

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(_redistribute.__name__)
    _redistribute._warned_flatten_issues.clear()
    logger.addHandler(handler)
    try:
        fn()
    finally:
        logger.removeHandler(handler)
    return sum("sequential" in m for m in seen)


def _load_resharded(path: str) -> list[float]:
    torch.set_num_threads(1)
    with reference_backends():
        return _load_resharded_steps(path)


def _load_resharded_steps(path: str) -> list[float]:
    data = batches(steps=SAVE_AT + 2)
    model = fusedpar.parallelize(make_model("llama", seed=7), {"dp_shard": 2})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    checkpoint.load(path, model, opt)
    return train_curve(model, opt, data[SAVE_AT:])


@pytest.mark.timeout(600)
def test_round_trip_resharded_load_and_hf_export(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    continued = pools(4).run(_save_then_continue, path, timeout=500)
    resharded = pools(2).run(_load_resharded, path, timeout=300)
    # another layout, the same data-parallel rank (4 ranks: rank = 2 * dp_rank + tp_rank):
    # the same numbers up to fp32 rounding
    for dp_rank, curve in enumerate(resharded):
        torch.testing.assert_close(torch.tensor(curve), torch.tensor(continued[2 * dp_rank]),
                                   rtol=1e-5, atol=1e-6)


def _expert_parallel_checkpoint(path: str, kind: str) -> bool:
    """Saved at dp_shard=4 x ep=2 (experts DTensors on the ep axis), loaded at tp=2 x
    dp_shard=2 without ep (experts whole, MoE blocks on sequence shards): the same names and
    global shapes, the same losses after; the full state dict loads into the plain model
    and gives the parallel model's loss."""
    torch.set_num_threads(1)
    with reference_backends():  # fusedpar's ops (grouped_mm) on their reference backends: fast
        return _expert_parallel_checkpoint_steps(path, kind)


def _expert_parallel_checkpoint_steps(path: str, kind: str) -> bool:
    data = batches(steps=3)  # one step, the checkpoint, two more
    base = make_model(kind)
    model = fusedpar.parallelize(copy.deepcopy(base), {"dp_shard": 4, "ep": 2})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train_curve(model, opt, data[:1])
    checkpoint.save(path, model, opt)
    state = checkpoint.full_state_dict(model)
    assert {n: s.shape for n, s in state.items()} == {n: s.shape for n, s in base.state_dict().items()}
    plain = copy.deepcopy(base)
    plain.load_state_dict(state, strict=True)
    ids, labels, _ = data[1]
    want_loss = plain(input_ids=ids, labels=labels).loss

    dense = fusedpar.parallelize(make_model(kind, seed=7), {"tp": 2, "dp_shard": 2})
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=LR)
    checkpoint.load(path, dense, dense_opt)
    continued, resharded = train_curve(model, opt, data[1:]), train_curve(dense, dense_opt, data[1:])
    torch.testing.assert_close(torch.tensor(resharded), torch.tensor(continued), rtol=1e-5, atol=1e-6)
    # every rank's loss is the global batch's
    torch.testing.assert_close(torch.tensor(continued[0]), want_loss.detach(), rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["mixtral", "hf-qwen3-moe"])  # HF: HF's expert names, aux loss
def test_expert_parallel_checkpoint_loads_without_ep(pools, tmp_path, kind):
    if kind.startswith("hf-"):
        pytest.importorskip("transformers")
    assert pools(4).run(_expert_parallel_checkpoint, str(tmp_path / "ckpt"), kind, timeout=300) == [True] * 4


# ---- crash safety (one process: DCP without a process group) ----------------------------


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_holds(path, want: dict[str, torch.Tensor]) -> None:
    probe = make_model("llama", seed=99)
    checkpoint.load(path, probe)
    for k, v in probe.state_dict().items():
        assert torch.equal(v, want[k]), f"{k} is not the saved checkpoint's"


def test_a_save_that_crashes_leaves_the_older_checkpoint(tmp_path, monkeypatch):
    """A save killed before DCP's .metadata (its last write) or between the two renames:
    the older checkpoint still loads, the partial folder is refused naming what it lacks;
    the next save replaces the older one and leaves nothing else behind."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "ck"
    old, new = make_model("llama", seed=1), make_model("llama", seed=2)
    checkpoint.save(path, old)

    def crash(*_, **__):
        raise RuntimeError("killed while writing")

    with monkeypatch.context() as m:
        m.setattr(dcp.FileSystemWriter, "finish", crash)
        with pytest.raises(BaseException, match="killed while writing"):  # DCP's CheckpointException
            checkpoint.save(path, new)
    partial = tmp_path / ".ck.partial"
    assert any(partial.iterdir()) and not (partial / ".metadata").exists()
    _assert_holds(path, _weights(old))
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="temporary folder of a save"):
        checkpoint.load(partial, make_model("llama"))

    renames = []

    def rename_once(src, dst):  # the older folder moved aside, then the crash
        if renames and os.path.isdir(src):
            raise KeyboardInterrupt("killed between the renames")
        renames.extend([dst] if os.path.isdir(src) else [])
        return os.replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(checkpoint.os, "rename", rename_once)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save(path, new)
    assert not path.exists() and renames == [str(tmp_path / ".ck.replaced")]
    _assert_holds(path, _weights(old))

    checkpoint.save(path, new)
    _assert_holds(path, _weights(new))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_load_refuses_an_incomplete_folder_naming_what_is_missing(tmp_path):
    path = tmp_path / "ck"
    checkpoint.save(path, make_model("llama"))
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(checkpoint.IncompleteCheckpointError, match=rf"lacks {shard.name} \(10 of \d+ bytes\)"):
        checkpoint.load(path, make_model("llama"))
    shard.unlink()
    with pytest.raises(checkpoint.IncompleteCheckpointError, match=rf"lacks {shard.name} \(missing\)"):
        checkpoint.load(path, make_model("llama"))
    (path / ".metadata").unlink()
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="lacks .metadata"):
        checkpoint.load(path, make_model("llama"))


def test_async_save_writes_the_state_of_the_call(tmp_path):
    """The state is copied when ``save`` returns: training may change it while the shards
    are written; ``wait()`` puts the checkpoint in place."""
    model = make_model("llama", seed=3)
    want = _weights(model)
    pending = checkpoint.save(tmp_path / "ck", model, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert pending.wait() == str(tmp_path / "ck")
    _assert_holds(tmp_path / "ck", want)


def test_keep_the_newest_complete_steps(tmp_path):
    model = make_model("llama")
    for step in (2, 4, 10):
        checkpoint.save(checkpoint.step_path(tmp_path, step), model)
    (tmp_path / "step-12").mkdir()  # a folder without .metadata is never counted
    assert [s for s, _ in checkpoint.complete_steps(tmp_path)] == [2, 4, 10]
    assert checkpoint.prune(tmp_path, 2) == [str(tmp_path / "step-2")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-12", "step-4"]


def test_a_trainer_checkpoint_whose_save_did_not_finish_is_named(tmp_path):
    """``FusedparTrainer(...).train(resume_from_checkpoint=...)`` on a checkpoint-N whose DCP
    save was cut short (only the partial folder): said so, not "not a FusedparTrainer's"."""
    hf = pytest.importorskip("fusedpar.integrations.hf")
    (tmp_path / "checkpoint-4" / f".{hf.DCP_DIR}.partial").mkdir(parents=True)
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="stopped while writing its fusedpar_dcp/"):
        hf.FusedparTrainer._load_from_checkpoint(None, str(tmp_path / "checkpoint-4"))
