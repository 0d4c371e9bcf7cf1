"""``fusedpar.parallelize`` on 4 CPU ranks against the single-process model: the loss and
every gradient after one step and the loss after 5 AdamW steps (fp32: rtol 1e-5, atol
1e-6), for fusedpar's own Llama and tiny Hugging Face models built from a config.
One pool run checks several configs (spawn and warm-up are paid once)."""

import copy
import math

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.parallel import ParallelConfig, get_submesh
from tests.parallel.parallel_cases import assert_matches, batches, make_model, parallel_run, reference_run

pytest.importorskip("transformers")  # the HF cases; the test dependencies include it

TP_BACKEND = "reference"  # the fused TP ops' backends are tested in tests/ops; keep CI fast


def _fsdp_lower_bound(model, world: int) -> dict[str, int]:
    """Bytes per step of ZeRO-3 over ``world`` ranks: every unit's shard all-gathered in
    forward, the non-root units' again in backward, every gradient reduce-scattered once
    (fp32); a shard is dim 0 padded to a multiple of ``world``."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    owned, gathered, scattered = set(), 0, 0
    for unit in reversed(units):  # innermost first: a parameter belongs to its innermost unit
        shard = 0
        for p in unit.parameters():
            if id(p) in owned:
                continue
            owned.add(id(p))
            shard += math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) * 4
        gathered += shard * (1 if unit is model else 2)
        scattered += shard
    return {"all_gather": (world - 1) * gathered, "reduce_scatter": (world - 1) * scattered}


def _check_dense(kind: str, configs: list[dict]) -> bool:
    torch.set_num_threads(1)
    data = batches()
    model = make_model(kind)
    want = reference_run(model, data)  # dense: the global-batch mean = the mean over dp slices
    losses = {}
    for extra in configs:
        cfg = ParallelConfig(**extra)
        if cfg.ep > 1:  # MoE: the aux loss is per data-parallel rank; average over the slices
            want = reference_run(model, data, cfg.validate(dist.get_world_size()).dp)
        par = fusedpar.parallelize(copy.deepcopy(model), cfg, backend=TP_BACKEND)
        dp_group = get_submesh(par.fusedpar_mesh, "dp").get_group()
        counters = []
        got = parallel_run(par, data, dp_group, counters)
        if cfg.fsdp_comm == "fusedpar" and cfg.dp_shard == dist.get_world_size() and cfg.ep == 1:
            by_op = {op: n for (op, _), n in counters[0].by_op().items()}
            assert by_op == _fsdp_lower_bound(par, cfg.dp_shard), by_op  # one step, nothing else
        assert_matches(got, want, f"{kind} {extra}", ep=cfg.ep)
        losses[str(extra)] = torch.stack(got[0])
    first = next(iter(losses.values()))
    for name, curve in losses.items():  # fusedpar's FSDP collectives and torch's agree
        torch.testing.assert_close(curve, first, rtol=1e-5, atol=1e-6, msg=name)
    return True


@pytest.mark.timeout(600)
def test_own_llama_matches_single_process(pools):
    configs = [dict(dp_shard=4), dict(dp_shard=4, fsdp_comm="torch"), dict(tp=2, dp_shard=2),
               dict(dp_replicate=2, dp_shard=2)]
    assert pools(4).run(_check_dense, "llama", configs, timeout=500) == [True] * 4


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["hf-llama", "hf-qwen2"])
def test_hugging_face_models_match_single_process(pools, kind):
    assert pools(4).run(_check_dense, kind, [dict(tp=2, dp_shard=2)], timeout=500) == [True] * 4


@pytest.mark.timeout(600)
def test_context_parallel_matches_single_process(pools):
    configs = [dict(cp=2, dp_shard=2), dict(tp=2, cp=2)]
    assert pools(4).run(_check_dense, "llama", configs, timeout=500) == [True] * 4


@pytest.mark.timeout(600)
def test_expert_parallel_matches_single_process(pools):
    """ep borrows its ranks from dp_shard: ep=2 (experts FSDP-sharded over efsdp=2), ep=4."""
    configs = [dict(dp_shard=4, ep=2), dict(dp_shard=4, ep=4)]
    assert pools(4).run(_check_dense, "mixtral", configs, timeout=500) == [True] * 4
