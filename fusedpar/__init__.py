"""fusedpar: kernels that fuse inter-GPU communication with the compute around it.

Public names: ``ops`` (``torch.ops.fusedpar.*`` custom ops), ``comm`` (groups, symmetric
memory, byte counters), ``ParallelConfig``. Importing touches no GPU.
"""

from . import _extension, comm, ops
from .errors import (
    BackendNotSupportedError,
    FusedparError,
    FusedparTimeoutError,
    ParallelConfigError,
)
from .parallel import ParallelConfig

__version__ = "0.1.0"

_extension.load()  # registers the CUDA ops when built; warns once, loudly, when broken

__all__ = [
    "BackendNotSupportedError",
    "FusedparError",
    "FusedparTimeoutError",
    "ParallelConfig",
    "ParallelConfigError",
    "comm",
    "ops",
]
