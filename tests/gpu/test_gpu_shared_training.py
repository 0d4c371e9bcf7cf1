"""Training on the shared-GPU ranks (tests/gpu/conftest.py): ``fusedpar.parallelize`` on two
ranks on cuda:0 with fusedpar's fused backends, against the single process on the same GPU:
the loss and every gradient after one step. ``dp_shard=2`` is FSDP2 with its all-gathers
and reduce-scatters on fusedpar's collectives (``fsdp_comm="fusedpar"``, the default); tp=2,
cp=2 and ep=2 (Mixtral-style MoE) run the fused TP, ring-attention and expert ops. Skipped
without a GPU."""

import copy

import pytest
import torch

import fusedpar
from fusedpar.parallel import ParallelConfig, get_submesh
from tests.parallel.parallel_cases import assert_matches, batches, make_model, parallel_run, reference_run

pytestmark = [pytest.mark.gpu, pytest.mark.multirank, pytest.mark.timeout(600)]

# fp32 models; fusedpar's Triton GEMMs and attention take fp32 operands as tf32 (10-bit
# mantissa), the single process's cuBLAS and SDPA full fp32
RTOL, ATOL = 2e-2, 2e-3


def _one_step(kind: str, options: dict) -> bool:
    data = [tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in batch)
            for batch in batches(steps=1)]
    model = make_model(kind).cuda()
    want = reference_run(model, data)
    par = fusedpar.parallelize(copy.deepcopy(model), ParallelConfig(**options))
    assert par.fusedpar_config.fsdp_comm == "fusedpar"
    got = parallel_run(par, data, get_submesh(par.fusedpar_mesh, "dp").get_group())
    assert_matches(got, want, f"{kind} {options} on shared-GPU ranks", rtol=RTOL, atol=ATOL)
    torch.cuda.synchronize()
    return True


@pytest.mark.parametrize("kind, options", [
    ("llama", dict(dp_shard=2)),                # FSDP2 on fusedpar's collectives
    ("llama", dict(tp=2, dp_shard=1)),
    ("llama", dict(cp=2, dp_shard=1)),
    ("mixtral", dict(dp_shard=2, ep=2)),
], ids=["fsdp2", "tp2", "cp2", "ep2"])
def test_gpu_shared_parallelize_one_step_matches_one_process(gpu_pools, kind, options):
    assert gpu_pools(2).run(_one_step, kind, options, timeout=500) == [True, True]
