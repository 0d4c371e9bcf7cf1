"""The all_gather / reduce_scatter pull kernels over tiles, and ring attention's K/V copy
over passes, one process playing every rank over loopback buffers. Small ``block`` sizes
give many tiles (passes) per call, partial in rows and columns, several per program (the op
tests' shapes fit one 4096-element tile, or one 16384-element pass).

Rank r's data encode r, the outputs start poisoned, and each kernel's byte count must be
exactly the peers' share.
"""

import pytest
import torch

from fusedpar.comm import get_loopback_buffers, layout, release_buffers
from fusedpar.kernels.all_gather import BLOCK, all_gather_pull, copy_tiles
from fusedpar.kernels.flash_attention import COPY_CONFIG, ring_kv_copy
from fusedpar.kernels.reduce_scatter import reduce_scatter_pull

META, EPOCH, WORLD = 4242, 1, 3
# (outer, inner, block): column tiles with a partial last one; rows of 8 with a partial last
# row tile; one long row; single-column rows
CASES = [(5, 200, 64), (37, 6, 64), (1, 1000, 128), (9, 1, 64)]


def _ready(bufs):
    """Every rank staged (READY from every source at EPOCH) with the same fingerprint."""
    for buf in bufs:
        buf.pad()[layout.META] = META
        buf.pad()[layout.READY:layout.READY + len(bufs)] = EPOCH


def _rank_data(rank, shape, dtype):
    """Integers below 256 (exact in bf16): the position mod 61 and 64 x the rank."""
    return (torch.arange(torch.Size(shape).numel()).reshape(shape) % 61 + 64 * rank).to(dtype)


def test_tiles_cover_the_rows_as_wide_as_they_allow():
    assert copy_tiles(5, 200, 64) == (1, 64, 5 * 4)
    assert copy_tiles(37, 6, 64) == (8, 8, 5)
    assert copy_tiles(9, 1, 64) == (64, 1, 1)
    assert copy_tiles(0, 7, 64) == (8, 8, 0)


def _check_all_gather(bufs, outer, inner, dtype, block=BLOCK):
    device = bufs[0].device
    shards = [_rank_data(r, (outer, inner), dtype).to(device) for r in range(WORLD)]
    for buf, shard in zip(bufs, shards):
        buf.data(dtype, shard.numel()).copy_(shard.flatten())
    _ready(bufs)
    for buf in bufs:
        out = torch.full((outer, WORLD, inner), -7, dtype=dtype, device=device)
        stats = torch.zeros(1, dtype=torch.int64, device=device)
        all_gather_pull(out, shards[buf.rank], buf.pad_table, buf.rank, WORLD, EPOCH, META, outer,
                        inner, int(10e9), stats, block=block)
        assert buf.pad()[layout.STATUS] == layout.OK
        assert torch.equal(out, torch.stack(shards, 1)), (buf.rank, dtype)
        assert stats.item() == (WORLD - 1) * outer * inner * shards[0].element_size()


def _check_reduce_scatter(bufs, outer, inner, dtype, block=BLOCK):
    device = bufs[0].device
    inputs = [_rank_data(r, (outer, WORLD, inner), dtype).to(device) for r in range(WORLD)]
    for buf, x in zip(bufs, inputs):
        buf.data(dtype, x.numel()).copy_(x.flatten())
    _ready(bufs)
    for buf in bufs:
        out = torch.full((outer, inner), float("nan"), dtype=dtype, device=device)
        stats = torch.zeros(1, dtype=torch.int64, device=device)
        reduce_scatter_pull(out, buf.pad_table, buf.rank, WORLD, EPOCH, META, outer, inner,
                            int(10e9), stats, divisor=float(WORLD), block=block)
        # the kernel's arithmetic: an exact fp32 sum, one fp32 division, one rounding
        expected = sum(x[:, buf.rank].float() for x in inputs) / WORLD
        assert buf.pad()[layout.STATUS] == layout.OK
        assert torch.equal(out, expected.to(dtype)), (buf.rank, dtype)
        assert stats.item() == (WORLD - 1) * outer * inner * out.element_size()


@pytest.mark.parametrize("outer, inner, block", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_all_gather_pull_copies_every_tile_of_every_source(loopback, outer, inner, block, dtype):
    _check_all_gather(loopback(WORLD), outer, inner, dtype, block)


@pytest.mark.parametrize("outer, inner, block", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reduce_scatter_pull_sums_every_tile_of_every_source(loopback, outer, inner, block, dtype):
    _check_reduce_scatter(loopback(WORLD), outer, inner, dtype, block)


def _check_ring_kv_copy(bufs, b, s, hk, d, rows, dtype, block=COPY_CONFIG["BLOCK"]):
    """Each rank copies rows ``rows`` of every peer's staged K/V (``[2, B, S, H_kv, D]``: 2B
    segments) into a poisoned slot: those rows of every segment arrive, nothing else is
    written, and the bytes counted are theirs."""
    device = bufs[0].device
    staged = [_rank_data(r, (2, b, s, hk, d), dtype).to(device) for r in range(WORLD)]
    for buf, kv in zip(bufs, staged):
        buf.data(dtype, kv.numel()).copy_(kv.flatten())
    _ready(bufs)
    lo, hi = rows
    for buf in bufs:
        for src in range(WORLD):
            if src == buf.rank:
                continue
            slot = torch.full((2, b, s, hk, d), -7, dtype=dtype, device=device)
            stats = torch.zeros(1, dtype=torch.int64, device=device)
            ring_kv_copy(slot, buf.pad_table, buf.rank, WORLD, EPOCH, META, int(10e9), src, rows,
                         stats, block=block)
            expected = torch.full_like(slot, -7)
            expected[:, :, lo:hi] = staged[src][:, :, lo:hi]
            assert buf.pad()[layout.STATUS] == layout.OK
            assert torch.equal(slot, expected), (buf.rank, src, dtype)
            assert stats.item() == expected[:, :, lo:hi].numel() * slot.element_size()


# (B, S_local, H_kv, D, rows, block): several passes per segment with a partial last one,
# from row 0 / to the last row / in the middle; no rows (the copy only checks the peer)
RING_CASES = [(2, 9, 2, 5, (0, 9), 16), (1, 12, 1, 24, (6, 12), 64), (2, 7, 3, 3, (2, 5), 8),
              (1, 6, 1, 8, (0, 0), 16)]


@pytest.mark.parametrize("b, s, hk, d, rows, block", RING_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ring_kv_copy_copies_the_rows_of_every_segment(loopback, b, s, hk, d, rows, block, dtype):
    _check_ring_kv_copy(loopback(WORLD), b, s, hk, d, rows, dtype, block)


# (outer, inner): 16-byte vectors over many tiles; rows whose width is no multiple of 16
# (scalar accesses); many short rows per tile
GPU_SHAPES = [(3, 70000), (1001, 24), (5000, 48)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("outer, inner", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_pull_kernels_over_tiles(outer, inner, dtype):
    """The compiled kernels, 16-byte vectors where the widths allow, on the default tiles."""
    release_buffers()
    try:
        bufs = get_loopback_buffers(WORLD, WORLD * outer * inner * 4, torch.device("cuda"))
        _check_all_gather(bufs, outer, inner, dtype)
        _check_reduce_scatter(bufs, outer, inner, dtype)
        # all but the first and last rows of [2, 1, S, 4, 128] K/V: up to 8 default passes
        # per segment, the last partial
        s = outer * inner // 1024
        _check_ring_kv_copy(bufs, 1, s, 4, 128, (1, s - 1), dtype)
    finally:
        release_buffers()
