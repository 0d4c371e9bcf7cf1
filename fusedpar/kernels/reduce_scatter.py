"""Reduce-scatter by pulling from peers' symmetric buffers.

Every rank has staged its whole input ``[outer, W, inner]`` and raised its READY flag; rank
``r`` sums the ``[:, r, :]`` slices of all W ranks in rank order (the same order on every
rank), in fp32, divides (by 1 or W) and rounds once into the ``[outer, inner]`` output.

``wait_self=True`` also waits for this rank's own READY flag (in its own pad) before
reading its own slice: for a reducer on a side stream that may start before this rank's
producer (e.g. the fused matmul + reduce-scatter GEMM) has finished writing it.
"""

import torch
import triton
import triton.language as tl

from .signal import data_ptr, wait_ready_and_match


@triton.jit
def reduce_scatter_pull_kernel(out_ptr, pad_table, rank, world_size, epoch, meta, outer, inner,
                               max_spins, stats_ptr, divisor, BLOCK: tl.constexpr, ELEM_BYTES: tl.constexpr,
                               WAIT_SELF: tl.constexpr = False):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < outer * inner
    row = offs // inner
    src_offs = (row * world_size + rank) * inner + (offs - row * inner)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for src in range(0, world_size):
        ok = True
        if WAIT_SELF or src != rank:
            ok = wait_ready_and_match(pad_table, rank, src, epoch, meta, max_spins)
        if ok:
            shard = data_ptr(pad_table, src, out_ptr.dtype.element_ty)
            acc += tl.load(shard + src_offs, mask=mask, other=0).to(tl.float32)
            if src != rank:
                tl.atomic_add(stats_ptr, tl.sum(mask.to(tl.int64)) * ELEM_BYTES)
    tl.store(out_ptr + offs, (acc / divisor).to(out_ptr.dtype.element_ty), mask=mask)


def reduce_scatter_pull(out: torch.Tensor, pad_table: torch.Tensor, rank: int, world_size: int,
                        epoch: int, meta: int, outer: int, inner: int, max_spins: int,
                        stats: torch.Tensor, divisor: float = 1.0, block: int = 1024,
                        wait_self: bool = False) -> None:
    """Fill ``out`` (contiguous ``[outer, inner]``) with the sum of every rank's slice
    ``rank``, divided by ``divisor`` (``W`` gives the average, rounded like torch's).
    ``wait_self``: also wait for this rank's own READY flag (see the module docstring)."""
    grid = (triton.cdiv(outer * inner, block),)
    reduce_scatter_pull_kernel[grid](out, pad_table, rank, world_size, epoch, meta, outer, inner,
                                     max_spins, stats, divisor, BLOCK=block, ELEM_BYTES=out.element_size(),
                                     WAIT_SELF=wait_self)


AOT_EXAMPLES = [
    (reduce_scatter_pull_kernel,
     {"out_ptr": f"*{t}", "pad_table": "*i64", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "meta": "i32", "outer": "i64", "inner": "i64", "max_spins": "i64", "stats_ptr": "*i64", "divisor": "fp32"},
     {"BLOCK": 1024, "ELEM_BYTES": nbytes, "WAIT_SELF": wait_self})
    for t, nbytes, wait_self in (("bf16", 2, False), ("fp16", 2, False), ("fp32", 4, False), ("bf16", 2, True))
]
