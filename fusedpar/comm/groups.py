"""Process-group resolution: every op accepts a ProcessGroup, a 1-D DeviceMesh, a
``(mesh, axis_name)`` pair or a group name, and passes the name across the op boundary."""

from __future__ import annotations

import atexit
import functools
import glob
import os
import time

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
    """The name that crosses the op boundary (schema-legal and traceable). A ProcessGroup is
    its name (dist.new_group hands non-members a sentinel, not a group), checked no further:
    every op call asks."""
    if isinstance(group, (str, dist.ProcessGroup)):
        return group if isinstance(group, str) else group.group_name
    return resolve_group(group).group_name


def host_collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a small collective of host-side values (sizes, names, checks) runs on ``group``:
    the CPU, unless the group has NCCL alone (``init_process_group("nccl")``, as torchrun
    scripts often do), which takes only CUDA tensors: then this rank's GPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")



GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the OS name of ProcessGroupGloo's worker threads
GLOO_SETTLE_S = 0.2


@functools.cache
def settle_gloo_workers_at_exit() -> None:
    """Run :func:`settle_gloo_workers` at interpreter exit (registered once).

    A gloo worker thread drops a finished collective only after ``wait()`` has returned; if
    the collective's tensors were made in Python, dropping them takes the GIL. When that
    falls into interpreter shutdown (a script ending with ``dcp.save`` then
    ``destroy_process_group``, whose groups a parallelized model still holds, so their
    workers are never joined), the thread is killed inside a noexcept frame and the process
    aborts: "terminate called without an active exception" (torch's gloo, see
    pytorch/pytorch#179291). ``atexit`` handlers run before shutdown begins."""
    atexit.register(settle_gloo_workers)


def settle_gloo_workers() -> None:
    """Sleep ``GLOO_SETTLE_S`` with the GIL released if gloo worker threads are alive in this
    process (Linux: named in /proc), so one still dropping a collective's Python tensors does
    it before shutdown; nothing when there are none or /proc is absent."""
    names = glob.glob(f"/proc/{os.getpid()}/task/*/comm")
    if any(_read(name) == GLOO_WORKER_THREAD for name in names):
        time.sleep(GLOO_SETTLE_S)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # the thread ended meanwhile
        return ""
