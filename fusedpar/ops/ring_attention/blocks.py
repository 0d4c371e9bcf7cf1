"""Which blocks of a ring attention a rank computes: its query rows against a source rank's
key rows, each block a flash-attention mask with its own diagonal.

A rank holds chunks of the global sequence (``layout``: ``"zigzag"``, chunks ``r`` and
``2W-1-r`` of ``2W``; ``"contiguous"``, chunk ``r`` of ``W``; ``"zigzag_docs"``, chunks ``r``
and ``2W-1-r`` of each packed document's ``2W``, documents in order). Query chunk at global
position ``gq`` (local row ``lq``) against key chunk at ``gk`` (local row ``lk``): global
query ``I`` sees global key ``J`` iff ``I - left <= J <= I + right`` (causal: ``right = 0``;
-1 unbounded), so local row ``i`` sees local key ``j`` iff the band holds with the diagonal
at ``j = i + diag``, ``diag = (gq - lq) - (gk - lk)``: flash-attention's mask with an offset.
Packed documents cut the chunks further (a query sees its own document's keys only). Keys
no query of a block sees are cut off (never moved or computed), as are rows that see none
of its keys; a block every row of which sees every key carries no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class RingBlock:
    """Local query rows ``rows = (lo, hi)`` against local key rows ``keys = (lo, hi)`` of the
    source's K/V: row ``i`` sees key ``j`` iff ``i + diag - left <= j <= i + diag + right``
    for ``window = (left, right)`` (-1 unbounded; ``causal``: ``right = 0``).
    ``causal=False, window=(-1, -1)``: every row sees every key."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    diag: int = 0
    causal: bool = False
    window: tuple[int, int] = (-1, -1)

    @property
    def masked(self) -> bool:
        return self.causal or self.window != (-1, -1)

    def sliced_diag(self) -> int:
        """The diagonal for tensors sliced to ``rows`` and ``keys`` (row 0 is ``rows[0]``)."""
        return self.diag + self.rows[0] - self.keys[0]


def rank_chunks(layout: str, world: int, rank: int, seqlen: int,
                documents: list[tuple[int, int]] | None = None) -> list[tuple[int, int, int]]:
    """``[(local start, global start, length)]`` of ``rank``'s chunks (``seqlen``: S_local;
    ``documents``: the ``[start, end)`` ranges ``"zigzag_docs"`` shards, each a multiple of
    ``2W`` long)."""
    if layout == "contiguous":
        return [(0, rank * seqlen, seqlen)]
    if layout == "zigzag_docs":
        chunks, local = [], 0
        for start, end in documents:
            size = (end - start) // (2 * world)
            chunks += [(local, start + rank * size, size),
                       (local + size, start + (2 * world - 1 - rank) * size, size)]
            local += 2 * size
        return chunks
    half = seqlen // 2
    return [(0, rank * half, half), (half, (2 * world - 1 - rank) * half, half)]


def _pieces(chunks, documents):
    """``(local start, global start, length, document)`` of the chunks cut at document ends."""
    for local, start, length in chunks:
        for doc, (a, z) in enumerate(documents):
            lo, hi = max(a, start), min(z, start + length)
            if lo < hi:
                yield local + lo - start, lo, hi - lo, doc


def band_block(rows, keys, diag: int, causal: bool, window: tuple[int, int]) -> RingBlock | None:
    """The block of ``rows`` x ``keys`` cut to the rows that see a key and the keys a row
    sees; None when no row sees a key."""
    left, right = window[0], 0 if causal else window[1]
    (r0, r1), (k0, k1) = rows, keys
    if left >= 0:
        k0, r1 = max(k0, rows[0] + diag - left), min(r1, keys[1] - diag + left)
    if right >= 0:
        k1, r0 = min(k1, rows[1] + diag + right), max(r0, keys[0] - diag - right)
    if k0 >= k1 or r0 >= r1:
        return None
    whole = (left < 0 or k0 >= r1 - 1 + diag - left) and (right < 0 or k1 - 1 <= r0 + diag + right)
    if whole:
        return RingBlock((r0, r1), (k0, k1))
    return RingBlock((r0, r1), (k0, k1), diag, causal, window)


def _merge(blocks: list[RingBlock]) -> list[RingBlock]:
    """Unmasked blocks with the same rows and adjacent keys (or the same keys and adjacent
    rows) as one."""
    blocks = list(blocks)
    merged = True
    while merged:
        merged = False
        for a in blocks:
            for b in blocks:
                if a is b or a.masked or b.masked:
                    continue
                if a.rows == b.rows and a.keys[1] == b.keys[0]:
                    joined = RingBlock(a.rows, (a.keys[0], b.keys[1]))
                elif a.keys == b.keys and a.rows[1] == b.rows[0]:
                    joined = RingBlock((a.rows[0], b.rows[1]), a.keys)
                else:
                    continue
                blocks = [c for c in blocks if c is not a and c is not b] + [joined]
                merged = True
                break
            if merged:
                break
    return sorted(blocks, key=lambda blk: (blk.rows, blk.keys))


def ring_blocks(layout: str, world: int, rank: int, src: int, seqlen: int, causal: bool,
                window: tuple[int, int] = (-1, -1),
                documents: list[tuple[int, int]] | None = None) -> list[RingBlock]:
    """The blocks of ``rank``'s queries against ``src``'s K/V (both ``seqlen`` local rows in
    ``layout``), in row order; empty when no query sees a key of ``src``. ``documents``:
    ``[start, end)`` global ranges of packed documents (None: one)."""
    if documents is None and src == rank and causal and window[0] < 0:
        # causal in local indices is exact for the own block in either layout (in zigzag
        # the second chunk sees all of the first, the first none of the second)
        return [RingBlock((0, seqlen), (0, seqlen), 0, True)]
    docs = documents if documents is not None else [(0, world * seqlen)]
    blocks = []
    for lq, gq, nq, dq in _pieces(rank_chunks(layout, world, rank, seqlen, documents), docs):
        for lk, gk, nk, dk in _pieces(rank_chunks(layout, world, src, seqlen, documents), docs):
            if dq == dk:
                block = band_block((lq, lq + nq), (lk, lk + nk), (gq - lq) - (gk - lk), causal, window)
                if block is not None:
                    blocks.append(block)
    return _merge(blocks)


def key_ranges(blocks: list[RingBlock]) -> list[tuple[int, int]]:
    """The key rows the blocks read, as disjoint sorted ``(lo, hi)`` ranges: what a rank
    must receive of the source's K/V, and no more."""
    out: list[list[int]] = []
    for lo, hi in sorted(blk.keys for blk in blocks):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]
