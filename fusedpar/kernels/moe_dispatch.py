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
- ``check_capacity_kernel``: one program: every entry of the ``[W, E + 1]`` table (each
  rank's per-expert counts and its token count) fits in ``max_tokens_per_rank``, else this
  rank records ``CAPACITY_EXCEEDED``. Every rank holds the same table, so every rank fails
  the same call (and pulls nothing).
"""

import torch
import triton
import triton.language as tl

from ..comm import layout
from .moe_permute import ROW_BLOCK_GPU, row_blocks, rows_grid
from .signal import PAD_BYTES, STATUS, call_epoch, pad_ptr, record_failure

CAPACITY_EXCEEDED = tl.constexpr(layout.CAPACITY_EXCEEDED)

NUM_WARPS = 4
CHECK_BLOCK = 1024


@triton.jit(do_not_specialize=["rank", "rows", "H"])
def pull_rows_kernel(out_ptr, src_rank_ptr, src_row_ptr, pad_table, rank, rows, H, stats_ptr,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ELEM_BYTES: tl.constexpr):
    failed = tl.load(pad_ptr(pad_table, rank) + STATUS, volatile=True) != 0
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_range = r < rows
    src = tl.load(src_rank_ptr + r, mask=in_range, other=-1)
    keep = (src >= 0) & (failed == 0)
    src_row = tl.load(src_row_ptr + r, mask=keep, other=0).to(tl.int64)
    # each row's source data region, as a pointer valid in this process
    base = (tl.load(pad_table + src, mask=keep, other=0) + PAD_BYTES).to(tl.pointer_type(out_ptr.dtype.element_ty))
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
    for t, nbytes in (("bf16", 2), ("fp16", 2), ("fp32", 4))
] + [
    (check_capacity_kernel,
     {"counts_ptr": "*i32", "n": "i32", "max_count": "i32", "pad_table": "*i64", "rank": "i32", "epoch": "i32"},
     {"BLOCK": CHECK_BLOCK}, {"num_warps": 4}),
]
