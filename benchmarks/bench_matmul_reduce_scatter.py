"""matmul_reduce_scatter (sum): fusedpar backends next to what a user would pick instead
(docs/design.md §6).

* ``test_loopback`` (one GPU, no torchrun): every rank of a W=8 matmul_reduce_scatter in one
  process (``matmul_reduce_scatter_loopback``: the triton GEMMs write their partials into
  loopback symmetric buffers; then, in stream order, each rank's peer partials are copied
  into its staging buffer and one pass sums its chunk), against W
  ``torch.matmul`` calls of the same per-rank GEMM (``A_r @ B_r``, the reduction left out).
  Target: >= 0.9x torch.matmul's TFLOP/s. ``triton.side_stream``: the same with the copies
  of a group call (``side_stream=True``: on the side stream while the GEMMs run on all SMs
  but one; a rank's copies wait for the GEMMs of the ranks after it). ``triton.graph``: the
  triton call captured once in a CUDA graph (after an eager call) and replayed, as a captured
  training step runs it: no host work per call; checked first: replays on new inputs equal
  eager calls bitwise (``common.graph_replay``). Target: its median within 1.15x of its GPU
  busy time (``vs_gpu_busy``).
* ``test_torchrun`` (``torchrun --nproc-per-node N -m pytest benchmarks``): each backend
  against the unfused cuBLAS matmul then NCCL ``reduce_scatter_tensor``, and against torch
  ``symm_mem.fused_matmul_reduce_scatter`` (async-TP). Targets: >= 1.0x symm_mem, >= 1.2x
  unfused.
  On one GPU, the group path in a gloo group of ranks sharing it (no NCCL there): rows of
  their own op, ``*_shared_gpu``, from tests/gpu/test_gpu_shared_rows.py.
* ``auto`` (both modes): what a user gets, ``backend=None`` (in loopback the case of the
  backend the dispatcher would run there); target: the case's best baseline (targets.py).
* ``test_loopback_volume_is_the_lower_bound``: not a timing; runs on CPU too.

``shape`` is ``M x K x N``: each rank's A is ``[M, K]`` (K: its shard of the contraction),
its B ``[K, N]``, its output the ``[M / W, N]`` chunk of the sum over ranks of A_r @ B_r,
scattered along dim 0, bf16; the Llama-3-70B TP=8 projections (attention out: K=1024, MLP
down: K=3584) and one odd small shape. Each case checks its result once before it is timed
(error against an fp64 sum at most 2x that of the same-dtype torch baseline); do_bench
quantiles go to ``results/matmul_reduce_scatter.csv`` with TFLOP/s, % of the session's
``matmul_roofline``, the speedups over the baselines and, in loopback, ``gpu_busy_ms`` (one
profiled call) and ``host_ms`` (the host's time in a call: near or above the busy time, the
call is host-bound) in ``notes``. Targets are printed and recorded, never asserted.
"""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops.calls import MatmulCall

from common import (AUTO, DTYPE, GRAPH, NCCL_REDUCE_SCATTER, W_LOOPBACK, MatmulSuite,
                    auto_choice, auto_label, counted, graph_replay, nbytes, or_skip, rel_err,
                    run_case, split_rows, symm_mem_op)

OP = "matmul_reduce_scatter"
SHAPES = [(8192, 1024, 8192), (8192, 3584, 8192), (1000 * W_LOOPBACK, 1032, 1288)]  # M, K, N
SYMM_MEM = "symm_mem.fused_matmul_reduce_scatter"
UNFUSED = "matmul+nccl"
SIDE_STREAM = "triton.side_stream"  # the loopback with a group call's copies (module docstring)
SUITE = MatmulSuite(OP, symm_mem=SYMM_MEM, unfused=UNFUSED, loopback_extra=(SIDE_STREAM, GRAPH),
                    moved_cols=lambda m, k, n: n)  # the [M, N] product crosses ranks


def _operands(m, k, n, rank, device, dtype=DTYPE, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``A [m, k]`` and ``B [k, n]``, reproducible on any rank."""
    g = torch.Generator(device=device)
    g.manual_seed(7919 * seed + rank)
    a = torch.randn(m, k, generator=g, device=device).to(dtype)
    b = (torch.randn(k, n, generator=g, device=device) * k ** -0.5).to(dtype)
    return a, b


# ---- single GPU: loopback --------------------------------------------------------------------


def _loopback_measure(backend, shape, device, gpu_times):
    """Check one loopback case once, then time it: ``(fn, (median, p20, p80), bytes_moved,
    None)``; ``Unavailable`` if it cannot run."""
    world = W_LOOPBACK
    m, k, n = shape
    As, Bs = zip(*[_operands(m, k, n, r, device) for r in range(world)])
    As, Bs = list(As), list(Bs)
    products = [a @ b for a, b in zip(As, Bs)]
    torch_outs = torch.stack(products).sum(0).chunk(world, 0)  # bf16 partials, one rounding
    del products
    chose = None
    if backend == AUTO:  # the loopback case of what the dispatcher would run
        backend, chose = auto_label(OP, MatmulCall(OP, As[0], 0, world, None, [Bs[0]], reduce_op="sum"),
                                    SUITE.loopback_labels)
    if backend == "torch.matmul":
        def fn():  # the same W per-rank GEMMs, the reduction left out
            return [torch.matmul(a, b) for a, b in zip(As, Bs)]
        outs, bytes_moved = torch_outs, None
    else:
        def fn():
            return fusedpar.ops.matmul_reduce_scatter_loopback(As, Bs, "sum", 0,
                                                               side_stream=backend == SIDE_STREAM)
        outs, bytes_moved = counted(fn)
        if backend == GRAPH:  # checked against eager calls, then replayed (counts no bytes)
            fn = graph_replay(fn, [*As, *Bs])
            outs, bytes_moved = fn(), None
    ref64 = torch.zeros(m, n, dtype=torch.float64, device=device)
    for a, b in zip(As, Bs):
        ref64 += a.double() @ b.double()
    ref64 = ref64.chunk(world, 0)
    assert len(outs) == world
    for rank, out in enumerate(outs):
        assert out.shape == (m // world, n) and out.dtype == DTYPE
        err, torch_err = rel_err(out, ref64[rank]), rel_err(torch_outs[rank], ref64[rank])
        assert err <= max(2 * torch_err, 1e-6), \
            f"simulated rank {rank}: error {err:.3g}, torch {torch_err:.3g}"
    del outs, torch_outs, ref64
    return fn, gpu_times(fn), bytes_moved, chose


# ---- several GPUs: torchrun ------------------------------------------------------------------


def _unfused_case(a, b, group):
    world = dist.get_world_size(group)
    product = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    out = torch.empty(a.shape[0] // world, b.shape[1], dtype=a.dtype, device=a.device)

    def unfused():
        torch.matmul(a, b, out=product)
        NCCL_REDUCE_SCATTER(out, product, group=group)
        return out
    return unfused


def _case(backend, a, b, group):
    """``(fn, note)`` for one case; raises ``Unavailable`` with the reason it cannot run."""
    if backend in (*SUITE.fusedpar, AUTO):
        chosen = None if backend == AUTO else backend
        return (lambda: fusedpar.ops.matmul_reduce_scatter(a, b, "sum", 0, group,
                                                           backend=chosen)), "fusedpar"
    if backend == UNFUSED:
        return _unfused_case(a, b, group), f"torch.matmul then dist.{NCCL_REDUCE_SCATTER.__name__}"
    _, op = symm_mem_op(backend, enable_for=group)
    return (lambda: op(a, b, "sum", 0, group.group_name)), \
        "async-TP: per-chunk cuBLAS + copy-engine P2P + reduce"


def _dist_measure(backend, shape, group, device, gpu_times, agree):
    """Check one torchrun case once, then time it: ``(fn, (median, p20, p80), bytes_moved,
    note)``; ``Unavailable`` (on every rank alike) if it cannot run."""
    m, k, n = shape
    world, rank = split_rows(m, group, agree)
    a, b = _operands(m, k, n, rank, device)
    ref64 = torch.zeros(m // world, n, dtype=torch.float64, device=device)
    for r in range(world):
        a_r, b_r = _operands(m, k, n, r, device)
        ref64 += a_r.chunk(world, 0)[rank].double() @ b_r.double()
    del a_r, b_r
    nccl_err = rel_err(_unfused_case(a, b, group)(), ref64)
    fn, note, out, bytes_moved = run_case(backend, lambda: _case(backend, a, b, group), agree)
    err = rel_err(out, ref64) if out.shape == ref64.shape else float("inf")
    # the fused sum must be as good as the unfused one's (2x); torch's own just bf16-accurate
    bound = max(2 * nccl_err, 1e-6) if note == "fusedpar" else max(2 * nccl_err, 1e-2)
    assert agree(err <= bound), \
        f"{backend}: error {err:.3g} vs unfused {nccl_err:.3g} on rank {rank}"
    del out, ref64
    if backend == AUTO:
        note = auto_choice(OP, MatmulCall(OP, a, 0, world, group, [b], reduce_op="sum"))
    return fn, gpu_times(fn), bytes_moved, note


test_loopback, test_torchrun = SUITE.tests(SHAPES, _loopback_measure, _dist_measure)


# ---- communication volume (no timing; CPU too) -----------------------------------------------


@pytest.mark.parametrize("a_shape,scatter_dim,n,dtype", [
    ((16, 16), 0, 24, torch.bfloat16),
    ((3, 16, 8), 1, 12, torch.float32),  # 3-D, scattered along dim 1
    ((8, 24), 0, 40, torch.float16),
], ids=["16x16-N24-bf16", "3x16x8-dim1-N12-fp32", "8x24-N40-fp16"])
def test_loopback_volume_is_the_lower_bound(local_device, a_shape, scatter_dim, n, dtype):
    """Each of the W simulated ranks reads the W-1 peers' partial products of its own
    ``[M / W, N]`` chunk: W (W-1) chunk bytes, nothing more. Small integers keep every
    partial exact in the dtype, so the fp32 sum rounds once, as the fp64 reference."""
    world = W_LOOPBACK
    k = a_shape[-1]
    As, Bs = [], []
    for r in range(world):
        g = torch.Generator(device=local_device)
        g.manual_seed(4000 + r)
        As.append(torch.randint(-2, 3, a_shape, generator=g, device=local_device).to(dtype))
        Bs.append(torch.randint(-2, 3, (k, n), generator=g, device=local_device).to(dtype))
    outs, moved = or_skip(counted, lambda: fusedpar.ops.matmul_reduce_scatter_loopback(
        As, Bs, "sum", scatter_dim))
    expected = sum(a.double() @ b.double() for a, b in zip(As, Bs)).to(dtype)
    expected = expected.chunk(world, scatter_dim)
    for rank, out in enumerate(outs):
        assert torch.equal(out, expected[rank]), f"simulated rank {rank}"
    chunk_bytes = nbytes(expected[0])
    assert moved == world * (world - 1) * chunk_bytes
