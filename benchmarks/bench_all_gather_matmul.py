"""all_gather_matmul: fusedpar backends next to what a user would pick instead (docs/design.md §6).

* ``test_loopback`` (one GPU, no torchrun): every rank of a W=8 all_gather_matmul in one
  process (``all_gather_matmul_loopback``: each simulated rank's peer shards are copied
  into its gathered A, then the triton GEMM a group runs), against W ``torch.matmul`` calls
  of the same per-rank GEMM (``A_gathered @ B``, the gather left out: the copies are
  fusedpar's cost alone). Target: >= 0.9x torch.matmul's TFLOP/s. Variants of ``triton``:

  - ``triton.graph``: the call captured once in a CUDA graph (after an eager call) and
    replayed, as a captured training step runs it: no host work per call. Checked first:
    replays on new inputs equal eager calls bitwise (``common.graph_replay``). Target: its
    median within 1.15x of its GPU busy time (``vs_gpu_busy``).
  - ``triton.copy_engine``: the peers' shards copied by the copy engine on a side stream
    while each view's GEMM spins on their flags, as a process group copies them; on one GPU
    every flag is up before the GEMM needs it (``copy_engine=True``).
  - ``triton.late_flags``: the same with each peer shard's copy delayed (``copy_delays``:
    the side stream sleeps first) so that the shard of the GEMM's step s lands about when
    the GEMM, walking its tiles in shard order, reaches it: in the round of tiles (one tile
    per resident program) that holds the shard's first tile (``_reach_ms``; with full rounds
    that is earlier than s/W of the GEMM's time), timed by the on-time run's GEMM from its
    profile, converted to cycles of the SM clock measured with CUDA events
    (``common.sleep_cycles_per_ms``), corrected once from where the copies landed in a
    profiled call. What it shows: a grid of resident programs (one per SM but the copy
    stream's) walking the tiles in shard order needs shard s only once the tiles before it
    are taken, so it loses no time to flags that late; a grid larger than the resident
    slots would, as resident programs spin on late shards while earlier tiles wait in
    programs not yet launched. The row notes the GEMM kernel's own time in both runs
    (``gemm_ms``, ``gemm_on_time_ms``: profiled calls) and their ratio; target: within 5%
    (``gemm_late_vs_on_time`` <= 1.05x); ``stagger`` (the rounds), ``last_flag_us`` (the
    last shard's planned landing after the GEMM's start) and ``flags_landed`` (1.00: where
    planned).
* ``test_torchrun`` (``torchrun --nproc-per-node N -m pytest benchmarks``): each backend
  against the unfused NCCL ``all_gather_into_tensor`` then cuBLAS matmul, and against torch
  ``symm_mem.fused_all_gather_matmul`` (async-TP). Targets: >= 1.0x symm_mem, >= 1.2x unfused.
  On one GPU, the group path in a gloo group of ranks sharing it (no NCCL there): rows of
  their own op, ``*_shared_gpu``, from tests/gpu/test_gpu_shared_rows.py.
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

import bisect

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops.calls import MatmulCall

from common import (AUTO, DTYPE, GRAPH, NCCL_ALL_GATHER, W_LOOPBACK, MatmulSuite, auto_choice,
                    auto_label, counted, gpu_intervals, graph_replay, kernel_ms, nbytes, or_skip,
                    rel_err, run_case, sleep_cycles_per_ms, split_rows, symm_mem_op)
from targets import row_target

OP = "all_gather_matmul"
SHAPES = [(8192, 8192, 1280), (8192, 8192, 7168), (1000 * W_LOOPBACK, 1032, 1288)]  # M, K, N
SYMM_MEM = "symm_mem.fused_all_gather_matmul"
UNFUSED = "nccl+matmul"
COPY_ENGINE, LATE_FLAGS = "triton.copy_engine", "triton.late_flags"  # module docstring
SUITE = MatmulSuite(OP, symm_mem=SYMM_MEM, unfused=UNFUSED,
                    loopback_extra=(GRAPH, COPY_ENGINE, LATE_FLAGS),
                    moved_cols=lambda m, k, n: k)  # A_gathered [M, K] crosses ranks
GEMM_KERNEL = "grouped_mm_peers_kernel"  # the triton GEMM's name in a profile
PEER_COPY = "Memcpy DtoD"  # a peer shard's copy-engine copy (torch.profiler's name)
PROFILED_CALLS = 3  # calls per profile of the GEMM's time (W GEMMs each)


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
    note = None  # AUTO: the backend it chose; a variant: its own notes (MatmulSuite.run)
    if backend == AUTO:  # the loopback case of what the dispatcher would run
        backend, note = auto_label(OP, MatmulCall(OP, xs[0], 0, world, None, [b]),
                                   SUITE.loopback_labels)
    if backend == "torch.matmul":
        def fn():  # the same W per-rank GEMMs, the gather left out
            return [(None, [torch.matmul(gathered, b)]) for _ in range(world)]
        results, bytes_moved = fn(), None
    elif backend == GRAPH:  # checked against eager calls, then replayed (counts no bytes)
        counted(lambda: fusedpar.ops.all_gather_matmul_loopback(xs, [b], 0))  # Unavailable?
        fn = graph_replay(lambda: fusedpar.ops.all_gather_matmul_loopback(xs, [b], 0), [*xs, b])
        results, bytes_moved = fn(), None
    elif backend in (COPY_ENGINE, LATE_FLAGS):
        fn, note = _copy_engine_case(backend, xs, b)
        results, bytes_moved = counted(fn)
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
    return fn, gpu_times(fn), bytes_moved, note


def _copy_engine_case(backend, xs, b):
    """``(fn, notes)`` of the ``COPY_ENGINE`` or ``LATE_FLAGS`` variant (module docstring);
    the GEMM's time in each from ``PROFILED_CALLS`` profiled calls."""
    world = W_LOOPBACK

    def run(cycles=None):  # cycles: the side stream's sleep before each peer copy
        return lambda: fusedpar.ops.all_gather_matmul_loopback(xs, [b], 0, copy_engine=True,
                                                               copy_delays=cycles)

    counted(run())  # Unavailable where triton cannot run here
    intervals = gpu_intervals(run(), PROFILED_CALLS)
    gemm_on_time, gemms = kernel_ms(intervals, GEMM_KERNEL, PROFILED_CALLS)
    copy_ms, copies = kernel_ms(intervals, PEER_COPY, PROFILED_CALLS)
    assert gemms == PROFILED_CALLS * world, f"{gemms} GEMM launches in {PROFILED_CALLS} calls"
    copy_ms *= PROFILED_CALLS / max(copies, 1)  # per copy
    if backend == COPY_ENGINE:
        return run(), {"gemm_ms": f"{gemm_on_time:.3f}", "copy_us": f"{1e3 * copy_ms:.1f}"}
    reach, how = _reach_ms(run(), xs[0].shape[0], b.shape[1], gemm_on_time / world)
    sleeps, lands = [], 0.0  # the side stream copies in order: each sleeps, then copies
    for step in range(1, world):
        sleeps.append(max(reach[step] - copy_ms - lands, 0.0))
        lands += sleeps[-1] + copy_ms
    cycles_per_ms = sleep_cycles_per_ms()
    cycles = [round(ms * cycles_per_ms) for ms in sleeps]
    landed = _last_landing(gpu_intervals(run(cycles), PROFILED_CALLS))
    slept = landed - (world - 1) * copy_ms
    if sum(sleeps) and slept > 0 and abs(landed / lands - 1) > 0.03:
        # the SM clock under the GEMM's load is not the idle one: scale the sleeps, once
        cycles = [round(c * sum(sleeps) / slept) for c in cycles]
    intervals = gpu_intervals(run(cycles), PROFILED_CALLS)
    gemm_late, _ = kernel_ms(intervals, GEMM_KERNEL, PROFILED_CALLS)
    landed = _last_landing(intervals)
    return run(cycles), {
        "gemm_ms": f"{gemm_late:.3f}", "gemm_on_time_ms": f"{gemm_on_time:.3f}",
        "gemm_late_vs_on_time": row_target("gemm_late_vs_on_time", gemm_late / gemm_on_time),
        "stagger": how, "last_flag_us": f"{1e3 * lands:.1f}",
        "flags_landed": f"{landed / lands:.2f}" if lands and landed else "n/a",
        "sleep_mhz": f"{cycles_per_ms / 1e3:.0f}"}


def _reach_ms(call, m: int, n: int, view_ms: float) -> tuple[list[float], str]:
    """``(ms, how)``: when a view's GEMM (``view_ms`` long, ``m`` rows per shard, N = ``n``)
    first reaches the rows of each shard it takes (step 0 its own), and how that was worked
    out. The GEMM's resident programs walk its tiles in order (``grouped_tile``: GROUP_M
    m-tiles at a time across N), a round of tiles at a time, so step s's shard is first
    needed in the round that holds its first tile, not s/W of the way through: a flag that
    lands then costs a resident grid nothing. The config and grid are those of the launch
    the op makes in ``call()`` (``gemm_peers.GatherLaunch``, recorded); where it cannot be
    seen, every shard an equal share (``uniform``)."""
    from fusedpar.kernels import gemm_peers

    world, made, original = W_LOOPBACK, [], gemm_peers.GatherLaunch

    class Recorded(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    gemm_peers.GatherLaunch = Recorded
    try:
        call()
    finally:
        gemm_peers.GatherLaunch = original
    try:
        cfg, programs = made[0].cfg, made[0].grid[0]
        bm, bn, group = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["GROUP_M"]
    except (AttributeError, IndexError, KeyError, TypeError):  # the op no longer makes one
        return [step * view_ms / world for step in range(world)], "uniform"
    n_tiles = -(-n // bn)
    rounds = -(-(-(-world * m // bm) * n_tiles) // programs)  # ceil(tiles / programs)
    firsts = [(j // group) * group * n_tiles + j % group  # the first tile of m-tile j
              for j in (step * m // bm for step in range(world))]
    reached = [first // programs for first in firsts]
    return ([r * view_ms / rounds for r in reached],
            f"rounds {'/'.join(map(str, reached))} of {rounds} ({programs} programs)")


def _last_landing(intervals) -> float:
    """The mean ms from a view's GEMM start to its last peer copy's end (each copy counted
    with the GEMM running when it ended); 0 without any."""
    gemms = [(start, end) for event, start, end in intervals if GEMM_KERNEL in event]
    starts = [start for start, _ in gemms]
    last: dict[int, float] = {}
    for event, _, end in intervals:
        if PEER_COPY in event:
            i = bisect.bisect_right(starts, end) - 1
            if i >= 0 and end <= gemms[i][1]:
                last[i] = max(last.get(i, end), end)
    return sum(end - starts[i] for i, end in last.items()) / len(last) / 1e3 if last else 0.0


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
