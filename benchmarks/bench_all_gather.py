"""all_gather: fusedpar backends next to what a user would pick instead (docs/design.md §6).

* ``test_loopback`` (one GPU, no torchrun): every rank of a W=8 all_gather in one process
  over a loopback symmetric buffer, against ``torch.cat`` of the W shards once per simulated
  rank (the same W outputs): the fused protocol's overhead over a plain device copy.
  ``triton.graph``: the triton call captured once in a CUDA graph (after an eager call) and
  replayed, as a captured training step runs it: no host work per call; checked first:
  replays on new inputs equal eager calls bitwise (``common.graph_replay``); its row notes
  ``gpu_busy_ms``, ``host_ms``, ``x_eager`` and ``vs_gpu_busy`` (target: its median within
  1.15x of its GPU busy time).
* ``test_torchrun`` (``torchrun --nproc-per-node N -m pytest benchmarks``): each backend
  against raw NCCL ``all_gather_into_tensor`` and torch ``symm_mem`` all-gathers.
* ``auto`` (both modes): what a user gets, ``backend=None`` (in loopback the case of the
  backend the dispatcher would run there); target: the case's best baseline (targets.py).
* ``test_loopback_volume_is_the_lower_bound``, ``test_graph_row_checks_replays_against_eager_calls``:
  not timings; run on CPU too.

``shape`` is the per-rank shard; the gather is along dim 0. Each case checks its result
once before it is timed; do_bench quantiles go to ``results/all_gather.csv``.
"""

import functools

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops import registry
from fusedpar.ops.calls import CollectiveCall
from fusedpar.testing.collectives import symmetric_backend_names

import common
from common import (AUTO, DTYPE, GRAPH, NCCL_ALL_GATHER, W_LOOPBACK, auto_choice, counted,
                    loopback_case, name, nbytes, or_skip, record_case, run_case, symm_mem_op)

OP = "all_gather"
SHAPES = [(4096, 8192), (1024, 8192), (1000, 4104)]  # per-rank shard


def _shard(shape, rank, device, dtype=DTYPE, seed=0) -> torch.Tensor:
    """Rank ``rank``'s input, reproducible on any rank; offset by the rank (provenance)."""
    g = torch.Generator(device=device)
    g.manual_seed(7919 * seed + rank)
    return (torch.randn(shape, generator=g, device=device) + rank).to(dtype)


# ---- single GPU: loopback --------------------------------------------------------------------


LOOPBACK_BACKENDS = [*symmetric_backend_names(OP), GRAPH, "torch.cat"]


@pytest.mark.parametrize("backend", [*LOOPBACK_BACKENDS, AUTO])
@pytest.mark.parametrize("shape", SHAPES, ids=name)
def test_loopback(benchmark, gpu, gpu_times, record_row, synced, shape, backend):
    world = W_LOOPBACK
    xs = [_shard(shape, r, gpu) for r in range(world)]
    expected = torch.cat(xs, 0)

    def baseline():
        return [torch.cat(xs, 0) for _ in range(world)]  # one output per simulated rank

    fn, outs, bytes_moved, notes = loopback_case(
        OP, backend, CollectiveCall(OP, xs[0], 0, world), LOOPBACK_BACKENDS, baseline,
        lambda runs: fusedpar.ops.all_gather_loopback(xs, 0, backend=runs), inputs=xs)
    assert len(outs) == world
    for rank, out in enumerate(outs):
        assert torch.equal(out, expected), f"simulated rank {rank}: wrong gathered tensor"
    del outs

    record_case(benchmark, gpu_times, record_row, synced, fn, OP, backend, shape, world,
                "loopback", algo_bytes=world * nbytes(expected), bytes_moved=bytes_moved,
                lower_bound=world * (world - 1) * nbytes(xs[0]), **notes)


# ---- several GPUs: torchrun ------------------------------------------------------------------


def _case(backend, x, group):
    """``(fn, note)`` for one case; raises ``Unavailable`` with the reason it cannot run."""
    world = dist.get_world_size(group)
    if backend in (*registry.get(OP).backends, AUTO):
        chosen = None if backend == AUTO else backend
        return (lambda: fusedpar.ops.all_gather(x, 0, group, backend=chosen)), "fusedpar"
    out_shape = (world * x.shape[0], *x.shape[1:])
    if backend == "nccl":
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)

        def nccl():
            NCCL_ALL_GATHER(out, x, group=group)
            return out
        return nccl, f"dist.{NCCL_ALL_GATHER.__name__}"
    symm_mem, op = symm_mem_op(backend)
    if backend == "symm_mem.multimem_all_gather_out":  # NVLS multicast; the output in symm memory
        out = symm_mem.empty(out_shape, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(out, group.group_name)
        return (lambda: op(x, group.group_name, out)), "output in symm_mem; needs multicast"
    # copy engine pull from a symm_mem workspace; the result is ready after wait_tensor
    return (lambda: torch.ops._c10d_functional.wait_tensor(op(x, group.group_name))), \
        "copy-engine pull"


DIST_BACKENDS = [*registry.get(OP).backends, "nccl", "symm_mem.multimem_all_gather_out",
                 "symm_mem._low_contention_all_gather", AUTO]


@pytest.mark.parametrize("backend", DIST_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=name)
def test_torchrun(benchmark, dist_gpu, gpu_times, record_row, agree, synced, shape, backend):
    group, device = dist_gpu
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x = _shard(shape, rank, device)
    expected = torch.cat([_shard(shape, r, device) for r in range(world)], 0)
    fn, note, out, bytes_moved = or_skip(run_case, backend, lambda: _case(backend, x, group), agree)
    assert agree(torch.equal(out, expected)), f"{backend}: wrong gathered tensor on some rank"
    notes = {"chose": auto_choice(OP, CollectiveCall(OP, x, 0, world, group))} if backend == AUTO else {}

    record_case(benchmark, gpu_times, record_row, synced, fn, OP, backend, shape, world,
                "torchrun", algo_bytes=nbytes(expected), bytes_moved=bytes_moved,
                lower_bound=(world - 1) * nbytes(x), impl=note, **notes)


# ---- communication volume (no timing; CPU too) -----------------------------------------------


@pytest.mark.parametrize("backend", symmetric_backend_names(OP))
@pytest.mark.parametrize("shape,dim,dtype", [((5, 7), 0, torch.bfloat16),
                                             ((3, 5, 2), 1, torch.float32),
                                             ((1, 9), -1, torch.int32)],
                         ids=["5x7-dim0-bf16", "3x5x2-dim1-fp32", "1x9-dim-1-int32"])
def test_loopback_volume_is_the_lower_bound(local_device, shape, dim, dtype, backend):
    """Each of the W simulated ranks receives (W-1)/W of the gathered tensor: nothing more."""
    world = W_LOOPBACK
    xs = [_shard(shape, r, local_device, torch.float32, seed=1).mul(4).round().to(dtype)
          for r in range(world)]
    outs, moved = or_skip(counted,
                          lambda: fusedpar.ops.all_gather_loopback(xs, dim, backend=backend))
    expected = torch.cat(xs, dim)
    for out in outs:
        assert torch.equal(out, expected)
    assert moved == world * (world - 1) * nbytes(xs[0])


# ---- the graph row's check (no timing; CPU too) ----------------------------------------------


def _faked_graph(fn, stale: bool = False):
    """``common.graphed`` without CUDA graphs: the first call's outputs are the captured ones
    and a replay refills them from a new call (``stale``: keeps them, as a replay that ignored
    its new inputs would)."""
    outs = fn()
    captured = common.tensors(outs)

    def replay():
        if not stale:
            for out, new in zip(captured, common.tensors(fn())):
                out.copy_(new)
        return outs
    return replay


@pytest.mark.parametrize("stale", [False, True], ids=["replays", "stale-replays"])
def test_graph_row_checks_replays_against_eager_calls(local_device, monkeypatch, stale):
    """The ``triton.graph`` rows' check (``common.graph_replay``) on the triton loopback call,
    capture faked where there is no GPU: replays on new inputs that equal eager calls pass and
    return the captured outputs; a replay that keeps its captured outputs fails; the inputs
    get their values back either way."""
    xs = [_shard((5, 7), r, local_device, torch.float32, seed=2) for r in range(W_LOOPBACK)]
    originals = [x.clone() for x in xs]
    if stale or local_device.type != "cuda":
        monkeypatch.setattr(common, "graphed", lambda fn: _faked_graph(fn, stale))
    call = functools.partial(fusedpar.ops.all_gather_loopback, xs, 0, backend="triton")
    if stale:
        with pytest.raises(AssertionError, match="differ from an eager call's"):
            common.graph_replay(call, xs)
    else:
        outs = common.graph_replay(call, xs)()
        assert all(torch.equal(out, torch.cat(originals, 0)) for out in outs)
    assert all(torch.equal(x, original) for x, original in zip(xs, originals))
