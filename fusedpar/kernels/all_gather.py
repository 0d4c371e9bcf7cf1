"""All-gather by pulling from peers' symmetric buffers.

Every rank has staged its input ``[outer, inner]`` in its data region and raised its READY
flag; program ``(s, b)`` copies block ``b`` of source ``(rank + s) % W`` (own shard first, read from ``x``)
into ``out[:, src, :]`` of the ``[outer, W, inner]`` output, after that source's flag.
"""

import torch
import triton
import triton.language as tl

from .signal import data_ptr, wait_ready_and_match


@triton.jit
def all_gather_pull_kernel(out_ptr, x_ptr, pad_table, rank, world_size, epoch, meta, outer, inner,
                           max_spins, stats_ptr, BLOCK: tl.constexpr, ELEM_BYTES: tl.constexpr):
    src = (rank + tl.program_id(0)) % world_size
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < outer * inner
    ok = True
    if src != rank:
        ok = wait_ready_and_match(pad_table, rank, src, epoch, meta, max_spins)
    if ok:
        shard = x_ptr
        if src != rank:
            shard = data_ptr(pad_table, src, out_ptr.dtype.element_ty)
        row = offs // inner
        col = offs - row * inner
        vals = tl.load(shard + offs, mask=mask)
        tl.store(out_ptr + (row * world_size + src) * inner + col, vals, mask=mask)
        if src != rank:
            tl.atomic_add(stats_ptr, tl.sum(mask.to(tl.int64)) * ELEM_BYTES)


def all_gather_pull(out: torch.Tensor, x: torch.Tensor, pad_table: torch.Tensor, rank: int, world_size: int,
                    epoch: int, meta: int, outer: int, inner: int, max_spins: int,
                    stats: torch.Tensor, block: int = 1024) -> None:
    """Fill ``out`` (contiguous, ``[outer, W, inner]`` elements): ``out[:, rank] = x`` and
    ``out[:, src]`` from every peer's staged shard."""
    grid = (world_size, triton.cdiv(outer * inner, block))
    all_gather_pull_kernel[grid](out, x, pad_table, rank, world_size, epoch, meta, outer, inner,
                                 max_spins, stats, BLOCK=block, ELEM_BYTES=out.element_size())


AOT_EXAMPLES = [
    (all_gather_pull_kernel,
     {"out_ptr": f"*{t}", "x_ptr": f"*{t}", "pad_table": "*i64", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "meta": "i32", "outer": "i64", "inner": "i64", "max_spins": "i64", "stats_ptr": "*i64"},
     {"BLOCK": 1024, "ELEM_BYTES": nbytes})
    for t, nbytes in (("bf16", 2), ("fp32", 4))
]
