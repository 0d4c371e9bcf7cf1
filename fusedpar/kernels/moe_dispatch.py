"""The token exchange of MoE dispatch / combine over symmetric memory.

Every rank has staged rows (its expert-sorted token copies for dispatch, its expert
outputs for combine) at the start of its data region and raised READY; the waits (one
``signal.wait_flags`` program, fingerprints checked) ran before these kernels launch, so
nothing here spins.

- ``pull_rows_kernel`` (a 2-D grid, as ``moe_permute``'s row kernels): ``out[r] = rows of
  rank src_rank[r], row src_row[r]`` (zero where
  ``src_rank[r] < 0``: padding, dropped copies). One kernel serves both directions; the
  route tables (computed on the device from the exchanged counts) say where each row
  lives. If this rank recorded a failure (a wait timed out, a fingerprint differed, a
  capacity was exceeded) it reads no peer at all and writes zeros. Adds the bytes read
  from peers to ``stats``.
- ``routes_kernel``: where every row goes, from the exchanged ``[W, E]`` counts table (the
  same on every rank): for this rank's recv_x and for its sorted copies, each row's peer
  and row there. Each program builds the block table of its layout from the counts and
  looks a block of rows up in it, so a dispatch computes its routes in one launch instead
  of a chain of small torch ops.
- ``check_capacity_kernel``: one program: every entry of the ``[W, E + 1]`` table (each
  rank's per-expert counts and its token count) fits in ``max_tokens_per_rank``, else this
  rank records ``CAPACITY_EXCEEDED``. Every rank holds the same table, so every rank fails
  the same call (and pulls nothing).
"""

import torch
import triton
import triton.language as tl

from ..comm import layout
from .interpreter import interpreting
from .moe_permute import ROW_BLOCK_GPU, row_blocks, rows_grid
from .signal import cdiv, STATUS, call_epoch, data_ptr, pad_ptr, record_failure

CAPACITY_EXCEEDED = tl.constexpr(layout.CAPACITY_EXCEEDED)

NUM_WARPS = 4
CHECK_BLOCK = 1024


@triton.jit(do_not_specialize=["rank", "rows"])
def pull_rows_kernel(out_ptr, src_rank_ptr, src_row_ptr, pad_table, rank, rows, H, stats_ptr,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ELEM_BYTES: tl.constexpr):
    failed = tl.load(pad_ptr(pad_table, rank) + STATUS, volatile=True) != 0
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_range = r < rows
    src = tl.load(src_rank_ptr + r, mask=in_range, other=-1)
    keep = (src >= 0) & (failed == 0)
    src_row = tl.load(src_row_ptr + r, mask=keep, other=0).to(tl.int64)
    # each row's source data region, as a pointer valid in this process (16-byte aligned: rows
    # are read 16 bytes at a time where H allows)
    base = data_ptr(pad_table, src, out_ptr.dtype.element_ty, keep)
    h_ok = (h < H)[None, :]
    vals = tl.load(base[:, None] + src_row[:, None] * H + h[None, :], mask=keep[:, None] & h_ok, other=0)
    tl.store(out_ptr + r[:, None] * H + h[None, :], vals, mask=in_range[:, None] & h_ok)
    if tl.program_id(1) == 0:  # the column blocks' first counts the whole rows
        from_peers = tl.sum((keep & (src != rank)).to(tl.int64))
        tl.atomic_add(stats_ptr, from_peers * H * ELEM_BYTES)


@triton.jit(do_not_specialize=["rank", "epoch", "n", "max_count"])
def check_capacity_kernel(counts_ptr, n, max_count, pad_table, rank, epoch, BLOCK: tl.constexpr):
    over = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(0, tl.cdiv(n, BLOCK)):
        i = b * BLOCK + tl.arange(0, BLOCK)
        over += (tl.load(counts_ptr + i, mask=i < n, other=0) > max_count).to(tl.int32)
    if tl.sum(over) > 0:
        record_failure(pad_ptr(pad_table, rank), CAPACITY_EXCEEDED, rank, call_epoch(pad_table, rank, epoch))


@triton.jit
def lookup(rows, n, start, size, peer, peer_start):
    """For each row in ``rows``: the block holding it (``start <= row < start + size``, the
    blocks' tiles flattened) gives ``(peer, peer_start + row - start)``; ``(-1, 0)`` for a
    row in no block or in several (only a table a failed capacity check cut can overlap)."""
    start, size = tl.reshape(start, [start.numel]), tl.reshape(size, [size.numel])
    peer, peer_start = tl.reshape(peer, [peer.numel]), tl.reshape(peer_start, [peer_start.numel])
    hit = ((start[None, :] <= rows[:, None]) & (rows[:, None] < start[None, :] + size[None, :])).to(tl.int32)
    one = tl.sum(hit, axis=1) == 1
    src = tl.where(one, tl.sum(hit * peer[None, :], axis=1), -1)
    row = tl.where(one, rows + tl.sum(hit * (peer_start - start)[None, :], axis=1), 0)
    return src, row, rows < n


@triton.jit(do_not_specialize=["stride", "rank", "W", "L", "cap", "recv_rows", "send_rows"])
def routes_kernel(table_ptr, stride, recv_rank_ptr, recv_row_ptr, send_rank_ptr, send_row_ptr,
                  per_expert_ptr, rank, W, L, cap, recv_rows, send_rows, PADDED: tl.constexpr,
                  W_PAD: tl.constexpr, L_PAD: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """Axis 1 picks the layout: 0, this rank's recv_x (blocks (source s, local expert e),
    rows ordered by (e, s)); 1, its sorted copies (blocks (owner o, local expert e), rows
    ordered by (o, e)). Axis 0: ROWS rows of it. Every program builds its layout's block
    table as ``[W_PAD, L_PAD]`` tiles from the counts, then looks its rows up. ``cap``: the
    rows a count takes at most (max_tokens_per_rank when PADDED, else 2**31 - 1)."""
    s = tl.arange(0, W_PAD)[:, None]  # sources (recv_x) or owners (sorted copies)
    e = tl.arange(0, L_PAD)[None, :]
    ok = (s < W) & (e < L)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    if tl.program_id(1) == 0:
        counts = tl.load(table_ptr + s * stride + rank * L + e, mask=ok, other=0)
        size = tl.minimum(counts, cap)
        per_expert = tl.sum(size, axis=0)
        if PADDED:
            expert_start = tl.arange(0, L_PAD) * W * cap
        else:
            expert_start = tl.cumsum(per_expert, axis=0) - per_expert
        start = expert_start[None, :] + tl.cumsum(size, axis=0) - size
        # peer_start: the block's row in source s's sorted copies, past its copies for lower ranks
        before = tl.zeros([W_PAD], dtype=tl.int32)
        for c0 in range(0, rank * L, CHUNK):
            c = c0 + tl.arange(0, CHUNK)[None, :]
            before += tl.sum(tl.load(table_ptr + s * stride + c, mask=(s < W) & (c < rank * L), other=0), axis=1)
        peer_start = before[:, None] + tl.cumsum(counts, axis=1) - counts
        src, row, valid = lookup(rows, recv_rows, start, size, s + 0 * e, peer_start)
        tl.store(recv_rank_ptr + rows, src, mask=valid)
        tl.store(recv_row_ptr + rows, row, mask=valid)
        if tl.program_id(0) == 0:
            tl.store(per_expert_ptr + tl.arange(0, L_PAD), per_expert, mask=tl.arange(0, L_PAD) < L)
    else:
        counts = tl.load(table_ptr + rank * stride + s * L + e, mask=ok, other=0)
        size = tl.minimum(counts, cap)
        per_owner = tl.sum(counts, axis=1)
        start = (tl.cumsum(per_owner, axis=0) - per_owner)[:, None] + tl.cumsum(counts, axis=1) - counts
        # peer_start: the block's row in owner o's recv_x (recv_x's start of (e, this rank))
        total = tl.zeros([W_PAD, L_PAD], dtype=tl.int32)
        lower = tl.zeros([W_PAD, L_PAD], dtype=tl.int32)
        for source in range(0, W):
            theirs = tl.minimum(tl.load(table_ptr + source * stride + s * L + e, mask=ok, other=0), cap)
            total += theirs
            lower += theirs * (source < rank).to(tl.int32)
        if PADDED:
            peer_start = e * W * cap + lower
        else:
            peer_start = tl.cumsum(total, axis=1) - total + lower
        dst, row, valid = lookup(rows, send_rows, start, size, s + 0 * e, peer_start)
        tl.store(send_rank_ptr + rows, dst, mask=valid)
        tl.store(send_row_ptr + rows, row, mask=valid)


def routes(table: torch.Tensor, rank: int, world: int, max_tokens: int | None, recv_rows: int,
           send_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(recv_src, send_src, tokens_per_expert)`` of ``rank`` from every rank's per-expert
    counts (``table`` int32 ``[W, E]``, rows may be strided; a rank's copies are sorted by
    expert, experts numbered rank-major), in one launch, nothing read on the host:

    - ``recv_src`` int32 ``[2, recv_rows]``: for each row of this rank's recv_x, ordered by
      (local expert, source, token), ``(source rank, row in the source's sorted copies)``;
    - ``send_src`` int32 ``[2, send_rows]``: for each of this rank's sorted copies, ``(owner
      rank, row in the owner's recv_x)``;
    - ``tokens_per_expert`` int32 ``[E_local]``: the rows of each local expert in recv_x.

    Source rank -1: a row in no block (padding, dropped copies). With ``max_tokens`` the
    owner's rows of local expert e start at ``e * W * max_tokens`` and counts above it are
    cut (the capacity check makes such a call fail)."""
    W, E = table.shape
    L = E // W
    w_pad, l_pad = triton.next_power_of_2(W), triton.next_power_of_2(L)
    # the lookup's [ROWS, W_PAD * L_PAD] tiles: ~8K entries a program on a GPU; one program
    # for a test's rows in the interpreter, which pays per operation, not per element
    rows = 1024 if interpreting() else max(1, min(256, 8192 // (w_pad * l_pad)))
    out = torch.empty(2, recv_rows + send_rows, dtype=torch.int32, device=table.device)
    recv_src, send_src = out[:, :recv_rows], out[:, recv_rows:]
    per_expert = torch.empty(L, dtype=torch.int32, device=table.device)
    grid = (max(1, cdiv(max(recv_rows, send_rows), rows)), 2)
    routes_kernel[grid](table, table.stride(0), recv_src[0], recv_src[1], send_src[0], send_src[1],
                        per_expert, rank, W, L, max_tokens or 2**31 - 1, recv_rows, send_rows,
                        PADDED=max_tokens is not None, W_PAD=w_pad, L_PAD=l_pad,
                        CHUNK=max(16, 4096 // w_pad), ROWS=rows, num_warps=NUM_WARPS)
    return recv_src, send_src, per_expert


def pull_rows(out: torch.Tensor, src_rank: torch.Tensor, src_row: torch.Tensor, pad_table: torch.Tensor,
              rank: int, stats: torch.Tensor) -> None:
    """``out[r] = peer src_rank[r]'s staged row src_row[r]`` (zero where ``src_rank[r] < 0``);
    ``out`` contiguous ``[rows, H]``, ``src_rank`` / ``src_row`` int32 ``[rows]``. Does not
    wait: the caller waited for every source's READY flag (``signal.wait_flags``) first."""
    rows, H = out.shape
    if rows == 0 or H == 0:
        return
    cfg = row_blocks()
    pull_rows_kernel[rows_grid(rows, H, cfg)](
        out, src_rank, src_row, pad_table, rank, rows, H, stats, ELEM_BYTES=out.element_size(),
        num_warps=NUM_WARPS, **cfg)


def check_capacity(counts: torch.Tensor, max_count: int, pad_table: torch.Tensor, rank: int,
                   epoch: int) -> None:
    """Record ``CAPACITY_EXCEEDED`` in this rank's status if any entry of the int32 counts
    table is above ``max_count`` (the op reads which one from the table when it raises)."""
    check_capacity_kernel[(1,)](counts, counts.numel(), max_count, pad_table, rank, epoch, BLOCK=CHECK_BLOCK)


AOT_EXAMPLES = [
    (pull_rows_kernel,
     {"out_ptr": f"*{t}", "src_rank_ptr": "*i32", "src_row_ptr": "*i32", "pad_table": "*i64", "rank": "i32",
      "rows": "i32", "H": "i32", "stats_ptr": "*i64"},
     dict(ROW_BLOCK_GPU, ELEM_BYTES=nbytes), {"num_warps": NUM_WARPS})
    for t, nbytes in (("bf16", 2), ("fp16", 2), ("fp32", 4), ("u8", 1))  # u8: float8 rows + scales
] + [
    (routes_kernel,
     {"table_ptr": "*i32", "stride": "i32", "recv_rank_ptr": "*i32", "recv_row_ptr": "*i32",
      "send_rank_ptr": "*i32", "send_row_ptr": "*i32", "per_expert_ptr": "*i32", "rank": "i32", "W": "i32",
      "L": "i32", "cap": "i32", "recv_rows": "i32", "send_rows": "i32"},
     {"PADDED": padded, "W_PAD": 8, "L_PAD": 32, "CHUNK": 512, "ROWS": 32}, {"num_warps": NUM_WARPS})
    for padded in (False, True)
] + [
    (check_capacity_kernel,
     {"counts_ptr": "*i32", "n": "i32", "max_count": "i32", "pad_table": "*i64", "rank": "i32", "epoch": "i32"},
     {"BLOCK": CHECK_BLOCK}, {"num_warps": 4}),
]
