"""The sm_90 tile choice of the fused GEMMs (``gemm.choose_tile``): tiles that fill the
waves of a GPU of S SMs, computed on the host (no GPU). The shapes are the fused matmul
benchmarks' (``M x K x N``; all_gather_matmul's gathered GEMM has all M rows in one run,
matmul_reduce_scatter's is tiled per chunk of M / 8 rows) on an H100 (132 SMs; the peers
kernel's grid leaves one free, and so does matmul_reduce_scatter's in a group call)."""

import types

import pytest
import torch

from fusedpar.kernels import gemm
from fusedpar.kernels.gemm import (DEFAULT_TILE, GPU_CONFIG_SM80, GPU_CONFIG_SM90, POINTER_CONFIG_SM90,
                                   TILE_CANDIDATES_SM90, TILE_MARGIN, choose_tile, gpu_config, tile_fit)

SMS = 132
W = 8

# (rows, N) -> the pick on 132 and on 131 SMs; rows: all_gather_matmul's one run, or
# matmul_reduce_scatter's W chunks
SHAPES = {
    "all_gather_matmul 8192x8192x1280": (8192, 1280, "128x128"),
    "all_gather_matmul 8192x8192x7168": (8192, 7168, "128x256"),
    "all_gather_matmul 8000x1032x1288": (8000, 1288, "128x256"),
    "matmul_reduce_scatter 8192x1024x8192": ([1024] * W, 8192, "128x256"),
    "matmul_reduce_scatter 8192x3584x8192": ([1024] * W, 8192, "128x256"),
    "matmul_reduce_scatter 8000x1032x1288": ([1000] * W, 1288, "128x256"),
}


def test_the_default_tile_is_todays_config():
    """Without a shape, and wherever the choice does not apply (sm_80, pointer loads, the
    SwiGLU epilogues), the configs are what they were."""
    assert TILE_CANDIDATES_SM90[DEFAULT_TILE] is GPU_CONFIG_SM90
    assert next(iter(TILE_CANDIDATES_SM90)) == DEFAULT_TILE  # the first preference
    assert gpu_config(9, True) is GPU_CONFIG_SM90
    shape = (8192, 1280)  # where sm_90 with TMA picks another tile
    assert gpu_config(9, True, shape=shape, sms=SMS) is not GPU_CONFIG_SM90
    assert gpu_config(8, False, shape=shape, sms=108) is GPU_CONFIG_SM80
    assert gpu_config(8, True, shape=shape, sms=108) is GPU_CONFIG_SM80
    assert gpu_config(9, False, shape=shape, sms=SMS) is POINTER_CONFIG_SM90
    assert gpu_config(9, True, "swiglu", shape=shape, sms=SMS) == dict(GPU_CONFIG_SM90, BLOCK_N=128)


def test_candidates_fit_an_sm():
    """Every candidate's pipeline fits the shared memory its CTAs per SM share (228 KB an
    SM, 1 KB reserved per CTA; ptxas adds a few bytes: tests/kernels/test_aot.py checks the
    compiled sizes), and 16-bit TMA boxes of at most 256 a side."""
    for name, cfg in TILE_CANDIDATES_SM90.items():
        stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
        per_sm = cfg.get("CTAS_PER_SM", 1)
        assert per_sm * (cfg["num_stages"] * stage + 1024 + 64) <= 228 * 1024, name
        assert cfg["TMA"] and max(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) <= 256, name


def test_n1280_no_longer_takes_a_2_42_wave_config():
    """all_gather_matmul 8192x8192x1280: 128x256 tiles are 64 x 5 = 320 tiles = 2.42 waves
    on 132 SMs (a third wave 42% full: 81%); the pick has 4.85 waves, 97%."""
    default = tile_fit(8192, 1280, GPU_CONFIG_SM90, SMS)
    assert (default.tiles, round(default.waves, 2), default.rounds) == (320, 2.42, 3)
    assert default.wave_efficiency == pytest.approx(320 / 396)
    for sms in (SMS, SMS - 1):
        name = choose_tile(8192, 1280, sms)
        fit = tile_fit(8192, 1280, TILE_CANDIDATES_SM90[name], sms)
        assert name != DEFAULT_TILE
        assert fit.waves > 4.8 and fit.wave_efficiency > 0.96 and fit.efficiency > 0.96, (name, fit)
    assert choose_tile(8192, 1280, SMS) == "128x128"
    # 2 CTAs/SM of 128x128 tiles have 128x256's waves: the same 81%
    two = tile_fit(8192, 1280, TILE_CANDIDATES_SM90["2x128x128"], SMS)
    assert (two.tiles, two.slots, round(two.waves, 2)) == (640, 264, 2.42)


@pytest.mark.parametrize("case", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("sms", [SMS, SMS - 1])
def test_the_benchmarks_shapes(case, sms):
    """N=7168 and the reduce-scatter shapes already fill 97% of their waves with 128x256:
    kept; the odd shape's 128x256 tiles fill 80% of the SMs' tile work, and so do all the
    others' (their edge tiles and waves trade off): the larger tile is kept."""
    rows, n, expected = SHAPES[case]
    assert choose_tile(rows, n, sms) == expected
    fit = tile_fit(rows, n, TILE_CANDIDATES_SM90[expected], sms)
    assert fit.efficiency >= 0.79, fit


def test_odd_shapes_count_partial_tiles_per_run():
    """Tiles never span runs or chunks: 8 chunks of 1000 rows take 8 x 8 row tiles of 128,
    one run of 8000 rows 63; N=1288 takes 6 column tiles of 256, 11 of 128."""
    assert tile_fit(8000, 1288, GPU_CONFIG_SM90, SMS).tiles == 63 * 6
    assert tile_fit([1000] * W, 1288, GPU_CONFIG_SM90, SMS).tiles == 64 * 6
    assert tile_fit(8000, 1288, TILE_CANDIDATES_SM90["128x128"], SMS).tiles == 63 * 11
    fit = tile_fit(8000, 1288, GPU_CONFIG_SM90, SMS)
    assert fit.rounds == 3 and fit.wave_efficiency == pytest.approx(378 / 396)
    assert fit.efficiency == pytest.approx(8000 * 1288 / (3 * 132 * 128 * 256))
    assert choose_tile((1000,) * W, 1288, SMS) == choose_tile([1000] * W, 1288, SMS)


@pytest.mark.parametrize("rows, n", [(1, 8), (100, 100), (128, 128), (0, 1280), (8192, 0), ([], 64)])
def test_tiny_and_empty_shapes(rows, n):
    """One tile: the smallest (half the MMAs of 128x256), the first of equal size;
    an empty product: the default."""
    name = choose_tile(rows, n, SMS)
    if rows in (0, []) or n == 0:
        assert name == DEFAULT_TILE
        assert tile_fit(rows, n, GPU_CONFIG_SM90, SMS).tiles == 0
    else:
        assert name == "128x128"


def test_choice_is_never_worse_than_the_default():
    """Over a sweep of LLM-like shapes and GPUs: the pick is at least as efficient as
    128x256, and where it is another tile, by more than TILE_MARGIN (the preference for
    larger tiles). Two 128x128 CTAs per SM have 128x256's waves: never picked."""
    changed = 0
    for m in (512, 1024, 2048, 4096, 8000, 8192, 16384):
        for n in (1024, 1280, 1288, 2048, 3584, 4096, 5120, 7168, 8192, 14336):
            for sms in (132, 131, 114, 78):
                for rows in (m, [m // W] * W):
                    name = choose_tile(rows, n, sms)
                    fit = tile_fit(rows, n, TILE_CANDIDATES_SM90[name], sms)
                    default = tile_fit(rows, n, GPU_CONFIG_SM90, sms)
                    assert fit.efficiency >= default.efficiency, (rows, n, sms, name)
                    assert name != "2x128x128"  # never above 128x128, which comes first
                    if name != DEFAULT_TILE:
                        changed += 1
                        assert fit.efficiency * (1 - TILE_MARGIN) > default.efficiency
    assert changed  # the choice does something


def _fake_hopper(monkeypatch, major=9, sms=SMS):
    """Launch-time queries as on a GPU of compute capability ``major`` with ``sms`` SMs,
    and the compiled (not interpreted) configs."""
    monkeypatch.setattr(gemm, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=sms))
    monkeypatch.setattr(gemm, "_sm_counts", {})


def test_gemm_operands_choose_where_the_caller_gives_the_shape(monkeypatch):
    """``shape=`` picks the tiles (and the TMA boxes); without it, or with a config that
    sets tiles itself, the old config; NUM_PROGRAMS is the SMs given (or the device's)
    times the config's CTAs per SM."""
    _fake_hopper(monkeypatch)
    a = torch.zeros(8192, 64, dtype=torch.bfloat16)
    b = torch.zeros(1, 64, 1280, dtype=torch.bfloat16)
    cfg, a_desc, b_desc, kmajor = gemm.gemm_operands(a, b)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["NUM_PROGRAMS"], cfg["TMA"]) == (128, 256, SMS, True)
    cfg, a_desc, b_desc, kmajor = gemm.gemm_operands(a, b, shape=(8192, 1280))
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]) == (128, 128, 8, 4)
    assert cfg["NUM_PROGRAMS"] == SMS and not kmajor
    assert list(a_desc.block_shape) == [128, 64] and list(b_desc.block_shape) == [1, 64, 128]
    cfg = gemm.grouped_config(a, {"NUM_PROGRAMS": 7}, shape=([1024] * W, 1280), sms=SMS - 1)
    assert (cfg["BLOCK_N"], cfg["NUM_PROGRAMS"]) == (128, 7)
    cfg = gemm.grouped_config(a, shape=(8192, 7168), sms=SMS - 1)
    assert (cfg["BLOCK_N"], cfg["NUM_PROGRAMS"]) == (256, SMS - 1)
    # a caller's tiles win, and set the grid of their CTAs per SM
    two = {k: v for k, v in TILE_CANDIDATES_SM90["2x128x128"].items() if k != "TMA"}
    cfg = gemm.grouped_config(a, two, shape=(8192, 1280))
    assert (cfg["BLOCK_N"], cfg["num_warps"], cfg["NUM_PROGRAMS"]) == (128, 4, 2 * SMS)
    cfg = gemm.grouped_config(a, {"BLOCK_N": 64}, shape=(8192, 1280))
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]) == (128, 64, 8)  # on the default
    # operands TMA cannot cover: the pointer-load config, whatever the shape
    cfg, *_ = gemm.gemm_operands(torch.zeros(8192, 63, dtype=torch.bfloat16), b[:, :63], shape=(8192, 1280))
    assert cfg == gemm.gemm_config(a.dtype, a.device, POINTER_CONFIG_SM90)


def test_sm80_and_fp32_ignore_the_shape(monkeypatch):
    _fake_hopper(monkeypatch, major=8, sms=108)
    a = torch.zeros(256, 64, dtype=torch.bfloat16)
    cfg = gemm.grouped_config(a, shape=(8192, 1280))
    assert cfg == dict(GPU_CONFIG_SM80, NUM_PROGRAMS=108)
    _fake_hopper(monkeypatch)
    cfg = gemm.grouped_config(a.float(), shape=(8192, 1280))
    assert cfg == dict(gemm.GPU_CONFIG_FP32, TMA=False, NUM_PROGRAMS=SMS)  # FMA tiles, pointer loads


def test_the_interpreter_keeps_its_config():
    a = torch.zeros(64, 32, dtype=torch.bfloat16)
    assert gemm.interpreting()
    cfg = gemm.grouped_config(a, shape=(8192, 1280), sms=SMS)
    assert cfg == dict(gemm.INTERPRETER_CONFIG, TMA=True)


def test_candidate_aot_examples():
    """``tile_candidate_examples``: each candidate but the default, B row-major and K-major,
    on sm_90, with only the kernel's constexprs (CTAS_PER_SM sets the grid, not the
    kernel) and NUM_PROGRAMS for its CTAs per SM."""
    from fusedpar.kernels import gemm_peers
    from fusedpar.kernels import matmul_reduce_scatter as mrs

    peers = gemm.tile_candidate_examples(gemm_peers.grouped_mm_peers_kernel, gemm_peers._PEERS_SIG,
                                         dict(gemm_peers._GATHER, END=True))
    sig = {k: v.replace("*T", "*bf16") for k, v in mrs._SIG.items()}
    scatter = gemm.tile_candidate_examples(mrs.matmul_reduce_scatter_kernel, sig, {"SCALED": False},
                                           num_programs=131)
    others = len(TILE_CANDIDATES_SM90) - 1
    assert len(peers) == len(scatter) == 2 * others
    for kernel, sig, consts, options in peers + scatter:
        assert options["arch"] == 90 and "spills_ok" not in options
        assert set(consts) <= set(kernel.arg_names) and "CTAS_PER_SM" not in consts
        assert sig["a"].startswith("tensordesc<bf16[") and consts["TMA"]
        assert ("stride_bk" in consts) != ("stride_bn" in consts) and consts["B_KMAJOR"] == ("stride_bk" in consts)
        # every runtime argument has a type or a value
        assert set(kernel.arg_names) - set(sig) - set(consts) == set()
    programs = sorted({consts["NUM_PROGRAMS"] for _, _, consts, _ in scatter})
    assert programs == [131, 262]
    shapes = {(c["BLOCK_M"], c["BLOCK_N"], o["num_warps"], o["num_stages"]) for _, _, c, o in peers}
    assert shapes == {(128, 128, 8, 4), (64, 256, 8, 4), (128, 128, 4, 3)}
