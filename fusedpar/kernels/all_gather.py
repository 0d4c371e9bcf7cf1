"""All-gather by pulling from peers' symmetric buffers.

Every rank has staged its input ``[outer, inner]`` in its data region and raised its READY
flag. The work is ``W x blocks`` items, item ``i`` copying block ``i % blocks`` of source
``(rank + i // blocks) % W`` (own shard first, read from ``x``) into ``out[:, src, :]`` of
the ``[outer, W, inner]`` output after that source's flag. The grid is capped
(``signal.spinning_grid``) and each program loops over items ``pid, pid + G, ...``; the
items run in rank-rotated order, so a program waits on sources in that order.
"""

import torch
import triton
import triton.language as tl

from .signal import PER_CALL_ARGS, call_epoch, data_ptr, sm_count, spinning_grid, wait_ready_and_match


# 512 elements on 8 warps: larger blocks or fewer warps spill on sm_80 (int64 offsets;
# triton 3.8 with 4-byte elements, 3.6 with 2-byte ones)
BLOCK = 512
NUM_WARPS = 8


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def all_gather_pull_kernel(out_ptr, x_ptr, pad_table, rank, world_size, epoch, meta, outer, inner,
                           timeout_ns, stats_ptr, BLOCK: tl.constexpr, ELEM_BYTES: tl.constexpr):
    # int64 offsets: outer/inner arrive as i32 when they fit, or as constexpr 1
    outer = tl.cast(outer, tl.int64)
    inner = tl.cast(inner, tl.int64)
    n = outer * inner
    epoch = call_epoch(pad_table, rank, epoch)
    blocks = tl.cdiv(n, BLOCK)
    checked = tl.full([], -1, tl.int64)  # the step whose flag this program checked last
    ok = tl.full([], 0, tl.int1)
    for item in range(tl.program_id(0), world_size * blocks, tl.num_programs(0)):
        step = item // blocks  # int64, as n is
        src = (rank + step) % world_size
        if step != checked:
            checked = step
            ok = tl.full([], 1, tl.int1)
            if src != rank:
                ok = wait_ready_and_match(pad_table, rank, src, epoch, meta, timeout_ns)
        if ok:
            offs = (item % blocks) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            shard = x_ptr
            if src != rank:
                shard = data_ptr(pad_table, src, out_ptr.dtype.element_ty)
            row = offs // inner
            col = offs - row * inner
            vals = tl.load(shard + offs, mask=mask)
            tl.store(out_ptr + (row * world_size + src) * inner + col, vals, mask=mask)
            if src != rank:
                tl.atomic_add(stats_ptr, tl.sum(mask.to(tl.int64)) * ELEM_BYTES)


def all_gather_grid(outer: int, inner: int, world_size: int, sms: int | None,
                    block: int = BLOCK) -> tuple[int]:
    return (spinning_grid(world_size * triton.cdiv(outer * inner, block), sms),)


def all_gather_pull(out: torch.Tensor, x: torch.Tensor, pad_table: torch.Tensor, rank: int, world_size: int,
                    epoch: int, meta: int, outer: int, inner: int, timeout_ns: int,
                    stats: torch.Tensor, block: int = BLOCK) -> None:
    """Fill ``out`` (contiguous, ``[outer, W, inner]`` elements): ``out[:, rank] = x`` and
    ``out[:, src]`` from every peer's staged shard. Spins on peers' flags with a capped grid
    (``spinning_grid``): what it waits on (peers' staging) never needs this kernel's SMs."""
    grid = all_gather_grid(outer, inner, world_size, sm_count(out.device), block)
    all_gather_pull_kernel[grid](out, x, pad_table, rank, world_size, epoch, meta, outer, inner,
                                 timeout_ns, stats, BLOCK=block, ELEM_BYTES=out.element_size(),
                                 num_warps=NUM_WARPS)


AOT_EXAMPLES = [
    (all_gather_pull_kernel,
     {"out_ptr": f"*{t}", "x_ptr": f"*{t}", "pad_table": "*i64", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "meta": "i32", "outer": "i32", "inner": "i32", "timeout_ns": "i64", "stats_ptr": "*i64"},
     {"BLOCK": BLOCK, "ELEM_BYTES": nbytes}, {"num_warps": NUM_WARPS})
    for t, nbytes in (("bf16", 2), ("fp16", 2), ("fp32", 4), ("i32", 4), ("i64", 8))
]
