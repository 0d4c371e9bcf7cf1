"""The planner against measured runs: the small fusedpar Llama and MoE models trained on 4
CPU ranks (gloo, reference backends, float32) under DDP, FSDP, tp=2 x dp_shard=2,
cp=2 x dp_shard=2 and ep=2, with and without activation checkpointing. Parameters,
gradients and optimizer state must match exactly, the peak within 10%."""

import pytest

from fusedpar.plan import Candidate, Training, estimate_memory, model_spec
from tests.plan import measured

# (model, ParallelConfig keys, planner candidate)
CONFIGS = [
    ("llama", {"dp_replicate": 4, "dp_shard": 1}, dict(dp_replicate=4)),
    ("llama", {"dp_shard": 4}, dict(dp_shard=4)),
    ("llama", {"tp": 2, "dp_shard": 2}, dict(tp=2, dp_shard=2)),
    ("llama", {"cp": 2, "dp_shard": 2}, dict(cp=2, dp_shard=2)),
    ("mixtral", {"ep": 2, "dp_shard": 4}, dict(ep=2, dp_shard=4)),
]
CASES = [(kind, par, cand, ac) for kind, par, cand in CONFIGS for ac in (False, True)]
# what the CPU run is: float32 throughout, torch's single-tensor AdamW on CPU, gloo's
# synchronous collectives (one FSDP unit unsharded at a time)
TRAIN = Training(seq_len=measured.SEQ, global_batch=measured.BATCH, param_dtype="float32",
                 compute_dtype="float32", foreach=False, units_in_flight=1)
@pytest.fixture(scope="module")
def runs(pools):
    results = pools(4).run(measured.measure_all, [(kind, par, ac) for kind, par, _, ac in CASES],
                           timeout=300)[0]  # rank 0: the most loaded rank (padded shards)
    out = {}
    for (kind, _, cand, ac), got in zip(CASES, results):
        c = Candidate(**cand, activation_checkpointing=ac)
        out[(kind, c.name)] = (got, estimate_memory(model_spec(measured.model_config(kind)), c, TRAIN))
    return out


@pytest.mark.timeout(400)
def test_plan_matches_measured_runs(runs):
    misses = []
    for key, (got, plan) in runs.items():
        assert (got["params"], got["grads"], got["optimizer"]) == (plan.params, plan.params, plan.optimizer), key
        error = plan.peak / got["peak"] - 1
        print(f"{key}: planned {plan.peak:,} B, measured {got['peak']:,} B ({error:+.1%})")
        if abs(error) > 0.10:
            misses.append(f"{key}: planned {plan.peak:,} B, measured {got['peak']:,} B ({error:+.1%})")
    assert not misses, "\n".join(misses)


def test_dry_run_equals_the_real_run(runs):
    """The fake-tensor dry run of a config allocates exactly what the 4 real ranks did."""
    from fusedpar.plan.dry_run import dry_run

    got, _ = runs[("llama", "fsdp4")]
    fake = dry_run(measured.model_config("llama"), {"dp_shard": 4}, 4, seq_len=measured.SEQ,
                   micro_batch=measured.BATCH // 4)
    assert (fake.params, fake.grads, fake.optimizer, fake.peak) == (
        got["params"], got["grads"], got["optimizer"], got["peak"])
