"""The shared-GPU-rank harness (tests/gpu/conftest.py) on any machine: one gloo world of W
spawned ranks with the symmetric-memory opt-in set, each on cuda:0 where there is a GPU.
Imports no fusedpar, so spawning its ranks stays cheap on CPU."""

import os

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(300)]


def _rank_data(rank):
    return torch.arange(12, dtype=torch.float32).view(3, 4) + 16 * (rank + 1)


def _describe():
    x = _rank_data(dist.get_rank())
    if torch.cuda.is_available():
        x = x.cuda()
    dist.all_reduce(x)  # gloo carries an all-reduce of CUDA tensors too
    return {"rank": dist.get_rank(), "world": dist.get_world_size(),
            "backend": str(dist.get_backend()),
            "opt_in": os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"),
            "device": torch.cuda.current_device() if torch.cuda.is_available() else None,
            "sum": x.cpu()}


def test_shared_pool_is_one_gloo_world_opted_in(shared_pools):
    world = 4  # W=2 runs the same code (and runs on a GPU in test_gpu_pool.py)
    seen = shared_pools(world).run(_describe)
    expected = sum(_rank_data(r) for r in range(world))
    for rank, info in enumerate(seen):
        assert (info["rank"], info["world"], info["backend"], info["opt_in"]) == (rank, world, "gloo", "1")
        assert info["device"] == (0 if torch.cuda.is_available() else None)
        assert torch.equal(info["sum"], expected)
