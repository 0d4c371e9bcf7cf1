"""fusedpar: kernels that fuse inter-GPU communication with the compute around it.

Public names: ``ops`` (``torch.ops.fusedpar.*`` custom ops), ``nn`` (drop-in TP/SP
layers), ``comm`` (groups, symmetric memory, byte counters), ``ParallelConfig``,
``apply_tp``, ``parallelize`` and ``forward_backward``. Importing touches no GPU.
"""

from . import _extension, comm, nn, ops
from .errors import (
    BackendNotSupportedError,
    FusedparError,
    FusedparTimeoutError,
    ParallelConfigError,
)
from .parallel import ParallelConfig, apply_tp, forward_backward, parallelize

__version__ = "0.1.0"

_extension.load()  # registers the CUDA ops when built; warns once, loudly, when broken

__all__ = [
    "BackendNotSupportedError",
    "FusedparError",
    "FusedparTimeoutError",
    "ParallelConfig",
    "ParallelConfigError",
    "apply_tp",
    "comm",
    "forward_backward",
    "nn",
    "ops",
    "parallelize",
]
