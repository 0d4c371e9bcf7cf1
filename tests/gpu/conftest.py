"""Shared-GPU ranks: W spawned processes on cuda:0 in one gloo world (NCCL refuses ranks
sharing a GPU), with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 so torch symmetric memory
accepts them (``tests.dist_pool.WorkerPool(shared_gpu=True)``). gloo carries only some
collectives of CUDA tensors, so the oracles run on CPU copies. Kernels of different
processes time-slice the GPU (no MPS: never start it on a lent machine): these tests prove
correctness, not speed, and their waits need seconds."""

import pytest
import torch

from tests.dist_pool import PoolRegistry

NEEDS_GPU = "needs a CUDA GPU: the shared-GPU ranks run the group path on cuda:0"


@pytest.fixture(scope="session")
def shared_pools(tmp_path_factory):
    """``shared_pools(W)``: W ranks in a gloo world, all on cuda:0 where there is a GPU (on
    CPU the same harness without the device: for its own tests)."""
    registry = PoolRegistry(tmp_path_factory.mktemp("shared_gpu_rendezvous"), shared_gpu=True)
    yield registry
    registry.close()


@pytest.fixture
def gpu_pools(shared_pools):
    """``shared_pools``, skipping without a GPU."""
    if not torch.cuda.is_available():
        pytest.skip(NEEDS_GPU)
    return shared_pools
