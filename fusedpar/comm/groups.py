"""Process-group resolution: every op accepts a ProcessGroup, a 1-D DeviceMesh, a
``(mesh, axis_name)`` pair or a group name, and passes the name across the op boundary."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def resolve_group(group) -> dist.ProcessGroup:
    """Return the ProcessGroup that ``group`` names; ``None`` is the default (world) group."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fusedpar: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) (or launch with torchrun) first"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group gives non-members
        raise ValueError(
            f"group: rank {dist.get_rank()} is not a member of this group; "
            "call the op only on the ranks of the group"
        )
    if group is None:
        pg = dist.group.WORLD
    elif isinstance(group, dist.ProcessGroup):
        pg = group
    elif isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group: a DeviceMesh with {group.ndim} axes {group.mesh_dim_names} is ambiguous; "
                "pass a 1-D mesh, mesh[axis_name] or (mesh, axis_name)"
            )
        pg = group.get_group()
    elif isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, axis = group
        if axis not in (mesh.mesh_dim_names or ()):
            raise ValueError(f"group: mesh has no axis {axis!r}; its axes are {mesh.mesh_dim_names}")
        pg = mesh.get_group(axis)
    elif isinstance(group, str):
        try:
            pg = dist.distributed_c10d._resolve_process_group(group)
        except Exception as e:  # torch raises several types for an unknown name
            raise ValueError(
                f"group: no process group is registered under the name {group!r} on rank "
                f"{dist.get_rank()}; pass group.group_name of a group created with dist.new_group"
            ) from e
    else:
        raise TypeError(
            "group: expected a ProcessGroup, a 1-D DeviceMesh, (mesh, axis_name), a group name "
            f"or None, got {type(group).__name__}"
        )
    if dist.get_rank(pg) < 0:
        raise ValueError(
            f"group: rank {dist.get_rank()} is not a member of group {pg.group_name!r}; "
            "call the op only on the ranks of the group"
        )
    return pg


def group_name(group) -> str:
    """The name that crosses the op boundary (schema-legal and traceable)."""
    if isinstance(group, str):
        return group
    return resolve_group(group).group_name


def host_collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a small collective of host-side values (sizes, names, checks) runs on ``group``:
    the CPU, unless the group has NCCL alone (``init_process_group("nccl")``, as torchrun
    scripts often do), which takes only CUDA tensors: then this rank's GPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
