"""fusedpar.plan's formulas and sweep on their own (no ranks): the seed case, parameter
counts against real models, what each axis must change, the CLI."""

import dataclasses
import json

import pytest
import torch

from fusedpar.models import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from fusedpar.plan import Candidate, Device, Training, estimate_memory, model_spec, parse_bytes, plan

GiB = 1 << 30
# GPT-2 XL (Hugging Face's gpt2-xl config.json keys)
GPT2_XL = {"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25, "vocab_size": 50257,
           "n_positions": 1024}


def test_seed_gpt2_xl_ddp_does_not_fit_fsdp_does():
    """GPT-2 XL (1.5B), batch 1 per GPU, two 24 GB GPUs: DDP runs out of memory, FSDP trains."""
    result = plan(GPT2_XL, 2, "24GB", seq_len=1024, global_batch=2, activation_checkpointing=False)
    ddp, fsdp = result.find("ddp2"), result.find("fsdp2")
    assert not ddp.fits and fsdp.fits
    # fp32 params + grads + two AdamW moments: 16 bytes a parameter, halved by FSDP
    n = result.model.num_parameters()
    assert ddp.memory.params + ddp.memory.optimizer == pytest.approx(12 * n, rel=1e-3)
    assert fsdp.memory.params == pytest.approx(4 * n / 2, rel=1e-3)
    assert [e.candidate.name for e in result.fits][0] in {e.candidate.name for e in result.fits}
    assert ddp in result.misfits and ddp.over_by > 0


@pytest.mark.parametrize("kind", ["llama", "mixtral", "tied"])
def test_parameter_count_matches_the_model(kind):
    if kind == "mixtral":
        cfg = MixtralConfig(vocab_size=96, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2,
                            intermediate_size=40, num_experts=4, top_k=2)
        model = MixtralForCausalLM(cfg)
    else:
        cfg = LlamaConfig(vocab_size=96, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=3,
                          intermediate_size=40, tie_embeddings=kind == "tied")
        model = LlamaForCausalLM(cfg)
    assert model_spec(cfg).num_parameters() == model.num_parameters()
    assert model_spec(model) == model_spec(cfg)


def test_hf_config_keys(tmp_path):
    """Llama / Mixtral / GPT-2 ``config.json`` keys, from a file or a dict."""
    llama = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama))
    spec = model_spec(str(path))
    assert (spec.kv_heads, spec.head_dim, spec.name) == (8, 128, "config.json")
    assert 8.0e9 < spec.num_parameters() < 8.1e9  # Llama 3 8B: 8.03B
    mixtral = {**llama, "model_type": "mixtral", "vocab_size": 32000, "num_local_experts": 8,
               "num_experts_per_tok": 2}
    moe = model_spec(mixtral)
    assert 46.6e9 < moe.num_parameters() < 46.8e9 and 12.8e9 < moe.active_parameters() < 13.0e9
    assert 1.55e9 < model_spec(GPT2_XL).num_parameters() < 1.56e9
    with pytest.raises(ValueError, match="missing num_hidden_layers"):
        model_spec({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_attention_heads": 2})


def test_each_axis_divides_what_it_shards():
    spec = model_spec({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 8,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                       "num_local_experts": 8, "num_experts_per_tok": 2})
    train = Training(seq_len=4096, global_batch=8)
    mem = lambda **kw: estimate_memory(spec, Candidate(**kw), train)  # noqa: E731
    base = mem(dp_shard=8)
    assert mem(dp_shard=4, dp_replicate=2).params == pytest.approx(2 * base.params, rel=1e-3)
    # ep splits the experts (most of the model), FSDP shards them over the rest: the same
    # bytes at rest, but a block's gather holds one rank's experts instead of all of them
    ep = mem(dp_shard=8, ep=8)
    assert ep.params == pytest.approx(base.params, rel=1e-3)
    assert ep.peak < base.peak and base.phase == "block backward"
    # CP halves the tokens per rank: activations drop; AC keeps only block inputs
    full = mem(dp_shard=1, dp_replicate=1)
    assert mem(cp=2, dp_shard=1).activations < full.activations
    assert mem(dp_shard=1, activation_checkpointing=True).activations < full.activations / 4
    # PP: the first stage holds pp micro-batches of its quarter of the layers
    pp = estimate_memory(spec, Candidate(pp=4, dp_shard=2),
                         Training(seq_len=4096, global_batch=8, micro_batch=1))
    assert pp.stage in ("first", "last") and pp.params < mem(dp_shard=2).params / 3


def test_fit_verdict_uses_the_reserve():
    spec = model_spec(GPT2_XL)
    train = Training(seq_len=1024, global_batch=2)
    device = Device.named("H100", memory=24 * GiB, gpus_per_node=2)
    m = estimate_memory(spec, Candidate(dp_shard=2), train, device)
    assert m.reserve == device.reserve(m.peak) and m.total == m.peak + m.symmetric + m.reserve
    assert m.reserve >= device.context_bytes


def test_sweep_orders_fits_by_time_and_misfits_by_shortfall():
    result = plan(MixtralConfig(), 8, "80GiB", seq_len=64, global_batch=16, micro_batch=1)
    times = [e.time.total for e in result.fits]
    assert times == sorted(times) and result.fits
    names = {e.candidate.name for e in result.estimates}
    assert {"fsdp8", "ddp8", "ep2 x fsdp8", "tp2 x fsdp4", "cp2 x fsdp4", "fsdp8 +AC"} <= names
    assert any(e.candidate.pp > 1 for e in result.estimates)
    tight = plan(MixtralConfig(), 8, "1GiB", seq_len=64, global_batch=16)  # under the context
    overs = [e.over_by for e in tight.misfits]
    assert not tight.fits and overs == sorted(overs)


def test_peak_uses_measured_benchmark_rows_or_says_datasheet():
    h100 = Device.named("H100")
    assert h100.peak_source.startswith("measured:") and "matmul_roofline" in h100.peak_source
    assert Device.named("A100").peak_source.startswith("A100 datasheet")
    with pytest.raises(ValueError, match="unknown GPU"):
        Device.named("TPU")


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes(1024) == 1024
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("lots")


def test_cli_json_and_table(capsys, tmp_path):
    from fusedpar.cli import main

    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(GPT2_XL))
    assert main(["plan", "--model", str(path), "--gpus", "2", "--gpu-mem", "24GB", "--seq", "1024",
                 "--global-batch", "2", "--ac", "off", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [e["config"] for e in out["misfits"]] == ["ddp2"] and "fsdp2" in [e["config"] for e in out["fits"]]
    assert out["misfits"][0]["over_by_bytes"] > 0
    assert main(["plan", "--model", str(path), "--gpus", "2", "--gpu-mem", "24GB", "--seq", "1024",
                 "--global-batch", "2", "--plot", str(tmp_path / "p.png")]) == 0
    captured = capsys.readouterr()
    assert "fits (" in captured.out and "does not fit (" in captured.out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "needs matplotlib" in captured.err
    else:
        assert (tmp_path / "p.png").stat().st_size > 0
    assert main(["plan", "--model", str(tmp_path / "missing.json"), "--seq", "1024",
                 "--global-batch", "2"]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_plan_on_a_module():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(), device="meta")
    assert plan(model, 4, "80GiB", seq_len=32, global_batch=8).fits


def test_train_reports_the_planned_peak_next_to_the_measured_one():
    import fusedpar
    from fusedpar.cli import train

    pcfg = fusedpar.ParallelConfig(tp=2, dp_shard=2).validate(4)
    tcfg = train.TrainConfig()
    result = {"comm": [{}], "lower_bounds": {}, "per_copy_bytes": {}, "state_bytes": {"params": 1},
              "parameters": 1, "losses": [1.0], "first_step": 0}
    want = estimate_memory(model_spec(LlamaConfig()), Candidate(tp=2, dp_shard=2),
                           Training(seq_len=tcfg.seq_len, global_batch=tcfg.batch_size,
                                    compute_dtype="float32", foreach=False, units_in_flight=1)).peak
    assert train.planned_peak(pcfg, tcfg, cuda=False) == want
    line = next(x for x in train.report(result, pcfg, tcfg) if x.startswith("peak memory"))
    assert f"planned {train._fmt_bytes(want)}" in line and "measured n/a" in line
    line = next(x for x in train.report({**result, "peak_bytes": 3 << 20}, pcfg, tcfg)
                if x.startswith("peak memory"))
    assert line.endswith("measured 3.0 MiB")


def test_cli_dry_run(capsys, tmp_path):
    """``--dry-run`` runs the picked configs under fake tensors and prints their peaks."""
    from fusedpar.cli import main

    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LlamaConfig(num_layers=1).to_dict()))
    assert main(["plan", "--model", str(path), "--gpus", "4", "--seq", "32", "--global-batch", "8",
                 "--limit", "1", "--dry-run", "tp=2,dp_shard=-1,ac"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("tp2 x fsdp2 +AC"))
    assert " MiB (formula" in line and "peak " in line
    assert main(["plan", "--model", str(path), "--gpus", "4", "--seq", "32", "--global-batch", "8",
                 "--dry-run", "tp2"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    # another family: its Hugging Face config, through the adapter parallelize uses
    (tmp_path / "gpt2.json").write_text(json.dumps({**GPT2_XL, "n_layer": 1, "n_embd": 64, "n_head": 4,
                                                    "vocab_size": 96}))
    assert main(["plan", "--model", str(tmp_path / "gpt2.json"), "--gpus", "2", "--seq", "64",
                 "--global-batch", "2", "--limit", "1", "--dry-run", "tp=2"]) == 0
    assert any(x.strip().startswith("tp2 ") and " (formula" in x for x in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "Interleaved1F1B"])
def test_train_reports_the_planned_peak_of_a_pipeline(schedule):
    """``fusedpar train --pp 2``: the plan of the run's microbatches (8 rows / dp 2 / 2
    microbatches) and schedule, for rank 0's first stage (the measured rank); a schedule
    the planner does not model says so."""
    import fusedpar
    from fusedpar.cli import train
    from fusedpar.plan.memory import stage_memories

    pcfg = fusedpar.ParallelConfig(pp=2, dp_shard=2, pp_schedule=schedule).validate(4)
    tcfg = train.TrainConfig()
    got = train.planned_peak(pcfg, tcfg, cuda=False)
    result = {"comm": [{}], "lower_bounds": {}, "per_copy_bytes": {}, "state_bytes": {"params": 1},
              "parameters": 1, "losses": [1.0], "first_step": 0}
    line = next(x for x in train.report(result, pcfg, tcfg) if x.startswith("peak memory"))
    if schedule == "Interleaved1F1B":
        assert got is None and "planned n/a (Interleaved1F1B not modelled)" in line
        return
    want = stage_memories(model_spec(LlamaConfig()), Candidate(pp=2, dp_shard=2),
                          Training(seq_len=tcfg.seq_len, global_batch=tcfg.batch_size, micro_batch=2,
                                   compute_dtype="float32", foreach=False, units_in_flight=1,
                                   pp_schedule=schedule))["first"].peak
    assert got == want and f"planned {train._fmt_bytes(want)}" in line


def test_pipeline_memory_terms():
    """pp: each stage's breakdown adds up to its peak; with more microbatches than stages
    GPipe holds more activations on the first stage than 1F1B; the first stage of 1F1B
    holds pp microbatches, the last one; an unknown schedule is refused."""
    from fusedpar.plan.memory import stage_memories

    spec = model_spec(LlamaConfig(num_layers=4))
    by = {}
    for schedule in ("1F1B", "GPipe"):
        for ac in (False, True):
            train = Training(seq_len=256, global_batch=16, micro_batch=1, pp_schedule=schedule)
            for stage, m in stage_memories(spec, Candidate(pp=2, dp_shard=2, activation_checkpointing=ac),
                                           train).items():
                parts = m.breakdown()
                assert sum(parts.values()) - parts["symmetric"] - parts["reserve"] == m.peak, (schedule, stage)
                by[schedule, ac, stage] = m
    assert by["GPipe", False, "first"].phases["forward"] > by["1F1B", False, "first"].phases["forward"]
    one = Training(seq_len=256, global_batch=16, micro_batch=1)
    two = dataclasses.replace(one, micro_batch=2)  # half the microbatches, twice the rows
    first = lambda t: stage_memories(spec, Candidate(pp=2, dp_shard=2), t)["first"].phases["forward"]  # noqa: E731
    assert first(one) < first(two)
    with pytest.raises(ValueError, match="pp_schedule='ZBV'"):
        Training(seq_len=8, global_batch=8, pp_schedule="ZBV")


def test_pp_schedule_gpipe_holds_every_microbatch():
    """The sweep's pp configs under GPipe (every microbatch's activations held) need more
    memory than under 1F1B (at most pp in flight); the other configs are unchanged."""
    from fusedpar.cli import main

    kw = dict(seq_len=256, global_batch=64, micro_batch=1, max_pp=2)
    by_schedule = {s: {e.candidate.name: e.memory.peak for e in plan(LlamaConfig(), 4, "80GiB", **kw,
                                                                        pp_schedule=s).estimates}
                   for s in ("1F1B", "GPipe")}
    pp_names = [n for n in by_schedule["1F1B"] if n.startswith("pp")]
    assert pp_names and all(by_schedule["GPipe"][n] > by_schedule["1F1B"][n] for n in pp_names)
    assert all(by_schedule["GPipe"][n] == by_schedule["1F1B"][n] for n in by_schedule["1F1B"]
               if n not in pp_names)
    with pytest.raises(ValueError, match="the planner models 1F1B and GPipe"):
        plan(LlamaConfig(), 4, "80GiB", **kw, pp_schedule="ZBVZeroBubble")
    assert main(["plan", "--model", "llama", "--gpus", "4", "--seq", "256", "--global-batch", "64",
                 "--pp-schedule", "GPipe", "--json"]) == 0
