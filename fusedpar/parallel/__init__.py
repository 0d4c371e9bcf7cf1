"""Parallel configuration, device meshes and (later) ``parallelize`` plans."""

from fusedpar.errors import ParallelConfigError
from fusedpar.parallel.config import (
    EP_MESH_AXES,
    FLATTENED_AXES,
    MESH_AXES,
    ParallelConfig,
    get_submesh,
)

__all__ = [
    "EP_MESH_AXES",
    "FLATTENED_AXES",
    "MESH_AXES",
    "ParallelConfig",
    "ParallelConfigError",
    "get_submesh",
]
