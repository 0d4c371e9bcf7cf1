"""``fusedpar train``'s lower bounds (:mod:`fusedpar.cli.bounds`) per dtype, and the planner's
FSDP all-gather bytes (:func:`fusedpar.plan.float8.fsdp_all_gather_bytes`), against the bytes
one step of a parallelized model counts (``fusedpar.comm.count_bytes``) on 4 CPU ranks:
bf16 and float8 (tensorwise, rowwise) FSDP, and float8 rowwise under tp=2 x dp_shard=2."""

import copy

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.cli.bounds import static_bounds
from fusedpar.models import LlamaConfig, LlamaForCausalLM
from fusedpar.parallel import ParallelConfig
from fusedpar.plan import Candidate, Training, model_spec
from fusedpar.plan.float8 import fsdp_all_gather_bytes
from tests.ops.collective_cases import cpu_row_scales
from tests.parallel.parallel_cases import SEQ, TINY, batches, reference_backends

pytest.importorskip("torchao.float8")

#: test_float8's tiny Llama whose linears hold most of the weights.
WIDE = dict(hidden_size=64, intermediate_size=256)

CASES = [dict(dp_shard=4), dict(dp_shard=4, float8="tensorwise"), dict(dp_shard=4, float8="rowwise"),
         dict(dp_shard=4, float8="rowwise_with_gw_hp"), dict(tp=2, dp_shard=2, float8="rowwise"),
         dict(tp=2, dp_shard=2, float8="tensorwise"), dict(tp=2, dp_shard=2, float8="rowwise_with_gw_hp")]


def _counted_and_bounds(cases) -> list:
    """Per case: ``(counted bytes per op, lower bounds, the planner's FSDP all-gather bytes)``
    of one forward and backward, rank 0's."""
    torch.set_num_threads(1)
    (batch,) = batches(steps=1)
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, **WIDE})
    model = LlamaForCausalLM(config)
    out = []
    for case in cases:
        cfg = ParallelConfig(**case, param_dtype="bfloat16").validate(dist.get_world_size())
        with reference_backends():
            par = fusedpar.parallelize(copy.deepcopy(model), cfg)
            ids, labels, _ = fusedpar.parallel.shard_batch(batch, par.fusedpar_mesh)
            with fusedpar.comm.count_bytes() as counter:
                par(input_ids=ids, labels=labels).loss.backward()
        counted = {}
        for (op, _), n in counter.by_op().items():
            counted[op] = counted.get(op, 0) + n
        train = Training(seq_len=SEQ, global_batch=batch[0].shape[0], float8=cfg.float8)
        planned = fsdp_all_gather_bytes(model_spec(config), Candidate.from_config(cfg), train, 2)  # bf16
        out.append((counted, static_bounds(par, cfg, batch[0].shape[0], SEQ), planned))
    return out if dist.get_rank() == 0 else None


@cpu_row_scales
@pytest.mark.timeout(300)
def test_bounds_per_dtype_and_planned_all_gather_match_counted_bytes(pools):
    """bf16 and float8 FSDP: every op moves exactly its bound, and the planner's all-gather
    bytes are the counted ones (fp8: 1 B an element, rowwise + a float32 scale per row, in
    forward and backward). Under tp the fp8 ops' ratios are at least 1 (the fp8 gathers
    exactly; the reduce-scatter moves float32 partials, one per projection)."""
    results = pools(4).run(_counted_and_bounds, CASES, timeout=240)[0]
    bf16_gather = results[0][0]["all_gather"]
    for case, (counted, bounds, planned) in zip(CASES, results):
        assert set(counted) == set(bounds), (case, counted, bounds)
        for op, n in counted.items():
            assert n >= bounds[op] > 0, (case, op, counted, bounds)
        if case.get("tp", 1) == 1:
            assert counted == bounds, (case, counted, bounds)
            assert counted["all_gather"] == planned, (case, counted, planned)
        else:
            assert counted["all_gather_scaled_matmul"] == bounds["all_gather_scaled_matmul"], (case, counted)
        if case.get("float8") and case["dp_shard"] == 4:  # the issue's "at most 0.55x bf16's"
            assert counted["all_gather"] <= 0.55 * bf16_gather, (case, counted, bf16_gather)
