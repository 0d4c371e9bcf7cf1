"""reduce_scatter (sum): fusedpar backends next to what a user would pick instead (docs/design.md §6).

* ``test_loopback`` (one GPU, no torchrun): every rank of a W=8 reduce_scatter in one
  process over a loopback symmetric buffer, against ``torch.stack(xs).sum(0).chunk(W)``
  (every simulated rank's output at once): the fused protocol's overhead over a plain sum.
  ``triton.graph``: the triton call captured once in a CUDA graph (after an eager call) and
  replayed, as a captured training step runs it: no host work per call; checked first:
  replays on new inputs equal eager calls bitwise (``common.graph_replay``); its row notes
  ``gpu_busy_ms``, ``host_ms``, ``x_eager`` and ``vs_gpu_busy`` (target: its median within
  1.15x of its GPU busy time).
* ``test_torchrun`` (``torchrun --nproc-per-node N -m pytest benchmarks``): each backend
  against raw NCCL ``reduce_scatter_tensor`` and torch ``symm_mem`` reduce-scatters.
* ``auto`` (both modes): what a user gets, ``backend=None`` (in loopback the case of the
  backend the dispatcher would run there); target: the case's best baseline (targets.py).
* ``test_loopback_volume_is_the_lower_bound``: not a timing; runs on CPU too.

``shape`` is the per-rank output; each rank's input is ``[W * shape[0], *shape[1:]]``,
scattered along dim 0. Each case checks its result once before it is timed (error against
an fp32 sum at most 2x that of the same-dtype torch baseline); do_bench quantiles go to
``results/reduce_scatter.csv``.
"""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops import registry
from fusedpar.ops.calls import CollectiveCall
from fusedpar.testing.collectives import symmetric_backend_names

from common import (AUTO, DTYPE, GRAPH, NCCL_REDUCE_SCATTER, W_LOOPBACK, auto_choice, counted,
                    loopback_case, name, nbytes, or_skip, record_case, rel_err, run_case,
                    symm_mem_op)

OP = "reduce_scatter"
SHAPES = [(4096, 8192), (1024, 8192), (1000, 4104)]  # per-rank output


def _input(shape, world, rank, device, dtype=DTYPE, seed=0) -> torch.Tensor:
    """Rank ``rank``'s full input ``[world * shape[0], ...]``, reproducible on any rank and
    scaled by the rank (provenance)."""
    g = torch.Generator(device=device)
    g.manual_seed(7919 * seed + rank)
    full = (world * shape[0], *shape[1:])
    return (torch.randn(full, generator=g, device=device) * (rank + 1)).to(dtype)


# ---- single GPU: loopback --------------------------------------------------------------------


LOOPBACK_BACKENDS = [*symmetric_backend_names(OP), GRAPH, "torch.stack.sum"]


@pytest.mark.parametrize("backend", [*LOOPBACK_BACKENDS, AUTO])
@pytest.mark.parametrize("shape", SHAPES, ids=name)
def test_loopback(benchmark, gpu, gpu_times, record_row, synced, shape, backend):
    world = W_LOOPBACK
    xs = [_input(shape, world, r, gpu) for r in range(world)]

    def baseline():
        return torch.stack(xs).sum(0).chunk(world, 0)  # every simulated rank's output

    fn, outs, bytes_moved, notes = loopback_case(
        OP, backend, CollectiveCall(OP, xs[0], 0, world, None, "sum"), LOOPBACK_BACKENDS, baseline,
        lambda runs: fusedpar.ops.reduce_scatter_loopback(xs, "sum", 0, backend=runs), inputs=xs)
    ref32 = torch.zeros(xs[0].shape, dtype=torch.float32, device=gpu)
    for x in xs:
        ref32 += x.float()
    ref32 = ref32.chunk(world, 0)
    torch_outs = baseline()
    assert len(outs) == world
    for rank, out in enumerate(outs):
        assert out.shape == ref32[rank].shape and out.dtype == DTYPE
        err, torch_err = rel_err(out, ref32[rank]), rel_err(torch_outs[rank], ref32[rank])
        assert err <= max(2 * torch_err, 1e-6), f"rank {rank}: error {err:.3g}, torch {torch_err:.3g}"
    del ref32, torch_outs, outs

    record_case(benchmark, gpu_times, record_row, synced, fn, OP, backend, shape, world,
                "loopback", algo_bytes=world * nbytes(xs[0]), bytes_moved=bytes_moved,
                lower_bound=world * (world - 1) * nbytes(xs[0]) // world, **notes)


# ---- several GPUs: torchrun ------------------------------------------------------------------


def _nccl_case(x, group):
    world = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)

    def nccl():
        NCCL_REDUCE_SCATTER(out, x, group=group)
        return out
    return nccl


def _case(backend, x, group):
    """``(fn, note)`` for one case; raises ``Unavailable`` with the reason it cannot run."""
    world = dist.get_world_size(group)
    if backend in (*registry.get(OP).backends, AUTO):
        chosen = None if backend == AUTO else backend
        return (lambda: fusedpar.ops.reduce_scatter(x, "sum", 0, group, backend=chosen)), "fusedpar"
    if backend == "nccl":
        return _nccl_case(x, group), f"dist.{NCCL_REDUCE_SCATTER.__name__}"
    symm_mem, op = symm_mem_op(backend)
    if backend == "symm_mem.reduce_scatter_out":  # two-shot first half; the input in symm memory
        staged = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(staged, group.group_name)
        out = torch.empty(x.numel() // world, dtype=x.dtype, device=x.device)
        out_shape = (x.shape[0] // world, *x.shape[1:])

        def two_shot():
            staged.copy_(x.reshape(-1))  # fusedpar stages its input the same way
            op(staged, group.group_name, False, out)
            return out.view(out_shape)
        return two_shot, "input copied into symm_mem each call"
    # push to a symm_mem workspace, then sum; the result is ready after wait_tensor
    return (lambda: torch.ops._c10d_functional.wait_tensor(op(x, "sum", group.group_name))), \
        "copy-engine push + sum"


DIST_BACKENDS = [*registry.get(OP).backends, "nccl", "symm_mem.reduce_scatter_out",
                 "symm_mem._low_contention_reduce_scatter", AUTO]


@pytest.mark.parametrize("backend", DIST_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=name)
def test_torchrun(benchmark, dist_gpu, gpu_times, record_row, agree, synced, shape, backend):
    group, device = dist_gpu
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x = _input(shape, world, rank, device)
    ref32 = torch.zeros(shape, dtype=torch.float32, device=device)
    for r in range(world):
        ref32 += _input(shape, world, r, device).chunk(world, 0)[rank].float()
    nccl_err = rel_err(_nccl_case(x, group)(), ref32)
    fn, note, out, bytes_moved = or_skip(run_case, backend, lambda: _case(backend, x, group), agree)
    err = rel_err(out, ref32) if out.shape == ref32.shape else float("inf")
    # the fused sum must be as good as NCCL's (2x); torch's own baselines just bf16-accurate
    bound = max(2 * nccl_err, 1e-6) if note == "fusedpar" else max(2 * nccl_err, 1e-2)
    assert agree(err <= bound), f"{backend}: error {err:.3g} vs NCCL {nccl_err:.3g} on some rank"
    del ref32
    notes = ({"chose": auto_choice(OP, CollectiveCall(OP, x, 0, world, group, "sum"))}
             if backend == AUTO else {})

    record_case(benchmark, gpu_times, record_row, synced, fn, OP, backend, shape, world,
                "torchrun", algo_bytes=nbytes(x), bytes_moved=bytes_moved,
                lower_bound=(world - 1) * nbytes(x) // world, impl=note, **notes)


# ---- communication volume (no timing; CPU too) -----------------------------------------------


@pytest.mark.parametrize("backend", symmetric_backend_names(OP))
@pytest.mark.parametrize("shape,dim,dtype", [((3, 5), 0, torch.bfloat16),
                                             ((3, 5, 2), 1, torch.float32),
                                             ((2, 7), -1, torch.float16)],
                         ids=["3x5-dim0-bf16", "3x5x2-dim1-fp32", "2x7-dim-1-fp16"])
def test_loopback_volume_is_the_lower_bound(local_device, shape, dim, dtype, backend):
    """Each of the W simulated ranks receives (W-1)/W of the full input: nothing more.
    ``shape`` is the per-rank output; inputs are small integers, so the sum is exact."""
    world = W_LOOPBACK
    full = list(shape)
    full[dim] *= world
    xs = []
    for r in range(world):
        g = torch.Generator(device=local_device)
        g.manual_seed(1000 + r)
        xs.append(torch.randint(-8, 9, full, generator=g, device=local_device).mul(r + 1).to(dtype))
    outs, moved = or_skip(counted, lambda: fusedpar.ops.reduce_scatter_loopback(
        xs, "sum", dim, backend=backend))
    expected = sum(x.double() for x in xs).to(dtype).chunk(world, dim)
    for rank, out in enumerate(outs):
        assert torch.equal(out, expected[rank]), f"simulated rank {rank}"
    assert moved == world * (world - 1) * nbytes(xs[0]) // world
