"""all_gather_scaled_matmul and scaled_matmul_reduce_scatter (fp8): fusedpar's backends next
to the bf16 op they replace and the fp8 paths a user would pick instead (docs/design.md §6).

* ``test_loopback`` (one GPU, no torchrun): the GEMM each of W=8 simulated ranks runs on
  the gathered A, in fp8 (``torch._scaled_mm``, tensorwise and rowwise scales, bf16 out)
  next to the bf16 ``torch.matmul`` of the bf16 op (what fp8 buys in compute alone), and
  ``triton``: ``all_gather_scaled_matmul_loopback`` (every rank's staged fp8 rows, and row
  scales, copied from the loopback buffer before that rank's peers-kernel fp8 GEMM: one GPU
  has no link to overlap them with, as in ``all_gather_matmul_loopback``); ``triton.rs``:
  ``scaled_matmul_reduce_scatter_loopback`` (each rank's fp8 GEMM into float32 partials, each
  chunk's sum pulled on a side stream while the GEMMs run: the group path on one GPU), recorded
  as scaled_matmul_reduce_scatter's ``triton`` row.
* ``test_torchrun`` (``torchrun --nproc-per-node N -m pytest benchmarks``): each fusedpar
  backend of the fp8 ops against torch's ``symm_mem.fused_all_gather_scaled_matmul`` /
  ``fused_scaled_matmul_reduce_scatter`` and the unfused NCCL collective + ``_scaled_mm``,
  beside the bf16 op (``all_gather_matmul`` / ``matmul_reduce_scatter``, auto backend).
  Targets (issue 44): the fp8 all-gather GEMM >= 1.6x the bf16 one at compute-bound shapes
  and >= 1.0x torch's fused op; printed and recorded, never asserted. Nothing here has run
  on a GPU yet.

``shape`` is ``M x K x N`` as in bench_all_gather_matmul.py (A gathered ``[M, K]``, B
``[K, N]``; the reduce-scatter's A ``[M, K]`` per rank, output ``[M / W, N]``), the Llama-3-70B
TP=8 projections. Each case is checked once before it is timed (against float64 of the
dequantized operands: error at most 2x ``_scaled_mm``'s own on the gathered operands). Rows go
to ``results/<op>.csv`` with dtype ``float8_e4m3fn``, TFLOP/s and the speedups in ``notes``.
"""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops.float8_scales import quantize

from common import (AUTO, NCCL_ALL_GATHER, NCCL_REDUCE_SCATTER, W_LOOPBACK, bench, name, or_skip,
                    rel_err, run_case, split_rows, symm_mem_op)

AG, RS = "all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"
FP8 = torch.float8_e4m3fn
SHAPES = [(8192, 8192, 1280), (8192, 8192, 7168)]  # M, K, N
SCALINGS = ("tensorwise", "rowwise")
LOOPBACK = ("torch.matmul.bf16", "torch._scaled_mm", "triton", "triton.rs")
AG_ROWS = ("nccl+_scaled_mm", "symm_mem.fused_all_gather_scaled_matmul", "all_gather_matmul.bf16",
           "pipelined", "reference", "symm_mem", AUTO)
RS_ROWS = ("_scaled_mm+nccl", "symm_mem.fused_scaled_matmul_reduce_scatter", "matmul_reduce_scatter.bf16",
           "pipelined", "reference", "symm_mem", AUTO)


def _operands(m, k, n, rows_seed, device, scaling):
    """``(a_hp, a, a_scale, b_hp, b, b_scale)``: bf16 data and its fp8 cast (rowwise: A per
    row, B per column)."""
    g = torch.Generator(device=device)
    g.manual_seed(rows_seed)
    a_hp = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    g.manual_seed(104729)
    b_hp = (torch.randn(k, n, generator=g, device=device) * k ** -0.5).to(torch.bfloat16)
    rowwise = scaling == "rowwise"
    a, a_scale = quantize(a_hp, FP8, -1 if rowwise else None)
    b, b_scale = quantize(b_hp, FP8, 0 if rowwise else None)
    return a_hp, a, a_scale, b_hp, b, b_scale


def _record(benchmark, gpu_times, record_row, synced, op, backend, shape, world, mode, scaling, fn,
            bytes_moved=None, **notes):
    times = gpu_times(fn)
    m, k, n = shape
    plays = world if mode == "loopback" else 1
    tflops = 2 * m * k * n * plays / (times[0] * 1e-3) / 1e12
    benchmark.group = f"{op} {name(shape)} fp8 {scaling} {mode} W={world}"
    notes.update(mode=mode, scaling=scaling, tflops=f"{tflops:.1f}")
    record_row(op, backend, shape, FP8, world, *times, algo_bytes=plays * m * k, bytes_moved=bytes_moved,
               **notes)
    bench(benchmark, synced, fn, times, **notes)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("backend", LOOPBACK)
@pytest.mark.parametrize("shape", SHAPES, ids=name)
def test_loopback(benchmark, gpu, gpu_times, record_row, synced, shape, backend, scaling):
    m, k, n = shape
    a_hp, a, a_scale, b_hp, b, b_scale = _operands(m, k, n, 0, gpu, scaling)
    exact = (a.double() * a_scale.double()) @ (b.double() * b_scale.double())
    if backend == "torch.matmul.bf16":
        if scaling == "rowwise":
            pytest.skip("the bf16 row is the same for both scalings")

        def fn():
            return [a_hp @ b_hp for _ in range(W_LOOPBACK)]
    elif backend == "triton.rs":  # every rank the same A: its GEMM's fp32 partials, then the reduction
        if m % W_LOOPBACK:
            pytest.skip(f"M={m} does not split over W={W_LOOPBACK}")

        def fn():
            return fusedpar.ops.scaled_matmul_reduce_scatter_loopback(
                [a] * W_LOOPBACK, [b] * W_LOOPBACK, [a_scale] * W_LOOPBACK, [b_scale] * W_LOOPBACK,
                side_stream=True)
        outs = fn()
        for r, out in enumerate(outs):
            want = W_LOOPBACK * exact.chunk(W_LOOPBACK)[r]
            assert rel_err(out, want) <= 1e-2, (r, rel_err(out, want))
        _record(benchmark, gpu_times, record_row, synced, RS, "triton", shape, W_LOOPBACK, "loopback",
                scaling, fn)
        return
    elif backend == "triton":  # every rank: the loopback gather, then the Triton fp8 peers GEMM
        rows = m // W_LOOPBACK
        shards = [a[r * rows:(r + 1) * rows] for r in range(W_LOOPBACK)]
        scales = [a_scale if a_scale.numel() == 1 else a_scale[r * rows:(r + 1) * rows]
                  for r in range(W_LOOPBACK)]

        def fn():
            return fusedpar.ops.all_gather_scaled_matmul_loopback(shards, [b], scales, [b_scale])
        out = fn()[0][1][0]
        assert rel_err(out, exact) <= 1e-2, rel_err(out, exact)
    else:
        bt = b.t().contiguous().t()  # cuBLAS: B column-major

        def fn():
            return [torch._scaled_mm(a, bt, a_scale, b_scale, out_dtype=torch.bfloat16)
                    for _ in range(W_LOOPBACK)]
        out = fn()[0]
        assert rel_err(out, exact) <= 1e-2, rel_err(out, exact)  # one bf16 rounding
    _record(benchmark, gpu_times, record_row, synced, AG, backend, shape, W_LOOPBACK, "loopback",
            scaling, fn)


def _ag_case(backend, a, a_scale, b, b_scale, a_hp, b_hp, group):
    world = dist.get_world_size(group)
    if backend in ("triton", "pipelined", "reference", "symm_mem", AUTO):
        chosen = None if backend == AUTO else backend
        return (lambda: fusedpar.ops.all_gather_scaled_matmul(a, [b], a_scale, [b_scale], 0, group,
                                                              backend=chosen)), "fusedpar"
    if backend == "all_gather_matmul.bf16":
        return (lambda: fusedpar.ops.all_gather_matmul(a_hp, [b_hp], 0, group)), "bf16"
    bt = b.t().contiguous().t()
    if backend == "nccl+_scaled_mm":
        gathered = torch.empty(world * a.shape[0], a.shape[1], dtype=a.dtype, device=a.device)
        scales = torch.empty(world * a_scale.numel(), dtype=torch.float32, device=a.device)

        def unfused():
            NCCL_ALL_GATHER(gathered.view(torch.uint8), a.view(torch.uint8), group=group)
            s = a_scale
            if a_scale.numel() > 1:
                NCCL_ALL_GATHER(scales, a_scale.view(-1), group=group)
                s = scales.view(-1, 1)
            return gathered, [torch._scaled_mm(gathered, bt, s, b_scale, out_dtype=torch.bfloat16)]
        return unfused, "NCCL all-gather of the fp8 bytes (+ row scales) then torch._scaled_mm"
    _, op = symm_mem_op("symm_mem.fused_all_gather_scaled_matmul", enable_for=group)
    return (lambda: op(a, [bt], a_scale, [b_scale], 0, group.group_name, [None], [None],
                       [torch.bfloat16], [False])), "async-TP"


def _rs_case(backend, a, a_scale, b, b_scale, a_hp, b_hp, group):
    if backend in ("triton", "pipelined", "reference", "symm_mem", AUTO):
        chosen = None if backend == AUTO else backend
        return (lambda: fusedpar.ops.scaled_matmul_reduce_scatter(a, b, a_scale, b_scale, "sum", 0,
                                                                  group, backend=chosen)), "fusedpar"
    if backend == "matmul_reduce_scatter.bf16":
        return (lambda: fusedpar.ops.matmul_reduce_scatter(a_hp, b_hp, "sum", 0, group)), "bf16"
    world = dist.get_world_size(group)
    bt = b.t().contiguous().t()
    if backend == "_scaled_mm+nccl":
        out = torch.empty(a.shape[0] // world, b.shape[1], dtype=torch.bfloat16, device=a.device)

        def unfused():
            NCCL_REDUCE_SCATTER(out, torch._scaled_mm(a, bt, a_scale, b_scale, out_dtype=torch.bfloat16),
                                group=group)
            return out
        return unfused, "torch._scaled_mm then NCCL reduce-scatter (bf16 partials)"
    _, op = symm_mem_op("symm_mem.fused_scaled_matmul_reduce_scatter", enable_for=group)
    return (lambda: op(a, bt, a_scale, b_scale, "sum", 0, 0, group.group_name,
                       [a.shape[0], b.shape[1]], out_dtype=torch.bfloat16)), "async-TP"


def _dist_measure(op, backend, shape, scaling, group, device, agree):
    """``(fn, bytes moved, note)`` of ``backend``'s case of ``op`` on ``group``, checked once
    against float64 of the dequantized operands (also tests/gpu/test_gpu_shared_rows.py's)."""
    m, k, n = shape
    world, rank = split_rows(m, group, agree)
    if op == AG:
        a_hp, a, a_scale, b_hp, b, b_scale = _operands(m // world, k, n, rank, device, scaling)
        make = _ag_case
    else:
        a_hp, a, a_scale, b_hp, b, b_scale = _operands(m, k, n, rank, device, scaling)
        make = _rs_case
    fn, note, got, bytes_moved = run_case(
        backend, lambda: make(backend, a, a_scale, b, b_scale, a_hp, b_hp, group), agree)
    if note != "bf16":
        out = got[1][0] if op == AG else got
        mine = (a.double() * a_scale.double()) @ (b.double() * b_scale.double())
        if op == AG:
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine, group=group)
            exact = torch.cat(parts)
        else:
            dist.all_reduce(mine, group=group)
            exact = mine.chunk(world)[rank]
        assert agree(rel_err(out, exact) <= 2e-2), f"{backend}: error {rel_err(out, exact):.3g}"
    return fn, bytes_moved, note


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("op,backend", [(AG, b) for b in AG_ROWS] + [(RS, b) for b in RS_ROWS])
@pytest.mark.parametrize("shape", SHAPES, ids=name)
def test_torchrun(benchmark, dist_gpu, gpu_times, record_row, agree, synced, shape, op, backend, scaling):
    group, device = dist_gpu
    if backend.endswith(".bf16") and scaling == "rowwise":
        pytest.skip("the bf16 row is the same for both scalings")
    fn, bytes_moved, note = or_skip(_dist_measure, op, backend, shape, scaling, group, device, agree)
    _record(benchmark, gpu_times, record_row, synced, op, backend, shape, dist.get_world_size(group),
            "torchrun", scaling, fn, bytes_moved, impl=note)

