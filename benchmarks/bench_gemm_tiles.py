"""gemm_tiles: the fused matmul ops' GEMMs alone (no communication), with each sm_90 tile
candidate of ``fusedpar.kernels.gemm`` (``TILE_CANDIDATES_SM90``), the one the tile choice
picks (``auto``: ``gemm.choose_tile``) and ``torch.matmul`` (cuBLAS) as the baseline, on one
GPU, bf16 (docs/design.md §6; issue 43: tiles that fill the waves at N=1280).

* ``mode=all_gather_matmul``: the peers kernel's plain gather, as all_gather_matmul runs it
  (``gemm_peers.grouped_mm_peers``, ending the call): the gathered ``A [M, K]`` in W=8 blocks
  of M / W rows, one per source, over a fake one-rank signal pad whose GATHERED flags are
  already raised, so no tile waits.
* ``mode=matmul_reduce_scatter``: ``matmul_reduce_scatter.matmul_reduce_scatter``'s GEMM of
  ``A [M, K] @ B [K, N]`` in W=8 chunks of M / W rows (tiles never span two), raising each
  chunk's READY flag in the same fake pad (standing for all W ranks' pads) and waiting for
  nothing (every DONE of epoch 0 is there).

Both grids as in a group call: all SMs but one (``sms - 1``, the peers kernel's
``peers_grid`` and matmul_reduce_scatter's ``REDUCER_SMS``), times the candidate's CTAs per
SM; ``auto`` is the candidate ``choose_tile`` names for those SMs (notes: ``chose``). The
shapes (``M x K x N``) are bench_all_gather_matmul.py's and bench_matmul_reduce_scatter.py's.
Each case checks its product once (NaN-poisoned output; error against fp64 at most 2x
torch.matmul's in bf16), then do_bench times it; rows go to ``results/gemm_tiles.csv`` with
TFLOP/s, the tiling (tiles, waves, wave efficiency, efficiency: ``gemm.tile_fit``), the
speed-up over torch.matmul (target: targets.py), ``gpu_busy_ms`` (one profiled call: the
kernel alone; the small shape's GEMM is tens of microseconds, near the launcher's host
time, so the median may hold host time: ``host_ms``). Skips without a GPU: no numbers are
ever printed for a machine that did not run them.

``test_candidates_multiply_exactly``: not a timing; every candidate through both launchers at
a tiny shape, in the interpreter on CPU (or on the GPU).
"""

import pytest
import torch

from fusedpar.comm import layout
from fusedpar.kernels import gemm, gemm_peers, matmul_reduce_scatter
from fusedpar.kernels.gemm import TILE_CANDIDATES_SM90, choose_tile, tile_fit

from common import AUTO, DTYPE, W_LOOPBACK, bench, gpu_profile, host_ms, name, rel_err
from targets import BASELINES

OP = "gemm_tiles"
W = W_LOOPBACK  # the blocks / chunks of the fused ops' W=8 cases
GATHER, SCATTER = "all_gather_matmul", "matmul_reduce_scatter"
CASES = [(GATHER, (8192, 8192, 1280)), (GATHER, (8192, 8192, 7168)), (GATHER, (1000 * W, 1032, 1288)),
         (SCATTER, (8192, 1024, 8192)), (SCATTER, (8192, 3584, 8192)), (SCATTER, (1000 * W, 1032, 1288))]
BASELINE = "torch.matmul"
BACKENDS = [BASELINE, *TILE_CANDIDATES_SM90, AUTO]  # the baseline first
TARGET = BASELINES[OP][BASELINE]
TIMEOUT_NS = 10 * 10**9
_medians: dict = {}
_operands: dict = {}


def fake_pad(device: torch.device, world: int = W) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pad, pad_table)``: one rank's signal pad (``layout``: zeros, so no failure, no
    deadline, every peer's DONE of epoch 0) with the GATHERED flags of ``world`` sources
    raised, and a table that names it as every one of ``world`` ranks' pads. Keep ``pad``
    alive while the table is used."""
    pad = torch.zeros(layout.PAD_WORDS, dtype=torch.int32, device=device)
    pad[layout.GATHERED:layout.GATHERED + world] = 1
    return pad, torch.full((world,), pad.data_ptr(), dtype=torch.int64, device=device)


def tile_config(cand: str, sms: int | None) -> dict:
    """The launch override of a candidate: its tiles and CTAs per SM (TMA stays the
    launcher's call: the layouts decide), NUM_PROGRAMS for ``sms`` SMs (None: the
    interpreter's)."""
    cfg = {k: v for k, v in TILE_CANDIDATES_SM90[cand].items() if k != "TMA"}
    if sms is not None:
        cfg["NUM_PROGRAMS"] = sms * cfg.get("CTAS_PER_SM", 1)
    return cfg


def gemm_fn(mode: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, config: dict | None):
    """``fn()`` running the fused op's GEMM kernel (``mode``) of ``a @ b`` into ``out`` with
    the launch ``config``; the pad and block tables made here, once."""
    device, m = a.device, a.shape[0]
    pad, table = fake_pad(device)
    if mode == GATHER:  # as all_gather_matmul's rank 0: sources 0..W-1, own first, one run
        rows = m // W
        blocks = [(src, 0, 0, src * rows, rows) for src in range(W)]
        runs = gemm_peers.block_runs(blocks)
        blocks_t = torch.tensor(blocks, dtype=torch.int32, device=device)
        runs_t = torch.from_numpy(runs).to(torch.int32).to(device)
        run_rows = runs[:, 2].tolist()
        b3 = b.unsqueeze(0)

        def fn():
            gemm_peers.grouped_mm_peers(a, b3, out, blocks_t, runs_t, run_rows, table, 0, 1, 1,
                                        TIMEOUT_NS, push=False, config=config, ends_call=True)
            return out
    else:
        def fn():
            matmul_reduce_scatter.matmul_reduce_scatter(a, b, out, table, 0, W, 1, 0, TIMEOUT_NS,
                                                        config=config)
            return out
    fn.pad = pad  # the table's addresses stay valid as long as fn lives
    return fn


def _case_operands(shape, device):
    """``(a, b, ref64, torch_err)`` of a shape, made once (the last shape's only)."""
    if shape not in _operands:
        _operands.clear()
        m, k, n = shape
        g = torch.Generator(device=device)
        g.manual_seed(0)
        a = torch.randn(m, k, generator=g, device=device).to(DTYPE)
        b = (torch.randn(k, n, generator=g, device=device) * k ** -0.5).to(DTYPE)
        ref64 = a.double() @ b.double()
        _operands[shape] = a, b, ref64, rel_err(a @ b, ref64)
    return _operands[shape]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, shape", CASES, ids=[f"{m}-{name(s)}" for m, s in CASES])
def test_gemm_tiles(benchmark, gpu, gpu_times, record_row, report_target, synced, mode, shape,
                    backend):
    m, k, n = shape
    a, b, ref64, torch_err = _case_operands(shape, gpu)
    out = torch.empty(m, n, dtype=DTYPE, device=gpu)
    sms = torch.cuda.get_device_properties(gpu).multi_processor_count - 1  # a group call's grid
    rows = [m // W] * W if mode == SCATTER else m  # matmul_reduce_scatter tiles per chunk
    notes = {"mode": mode}
    if backend == BASELINE:
        def fn():
            return torch.matmul(a, b, out=out)
    else:
        cand = choose_tile(rows, n, sms) if backend == AUTO else backend
        cfg = TILE_CANDIDATES_SM90[cand]
        fit = tile_fit(rows, n, cfg, sms)
        notes.update(config=f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} "
                            f"s{cfg['num_stages']} {cfg.get('CTAS_PER_SM', 1)}/SM",
                     tiles=fit.tiles, waves=f"{fit.waves:.2f}", wave_efficiency=f"{fit.wave_efficiency:.3f}",
                     efficiency=f"{fit.efficiency:.3f}")
        if backend == AUTO:
            notes["chose"] = cand
        fn = gemm_fn(mode, a, b, out, tile_config(cand, sms))
    out.fill_(float("nan"))
    err = rel_err(fn(), ref64)
    assert err <= max(2 * torch_err, 1e-6), f"{backend}: error {err:.3g}, torch.matmul {torch_err:.3g}"
    times = gpu_times(fn)
    tflops = 2 * m * k * n / (times[0] * 1e-3) / 1e12
    busy, _ = gpu_profile(fn)
    notes.update(tflops=f"{tflops:.1f}", gpu_busy_ms=f"{busy:.3f}", host_ms=f"{host_ms(fn):.3f}")
    key = (mode, shape)
    if backend == BASELINE:
        _medians[key] = times[0]
    elif key in _medians:
        ratio = _medians[key] / times[0]
        verdict = "met" if ratio >= TARGET else "MISSED"
        notes[f"vs_{BASELINE}"] = f"{ratio:.3f}x (target >= {TARGET}x: {verdict})"
        report_target(f"{OP} {mode} {name(shape)} {backend}: {ratio:.3f}x {BASELINE} "
                      f"(target >= {TARGET}x: {verdict})")
    record_row(OP, backend, shape, DTYPE, 1, *times,
               algo_bytes=(m * k + k * n + m * n) * DTYPE.itemsize, **notes)
    benchmark.group = f"{OP} {mode} {name(shape)} bf16"
    bench(benchmark, synced, fn, times, **notes)


# ---- the candidates' products (no timing; CPU too) -------------------------------------------


@pytest.mark.parametrize("mode", [GATHER, SCATTER])
def test_candidates_multiply_exactly(local_device, mode):
    """Every candidate's blocks through the launcher of ``mode`` at a tiny shape (W blocks or
    chunks of 20 rows, several tiles of each block size, TMA loads: 16-byte rows): the
    product exactly (small integers), every element written (NaN-poisoned output). In the
    interpreter the blocks are the candidates', the grid the interpreter's."""
    m, k, n = 20 * W, 64, 296
    g = torch.Generator(device=local_device)
    g.manual_seed(5)
    a = torch.randint(-1, 2, (m, k), generator=g, device=local_device).to(DTYPE)
    b = torch.randint(-2, 3, (k, n), generator=g, device=local_device).to(DTYPE)
    expected = (a.double() @ b.double()).to(DTYPE)  # |sums| <= 128: exact in bf16
    sms = None if gemm.interpreting() else \
        torch.cuda.get_device_properties(local_device).multi_processor_count - 1
    for cand in TILE_CANDIDATES_SM90:
        out = torch.full((m, n), float("nan"), dtype=DTYPE, device=local_device)
        config = tile_config(cand, sms)
        assert gemm.gemm_operands(a, b.unsqueeze(0), config)[0]["TMA"], cand
        gemm_fn(mode, a, b, out, config)()
        assert torch.equal(out, expected), (cand, (out.double() - expected.double()).abs().nan_to_num(1e9).max())
