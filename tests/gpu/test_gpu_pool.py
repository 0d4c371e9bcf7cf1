"""torch symmetric memory across the processes of the shared-GPU-rank harness (W=2 and 4 on
cuda:0). Skipped without a GPU."""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from tests.ops.collective_cases import subgroup

pytestmark = [pytest.mark.gpu, pytest.mark.multirank, pytest.mark.timeout(300)]


def _symmetric_buffer_across_processes():
    """Each rank fills its segment with its rank + 1; every rank reads every peer's segment
    through the torch symmetric-memory mapping of the shared GPU."""
    group = subgroup()
    buf = fusedpar.comm.get_buffer(group, 1024, torch.device("cuda", 0))
    buf.data(torch.float32, 8).fill_(dist.get_rank() + 1)
    torch.cuda.synchronize()
    dist.barrier(group)
    seen = [buf.data(torch.float32, 8, rank=r).cpu().tolist() for r in range(dist.get_world_size())]
    dist.barrier(group)  # nobody rewrites a segment before every peer read it
    return buf.backend, seen


@pytest.mark.parametrize("world", [2, 4])
def test_gpu_symmetric_memory_across_processes_on_one_gpu(gpu_pools, world):
    for backend, seen in gpu_pools(world).run(_symmetric_buffer_across_processes):
        assert backend == "torch"
        assert seen == [[float(r + 1)] * 8 for r in range(world)]
