"""Launch grids against CUDA's limits, computed at shapes far beyond what the interpreter can
run (no GPU needed): axis 0 < 2^31, axes 1 and 2 <= 65,535, and kernels that spin on flags
hold at most a few programs per SM (they loop over their work)."""

import pytest
import torch

from fusedpar.kernels import all_gather, gemm, gemm_peers, moe_permute, reduce_scatter
from fusedpar.kernels.signal import PROGRAMS_PER_SM, poison_grid

SMS = 132  # H100 SXM
HUGE = [(1, 2**31 + 5), (3, 2**27 + 1), (2**20, 4096)]  # (outer, inner): > 65,535 blocks


def _within_cuda_limits(grid):
    assert 1 <= len(grid) <= 3, grid
    assert 1 <= grid[0] < 2**31, grid
    assert all(1 <= g <= 65_535 for g in grid[1:]), grid


@pytest.mark.parametrize("outer, inner", HUGE)
@pytest.mark.parametrize("world", [1, 8, 256])
def test_all_gather_grid_is_capped_and_legal(outer, inner, world):
    grid = all_gather.all_gather_grid(outer, inner, world, SMS)
    _within_cuda_limits(grid)
    assert grid[0] <= PROGRAMS_PER_SM * SMS


@pytest.mark.parametrize("outer, inner", HUGE)
def test_reduce_scatter_grid_is_capped_and_legal(outer, inner):
    grid = reduce_scatter.reduce_scatter_grid(outer, inner, SMS)
    _within_cuda_limits(grid)
    assert grid[0] <= PROGRAMS_PER_SM * SMS


@pytest.mark.parametrize("outer, inner", HUGE)
def test_the_poison_grid_is_capped_and_legal(outer, inner):
    grid = poison_grid(outer * inner, SMS)
    _within_cuda_limits(grid)
    assert grid[0] <= PROGRAMS_PER_SM * SMS


def test_persistent_gemm_grids_hold_one_program_per_sm():
    for arch, major in ((90, 9), (80, 8)):
        for dtype in (torch.bfloat16, torch.float32):
            cfg = dict(gemm.gpu_gemm_config(dtype, major), NUM_PROGRAMS=gemm.SM_COUNT[arch])
            tiles = 256 * (2**20 // cfg["BLOCK_M"]) * (2**16 // cfg["BLOCK_N"])
            grid = gemm.persistent_grid(tiles, cfg)
            _within_cuda_limits(grid)
            assert grid == (gemm.SM_COUNT[arch],)


@pytest.mark.parametrize("rows, H", [(2**31 - 1, 7168), (2**20 + 3, 65535 * 256), (1, 1), (0, 0)])
def test_moe_row_kernel_grids_are_legal(rows, H):
    _within_cuda_limits(moe_permute.rows_grid(rows, H, moe_permute.ROW_BLOCK_GPU))


@pytest.mark.parametrize("pieces", [1, 7, 2**31 - 1])
def test_ring_attention_copy_grid_leaves_most_sms_to_the_attention(pieces):
    from fusedpar.kernels.flash_attention import ring_copy_programs
    grid = (ring_copy_programs(pieces, SMS),)
    _within_cuda_limits(grid)
    assert grid[0] <= max(1, SMS // 4)


@pytest.mark.parametrize("ctas", [1, 2])
@pytest.mark.parametrize("tiles", [1, 2**31 - 1])
def test_grouped_mm_peers_grid_is_resident_and_leaves_an_sm(tiles, ctas):
    """The peers GEMM's programs are all resident at once on all SMs but one (what its flags
    wait for runs on that one): never more than (SMs - 1) x CTAs per SM, never more than the
    tiles, at least one."""
    grid = gemm_peers.peers_grid(tiles, SMS, {"CTAS_PER_SM": ctas})
    _within_cuda_limits(grid)
    assert grid[0] == min(tiles, (SMS - 1) * ctas)
