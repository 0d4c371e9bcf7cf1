import pytest
import torch

from fusedpar.comm import get_loopback_buffers, release_buffers


@pytest.fixture
def loopback():
    """Fresh, zeroed loopback buffers (none shared with other tests' cached ones)."""
    release_buffers()
    yield lambda world: get_loopback_buffers(world, 1 << 16, torch.device("cpu"))
    release_buffers()
