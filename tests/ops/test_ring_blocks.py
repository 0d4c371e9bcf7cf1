"""``fusedpar.ops.ring_attention.blocks``: the blocks of a ring attention, checked against the global
mask (by global position) for every layout, world size, rank and source, windows, causal
or not, packed documents: together they cover exactly the visible (query, key) pairs, no
pair twice, and read exactly the keys some query sees (what the rings move)."""

import pytest
import torch

from fusedpar.ops.ring_attention.blocks import key_ranges, rank_chunks, ring_blocks

WINDOWS = [(-1, -1), (0, 0), (3, -1), (2, 5), (-1, 4), (13, -1), (100, 100)]


def _positions(layout, world, rank, seqlen):
    pos = torch.empty(seqlen, dtype=torch.long)
    for local, start, length in rank_chunks(layout, world, rank, seqlen):
        pos[local:local + length] = torch.arange(start, start + length)
    return pos


def _visible(rows, keys, diag, causal, window, shape):
    """The blocks' mask (of one block) in local indices."""
    out = torch.zeros(shape, dtype=torch.bool)
    i, j = torch.arange(*rows)[:, None], torch.arange(*keys)[None, :]
    ok = torch.ones(len(i), j.shape[1], dtype=torch.bool)
    left, right = window[0], 0 if causal else window[1]
    if left >= 0:
        ok &= j >= i + diag - left
    if right >= 0:
        ok &= j <= i + diag + right
    out[slice(*rows), slice(*keys)] = ok
    return out


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("packed", [False, True])
def test_blocks_cover_exactly_the_visible_pairs(layout, packed):
    for world in (1, 2, 3, 4):
        seqlen = 10
        total = world * seqlen
        documents = [(0, 5), (5, total - 1), (total - 1, total)] if packed else None
        doc = torch.zeros(total, dtype=torch.long)
        for d, (a, z) in enumerate(documents or []):
            doc[a:z] = d
        for causal in (True, False):
            for window in WINDOWS:
                left, right = window[0], 0 if causal else window[1]
                for rank in range(world):
                    for src in range(world):
                        qi = _positions(layout, world, rank, seqlen)[:, None]
                        kj = _positions(layout, world, src, seqlen)[None, :]
                        want = doc[qi] == doc[kj]
                        if left >= 0:
                            want &= kj >= qi - left
                        if right >= 0:
                            want &= kj <= qi + right
                        blocks = ring_blocks(layout, world, rank, src, seqlen, causal, window, documents)
                        masks = [_visible(b.rows, b.keys, b.diag, b.causal, b.window, want.shape)
                                 for b in blocks]
                        where = (world, causal, window, rank, src, blocks)
                        assert torch.equal(sum(m.long() for m in masks) if masks else
                                           torch.zeros_like(want, dtype=torch.long), want.long()), where
                        read = torch.zeros(seqlen, dtype=torch.bool)
                        for lo, hi in key_ranges(blocks):
                            read[lo:hi] = True
                        assert torch.equal(read, want.any(0)), where


def test_plain_masks_keep_one_block_per_source():
    """Without a window the blocks are the classic ring's: one per source (the own block
    causal in local indices; zigzag: a peer's first chunk to every query, or every key of
    a later peer to the second query chunk)."""
    assert [b.keys for b in ring_blocks("zigzag", 4, 1, 1, 8, True)] == [(0, 8)]
    assert [(b.rows, b.keys) for b in ring_blocks("zigzag", 4, 1, 0, 8, True)] == [((0, 8), (0, 4))]
    assert [(b.rows, b.keys) for b in ring_blocks("zigzag", 4, 1, 3, 8, True)] == [((4, 8), (0, 8))]
    assert ring_blocks("contiguous", 4, 1, 3, 8, True) == []
    assert len(ring_blocks("zigzag", 4, 1, 2, 8, False)) == 1


def test_a_sliding_window_reads_only_the_keys_it_sees():
    """Causal window of 3 at W=2, zigzag, 8 rows (chunks of 4): rank 1 (chunks 1, 2) sees
    the last 3 keys of chunk 0 of rank 0 and none of its chunk 3."""
    blocks = ring_blocks("zigzag", 2, 1, 0, 8, True, (3, -1))
    assert key_ranges(blocks) == [(1, 4)]
    assert ring_blocks("zigzag", 2, 0, 1, 8, True, (3, -1)) != []  # chunk 3 sees chunk 2
