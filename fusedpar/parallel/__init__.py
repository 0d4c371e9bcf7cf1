"""Parallel configuration, device meshes, model adapters, ``parallelize``, ``shard_batch`` and
``forward_backward`` (one training step's forward and backward, the same call in every config)."""

from fusedpar.errors import ParallelConfigError
from fusedpar.parallel.config import (
    EP_MESH_AXES,
    FLATTENED_AXES,
    MESH_AXES,
    ParallelConfig,
    get_submesh,
)
from fusedpar.parallel.adapters import ModelAdapter, find_adapter, register_adapter
from fusedpar.parallel.cp import (sequence_shard, sequence_unshard, zigzag_positions, zigzag_shard,
                                  zigzag_unshard)
from fusedpar.parallel.tp import apply_tp
from fusedpar.parallel.parallelize import forward_backward, parallelize, shard_batch  # noqa: E402

__all__ = [
    "EP_MESH_AXES",
    "FLATTENED_AXES",
    "MESH_AXES",
    "ModelAdapter",
    "ParallelConfig",
    "ParallelConfigError",
    "apply_tp",
    "find_adapter",
    "forward_backward",
    "get_submesh",
    "parallelize",
    "register_adapter",
    "sequence_shard",
    "sequence_unshard",
    "shard_batch",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_unshard",
]
