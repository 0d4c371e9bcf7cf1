"""Test setup. Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must
be set before any kernel module is imported (triton reads it when decorating)."""

import glob
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FUSEDPAR_TIMEOUT", "30")

import pytest  # noqa: E402

from fusedpar.comm.symmetric import shm_job_prefix  # noqa: E402
from tests.dist_pool import PoolRegistry  # noqa: E402


@pytest.fixture(scope="session")
def pools(tmp_path_factory):
    """``pools(W)``: a pool of W spawned gloo ranks, shared by the session's tests and
    replaced after any failure. Teardown stops them and removes this session's leftover
    shm segments (named after this process, the ranks' parent)."""
    registry = PoolRegistry(tmp_path_factory.mktemp("rendezvous"))
    yield registry
    registry.close()
    for path in glob.glob(f"/dev/shm/{shm_job_prefix(os.getpid())}*"):
        os.unlink(path)

