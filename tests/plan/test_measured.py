"""The planner against measured runs: the small fusedpar Llama and MoE models trained on 4
CPU ranks (gloo, reference backends, float32) under DDP, FSDP, tp=2 x dp_shard=2,
cp=2 x dp_shard=2, ep=2 and pp=2 x dp_shard=2 (1F1B and GPipe; the Llama's first and last
stage each), with and without activation checkpointing. Parameters, gradients and
optimizer state must match exactly, the peak within 10%."""

import dataclasses

import pytest

from fusedpar.plan import Candidate, Training, model_spec
from fusedpar.plan.memory import stage_memories
from tests.plan import measured

PP = {"pp": 2, "dp_shard": 2}
# (model, ParallelConfig keys, planner candidate, micro_batch, schedule); pp's default
# pp_microbatches is pp: 2 of 2 rows per data-parallel rank; with 4 of 1 row 1F1B and GPipe differ
CONFIGS = [
    ("llama", {"dp_replicate": 4, "dp_shard": 1}, dict(dp_replicate=4), None, "1F1B"),
    ("llama", {"dp_shard": 4}, dict(dp_shard=4), None, "1F1B"),
    ("llama", {"tp": 2, "dp_shard": 2}, dict(tp=2, dp_shard=2), None, "1F1B"),
    ("llama", {"cp": 2, "dp_shard": 2}, dict(cp=2, dp_shard=2), None, "1F1B"),
    ("mixtral", {"ep": 2, "dp_shard": 4}, dict(ep=2, dp_shard=4), None, "1F1B"),
    ("llama", PP, dict(pp=2, dp_shard=2), 2, "1F1B"),
]
# activation checkpointing under every config but DDP (its activations are FSDP's: same formula)
CASES = [(kind, par, cand, micro, sched, ac) for kind, par, cand, micro, sched in CONFIGS
         for ac in ((False,) if "dp_replicate" in par else (False, True))]
CASES += [("llama", {**PP, "pp_microbatches": 4, "pp_schedule": sched}, dict(pp=2, dp_shard=2), 1, sched, False)
          for sched in ("1F1B", "GPipe")]
CASES += [("mixtral", {**PP, "ep": 2}, dict(pp=2, dp_shard=2, ep=2), 2, "1F1B", False)]
# what the CPU run is: float32 throughout, torch's single-tensor AdamW on CPU, gloo's
# synchronous collectives (one FSDP unit unsharded at a time)
TRAIN = Training(seq_len=measured.SEQ, global_batch=measured.BATCH, param_dtype="float32",
                 compute_dtype="float32", foreach=False, units_in_flight=1)


@pytest.fixture(scope="module")
def runs(pools):
    by_rank = pools(4).run(measured.measure_all, [(kind, par, ac) for kind, par, _, _, _, ac in CASES],
                           timeout=400)
    out = {}
    for i, (kind, _, cand, micro, sched, ac) in enumerate(CASES):
        c = Candidate(**cand, activation_checkpointing=ac)
        plans = stage_memories(model_spec(measured.model_config(kind)), c,
                               dataclasses.replace(TRAIN, micro_batch=micro, pp_schedule=sched))
        # rank 0: the most loaded rank (padded shards); pp: rank 0 runs the first stage, rank 3 the last
        for got in (by_rank[0][i], by_rank[3][i]) if c.pp > 1 else (by_rank[0][i],):
            name = c.name + (f" ({sched}, micro-batch {micro}, {got['stage']} stage)" if c.pp > 1 else "")
            out[(kind, name)] = (got, plans[got["stage"]])
    return out


@pytest.mark.timeout(500)
def test_plan_matches_measured_runs(runs):
    misses = []
    assert {got["stage"] for got, _ in runs.values()} == {"all", "first", "last"}
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
