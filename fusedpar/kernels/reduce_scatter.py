"""Reduce-scatter by pulling from peers' symmetric buffers.

Every rank has staged its whole input ``[outer, W, inner]`` and raised its READY flag; rank
``r`` sums the ``[:, r, :]`` slices of all W ranks in rank order (the same order on every
rank), in fp32, divides (by 1 or W) and rounds once into the ``[outer, inner]`` output.
The grid is capped (``signal.spinning_grid``); each program loops over tiles of the output
(``all_gather.copy_tiles``: rows of contiguous columns, accessed 16 bytes at a time where
``inner`` allows) ``pid, pid + G, ...`` and checks each source's flag once, on its first
tile; it counts the bytes it read from peers with one atomic at its end.
"""

import functools

import torch
import triton
import triton.language as tl

from .all_gather import BLOCK, NUM_WARPS, copy_tiles, tile_at
from .signal import (PER_CALL_ARGS, call_epoch, data_ptr, end_call, sm_count, spinning_grid,
                     wait_ready_and_match)


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def reduce_scatter_pull_kernel(out_ptr, pad_table, rank, world_size, epoch, meta, outer, inner,
                               timeout_ns, stats_ptr, divisor, BLOCK_R: tl.constexpr,
                               BLOCK_C: tl.constexpr, ELEM_BYTES: tl.constexpr, END: tl.constexpr):
    """``END``: the call ends here (``signal.end_call``: DONE, the failed call's NaNs)."""
    # int64 offsets: outer/inner arrive as i32 when they fit, or as constexpr 1
    outer = tl.cast(outer, tl.int64)
    inner = tl.cast(inner, tl.int64)
    call = call_epoch(pad_table, rank, epoch)
    ok = tl.full([], 1, tl.int1)
    first = tl.full([], 1, tl.int1)
    moved = tl.zeros([], tl.int64)  # bytes this program read from peers
    for t in range(tl.program_id(0), tl.cdiv(outer, BLOCK_R) * tl.cdiv(inner, BLOCK_C),
                   tl.num_programs(0)):
        rows, cols, mask, count = tile_at(t, outer, inner, BLOCK_R, BLOCK_C)
        src_offs = (rows[:, None] * world_size + rank) * inner + cols[None, :]
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for src in range(0, world_size):
            if first:  # every source's flag, once per program, before its first read
                if src != rank:
                    ok = ok & wait_ready_and_match(pad_table, rank, src, call, meta, timeout_ns)
            if ok:
                shard = data_ptr(pad_table, src, out_ptr.dtype.element_ty)
                acc += tl.load(shard + src_offs, mask=mask, other=0).to(tl.float32)
                if src != rank:
                    moved += count * ELEM_BYTES
        first = tl.full([], 0, tl.int1)
        # div_rn: fp32 ``/`` compiles to an approximate division (the average rounds as torch's)
        if ok:
            tl.store(out_ptr + rows[:, None] * inner + cols[None, :],
                     tl.math.div_rn(acc, divisor).to(out_ptr.dtype.element_ty), mask=mask)
    if moved > 0:
        tl.atomic_add(stats_ptr, moved, sem="relaxed")
    if END:
        end_call(pad_table, rank, world_size, epoch, out_ptr, outer * inner, out_ptr, 0, True, True, False)


@functools.lru_cache(maxsize=256)
def reduce_scatter_grid(outer: int, inner: int, sms: int | None, block: int = BLOCK) -> tuple[int]:
    return (spinning_grid(copy_tiles(outer, inner, block)[2], sms),)


def reduce_scatter_pull(out: torch.Tensor, pad_table: torch.Tensor, rank: int, world_size: int,
                        epoch: int, meta: int, outer: int, inner: int, timeout_ns: int,
                        stats: torch.Tensor, divisor: float = 1.0, block: int = BLOCK, *,
                        ends_call: bool = False) -> None:
    """Fill ``out`` (contiguous ``[outer, inner]``) with the sum of every rank's slice
    ``rank``, divided by ``divisor`` (``W`` gives the average, rounded like torch's).
    Spins with a capped grid (``spinning_grid``). ``ends_call``: its last program raises DONE
    in every peer's pad and NaN-fills ``out`` if this rank recorded a failure."""
    block_r, block_c, _ = copy_tiles(outer, inner, block)
    grid = reduce_scatter_grid(outer, inner, sm_count(out.device), block)
    reduce_scatter_pull_kernel[grid](out, pad_table, rank, world_size, epoch, meta, outer, inner,
                                     timeout_ns, stats, divisor, BLOCK_R=block_r, BLOCK_C=block_c,
                                     ELEM_BYTES=out.element_size(), END=ends_call,
                                     num_warps=NUM_WARPS)


# fp32, triton 3.8: the end's ticket (signal.last_program) costs 8-32 B of stack (sm_90 rows of
# 64, sm_80 rows of 4096)
END_SPILLS = "fp32: 8-32 B around the closing ticket (fp32 reduce-scatters, tests and fp32 training)"
AOT_EXAMPLES = [
    (reduce_scatter_pull_kernel,
     {"out_ptr": f"*{t}", "pad_table": "*i64", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "meta": "i32", "outer": "i32", "inner": "i32", "timeout_ns": "i64", "stats_ptr": "*i64", "divisor": "fp32"},
     {"BLOCK_R": block_r, "BLOCK_C": BLOCK // block_r, "ELEM_BYTES": nbytes, "END": True},
     dict({"num_warps": NUM_WARPS}, **({"spills_ok": END_SPILLS} if t == "fp32" else {})))
    for t, nbytes in (("bf16", 2), ("fp16", 2), ("fp32", 4))
    for block_r in (1, 64)  # rows of 4096 or more elements; rows of 64 (a scatter along a last dim)
]
