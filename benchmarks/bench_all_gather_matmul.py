"""all_gather_matmul: fusedpar backends next to what a user would pick instead (docs/design.md §6).

* ``test_loopback`` (one GPU, no torchrun): every rank of a W=8 all_gather_matmul in one
  process (``all_gather_matmul_loopback``: each simulated rank's peer shards are copied
  into its gathered A, then the triton GEMM a group runs), against W ``torch.matmul`` calls
  of the same per-rank GEMM (``A_gathered @ B``, the gather left out: the copies are
  fusedpar's cost alone). Target: >= 0.9x torch.matmul's TFLOP/s.
* ``test_torchrun`` (``torchrun --nproc-per-node N -m pytest benchmarks``): each backend
  against the unfused NCCL ``all_gather_into_tensor`` then cuBLAS matmul, and against torch
  ``symm_mem.fused_all_gather_matmul`` (async-TP). Targets: >= 1.0x symm_mem, >= 1.2x unfused.
* ``auto`` (both modes): what a user gets, ``backend=None`` (in loopback the case of the
  backend the dispatcher would run there); target: the case's best baseline (targets.py).
* ``test_loopback_volume``: not a timing; runs on CPU too.

``shape`` is ``M x K x N``: A_gathered is ``[M, K]`` (a rank's shard ``M / W`` rows, gathered
along dim 0), B ``[K, N]``, bf16; the Llama-3-70B TP=8 projections (qkv: N=1280, gate/up:
N=7168) and one odd small shape. Each case checks its result once before it is timed
(A_gathered exactly; the product's error against fp64 at most 2x that of torch.matmul in
bf16); do_bench quantiles go to ``results/all_gather_matmul.csv`` with TFLOP/s, % of the
session's ``matmul_roofline``, the speedups over the baselines and, in loopback,
``gpu_busy_ms`` (one profiled call) and ``host_ms`` (the host's time in a call: near or
above the busy time, the call is host-bound) in ``notes``. Targets are printed and
recorded, never asserted.
"""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops.calls import MatmulCall

from common import (AUTO, DTYPE, NCCL_ALL_GATHER, W_LOOPBACK, MatmulSuite, auto_choice, auto_label,
                    counted, nbytes, or_skip, rel_err, run_case, split_rows, symm_mem_op)

OP = "all_gather_matmul"
SHAPES = [(8192, 8192, 1280), (8192, 8192, 7168), (1000 * W_LOOPBACK, 1032, 1288)]  # M, K, N
SYMM_MEM = "symm_mem.fused_all_gather_matmul"
UNFUSED = "nccl+matmul"
SUITE = MatmulSuite(OP, symm_mem=SYMM_MEM, unfused=UNFUSED,
                    moved_cols=lambda m, k, n: k)  # A_gathered [M, K] crosses ranks


def _shard(m, k, rank, device, dtype=DTYPE, seed=0) -> torch.Tensor:
    """Rank ``rank``'s ``[m, k]`` A shard, reproducible on any rank."""
    g = torch.Generator(device=device)
    g.manual_seed(7919 * seed + rank)
    return torch.randn(m, k, generator=g, device=device).to(dtype)


def _weight(k, n, device, dtype=DTYPE, seed=0) -> torch.Tensor:
    """B ``[k, n]``, the same on every rank, scaled so the products are O(1)."""
    g = torch.Generator(device=device)
    g.manual_seed(104729 + seed)
    return (torch.randn(k, n, generator=g, device=device) * k ** -0.5).to(dtype)


# ---- single GPU: loopback --------------------------------------------------------------------


def _loopback_measure(backend, shape, device, gpu_times):
    """Check one loopback case once, then time it: ``(fn, (median, p20, p80), bytes_moved,
    None)``; ``Unavailable`` if it cannot run."""
    world = W_LOOPBACK
    m, k, n = shape
    xs = [_shard(m // world, k, r, device) for r in range(world)]
    b = _weight(k, n, device)
    gathered = torch.cat(xs, 0)
    chose = None
    if backend == AUTO:  # the loopback case of what the dispatcher would run
        backend, chose = auto_label(OP, MatmulCall(OP, xs[0], 0, world, None, [b]),
                                    SUITE.loopback_labels)
    if backend == "torch.matmul":
        def fn():  # the same W per-rank GEMMs, the gather left out
            return [(None, [torch.matmul(gathered, b)]) for _ in range(world)]
        results, bytes_moved = fn(), None
    else:
        def fn():
            return fusedpar.ops.all_gather_matmul_loopback(xs, [b], 0)
        results, bytes_moved = counted(fn)
    ref64 = gathered.double() @ b.double()
    torch_err = rel_err(gathered @ b, ref64)
    assert len(results) == world
    for rank, (a_gathered, (out,)) in enumerate(results):
        if backend != "torch.matmul":
            assert torch.equal(a_gathered, gathered), f"simulated rank {rank}: wrong A_gathered"
        assert out.shape == (m, n) and out.dtype == DTYPE
        err = rel_err(out, ref64)
        assert err <= max(2 * torch_err, 1e-6), \
            f"simulated rank {rank}: error {err:.3g}, torch {torch_err:.3g}"
    del results, ref64
    return fn, gpu_times(fn), bytes_moved, chose


# ---- several GPUs: torchrun ------------------------------------------------------------------


def _case(backend, a, b, group):
    """``(fn, note)`` for one case, ``fn() -> (A_gathered, [out])``; raises ``Unavailable``
    with the reason it cannot run."""
    world = dist.get_world_size(group)
    if backend in (*SUITE.fusedpar, AUTO):
        chosen = None if backend == AUTO else backend
        return (lambda: fusedpar.ops.all_gather_matmul(a, [b], 0, group, backend=chosen)), \
            "fusedpar"
    if backend == UNFUSED:
        gathered = torch.empty(world * a.shape[0], a.shape[1], dtype=a.dtype, device=a.device)
        out = torch.empty(gathered.shape[0], b.shape[1], dtype=a.dtype, device=a.device)

        def unfused():
            NCCL_ALL_GATHER(gathered, a, group=group)
            torch.matmul(gathered, b, out=out)
            return gathered, [out]
        return unfused, f"dist.{NCCL_ALL_GATHER.__name__} then torch.matmul"
    _, op = symm_mem_op(backend, enable_for=group)
    return (lambda: op(a, [b], 0, group.group_name)), "async-TP: copy-engine shards + cuBLAS"


def _dist_measure(backend, shape, group, device, gpu_times, agree):
    """Check one torchrun case once, then time it: ``(fn, (median, p20, p80), bytes_moved,
    note)``; ``Unavailable`` (on every rank alike) if it cannot run."""
    m, k, n = shape
    world, rank = split_rows(m, group, agree)
    a = _shard(m // world, k, rank, device)
    b = _weight(k, n, device)
    expected = torch.cat([_shard(m // world, k, r, device) for r in range(world)], 0)
    ref64 = expected.double() @ b.double()
    torch_err = rel_err(expected @ b, ref64)
    fn, note, got, bytes_moved = run_case(backend, lambda: _case(backend, a, b, group), agree)
    a_gathered, (out,) = got
    assert agree(torch.equal(a_gathered, expected)), f"{backend}: wrong A_gathered on some rank"
    err = rel_err(out, ref64) if out.shape == ref64.shape else float("inf")
    assert agree(err <= max(2 * torch_err, 1e-6)), \
        f"{backend}: error {err:.3g} vs torch.matmul {torch_err:.3g} on rank {rank}"
    del got, a_gathered, out, ref64, expected
    if backend == AUTO:
        note = auto_choice(OP, MatmulCall(OP, a, 0, world, group, [b]))
    return fn, gpu_times(fn), bytes_moved, note


test_loopback, test_torchrun = SUITE.tests(SHAPES, _loopback_measure, _dist_measure)


# ---- communication volume (no timing; CPU too) -----------------------------------------------


@pytest.mark.parametrize("a_shape,gather_dim,n,n_bs,dtype", [
    ((3, 40), 0, 70, 1, torch.bfloat16),    # several N tiles (the interpreter's are 32 wide)
    ((5, 24), 0, 17, 2, torch.float16),     # a second B reuses the gathered A
    ((2, 3, 16), 1, 32, 1, torch.float32),  # 3-D, gathered along dim 1
], ids=["3x40-N70-bf16", "5x24-N17-2Bs-fp16", "2x3x16-dim1-N32-fp32"])
def test_loopback_volume(local_device, a_shape, gather_dim, n, n_bs, dtype):
    """Each peer shard crosses once, whatever N and however many Bs: W (W-1) shard bytes,
    the lower bound. Small integers keep the products exact."""
    world = W_LOOPBACK
    k = a_shape[-1]
    xs, bs = [], []
    for r in range(world):
        g = torch.Generator(device=local_device)
        g.manual_seed(2000 + r)
        xs.append(torch.randint(-4, 5, a_shape, generator=g, device=local_device).to(dtype))
    for i in range(n_bs):
        g = torch.Generator(device=local_device)
        g.manual_seed(3000 + i)
        bs.append(torch.randint(-4, 5, (k, n + i), generator=g, device=local_device).to(dtype))
    results, moved = or_skip(counted,
                             lambda: fusedpar.ops.all_gather_matmul_loopback(xs, bs, gather_dim))
    expected = torch.cat(xs, gather_dim)
    for rank, (a_gathered, outs) in enumerate(results):
        assert torch.equal(a_gathered, expected), f"simulated rank {rank}: A_gathered"
        for b, out in zip(bs, outs):
            assert torch.equal(out, (expected.double() @ b.double()).to(dtype)), \
                f"simulated rank {rank}"
    assert moved == world * (world - 1) * nbytes(xs[0])
