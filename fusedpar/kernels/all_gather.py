"""All-gather by pulling from peers' symmetric buffers.

Every rank has staged its input ``[outer, inner]`` in its data region and raised its READY
flag. The work is ``W x tiles`` items, item ``i`` copying tile ``i % tiles`` (``BLOCK_R``
rows by ``BLOCK_C`` columns of ``[outer, inner]``, ``copy_tiles``) of source
``(rank + i // tiles) % W`` (own shard first, read from ``x``) into ``out[:, src, :]`` of
the ``[outer, W, inner]`` output after that source's flag. The grid is capped
(``signal.spinning_grid``) and each program loops over items ``pid, pid + G, ...``; the
items run in rank-rotated order, so a program waits on sources in that order.

Tiles, not flat blocks: a flat block's element needs ``offset // inner`` to find its row
(an int64 division per element) and its columns are no longer provably contiguous, so
each element became its own 2-byte load and store. A tile's row and column starts are
two scalar divisions per item, and its rows are contiguous runs of a 16-byte-aligned
region (``signal.data_ptr``), loaded and stored 16 bytes at a time where ``inner`` allows.
Each program adds up the bytes it moved and counts them with one atomic at its end.
"""

import functools

import torch
import triton
import triton.language as tl

from .signal import (cdiv, PER_CALL_ARGS, call_epoch, data_ptr, end_call, sm_count, spinning_grid,
                     wait_ready_and_match)


# 4096 elements on 8 warps: 16 per thread, two 16-byte vectors at 2-byte dtypes
BLOCK = 4096
NUM_WARPS = 8


@functools.lru_cache(maxsize=256)
def copy_tiles(outer: int, inner: int, block: int = BLOCK) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_C, tiles)``: tiles of ``block`` elements covering ``[outer, inner]``,
    as wide as a row allows (a power of two up to ``block``), as many rows as fit (kept:
    every call of a shape asks)."""
    block_c = min(block, triton.next_power_of_2(max(inner, 1)))
    block_r = block // block_c
    return block_r, block_c, cdiv(outer, block_r) * cdiv(inner, block_c)


@triton.jit
def tile_at(t, outer, inner, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tile ``t`` (row-major over ``[outer, inner]``): its rows and columns (int64), the mask
    of its elements inside, and how many those are."""
    col_tiles = tl.cdiv(inner, BLOCK_C)
    r0 = (t // col_tiles) * BLOCK_R
    c0 = (t % col_tiles) * BLOCK_C
    rows = r0 + tl.arange(0, BLOCK_R)
    cols = c0 + tl.arange(0, BLOCK_C)
    mask = (rows < outer)[:, None] & (cols < inner)[None, :]
    count = tl.minimum(outer - r0, BLOCK_R) * tl.minimum(inner - c0, BLOCK_C)
    return rows, cols, mask, count


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def all_gather_pull_kernel(out_ptr, x_ptr, pad_table, rank, world_size, epoch, meta, outer, inner,
                           timeout_ns, stats_ptr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                           ELEM_BYTES: tl.constexpr, SLOTS: tl.constexpr, POISON: tl.constexpr,
                           SIGNAL_DONE: tl.constexpr, RAISE_GATHERED: tl.constexpr):
    """``SLOTS``: rank r's shard sits at slot r of its data region (``outer * inner``
    elements each), and ours is in ``out`` already (all_gather_matmul). ``POISON``,
    ``SIGNAL_DONE``, ``RAISE_GATHERED``: the call's device work ends here (``signal.end_call``)."""
    # int64 offsets: outer/inner arrive as i32 when they fit, or as constexpr 1
    outer = tl.cast(outer, tl.int64)
    inner = tl.cast(inner, tl.int64)
    call = call_epoch(pad_table, rank, epoch)
    tiles = tl.cdiv(outer, BLOCK_R) * tl.cdiv(inner, BLOCK_C)
    checked = tl.full([], -1, tl.int64)  # the step whose flag this program checked last
    ok = tl.full([], 0, tl.int1)
    moved = tl.zeros([], tl.int64)  # bytes this program read from peers
    for item in range(tl.program_id(0), world_size * tiles, tl.num_programs(0)):
        step = item // tiles  # int64, as tiles is
        src = (rank + step) % world_size
        if step != checked:
            checked = step
            ok = tl.full([], 1, tl.int1)
            if src != rank:
                ok = wait_ready_and_match(pad_table, rank, src, call, meta, timeout_ns)
        if ok & ((src != rank) | (not SLOTS)):
            rows, cols, mask, count = tile_at(item - step * tiles, outer, inner, BLOCK_R, BLOCK_C)
            shard = x_ptr
            if src != rank:
                shard = data_ptr(pad_table, src, out_ptr.dtype.element_ty)
                if SLOTS:
                    shard += src * outer * inner
                moved += count * ELEM_BYTES
            vals = tl.load(shard + rows[:, None] * inner + cols[None, :], mask=mask)
            tl.store(out_ptr + (rows[:, None] * world_size + src) * inner + cols[None, :], vals,
                     mask=mask)
    if moved > 0:
        tl.atomic_add(stats_ptr, moved, sem="relaxed")
    if POISON | SIGNAL_DONE | RAISE_GATHERED:
        end_call(pad_table, rank, world_size, epoch, out_ptr, outer * world_size * inner, out_ptr, 0,
                 POISON, SIGNAL_DONE, RAISE_GATHERED)


@functools.lru_cache(maxsize=256)
def all_gather_grid(outer: int, inner: int, world_size: int, sms: int | None,
                    block: int = BLOCK) -> tuple[int]:
    return (spinning_grid(world_size * copy_tiles(outer, inner, block)[2], sms),)


def all_gather_pull(out: torch.Tensor, x: torch.Tensor, pad_table: torch.Tensor, rank: int, world_size: int,
                    epoch: int, meta: int, outer: int, inner: int, timeout_ns: int,
                    stats: torch.Tensor, block: int = BLOCK, *, ends_call: bool = False,
                    slots: bool = False) -> None:
    """Fill ``out`` (contiguous, ``[outer, W, inner]`` elements): ``out[:, rank] = x`` and
    ``out[:, src]`` from every peer's staged shard. Spins on peers' flags with a capped grid
    (``spinning_grid``): what it waits on (peers' staging) never needs this kernel's SMs.
    ``ends_call``: its last program raises DONE in every peer's pad and NaN-fills a
    floating-point ``out`` if this rank recorded a failure. ``slots`` (all_gather_matmul's
    gather; ``x`` unused): rank r staged its shard at slot r of its data region, ours is in
    ``out`` already; the last program sets this rank's GATHERED flags and raises DONE (the
    GEMM after it NaN-fills)."""
    block_r, block_c, _ = copy_tiles(outer, inner, block)
    grid = all_gather_grid(outer, inner, world_size, sm_count(out.device), block)
    all_gather_pull_kernel[grid](out, x, pad_table, rank, world_size, epoch, meta, outer, inner,
                                 timeout_ns, stats, BLOCK_R=block_r, BLOCK_C=block_c,
                                 ELEM_BYTES=out.element_size(), SLOTS=slots,
                                 POISON=ends_call and out.is_floating_point(),
                                 SIGNAL_DONE=ends_call or slots, RAISE_GATHERED=slots,
                                 num_warps=NUM_WARPS)


AOT_EXAMPLES = [
    (all_gather_pull_kernel,
     {"out_ptr": f"*{t}", "x_ptr": f"*{t}", "pad_table": "*i64", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "meta": "i32", "outer": "i32", "inner": "i32", "timeout_ns": "i64", "stats_ptr": "*i64"},
     {"BLOCK_R": block_r, "BLOCK_C": BLOCK // block_r, "ELEM_BYTES": nbytes, "SLOTS": False,
      "POISON": ends and t in ("bf16", "fp16", "fp32"), "SIGNAL_DONE": ends, "RAISE_GATHERED": False},
     {"num_warps": NUM_WARPS})
    for t, nbytes in (("bf16", 2), ("fp16", 2), ("fp32", 4), ("i32", 4), ("i64", 8))
    for block_r in (1, 64)  # rows of 4096 or more elements; rows of 64 (a gather along a last dim)
    for ends in (True, False)  # all_gather's; moe_dispatch's (the call ends later)
] + [
    # all_gather_matmul's gather of the peers' rows (loopback, CPU)
    (all_gather_pull_kernel,
     {"out_ptr": f"*{t}", "x_ptr": f"*{t}", "pad_table": "*i64", "rank": "i32", "world_size": "i32",
      "epoch": "i32", "meta": "i32", "outer": "i32", "inner": "i32", "timeout_ns": "i64", "stats_ptr": "*i64"},
     {"BLOCK_R": 1, "BLOCK_C": BLOCK, "ELEM_BYTES": nbytes, "SLOTS": True, "POISON": False,
      "SIGNAL_DONE": True, "RAISE_GATHERED": True}, {"num_warps": NUM_WARPS})
    for t, nbytes in (("bf16", 2), ("fp32", 4), ("i32", 4))  # i32: all_gather_scaled_matmul's words
]
