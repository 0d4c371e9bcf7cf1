"""Parallel configuration, device meshes and (later) ``parallelize`` plans."""

from fusedpar.errors import ParallelConfigError
from fusedpar.parallel.config import (
    EP_MESH_AXES,
    FLATTENED_AXES,
    MESH_AXES,
    ParallelConfig,
    get_submesh,
)
from fusedpar.parallel.tp import apply_tp

__all__ = [
    "EP_MESH_AXES",
    "FLATTENED_AXES",
    "MESH_AXES",
    "ParallelConfig",
    "ParallelConfigError",
    "apply_tp",
    "get_submesh",
]
