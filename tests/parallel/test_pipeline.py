"""Pipeline parallelism on 4 CPU ranks against the single-process model:
``fusedpar.parallel.forward_backward``'s loss and every gradient after one step and the loss after 3 AdamW steps (fp32: rtol 1e-5,
atol 1e-6), for each schedule and pp with every other axis, and packed rows (each document
attending alone, as the Hugging Face model's own forward does); the zero-bubble schedules'
refusal where a fusedpar op computes a weight gradient; invalid pipeline configs and packed
rows under pp x cp fail before any communication; a DCP checkpoint saved at pp=2 x
dp_shard=2 loads at dp_shard=4 and training continues with the same losses."""

import copy

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.models import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from fusedpar.parallel import checkpoint, forward_backward
from fusedpar.parallel.decoder import causal_lm_loss
from tests.parallel.parallel_cases import (LR, TINY, assert_matches, batches, clean_name, make_model,
                                           parallel_run, reference_backends, reference_run,
                                           train_curve)


def _model(kind: str, layers: int):
    """A seeded model with ``layers`` decoder layers (the HF ones untied: their first and
    last stages live on other ranks)."""
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**{**TINY, "num_layers": layers}))
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**{**TINY, "num_layers": layers}, num_experts=4,
                                                top_k=2, router_aux_loss_coef=0.1))
    model = make_model(kind)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers, config.tie_word_embeddings = layers, False
    if hasattr(config, "layer_types"):
        config.layer_types = [config.layer_types[i % 2] for i in range(layers)]
    torch.manual_seed(0)
    return type(model)(config)


def microbatched_reference(model, data, dp: int, microbatches: int):
    """The single process as the pipeline computes an MoE model: the cross-entropy over the
    whole global batch, and the aux loss as the mean over microbatches of each
    microbatch's (its rows on every data-parallel rank, routed together)."""
    coef = model.config.router_aux_loss_coef

    def loss(model, batch):
        ids, labels, _ = batch
        # microbatch m: the m-th contiguous piece of each dp rank's rows
        rows = torch.arange(ids.shape[0]).view(dp, microbatches, -1).transpose(0, 1)
        ce_sum, count, aux = 0.0, 0, 0.0
        for m in range(microbatches):
            out = model(ids[rows[m].flatten()])
            target = labels[rows[m].flatten()]
            per_row = causal_lm_loss(out.logits, target)  # mean over its valid labels
            valid = int((target[:, 1:] != -100).sum())
            ce_sum = ce_sum + (per_row * valid if valid else 0.0)
            count += valid
            aux = aux + out.aux_loss / microbatches
        return ce_sum / count + coef * aux

    return reference_run(model, data, loss)


def _check_pipelines(cases: list) -> list[set]:
    """Each ``(kind, layers, config[, packed])`` against the single process (``packed``: rows
    of documents, as ``batches`` takes it); returns, per case, the parameter names this rank
    checked (the test checks that the pp ranks cover them all)."""
    torch.set_num_threads(1)
    checked = []
    for kind, layers, config, *packed in cases:
        data = batches(packed=packed[0] if packed else False)
        model = _model(kind, layers)
        cfg = fusedpar.ParallelConfig(**config).validate(dist.get_world_size())
        if kind == "mixtral":
            micro = cfg.pp_microbatches or cfg.pp_stages
            want = microbatched_reference(model, data, cfg.dp, micro)
        else:
            want = reference_run(model, data)
        with reference_backends():
            par = fusedpar.parallelize(copy.deepcopy(model), config)
            losses, grads = parallel_run(par, data)
        assert_matches((losses, grads), (want[0], {n: want[1][n] for n in grads}), f"{kind} {config}")
        checked.append(set(grads))
    return checked


PIPELINES = [
    ("llama", 4, dict(pp=2, dp_shard=2)),  # 1F1B, two microbatches
    ("llama", 4, dict(pp=2, dp_shard=2, pp_schedule="GPipe", pp_split_points=[1])),
    ("llama", 4, dict(pp=2, tp=2)),
    ("llama", 4, dict(pp=2, cp=2)),
    ("llama", 8, dict(pp=4, pp_schedule="Interleaved1F1B", pp_microbatches=4)),
    ("mixtral", 4, dict(pp=2, dp_shard=2, ep=2)),
]


@pytest.mark.timeout(600)
def test_pipelines_match_single_process(pools):
    checked = pools(4).run(_check_pipelines, PIPELINES, timeout=550)
    for i, (kind, layers, _) in enumerate(PIPELINES):
        names = {clean_name(n) for n in _model(kind, layers).state_dict()}
        assert set().union(*(rank[i] for rank in checked)) == names, PIPELINES[i]


@pytest.mark.timeout(600)
def test_hugging_face_pipelines_match_single_process(pools):
    pytest.importorskip("transformers")
    # hf-llama: packed rows, each microbatch (one row) its own documents on every stage (dp
    # rank 0's second row one document: sdpa's causal path); hf-mistral: 16 tokens against
    # its window of 8, which the ring applies under cp
    cases = [("hf-llama", 2, dict(pp=2, dp_shard=2), ((5, 7, 4), (16,), (8, 8), (4, 12))),
             ("hf-gemma2", 2, dict(pp=2, dp_shard=2)), ("hf-mistral", 2, dict(pp=2, cp=2))]
    checked = pools(4).run(_check_pipelines, cases, timeout=550)
    for i, (kind, layers, *_) in enumerate(cases):
        names = set(_model(kind, layers).state_dict())
        assert set().union(*(rank[i] for rank in checked)) == names, cases[i]


# ---- DCP across pp degrees -------------------------------------------------------------------

SAVE_AT = 2  # steps before the checkpoint; two after it (the second reads AdamW's restored state)


def _save_pipelined(path: str) -> list[float]:
    """Trained at pp=2 x dp_shard=2, saved, then trained on: the curve after the save."""
    torch.set_num_threads(1)
    data = batches(steps=SAVE_AT + 2)
    with reference_backends():
        model = fusedpar.parallelize(_model("llama", 4), {"pp": 2, "dp_shard": 2})
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        train_curve(model, opt, data[:SAVE_AT])
        checkpoint.save(path, model, opt)
        return train_curve(model, opt, data[SAVE_AT:])


def _load_without_pp(path: str) -> list[float]:
    torch.set_num_threads(1)
    data = batches(steps=SAVE_AT + 2)
    torch.manual_seed(7)
    with reference_backends():
        model = fusedpar.parallelize(LlamaForCausalLM(LlamaConfig(**{**TINY, "num_layers": 4})),
                                     {"dp_shard": 4})
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        checkpoint.load(path, model, opt)
        return train_curve(model, opt, data[SAVE_AT:])


@pytest.mark.timeout(600)
def test_checkpoint_saved_with_pp_loads_without(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    continued = pools(4).run(_save_pipelined, path, timeout=300)
    resharded = pools(4).run(_load_without_pp, path, timeout=300)
    assert all(curve == continued[0] for curve in continued)  # every rank returns the loss
    want = reference_run(_model("llama", 4), batches(steps=SAVE_AT + 2))[0][SAVE_AT:]
    for curve in (continued[0], resharded[0]):
        torch.testing.assert_close(torch.tensor(curve), torch.stack(want), rtol=1e-5, atol=1e-6)


# ---- invalid pipeline configs: a clear error before any communication ---------------------


def _invalid_pipelines() -> dict:
    from tests.ops.collective_cases import capture_errors
    from tests.parallel.test_parallelize import _NoCommunication

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tied = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_layers": 4, "tie_embeddings": True}))
    llama2, llama4 = _model("llama", 2), _model("llama", 4)
    cases = {
        "layers": (llama2, {"pp": 4}),
        "split_points": (llama4, {"pp": 2, "dp_shard": 2, "pp_split_points": [4]}),
        "tied": (tied, {"pp": 2, "dp_shard": 2}),
        "microbatches": (llama4, {"pp": 2, "dp_shard": 2, "pp_microbatches": 1}),
        "zero_bubble_tp": (llama4, {"pp": 2, "tp": 2, "pp_schedule": "ZBVZeroBubble"}),
        "zero_bubble_moe": (_model("mixtral", 4), {"pp": 2, "dp_shard": 2, "pp_schedule": "zbv"}),
        "zero_bubble": (llama4, {"pp": 2, "dp_shard": 2, "pp_schedule": "InterleavedZeroBubble"}),
        "world": (llama4, {"pp": 2, "dp_shard": 4}),
        "hf_router_aux": (make_model("hf-qwen3-moe"), {"pp": 2, "dp_shard": 2}),
    }
    calls = {name: (lambda m=m, c=c: fusedpar.parallelize(copy.deepcopy(m), c))
             for name, (m, c) in cases.items()}
    with reference_backends():  # cp: packed rows are refused under pp x cp
        par = fusedpar.parallelize(copy.deepcopy(llama4), {"pp": 2, "cp": 2})
    ids = torch.zeros(3, 8, dtype=torch.long)
    calls["step_rows"] = lambda: forward_backward(par, ids, ids)
    calls["step_shapes"] = lambda: forward_backward(par, ids, ids[:, :4])
    calls["step_positions"] = lambda: forward_backward(par, ids[:2], ids[:2], position_ids=torch.arange(4))
    packed = (torch.arange(8) % 4).expand(2, -1)  # two documents per row
    calls["step_packed_cp"] = lambda: forward_backward(par, ids[:2], ids[:2], position_ids=packed)
    calls["step_padded"] = lambda: forward_backward(par, ids[:2], ids[:2],
                                                    attention_mask=torch.arange(8).expand(2, -1) < 6)
    calls["forward"] = lambda: par(ids)
    with _NoCommunication():
        errors = capture_errors(calls)
    dist.barrier()
    return errors


@pytest.mark.timeout(300)
def test_invalid_pipelines_fail_before_any_communication(pools):
    pytest.importorskip("transformers")
    expected = {
        "layers": "pp=4 x 1 stage(s) per rank = 4 stages, but the model has 2 decoder layers",
        "split_points": "pp_split_points=[4]: pp=2 x 1 stage(s) per rank = 2 stages need 1 increasing "
                        "layer indices between 1 and 3",
        "tied": "the head shares the embedding's weight (tied embeddings)",
        "microbatches": "pp_microbatches=1 is fewer than pp=2: 1F1B needs",
        "zero_bubble_tp": "pp_schedule=ZBVZeroBubble splits each backward into input- and "
                          "weight-gradient passes, which torch cannot do through a custom "
                          "autograd.Function (pytorch issue 166577), this config's stages run "
                          "fusedpar ops that are such functions: tp=2: fusedpar.ops.all_gather_matmul",
        "zero_bubble_moe": "fusedpar's MoEBlock: fusedpar.ops.moe.experts_dense / topk_route",
        "zero_bubble": "leave some layers' weight gradients unset",
        "world": "pp(2) * dp_replicate(1) * dp_shard(4) * cp(1) * tp(1) = 8 but world_size is 4",
        "hf_router_aux": "config.output_router_logits=True: the router aux loss spans every layer",
        "step_rows": "this data-parallel rank's batch of 3 rows does not split into pp_microbatches=2",
        "step_shapes": "labels (3, 4) and input_ids (3, 8) differ in shape",
        "step_positions": "position_ids must be a tensor of input_ids' shape (2, 8) (or broadcast "
                          "to it), got torch.Size([4])",
        "step_packed_cp": "pipeline_parallel_size > 1 with cp=2 does not take packed documents yet: "
                          "unpack the rows",
        "step_padded": "attention_mask masks some positions",
        "forward": "loss = fusedpar.parallel.forward_backward(model, input_ids, labels, ",
    }
    for errors in pools(4).run(_invalid_pipelines, timeout=250):
        for name, fragment in expected.items():
            assert errors[name] is not None, f"{name}: no error"
            kind, message = errors[name]
            assert kind in ("ParallelConfigError", "ValueError", "TypeError") and fragment in message, \
                (name, errors[name])
