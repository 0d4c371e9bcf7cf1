"""Rank-side helpers shared by the TP layer and apply_tp tests (run inside workers)."""

import functools

import torch
import torch.distributed as dist

TOL = {"rtol": 1e-5, "atol": 1e-5}


@functools.cache
def tp_mesh():
    """A 1-D CPU mesh over the whole world (made once per worker process)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")
