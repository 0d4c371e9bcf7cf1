import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fusedpar.comm import group_name, resolve_group
from fusedpar.comm.groups import host_collective_device

pytestmark = [pytest.mark.timeout(120)]


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return type(e).__name__, str(e)
    return None


def _resolve_everything():
    world = dist.group.WORLD
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    pair = dist.new_group([0, 1])
    assert resolve_group(None) is world
    assert resolve_group(world) is world
    assert resolve_group(world.group_name) is world
    assert resolve_group(mesh["tp"]) is tp
    assert resolve_group((mesh, "tp")) is tp
    assert group_name((mesh, "dp")) == mesh.get_group("dp").group_name
    assert group_name("any-name") == "any-name"  # names pass through untouched
    return {
        "mesh_2d": _error(lambda: resolve_group(mesh)),
        "bad_axis": _error(lambda: resolve_group((mesh, "cp"))),
        "bad_type": _error(lambda: resolve_group(3.5)),
        "unknown_name": _error(lambda: resolve_group("nope")),
        "non_member": _error(lambda: resolve_group(pair)) if dist.get_rank() >= 2 else None,
    }


def test_resolve_group_accepts_every_form_and_explains_bad_ones(pools):
    results = pools(4).run(_resolve_everything)
    for rank, errors in enumerate(results):
        assert errors["mesh_2d"][0] == "ValueError" and "2 axes" in errors["mesh_2d"][1]
        assert errors["bad_axis"][0] == "ValueError" and "'cp'" in errors["bad_axis"][1]
        assert errors["bad_type"][0] == "TypeError" and "float" in errors["bad_type"][1]
        assert errors["unknown_name"][0] == "ValueError" and "'nope'" in errors["unknown_name"][1]
        if rank >= 2:
            assert "not a member" in errors["non_member"][1]


def test_uninitialized_distributed_is_explained():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        resolve_group(None)


@pytest.mark.parametrize("backend, device", [("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"),
                                             ("nccl", "cuda"), ("cuda:nccl", "cuda")])
def test_host_collectives_run_where_the_group_takes_tensors(monkeypatch, backend, device):
    """NCCL alone takes CUDA tensors only; any group with gloo takes the CPU's. (The ops'
    run on an NCCL-only group: tests/ops/test_moe_experts.py, on a GPU.)"""
    monkeypatch.setattr(dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert host_collective_device(object()).type == device


def test_settle_gloo_workers_sleeps_only_while_a_worker_thread_lives(monkeypatch):
    """At exit, a process with gloo worker threads sleeps GLOO_SETTLE_S (the GIL released) so
    a worker still dropping a collective's Python tensors does it before interpreter shutdown;
    one without them does not wait. The hook is registered once however often it is asked."""
    from fusedpar.comm import groups

    slept, registered = [], []
    monkeypatch.setattr(groups.time, "sleep", slept.append)
    with open(f"/proc/{os.getpid()}/comm") as f:  # this process's main thread stands in
        monkeypatch.setattr(groups, "GLOO_WORKER_THREAD", f.read().strip())
    groups.settle_gloo_workers()
    monkeypatch.setattr(groups, "GLOO_WORKER_THREAD", "no-such-thread")
    groups.settle_gloo_workers()
    assert slept == [groups.GLOO_SETTLE_S]

    monkeypatch.setattr(groups.atexit, "register", registered.append)
    groups.settle_gloo_workers_at_exit.cache_clear()
    groups.settle_gloo_workers_at_exit()
    groups.settle_gloo_workers_at_exit()
    groups.settle_gloo_workers_at_exit.cache_clear()  # later callers register for real
    assert registered == [groups.settle_gloo_workers]
