"""Matmul + reduce-scatter, producer side: ``P = A @ B`` into this rank's symmetric data
region, with a READY flag per finished row chunk.

``A`` is ``[M, K]`` with ``M = W * m_chunk``; chunk ``c`` is rows ``[c*m_chunk, (c+1)*m_chunk)``
of ``P`` and is reduced on rank ``c``. One persistent kernel computes the tiles in
rank-rotated chunk order: step ``s`` covers chunk ``c = (rank + 1 + s) % W``, so peers'
chunks come first and the own chunk last (the reducer on rank ``c`` can start while this
rank still computes). Tiles never straddle chunks; within a chunk, GROUP_M-grouped order.

After storing a tile, the program counts it in this rank's ``CHUNK_TILES + c`` pad word
(zeroed by the host before the launch, see ``reset_chunk_counters``); the program that
finishes chunk ``c`` raises ``READY + rank = epoch`` in rank ``c``'s pad (release, system
scope), own pad included, so that a reducer on another stream of this rank can wait for
it too. The reduction itself is ``reduce_scatter.reduce_scatter_pull`` with ``outer=1,
inner=m_chunk*N`` (``wait_self=True`` when it may run before this kernel finished).
This kernel never waits on anything.
"""

import torch
import triton
import triton.language as tl

from ..comm import layout
from .ag_gemm import aot_variants, gemm_config, grouped_tile, interpreting, mma, persistent_grid
from .signal import pad_ptr

READY = tl.constexpr(layout.READY)
CHUNK_TILES = tl.constexpr(layout.CHUNK_TILES)


@triton.jit(do_not_specialize=["rank", "world_size", "epoch"])
def gemm_rs_kernel(a_ptr, b_ptr, p_ptr, pad_table, rank, world_size, epoch, m_chunk, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, UPCAST: tl.constexpr):
    m_tiles = tl.cdiv(m_chunk, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    chunk_tiles = m_tiles * n_tiles
    num_tiles = world_size * chunk_tiles
    my_pad = pad_ptr(pad_table, rank)
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        step = tile // chunk_tiles
        chunk = (rank + 1 + step) % world_size
        pid_m, pid_n = grouped_tile(tile - step * chunk_tiles, m_tiles, n_tiles, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_ok = rm < m_chunk
        col_ok = rn < N
        rows = (chunk * m_chunk + rm).to(tl.int64)
        a_ptrs = a_ptr + rows[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = rk < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = mma(a, b, acc, UPCAST)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        p_ptrs = p_ptr + rows[:, None] * N + rn[None, :]
        tl.store(p_ptrs, acc.to(p_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        # every thread's stores of this tile happen before the count (and, through the
        # acq_rel chain on the counter, before the release of the chunk's flag)
        tl.debug_barrier()
        done = tl.atomic_add(my_pad + CHUNK_TILES + chunk, 1, sem="acq_rel", scope="sys")
        if done + 1 == chunk_tiles:
            tl.atomic_xchg(pad_ptr(pad_table, chunk) + READY + rank, epoch, sem="release", scope="sys")


def reset_chunk_counters(pad: torch.Tensor, world_size: int) -> None:
    """Before a launch: zero this rank's ``CHUNK_TILES`` words (``pad``: this rank's
    signal pad as an int32 tensor, e.g. ``buf.pad()``)."""
    pad[layout.CHUNK_TILES : layout.CHUNK_TILES + world_size].zero_()


def gemm_rs(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor, pad_table: torch.Tensor, rank: int,
            world_size: int, epoch: int, *, config: dict | None = None) -> None:
    """Fill ``p`` (contiguous ``[M, N]``, a view of this rank's symmetric data region) with
    ``a @ b`` (``a``: ``[M, K]``, ``b``: ``[K, N]``, any strides; ``M = W * m_chunk``), raising
    ``READY + rank = epoch`` in rank ``c``'s pad as soon as chunk ``c`` of ``p`` is complete.
    Call ``reset_chunk_counters`` on this rank's pad first. The kernel never waits, so its
    persistent grid (one program per SM) can hold every SM.
    """
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K or tuple(p.shape) != (M, N) or M % world_size:
        raise ValueError(f"gemm_rs: A {tuple(a.shape)}, B {tuple(b.shape)}, P {tuple(p.shape)} do not "
                         f"fit world size {world_size} (M must be divisible by it)")
    if not p.is_contiguous():
        raise ValueError("gemm_rs: p must be contiguous")
    m_chunk = M // world_size
    if m_chunk == 0 or N == 0:
        raise ValueError("gemm_rs: empty output: no tile would raise the chunks' READY flags")
    cfg = gemm_config(a.dtype, a.device, config)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    num_tiles = world_size * triton.cdiv(m_chunk, bm) * triton.cdiv(N, bn)
    grid = persistent_grid(num_tiles, cfg)
    gemm_rs_kernel[grid](
        a, b, p, pad_table, rank, world_size, epoch, m_chunk, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        NUM_PROGRAMS=cfg["NUM_PROGRAMS"], UPCAST=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


AOT_EXAMPLES = aot_variants(
    gemm_rs_kernel,
    {"a_ptr": "*T", "b_ptr": "*T", "p_ptr": "*T", "pad_table": "*i64", "rank": "i32",
     "world_size": "i32", "epoch": "i32", "m_chunk": "i32", "N": "i32", "K": "i32",
     "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32"})
