"""The planner reads models through the adapters ``parallelize`` uses: for a tiny model of
every registered family, the planned parameter bytes per rank, the dry run's (the real
``parallelize`` on fake tensors) and a real ``parallelize`` on 4 gloo ranks agree exactly;
an unknown family fails naming the known ones; DeepSeek-V3 is planned as the MoE it is. (The
seeds' GPT-2 XL case from the command line: test_plan.test_cli_json_and_table.)"""

import pytest

from fusedpar.parallel.adapters import ADAPTERS, find_adapter
from fusedpar.plan import Candidate, Training, estimate_memory, model_spec
from fusedpar.plan.dry_run import parameter_bytes
from tests.parallel.parallel_cases import make_model

pytest.importorskip("transformers")

# (model kind, parallel config): every adapter, each config one its family takes
CASES = [("llama", dict(tp=2, dp_shard=2)), ("mixtral", dict(dp_shard=4, ep=2)),
         ("hf-llama", dict(tp=2, dp_shard=2)), ("hf-qwen2", dict(tp=2, dp_shard=2)),
         ("hf-mixtral", dict(dp_shard=4, ep=2)), ("hf-qwen2-moe", dict(tp=2, dp_shard=2, ep=2)),
         ("hf-qwen3-moe", dict(tp=2, dp_shard=2)), ("hf-olmoe", dict(dp_shard=4, ep=4)),
         ("hf-deepseek-v3", dict(dp_shard=4, ep=2)), ("hf-gemma2", dict(tp=2, dp_shard=2)),
         ("hf-gpt2", dict(dp_shard=4)), ("hf-gpt2", dict(tp=2, dp_shard=2)),
         ("hf-mistral", dict(dp_shard=4))]


def _local_bytes(model) -> int:
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def _real_bytes(cases) -> list[int]:
    import fusedpar

    return [_local_bytes(fusedpar.parallelize(make_model(kind), config)) for kind, config in cases]


@pytest.mark.timeout(300)
def test_plan_dry_run_and_parallelize_agree_on_parameter_bytes(pools):
    assert {find_adapter(make_model(kind)).family for kind, _ in CASES} == {a.family for a in ADAPTERS}
    real = pools(4).run(_real_bytes, CASES, timeout=200)[0]  # rank 0, as the plan and dry run
    for (kind, config), got in zip(CASES, real):
        model_config = make_model(kind).config
        cand = Candidate(**config)
        planned = estimate_memory(model_spec(model_config), cand, Training(
            seq_len=16, global_batch=cand.dp, foreach=False)).params
        assert (planned, parameter_bytes(model_config, config, 4)) == (got, got), (kind, config)


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ValueError) as info:
        model_spec({"model_type": "bloom", "vocab_size": 8, "hidden_size": 8})
    for family in ("llama", "gpt2", "deepseek_v3", "mistral", "LlamaConfig"):
        assert family in str(info.value)


def test_deepseek_v3_is_planned_as_moe():
    """DeepSeek-V3's shape (671B, 37B active): MoE layers after three dense ones, no tp / cp
    (its adapter refuses them), ep among the configs."""
    from fusedpar.plan import candidates

    config = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
              "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
              "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
              "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
              "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
              "qk_nope_head_dim": 128, "v_head_dim": 128}
    spec = model_spec(config)
    assert spec.moe and spec.moe_layers == 58
    assert 6.7e11 < spec.num_parameters() < 6.75e11 and 3.6e10 < spec.active_parameters() < 3.9e10
    cands = candidates(spec, 64, Training(seq_len=4096, global_batch=64, micro_batch=1))
    assert cands and all(c.tp == c.cp == 1 for c in cands) and any(c.ep > 1 for c in cands)
