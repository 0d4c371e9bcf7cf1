"""``fusedpar plan --float8 RECIPE`` (:mod:`fusedpar.plan.float8`): fp8 FSDP all-gather bytes,
the fp8 GEMM peak, fp8 weights in memory, what the output says it assumed. The plan's
all-gather bytes against a counted float8 run: tests/cli/test_bounds.py."""

import json

import pytest

from fusedpar.plan import Candidate, Device, Training, plan, speed
from fusedpar.plan.float8 import converted, fsdp_all_gather_bytes
from fusedpar.plan.model import model_spec
from tests.plan.test_plan import GPT2_XL

#: Llama-3-8B's sizes (Hugging Face config keys).
LLAMA_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
RUN = dict(seq_len=4096, global_batch=8, micro_batch=1)


def _plans(**options) -> dict:
    return {recipe: plan(LLAMA_8B, 8, **RUN, float8=recipe, **options)
            for recipe in (None, "tensorwise", "rowwise", "rowwise_with_gw_hp")}


def test_float8_halves_the_fsdp_all_gather_and_speeds_the_gemms():
    """fsdp8: the linears (82% of the weights) gathered in fp8, the embedding and head in
    bf16: ~0.53x the bytes (rowwise: plus a scale per row); fp8 GEMMs at twice the bf16
    peak (rowwise_with_gw_hp: the weight gradient's in bf16); the unsharded unit in fp8."""
    plans = _plans(activation_checkpointing=False)
    bf16 = plans[None].find("fsdp8")
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        e = plans[recipe].find("fsdp8")
        assert 0.5 < e.time.all_gather_bytes / bf16.time.all_gather_bytes < 0.55, recipe
        assert e.time.compute < bf16.time.compute and e.time.comm["fsdp"] < bf16.time.comm["fsdp"], recipe
        assert e.memory.phases["block backward"] < bf16.memory.phases["block backward"], recipe
    tw, rw, hp = (plans[r].find("fsdp8") for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    assert tw.time.all_gather_bytes < rw.time.all_gather_bytes == hp.time.all_gather_bytes  # row scales
    assert tw.time.compute == rw.time.compute < hp.time.compute
    assert "cp2" in {e.candidate.name.split(" x ")[0] for e in plans["rowwise"].estimates}  # every axis


def test_what_is_gathered_in_fp8_follows_parallelize():
    """Not under tp (the TP ops move fp8 inputs) nor with float8_all_gather=False; rowwise
    not under activation checkpointing or with rows FSDP2 pads; tensorwise always."""
    spec = model_spec(LLAMA_8B)
    assert converted(spec) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

    def gathered(recipe, cand, **options):
        return fsdp_all_gather_bytes(spec, cand, Training(**RUN, float8=recipe, **options), 2)

    fsdp, ac, tp = Candidate(dp_shard=8), Candidate(dp_shard=8, activation_checkpointing=True), Candidate(tp=2, dp_shard=4)
    bf16 = gathered(None, fsdp)
    assert gathered("rowwise", fsdp, float8_all_gather=False) == bf16
    assert gathered("rowwise", ac) == bf16 and gathered("tensorwise", ac) == gathered("tensorwise", fsdp) < bf16
    assert gathered("tensorwise", tp) == gathered(None, tp)
    assert gathered("rowwise", Candidate(dp_shard=3)) == gathered(None, Candidate(dp_shard=3))  # no rows divide 3
    for recipe in ("tensorwise", "rowwise"):  # FSDP2 shards over dp_shard x cp, in fp8 as without cp
        assert gathered(recipe, Candidate(dp_shard=4, cp=2)) == gathered(recipe, fsdp) < bf16


def test_cli_says_what_it_assumed(capsys, tmp_path):
    from fusedpar.cli import main

    args = ["plan", "--model", "llama", "--gpus", "4", "--seq", "64", "--global-batch", "8", "--ac", "off"]
    assert main([*args, "--float8", "rowwise"]) == 0
    out = capsys.readouterr().out
    assert "float8 rowwise: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj in fp8" in out
    assert "a float32 scale per row" in out and "fsdp AG" in out
    assert "fp8 GEMM peak 1482 TFLOP/s (assumed: 2x the bf16 peak" in out
    assert main([*args, "--float8", "tensorwise", "--json"]) == 0
    fits = json.loads(capsys.readouterr().out)["fits"]
    assert all(e["fsdp_all_gather_bytes"] >= 0 for e in fits) and any(e["cp"] > 1 for e in fits)
    assert main([*args, "--float8", "tensorwise", "--gpu", "A100"]) == 2
    assert "A100 has no fp8 GEMM" in capsys.readouterr().err
    (tmp_path / "gpt2.json").write_text(json.dumps(GPT2_XL))
    assert main([*args[:2], str(tmp_path / "gpt2.json"), *args[3:], "--float8", "rowwise"]) == 2  # Conv1D only
    assert "has no linear layer float8 converts" in capsys.readouterr().err
    pytest.importorskip("torchao.float8")
    assert main([*args, "--float8", "rowwise", "--dry-run", "dp_shard=4"]) == 0  # the float8 model, faked
    out = capsys.readouterr().out
    assert "dry runs (fake tensors" in out and "tracker counts" not in out
    assert main([*args, "--float8", "tensorwise", "--dry-run", "dp_shard=4"]) == 0
    assert "the dry run's tracker counts torchao's fp8 all-gather outputs" in capsys.readouterr().out


def test_fp8_peak_measured_where_the_package_data_has_one(monkeypatch, tmp_path):
    (tmp_path / "measured.json").write_text(json.dumps({
        "matmul_peaks": [{"device": "NVIDIA H200", "tflops": 700.0, "source": "a bf16 row"}],
        "float8_matmul_peaks": [{"device": "NVIDIA H200", "tflops": 1200.0, "source": "an fp8 row"}]}))
    monkeypatch.setattr(speed.resources, "files", lambda package: tmp_path)
    h200, h100 = Device.named("H200"), Device.named("H100")
    assert (h200.fp8_peak_tflops, h200.fp8_peak_source) == (1200.0, "measured: an fp8 row")
    assert h100.fp8_peak_tflops == 2 * h100.peak_tflops and h100.fp8_peak_source.startswith("assumed")
    with pytest.raises(ValueError, match="float8='bf8'"):
        Training(**RUN, float8="bf8")


def _saved_fp8_bytes_after_forward() -> tuple[int, int]:
    """Tensorwise float8 with torchao's fp8 all-gather on 2 ranks: the bytes of the fp8
    tensors autograd saved in the forward, when saved and after the forward."""
    import torch
    import torch.distributed as dist

    import fusedpar
    from tests.parallel.parallel_cases import make_model, reference_backends

    torch.set_num_threads(1)
    with reference_backends():
        model = fusedpar.parallelize(make_model("llama"), {"dp_shard": dist.get_world_size(),
                                                           "float8": "tensorwise"})
        storages, when_saved = {}, 0

        def pack(t):
            nonlocal when_saved
            data = getattr(t, "_data", t)
            if data.dtype == torch.float8_e4m3fn and data.untyped_storage().data_ptr() not in storages:
                storages[data.untyped_storage().data_ptr()] = data.untyped_storage()
                when_saved += data.untyped_storage().nbytes()
            return t

        ids = torch.arange(32).view(2, 16) % 64
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids).loss
        after = sum(s.nbytes() for s in storages.values())
        loss.backward()
    return when_saved, after


def test_fsdp_frees_the_saved_fp8_weights_after_the_forward(pools):
    """Why the planner does not hold fp8 weight copies through the backward (and the dry
    run's tracker, which does, is high): the gathered fp8 weights torchao saves are freed
    when FSDP reshards after the forward."""
    pytest.importorskip("torchao.float8")
    for when_saved, after in pools(2).run(_saved_fp8_bytes_after_forward):
        assert when_saved > 0 and after == 0, (when_saved, after)
