"""Grouped GEMM: the tiles of every group in one persistent launch (``torch._grouped_mm``
contract: ``offs`` holds int32 cumulative group ends, read on the device, so there is no
host loop and no device-to-host sync).

- ``grouped_mm_rows_kernel`` (forward and dgrad): ``a [T, K]`` times ``b [E, K, N]``; the
  rows ``offs[g-1]:offs[g]`` of ``a`` are multiplied by ``b[g]``. The programs walk the
  groups in order, each keeping a running count of the tiles before the current group, and
  take every NUM_PROGRAMS-th tile of the concatenated tile list (GROUP_M-grouped within a
  group). Rows past ``offs[-1]`` get zeros (a padded buffer's tail), so no output row is
  left unwritten.
- ``grouped_mm_k_kernel`` (wgrad): ``a [M, K_total]`` times ``b [K_total, N]`` with groups
  along K: ``c[g] = a[:, offs[g-1]:offs[g]] @ b[offs[g-1]:offs[g]]``; an empty group gives
  zeros. Its tile count ``E * m_tiles * n_tiles`` is known on the host.

- ``grouped_mm_peers_kernel`` (the fused expert MLP of ``ops/moe_experts.py``, and
  ``ops/all_gather_matmul.py``'s GEMM: one expert, a block per source shard): the rows
  come in blocks listed in a table of ``(src, expert, peer_row, local_row, rows)``,
  ordered own rank first; A rows are local (``a[local_row]``). Tiles cover runs of blocks
  (consecutive blocks of one expert whose rows follow each other, ``block_runs``), not
  single blocks: with one expert per rank a rank's rows of it are one or two runs, and a
  tile per source's last partial tile (~10% more tiles at Mixtral's W=8 shapes) is not
  paid. Gather mode (``PUSH=False``): the sources' rows were copied into ``a`` by a
  producer that raises this rank's ``GATHERED + src`` flag after each source's block (the
  copy engine on a GPU), and a tile waits for the flags of the sources it holds rows of,
  so a source's rows are multiplied as soon as they land; C goes to ``c[local_row]``. A
  failed wait (recorded in STATUS) makes the program skip the tiles that hold that source's
  rows. Push (``PUSH=True``): each row of a C tile goes straight into its source's region
  at its block's ``peer_row`` onward.

Epilogues (the gather and the rows kernel, for the expert MLPs): ``SWIGLU`` multiplies one
A tile by b's gate and up columns and stores ``silu(gate) * up`` from the fp32 products
(``KEEP_H``: the products too, for autograd); ``SWIGLU_VJP`` turns the product, the
gradient of SwiGLU's output, into the gradients of the forward's gate and up products.
They work on column halves of a tile: whole tiles of the products spill.

The rows and peers kernels read A and B through TMA descriptors (``TMA``: Hopper's bulk
tensor copies, host-built ``TensorDescriptor`` s) where the GPU has them and the operands'
layouts allow (unit inner stride, 16-byte aligned base and strides): a tile's rows past
its group's end then hold the next group's rows (the store masks them) and the K tail
reads as zeros; on the H100 that is 1.3x the pointer loads (benchmarks/results/grouped_mm.csv).
Elsewhere (sm_80, odd strides) they use pointer loads. The interpreter takes the TMA path
wherever the layouts allow, so CPU tests cover both.

Accumulation is fp32 (fp32 inputs use exact fp32 products, no TF32); any strides.
The first two kernels wait on nothing: their grid is capped at NUM_PROGRAMS (the SM
count) only because they are persistent.
"""

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm import (GPU_CONFIG_FP32, GPU_CONFIG_SM80, GPU_CONFIG_SM90, POINTER_CONFIG_SM90, gemm_config,
                   grouped_tile, mma)
from .interpreter import interpreting
from .signal import (GATHERED, data_ptr, fence_async_proxy, pad_ptr, sm_count, spinning_grid,
                     wait_flag)

# The peers kernel's push variant (C tiles into a peer's region through computed pointers)
# used to spill on these configs (100-288 B), and took smaller tiles or fewer stages to
# spill less: those spills were the stores' per-element 64-bit addresses. Since peers'
# data pointers carry their 16-byte alignment (signal.data_ptr) and the region offset is a
# row count, its stores are 16-byte vectors and it takes the same configs as the other
# GEMMs without spilling (triton 3.6 and 3.8). (On the H100, 128x256 TMA tiles had been
# the fastest push even spilling: the W=8 loopback expert MLP took 28.6 / 30.1 ms with
# them, 33.4 / 32.9 with 128x64 tiles, 29.8 / 30.3 with 128x128.)
# triton 3.8 (not 3.6) spills 28 B of them in the SwiGLU gather that keeps the products
GATHER_KEEP_H_SPILLS = "per-tile scalars outside the K loop, triton 3.8 only, 28 B"


def gpu_config(major: int, tma: bool, epilogue: str | None = None) -> dict:
    """The 16-bit launch config on a GPU of compute capability ``major``: TMA loads where the
    GPU has them and ``tma``; ``epilogue``: the peers kernel's gather's, on half the columns
    (SwiGLU's two accumulators, gate and up, or the VJP's two tiles of the forward's
    products). The push takes the same configs."""
    cfg = GPU_CONFIG_SM80 if major < 9 else GPU_CONFIG_SM90 if tma else POINTER_CONFIG_SM90
    return dict(cfg, BLOCK_N=cfg["BLOCK_N"] // 2) if epilogue else cfg


@triton.jit
def tile_product(a_ptr, b_ptr, m0, n0, m_end, N, k_lo, k_hi, stride_am, stride_ak, stride_bk,
                 stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr):
    """``a[m0:m0+BLOCK_M, k_lo:k_hi] @ b[k_lo:k_hi, n0:n0+BLOCK_N]`` in fp32, rows masked at
    ``m_end``, columns at ``N`` and the K tail."""
    return add_tile_product(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), a_ptr, b_ptr, m0, n0,
                            m_end, N, k_lo, k_hi, stride_am, stride_ak, stride_bk, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)


@triton.jit
def add_tile_product(acc, a_ptr, b_ptr, m0, n0, m_end, N, k_lo, k_hi, stride_am, stride_ak,
                     stride_bk, stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + tile_product(...)`` (one accumulator: a second whole tile would spill)."""
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < m_end
    col_ok = rn < N
    # pointers built once and advanced per K step: int64 offsets recomputed in the loop
    # cost the registers that larger tiles need
    ks = (k_lo + rk).to(tl.int64)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + rn.to(tl.int64)[None, :] * stride_bn
    a_step = tl.cast(stride_ak, tl.int64) * BLOCK_K
    b_step = tl.cast(stride_bk, tl.int64) * BLOCK_K
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = rk < k_hi - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = mma(a, b, acc, UPCAST)
        a_ptrs += a_step
        b_ptrs += b_step
    return acc


@triton.jit
def tile_product_tma(a_desc, b_desc, m0, n0, expert, k_hi, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_KMAJOR: tl.constexpr,
                     UPCAST: tl.constexpr):
    """``a[m0:m0+BLOCK_M, :k_hi] @ b[expert][:k_hi, n0:n0+BLOCK_N]`` in fp32 through TMA
    descriptors: ``a_desc`` over ``a [rows, K]``, ``b_desc`` over ``b [E, K, N]`` or, with
    B_KMAJOR, over its transpose ``[E, N, K]``. Rows, columns and K past the arrays' ends
    read as zeros."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_hi, BLOCK_K):
        a = a_desc.load([m0, k0])
        if B_KMAJOR:
            b = b_desc.load([expert, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
        else:
            b = b_desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
        acc = mma(a, b, acc, UPCAST)
    return acc


@triton.jit
def store_tile(c_ptr, acc, m0, n0, m_end, N, stride_cm, stride_cn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    base = c_ptr + tl.cast(m0, tl.int64) * stride_cm + tl.cast(n0, tl.int64) * stride_cn
    mask = (m0 + rm < m_end)[:, None] & (n0 + rn < N)[None, :]
    tl.store(base + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_tile(ptr, m0, n0, m_end, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``ptr[m0:m0+BLOCK_M, n0:n0+BLOCK_N]`` (unit column stride) in fp32, zeros past
    ``m_end`` rows and ``N`` columns."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    base = ptr + tl.cast(m0, tl.int64) * stride_m + n0
    mask = (m0 + rm < m_end)[:, None] & (n0 + rn < N)[None, :]
    return tl.load(base + rm[:, None] * stride_m + rn[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def tile_pair_tma(a_desc, b_desc, m0, n0, n1, expert, k_hi, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_KMAJOR: tl.constexpr,
                  UPCAST: tl.constexpr):
    """``tile_product_tma`` at columns ``n0`` and ``n1`` of one A tile (loaded once per K
    step): the gate and up products of a SwiGLU tile."""
    acc0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_hi, BLOCK_K):
        a = a_desc.load([m0, k0])
        if B_KMAJOR:
            b0 = b_desc.load([expert, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
            b1 = b_desc.load([expert, n1, k0]).reshape(BLOCK_N, BLOCK_K).T
        else:
            b0 = b_desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            b1 = b_desc.load([expert, k0, n1]).reshape(BLOCK_K, BLOCK_N)
        acc0 = mma(a, b0, acc0, UPCAST)
        acc1 = mma(a, b1, acc1, UPCAST)
    return acc0, acc1


@triton.jit
def column_halves(t, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``t[:, :BLOCK_N // 2], t[:, BLOCK_N // 2:]``."""
    return tl.split(tl.permute(tl.reshape(t, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def swiglu_tile(c_ptr, h_ptr, gate, up, m0, n0, m_end, N, KEEP_H: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """SwiGLU on one tile of the fp32 ``gate`` and ``up`` products at columns
    ``n0:n0+BLOCK_N``: ``c [T, N]`` gets ``silu(gate) * up``, and with KEEP_H ``h [T,
    2N]`` gets ``[gate | up]``."""
    if KEEP_H:
        store_tile(h_ptr, gate, m0, n0, m_end, N, 2 * N, 1, BLOCK_M, BLOCK_N)
        store_tile(h_ptr + N, up, m0, n0, m_end, N, 2 * N, 1, BLOCK_M, BLOCK_N)
    store_tile(c_ptr, gate * tl.sigmoid(gate) * up, m0, n0, m_end, N, N, 1, BLOCK_M, BLOCK_N)


@triton.jit
def swiglu_vjp_tile(c_ptr, h_ptr, grad, m0, n0, m_end, N, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """SwiGLU's backward on one tile: ``grad`` (fp32) is the gradient of its output at
    columns ``n0:n0+BLOCK_N``; ``h`` and ``c`` (``[T, 2N]``) hold the forward's ``[gate |
    up]`` and get their gradients. d silu(g) / dg = s (1 + g (1 - s)), s = sigmoid(g)."""
    gate = load_tile(h_ptr, m0, n0, m_end, N, 2 * N, BLOCK_M, BLOCK_N)
    s = tl.sigmoid(gate)
    store_tile(c_ptr + N, grad * gate * s, m0, n0, m_end, N, 2 * N, 1, BLOCK_M, BLOCK_N)
    grad = grad * s * (1 + gate * (1 - s))
    grad = grad * load_tile(h_ptr + N, m0, n0, m_end, N, 2 * N, BLOCK_M, BLOCK_N)
    store_tile(c_ptr, grad, m0, n0, m_end, N, 2 * N, 1, BLOCK_M, BLOCK_N)


@triton.jit
def tile_pair(a_ptr, b_ptr, m0, n0, n1, m_end, N, k_hi, stride_am, stride_ak, stride_bk, stride_bn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              UPCAST: tl.constexpr):
    """``tile_product`` at columns ``n0`` and ``n1`` (pointer loads): a SwiGLU tile's gate
    and up products."""
    gate = tile_product(a_ptr, b_ptr, m0, n0, m_end, N, 0, k_hi, stride_am, stride_ak, stride_bk,
                        stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    up = tile_product(a_ptr, b_ptr, m0, n1, m_end, N, 0, k_hi, stride_am, stride_ak, stride_bk,
                      stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    return gate, up


@triton.jit
def swiglu_epilogue(c_ptr, h_ptr, gate, up, m0, n0, m_end, N, KEEP_H: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``swiglu_tile`` on the two column halves of a tile (whole tiles of both products
    spill)."""
    gate0, gate1 = column_halves(gate, BLOCK_M, BLOCK_N)
    up0, up1 = column_halves(up, BLOCK_M, BLOCK_N)
    swiglu_tile(c_ptr, h_ptr, gate0, up0, m0, n0, m_end, N, KEEP_H, BLOCK_M, BLOCK_N // 2)
    swiglu_tile(c_ptr, h_ptr, gate1, up1, m0, n0 + BLOCK_N // 2, m_end, N, KEEP_H, BLOCK_M,
                BLOCK_N // 2)


@triton.jit
def swiglu_vjp_epilogue(c_ptr, h_ptr, grad, m0, n0, m_end, N, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """``swiglu_vjp_tile`` on the two column halves of a tile (the forward's products are
    two more tiles: whole ones spill)."""
    grad0, grad1 = column_halves(grad, BLOCK_M, BLOCK_N)
    swiglu_vjp_tile(c_ptr, h_ptr, grad0, m0, n0, m_end, N, BLOCK_M, BLOCK_N // 2)
    swiglu_vjp_tile(c_ptr, h_ptr, grad1, m0, n0 + BLOCK_N // 2, m_end, N, BLOCK_M, BLOCK_N // 2)


@triton.jit
def grouped_mm_rows_kernel(a, b, c_ptr, h_ptr, offs_ptr, T, N, K, E, pad_rows,
                           stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                           stride_cm, stride_cn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
                           MASKED: tl.constexpr, SWIGLU: tl.constexpr, KEEP_H: tl.constexpr,
                           SWIGLU_VJP: tl.constexpr, UPCAST: tl.constexpr):
    """``a``, ``b``: pointers, or TMA descriptors (``TMA``; the strides are then unused).
    ``MASKED``: ``offs_ptr`` holds row counts and group g owns rows ``g * pad_rows`` onward
    (the first ``min(count, pad_rows)`` multiplied, the rest zeros); ``pad_rows`` is unused
    otherwise. Either way the rows form segments (multiplied, or zeros: ``k_hi = 0``).
    ``SWIGLU`` / ``KEEP_H`` / ``SWIGLU_VJP``: the peers kernel's epilogues (contiguous ``c``
    and ``h``; c's strides are then unused)."""
    step = tl.num_programs(0)
    b_cols = 2 * N if SWIGLU else N
    n_tiles = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)  # this program's next tile in the concatenated tile list
    first = tl.zeros([], tl.int32)  # index of the current segment's first tile in that list
    start = tl.zeros([], tl.int32)
    # MASKED: 2 segments per group (its rows, its padding); else groups 0..E-1, then the rows
    # past offs[-1] (zeros)
    for s in range(0, 2 * E if MASKED else E + 1):
        if MASKED:
            g = s // 2
            count = tl.minimum(tl.maximum(tl.load(offs_ptr + g), 0), pad_rows)
            start = g * pad_rows + tl.where(s % 2 == 1, count, 0)
            end = tl.where(s % 2 == 0, g * pad_rows + count, (g + 1) * pad_rows)
            k_hi = tl.where(s % 2 == 0, K, 0)
        else:
            g = s
            if g < E:
                end = tl.load(offs_ptr + g)
            else:
                end = T
            k_hi = tl.where(g < E, K, 0)  # the zero segment multiplies nothing
        m_tiles = tl.cdiv(tl.maximum(end - start, 0), BLOCK_M)
        group_tiles = m_tiles * n_tiles
        while tile < first + group_tiles:
            pid_m, pid_n = grouped_tile(tile - first, m_tiles, n_tiles, GROUP_M)
            m0 = start + pid_m * BLOCK_M
            n0 = pid_n * BLOCK_N
            if TMA:
                if SWIGLU:
                    gate, up = tile_pair_tma(a, b, m0, n0, N + n0, g, k_hi, BLOCK_M, BLOCK_N,
                                             BLOCK_K, B_KMAJOR, UPCAST)
                else:
                    acc = tile_product_tma(a, b, m0, n0, g, k_hi, BLOCK_M, BLOCK_N, BLOCK_K,
                                           B_KMAJOR, UPCAST)
            else:
                b_group = b + tl.cast(g, tl.int64) * stride_be
                if SWIGLU:
                    gate, up = tile_pair(a, b_group, m0, n0, N + n0, end, b_cols, k_hi, stride_am,
                                         stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N,
                                         BLOCK_K, UPCAST)
                else:
                    acc = tile_product(a, b_group, m0, n0, end, N, 0, k_hi, stride_am, stride_ak,
                                       stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
            if SWIGLU:
                swiglu_epilogue(c_ptr, h_ptr, gate, up, m0, n0, end, N, KEEP_H, BLOCK_M, BLOCK_N)
            elif SWIGLU_VJP:
                swiglu_vjp_epilogue(c_ptr, h_ptr, acc, m0, n0, end, N, BLOCK_M, BLOCK_N)
            else:
                store_tile(c_ptr, acc, m0, n0, end, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)
            tile += step
        first += group_tiles
        start = end


@triton.jit
def grouped_mm_k_kernel(a_ptr, b_ptr, c_ptr, offs_ptr, M, N, E, pad_rows, sources,
                        stride_am, stride_ak, stride_bk, stride_bn,
                        stride_ce, stride_cm, stride_cn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """``MASKED``: ``offs_ptr`` holds counts; group g's K starts at ``g * pad_rows``. Else
    ``offs_ptr`` holds the ends of ``sources * E`` segments, source-major, and group g sums
    the products over its segments ``s * E + g``."""
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    group_tiles = m_tiles * n_tiles
    for tile in range(tl.program_id(0), E * group_tiles, tl.num_programs(0)):
        g = tile // group_tiles
        pid_m, pid_n = grouped_tile(tile - g * group_tiles, m_tiles, n_tiles, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if MASKED:
            k_lo = g * pad_rows
            k_hi = k_lo + tl.minimum(tl.maximum(tl.load(offs_ptr + g), 0), pad_rows)
            acc = add_tile_product(acc, a_ptr, b_ptr, m0, n0, M, N, k_lo, k_hi, stride_am,
                                   stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        else:
            for s in range(0, sources):
                seg = s * E + g
                k_lo = tl.where(seg > 0, tl.load(offs_ptr + seg - 1, mask=seg > 0, other=0), 0)
                k_hi = tl.load(offs_ptr + seg)
                acc = add_tile_product(acc, a_ptr, b_ptr, m0, n0, M, N, k_lo, k_hi, stride_am,
                                       stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K,
                                       UPCAST)
        store_tile(c_ptr + tl.cast(g, tl.int64) * stride_ce, acc, m0, n0, M, N, stride_cm,
                   stride_cn, BLOCK_M, BLOCK_N)


@triton.jit
def overlaps(start, n, m0, BLOCK_M: tl.constexpr):
    """Whether rows ``start : start + n`` and ``m0 : m0 + BLOCK_M`` share one (never when
    ``n`` is 0)."""
    return tl.maximum(start, m0) < tl.minimum(start + n, m0 + BLOCK_M)


@triton.jit
def wait_run_rows(blocks_ptr, b0, nb, run_row, m0, my_pad, epoch, timeout_ns, checked, ok,
                  TMA: tl.constexpr, BLOCK_M: tl.constexpr):
    """Wait for the GATHERED flag of every source whose block of the run (blocks ``b0 :
    b0 + nb``, starting at received row ``run_row``) holds one of the tile's rows ``m0 :
    m0 + BLOCK_M``; ``checked`` / ``ok``: the source this program waited for last and how
    that went (a source is polled once per change, not per tile). Returns ``(tile_ok,
    checked, ok)``."""
    tile_ok = tl.full([], 1, tl.int1)
    for blk in range(b0, b0 + nb):
        start = tl.load(blocks_ptr + blk * 5 + 3) - run_row
        if overlaps(start, tl.load(blocks_ptr + blk * 5 + 4), m0, BLOCK_M):
            src = tl.load(blocks_ptr + blk * 5)
            if src != checked:
                checked = src
                ok = wait_flag(my_pad, GATHERED + src, src, epoch, timeout_ns, 1)  # TIMEOUT_READY
                if TMA:
                    fence_async_proxy()  # the rows seen landed, before TMA reads them
            tile_ok = tile_ok & ok
    return tile_ok, checked, ok


@triton.jit
def push_tile(pad_table, c_ptr, blocks_ptr, b0, nb, run_row, acc, m0, n0, rows, N, c_row,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the tile's rows ``m0 : m0 + BLOCK_M`` of a run (blocks ``b0 : b0 + nb``, from
    received row ``run_row``; ``rows`` in all) into their sources' regions: the i-th row of
    block ``(src, peer_row)`` goes to row ``c_row + peer_row + i`` of src's data (rows of N
    elements: with N a multiple of 16, whole rows start 16-byte aligned and the tile is
    stored 16 bytes at a time). One masked store per block the tile holds rows of (per-row
    pointers spill)."""
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    cols = (n0 + rn < N)[None, :]
    out = acc.to(c_ptr.dtype.element_ty)  # before the loop: half the registers kept across it
    for blk in range(b0, b0 + nb):
        start = tl.load(blocks_ptr + blk * 5 + 3) - run_row
        n = tl.load(blocks_ptr + blk * 5 + 4)
        if overlaps(start, n, m0, BLOCK_M):
            peer_row = tl.load(blocks_ptr + blk * 5 + 2).to(tl.int64)
            base = (data_ptr(pad_table, tl.load(blocks_ptr + blk * 5), c_ptr.dtype.element_ty)
                    + (c_row + peer_row - start + m0) * N + n0)  # the tile's first row
            mask = ((rm >= start) & (rm < tl.minimum(start + n, rows)))[:, None] & cols
            tl.store(base + (rm - m0)[:, None] * N + rn[None, :], out, mask=mask)


# meta is not an argument: the READY waits (with the fingerprints) ran before the gather
@triton.jit(do_not_specialize=["rank", "world_size", "epoch", "timeout_ns", "num_runs", "c_row"])
def grouped_mm_peers_kernel(a, b, c_ptr, h_ptr, blocks_ptr, runs_ptr, pad_table, rank,
                            world_size, epoch, timeout_ns, num_runs, N, K, c_row, stride_be,
                            stride_bk, stride_bn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, PUSH: tl.constexpr, TMA: tl.constexpr,
                            B_KMAJOR: tl.constexpr, SWIGLU: tl.constexpr, KEEP_H: tl.constexpr,
                            SWIGLU_VJP: tl.constexpr, UPCAST: tl.constexpr):
    """``a``, ``b``: pointers, or TMA descriptors (``TMA``; b's strides are then unused).
    Tiles cover runs (``runs_ptr``: first block, blocks, rows), not blocks: a tile may hold
    the rows of several sources, so a source's partial tile does not cost a whole one.
    The gather stores C tiles to ``c`` (``[rows, N]``), or with an epilogue (``h`` is
    ``[rows, 2N]``, the gate and up products side by side): ``SWIGLU``: b holds ``[gate | up]`` along its ``2N`` columns; C tiles are ``silu(a @
    gate) * (a @ up)`` from the fp32 products, and with ``KEEP_H`` both products also go to
    ``h``. ``SWIGLU_VJP``: the product P = a @ b is the gradient of SwiGLU's output; C
    (``[rows, 2N]``) gets the gradients of the gate and up products, read from ``h``."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    my_pad = pad_ptr(pad_table, rank)
    tile = tl.program_id(0)  # this program's next tile in the concatenated tile list
    first = tl.zeros([], tl.int32)  # index of the current run's first tile in that list
    checked = tl.full([], -1, tl.int32)  # the source whose flag this program checked last
    ok = tl.full([], 1, tl.int1)
    tile_ok = tl.full([], 1, tl.int1)
    b_cols = 2 * N if SWIGLU else N
    c_cols = 2 * N if SWIGLU_VJP else N
    for run in range(0, num_runs):
        b0 = tl.load(runs_ptr + run * 3)
        nb = tl.load(runs_ptr + run * 3 + 1)
        rows = tl.load(runs_ptr + run * 3 + 2)
        expert = tl.load(blocks_ptr + b0 * 5 + 1)
        local_row = tl.load(blocks_ptr + b0 * 5 + 3)
        m_tiles = tl.cdiv(rows, BLOCK_M)
        group_tiles = m_tiles * n_tiles
        c_base = c_ptr + local_row.to(tl.int64) * c_cols
        h_base = h_ptr + local_row.to(tl.int64) * 2 * N
        while tile < first + group_tiles:
            pid_m, pid_n = grouped_tile(tile - first, m_tiles, n_tiles, GROUP_M)
            m0 = pid_m * BLOCK_M
            n0 = pid_n * BLOCK_N
            if not PUSH:
                tile_ok, checked, ok = wait_run_rows(blocks_ptr, b0, nb, local_row, m0, my_pad,
                                                     epoch, timeout_ns, checked, ok, TMA, BLOCK_M)
            if tile_ok:
                if TMA:
                    if SWIGLU:
                        gate, up = tile_pair_tma(a, b, local_row + m0, n0, N + n0, expert, K,
                                                 BLOCK_M, BLOCK_N, BLOCK_K, B_KMAJOR, UPCAST)
                    else:
                        acc = tile_product_tma(a, b, local_row + m0, n0, expert, K, BLOCK_M,
                                               BLOCK_N, BLOCK_K, B_KMAJOR, UPCAST)
                else:
                    a_rows = a + local_row.to(tl.int64) * K
                    b_expert = b + tl.cast(expert, tl.int64) * stride_be
                    if SWIGLU:
                        gate, up = tile_pair(a_rows, b_expert, m0, n0, N + n0, rows, b_cols, K, K, 1,
                                             stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
                    else:
                        acc = tile_product(a_rows, b_expert, m0, n0, rows, N, 0, K, K, 1,
                                           stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
                if SWIGLU:  # gate columns past N read up columns: computed, never stored
                    swiglu_epilogue(c_base, h_base, gate, up, m0, n0, rows, N, KEEP_H, BLOCK_M, BLOCK_N)
                elif SWIGLU_VJP:
                    swiglu_vjp_epilogue(c_base, h_base, acc, m0, n0, rows, N, BLOCK_M, BLOCK_N)
                elif not PUSH:
                    store_tile(c_base, acc, m0, n0, rows, N, N, 1, BLOCK_M, BLOCK_N)
                else:
                    push_tile(pad_table, c_ptr, blocks_ptr, b0, nb, local_row, acc, m0, n0, rows,
                              N, c_row, BLOCK_M, BLOCK_N)
            tile += tl.num_programs(0)
        first += group_tiles


def peers_grid(tiles: int, sms: int | None) -> tuple[int]:
    """The peers kernel spins on flags: a capped grid looping over its tiles (axis 0)."""
    return (spinning_grid(tiles, sms),)


EPILOGUES = ("swiglu", "swiglu_vjp")  # the gather's; the push has none


def block_runs(blocks, firsts=()) -> np.ndarray:
    """The runs of ``blocks`` (host ints ``[G, 5]``, as ``grouped_mm_peers`` takes them):
    stretches of consecutive blocks of one expert whose rows follow each other in ``a``
    (one block's ``local_row`` is the last one's ``local_row + rows``), as int64 ``[R, 3]``:
    first block, blocks, rows; the blocks at ``firsts`` start one anyway (the first of
    another launch's table). A tile may span the blocks of a run. (numpy: a host table the
    launch waits for, at a fraction of torch's per-op cost.)"""
    blocks = np.asarray(blocks, dtype=np.int64)
    expert, local_row, rows = blocks[:, 1], blocks[:, 3], blocks[:, 4]
    starts = np.ones(len(blocks), dtype=bool)
    starts[1:] = (expert[1:] != expert[:-1]) | (local_row[1:] != local_row[:-1] + rows[:-1])
    starts[np.asarray(firsts, dtype=np.int64)] = True
    bounds = np.append(np.flatnonzero(starts), len(blocks))
    row_bounds = np.concatenate([[0], np.cumsum(rows)])[bounds]
    return np.stack([bounds[:-1], np.diff(bounds), np.diff(row_bounds)], axis=1)


def grouped_mm_peers(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, blocks: torch.Tensor,
                     runs: torch.Tensor, run_rows: list[int], pad_table: torch.Tensor, rank: int,
                     world_size: int, epoch: int, timeout_ns: int, *, push: bool, c_row: int = 0,
                     epilogue: str | None = None, h: torch.Tensor | None = None) -> None:
    """One launch over the row blocks in ``blocks`` (int32 ``[G, 5]``: src, expert,
    peer_row, local_row, rows), tiled by ``runs`` (int32 ``[R, 3]``, ``block_runs``; their
    rows ``run_rows`` on the host): a tile may hold several sources' rows of one expert, so
    each source's last partial tile costs none of its own.

    Gather (not ``push``): a tile waits for this rank's ``GATHERED + src`` flag of each
    source it holds rows of to reach ``epoch`` (the producer copied that source's rows into
    ``a`` first); with ``P = a[local_row:+rows] @ b[expert]``, the ``epilogue`` writes
    ``c[local_row:+rows]``:

    - None: ``c = P`` (all_gather_matmul: one expert, a block per source shard).
    - ``"swiglu"``: b's columns are ``[gate | up]`` and ``c = swiglu(P)`` (``ops.moe.swiglu``
      from fp32 products: no ``[rows, 2N]`` round trip through memory); given ``h``, it
      also gets ``P``.
    - ``"swiglu_vjp"``: ``c [rows, 2N] = vjp(swiglu, h)(P)``, SwiGLU's backward at the
      forward's products ``h [rows, 2N]``.

    Push (no epilogue): ``src's region[(c_row + peer_row:+rows) * N] =
    a[local_row:+rows] @ b[expert]``; ``c`` only gives the dtype. ``a``, ``c`` and ``h``
    contiguous; ``b [E, K, N]`` any strides.
    Waits: the GATHERED flags it spins on are raised by the copy engine (``stream_write_value32``
    on a side stream) or, without one, before this launch in stream order; neither needs an SM
    this kernel holds, and the grid is ``spinning_grid``-capped.
    """
    if epilogue not in (None, *EPILOGUES) or push and epilogue is not None:
        raise ValueError(f"grouped_mm_peers: push={push} with epilogue={epilogue!r}; the gather "
                         f"takes None (the product) or one of {EPILOGUES}, the push None")
    swiglu = epilogue == "swiglu"
    K, N = b.shape[1], b.shape[2] // 2 if swiglu else b.shape[2]
    cfg, a_arg, b_arg, kmajor = gemm_operands(a, b, epilogue=epilogue)
    tiles = sum(triton.cdiv(r, cfg["BLOCK_M"]) for r in run_rows) * triton.cdiv(N, cfg["BLOCK_N"])
    if tiles == 0:
        return
    grouped_mm_peers_kernel[peers_grid(tiles, sm_count(a.device))](
        a_arg, b_arg, c, c if h is None else h, blocks, runs, pad_table, rank, world_size, epoch,
        timeout_ns, runs.shape[0], N, K, c_row, b.stride(0), b.stride(1), b.stride(2),
        PUSH=push, TMA=cfg["TMA"], B_KMAJOR=kmajor, SWIGLU=swiglu, KEEP_H=swiglu and h is not None,
        SWIGLU_VJP=epilogue == "swiglu_vjp", **launch_options(cfg))


def grouped_config(a: torch.Tensor, config: dict | None = None, *, tma: bool = True,
                   epilogue: str | None = None) -> dict:
    """Blocks and launch options for ``a``'s dtype and GPU (queried at launch): the TMA
    config where the GPU has TMA and ``tma``, else the pointer-load one; ``epilogue``: the
    peers kernel's gather variants (``gpu_config``). The interpreter takes the TMA
    path when ``tma``."""
    base = {"TMA": tma and interpreting()}
    if not interpreting() and a.dtype != torch.float32:
        base = gpu_config(torch.cuda.get_device_capability(a.device)[0], tma, epilogue)
    return gemm_config(a.dtype, a.device, dict(base, **(config or {})))


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can cover ``t``: unit inner stride, 16-byte aligned base and
    outer strides, none zero (an expanded tensor), no empty dimension."""
    size = t.element_size()
    return (t.numel() > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(stride > 0 and stride * size % 16 == 0 for stride in t.stride()[:-1]))


def gemm_operands(a: torch.Tensor, b: torch.Tensor, config: dict | None = None, *,
                  epilogue: str | None = None) -> tuple[dict, object, object, bool]:
    """``(config, a, b, b_kmajor)`` for the rows and peers kernels (and ``matmul_reduce_scatter``'s, with
    one group): TMA descriptors over
    ``a [rows, K]`` and ``b [E, K, N]`` (or, ``b_kmajor``, over its transpose ``[E, N, K]``,
    as the expert MLP passes ``w.transpose(1, 2)`` of row-major weights) where the config
    has TMA and the layouts allow, else the tensors themselves and the pointer-load config."""
    kmajor = b.stride(2) != 1
    b_view = b.transpose(1, 2) if kmajor else b
    # swiglu reads b's up half from column N: a TMA box must start 16-byte aligned
    up_aligned = kmajor or epilogue != "swiglu" or b.shape[2] // 2 * b.element_size() % 16 == 0
    cfg = grouped_config(a, config, tma=_tma_ready(a) and _tma_ready(b_view) and up_aligned,
                         epilogue=epilogue)
    if not cfg["TMA"]:
        return cfg, a, b, False
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    return (cfg, TensorDescriptor.from_tensor(a, [bm, bk]),
            TensorDescriptor.from_tensor(b_view, [1, bn, bk] if kmajor else [1, bk, bn]), kmajor)


def launch_options(cfg: dict) -> dict:
    return dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                GROUP_M=cfg["GROUP_M"], UPCAST=interpreting(), num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])


def grouped_mm_rows(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, c: torch.Tensor,
                    config: dict | None = None, *, pad_rows: int | None = None,
                    epilogue: str | None = None, h: torch.Tensor | None = None) -> None:
    """``c[offs[g-1]:offs[g]] = a[offs[g-1]:offs[g]] @ b[g]``, zeros past ``offs[-1]``.
    With ``pad_rows`` (P), ``offs`` holds counts instead: ``c[g*P:g*P+n] = a[g*P:g*P+n] @
    b[g]`` with ``n = min(offs[g], P)``, zeros in the rest of ``c[g*P:(g+1)*P]``.

    ``a [T, K]``, ``b [E, K, N]``, ``c [T, N]`` (any strides), ``offs`` int32 ``[E]``
    (non-decreasing, ``offs[-1] <= T``: the caller checks; with P, ``T = E * P``). The grid
    is a bound on the tile count that needs no look at ``offs`` (``(cdiv(T, BLOCK_M) + 2E)
    * n_tiles``: every segment adds at most one partial tile), capped at NUM_PROGRAMS.

    ``epilogue`` (not with P; contiguous ``c`` and ``h``): what ``grouped_mm_peers``'s
    gather does with the product: ``"swiglu"`` (b ``[E, K, 2N]``, c ``[T, N]``, h ``[T, 2N]``
    given: the products too) or ``"swiglu_vjp"`` (c ``[T, 2N]``, h ``[T, 2N]`` the
    forward's products).
    """
    if epilogue is not None and (epilogue not in EPILOGUES or pad_rows is not None
                                 or not c.is_contiguous() or h is not None and not h.is_contiguous()):
        raise ValueError(f"grouped_mm_rows: epilogue={epilogue!r} needs offs (no pad_rows) and "
                         f"contiguous c and h; the epilogues are {EPILOGUES}")
    swiglu = epilogue == "swiglu"
    T, K = a.shape
    E, N = b.shape[0], b.shape[2] // 2 if swiglu else b.shape[2]
    if T == 0 or N == 0:
        return
    cfg, a_arg, b_arg, kmajor = gemm_operands(a, b, config, epilogue=epilogue)
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
    bound = (triton.cdiv(T, cfg["BLOCK_M"]) + 2 * E + 1) * n_tiles
    grid = (min(bound, cfg["NUM_PROGRAMS"]),)
    grouped_mm_rows_kernel[grid](
        a_arg, b_arg, c, c if h is None else h, offs, T, N, K, E, pad_rows or 0, a.stride(0),
        a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        TMA=cfg["TMA"], B_KMAJOR=kmajor, MASKED=pad_rows is not None, SWIGLU=swiglu,
        KEEP_H=swiglu and h is not None, SWIGLU_VJP=epilogue == "swiglu_vjp", **launch_options(cfg))


def grouped_mm_k(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, c: torch.Tensor,
                 config: dict | None = None, *, pad_rows: int | None = None, sources: int = 1) -> None:
    """``c[g] = a[:, offs[g-1]:offs[g]] @ b[offs[g-1]:offs[g]]`` (zeros for an empty group).
    With ``pad_rows`` (P), ``offs`` holds counts and group g's K range is
    ``g*P : g*P + min(offs[g], P)``. With ``sources`` (S), ``offs`` holds the ends of ``S *
    E`` segments of K, source-major (segment ``s * E + g`` is source s's share of group g,
    as the expert MLP's received rows lie), and ``c[g]`` sums g's S segments: one launch
    and one write of ``c``, not S.

    ``a [M, K_total]``, ``b [K_total, N]``, ``c [E, M, N]`` (any strides), ``offs`` int32 ``[S * E]``.
    """
    if sources < 1 or offs.shape[0] % sources or pad_rows is not None and sources != 1:
        raise ValueError(f"grouped_mm_k: {offs.shape[0]} group ends for sources={sources} "
                         f"(pad_rows={pad_rows}); need sources * E ends, and one source with pad_rows")
    M, N, E = a.shape[0], b.shape[1], offs.shape[0] // sources
    cfg = grouped_config(a, config, tma=False)  # ragged K: masked pointer loads
    tiles = E * triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    if tiles == 0:
        return
    grouped_mm_k_kernel[(min(tiles, cfg["NUM_PROGRAMS"]),)](
        a, b, c, offs, M, N, E, pad_rows or 0, sources, a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), c.stride(0), c.stride(1), c.stride(2), MASKED=pad_rows is not None,
        **launch_options(cfg))


# unit inner strides are constexprs, as the JIT specializes them for row-major operands
_ROWS_UNIT = {"stride_ak": 1, "stride_bn": 1, "stride_cn": 1}
_K_UNIT = {"stride_am": 1, "stride_bn": 1, "stride_cn": 1}  # a = x.t() of a row-major x
_ROWS_SIG = {"a": "*bf16", "b": "*bf16", "c_ptr": "*bf16", "h_ptr": "*bf16", "offs_ptr": "*i32", "T": "i32",
             "N": "i32", "K": "i32", "E": "i32", "pad_rows": "i32", "stride_am": "i32", "stride_be": "i32",
             "stride_bk": "i32", "stride_cm": "i32"}
_K_SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "offs_ptr": "*i32", "M": "i32",
          "N": "i32", "E": "i32", "pad_rows": "i32", "sources": "i32", "stride_ak": "i32",
          "stride_bk": "i32", "stride_ce": "i32", "stride_cm": "i32"}
_PEERS_SIG = {"a": "*bf16", "b": "*bf16", "c_ptr": "*bf16", "h_ptr": "*bf16", "blocks_ptr": "*i32",
              "runs_ptr": "*i32", "pad_table": "*i64", "rank": "i32", "world_size": "i32",
              "epoch": "i32", "timeout_ns": "i64", "num_runs": "i32", "N": "i32", "K": "i32",
              "c_row": "i32", "stride_be": "i32"}
# b of the fused expert MLP: w.transpose(1, 2) of row-major expert weights in the forward
# (unit stride along K), the weights themselves in the backward (unit stride along N)
B_UNIT = {True: ("stride_bk", "stride_bn"), False: ("stride_bn", "stride_bk")}  # kmajor: (unit, other)


def aot_example(kernel, sig, consts, cfg, arch, kmajor=False, spills_ok=None):
    """One variant: with TMA in ``cfg``, ``a``/``b`` are descriptors of the launcher's blocks;
    ``spills_ok``: why it may spill."""
    if cfg["TMA"]:
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        sig = dict(sig, a=f"tensordesc<bf16[{bm},{bk}]>",
                   b=f"tensordesc<bf16[1,{bn},{bk}]>" if kmajor else f"tensordesc<bf16[1,{bk},{bn}]>")
    consts = dict({k: v for k, v in cfg.items() if k.isupper() and k != "TMA"}, UPCAST=False, **consts)
    if kernel is not grouped_mm_k_kernel:  # the kernels that take descriptors
        consts.update(TMA=cfg["TMA"], B_KMAJOR=kmajor and cfg["TMA"])
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "arch": arch}
    return kernel, sig, consts, dict(options, spills_ok=spills_ok) if spills_ok else options


_GATHER = dict(PUSH=False, SWIGLU=False, KEEP_H=False, SWIGLU_VJP=False)
# the peers kernel's variants with the B layouts the expert MLP passes (kmajor: ``B_UNIT``):
# the forward's SwiGLU gather (b = w13ᵀ) with and without the gate/up products kept, the
# backward's VJP gather (b = w2), the push (w2ᵀ in the forward, w13 in the backward); and
# all_gather_matmul's plain gather (B row-major, or a Linear's weightᵀ)
PEERS_MODES = [(dict(_GATHER), None, (True, False)),
               (dict(_GATHER, SWIGLU=True), "swiglu", (True,)),
               (dict(_GATHER, SWIGLU=True, KEEP_H=True), "swiglu", (True,)),
               (dict(_GATHER, SWIGLU_VJP=True), "swiglu_vjp", (False,)),
               (dict(_GATHER, PUSH=True), None, (True, False))]


def _peers_examples(mode: dict, epilogue: str | None, layouts: tuple, tma: bool, major: int) -> list:
    cfg = gpu_config(major, tma, epilogue)
    spills = GATHER_KEEP_H_SPILLS if mode["KEEP_H"] and cfg["TMA"] else None
    return [aot_example(grouped_mm_peers_kernel, dict(_PEERS_SIG, **{B_UNIT[kmajor][1]: "i32"}),
                        dict(mode, **{B_UNIT[kmajor][0]: 1}), cfg, major * 10, kmajor, spills)
            for kmajor in layouts]


def _rows_epilogue_example(mode: dict, epilogue: str, kmajor: bool, tma: bool, major: int):
    """The rows kernel with an epilogue, as the pipelined expert MLP launches it: b =
    w13ᵀ (unit stride along K) or w2 (along N), c and h contiguous."""
    unit, other = B_UNIT[kmajor]
    sig = {k: v for k, v in _ROWS_SIG.items() if k != unit}
    consts = {k: v for k, v in _ROWS_UNIT.items() if k != other}
    cfg = gpu_config(major, tma, epilogue)
    return aot_example(grouped_mm_rows_kernel, dict(sig, **{other: "i32"}),
                       dict(consts, MASKED=False, **mode, **{unit: 1}), cfg, major * 10, kmajor,
                       ROWS_KEEP_H_SPILLS if mode["KEEP_H"] and cfg["TMA"] else None)


# triton 3.8 (not 3.6) spills 16 B in this variant's h stores
ROWS_KEEP_H_SPILLS = "epilogue only (the gate/up stores a backward needs), 16 B"


# fp32 is the exact path for tests and fp32 training, not a fast one
FP32_SPILLS = "fp32 FMA tiles on sm_80, 32 B under triton 3.8 (tests and fp32 training only)"
_NO_EPILOGUE = dict(SWIGLU=False, KEEP_H=False, SWIGLU_VJP=False)
AOT_EXAMPLES = (
    [aot_example(grouped_mm_rows_kernel, _ROWS_SIG, dict(_ROWS_UNIT, MASKED=masked, **_NO_EPILOGUE),
                 gpu_config(major, tma), major * 10, kmajor)
     for major, tma, kmajor in ((9, True, False), (9, True, True), (9, False, False), (8, False, False))
     for masked in (False, True)]
    + [_rows_epilogue_example(dict(_NO_EPILOGUE, **mode), epilogue, kmajor, tma, major)
       for mode, epilogue, kmajor in ((dict(SWIGLU=True), "swiglu", True),
                                      (dict(SWIGLU=True, KEEP_H=True), "swiglu", True),
                                      (dict(SWIGLU_VJP=True), "swiglu_vjp", False))
       for major, tma in ((9, True), (9, False), (8, False))]
    + [aot_example(grouped_mm_k_kernel, _K_SIG, dict(_K_UNIT, MASKED=masked), cfg, arch)
       for cfg, arch in ((POINTER_CONFIG_SM90, 90), (GPU_CONFIG_SM80, 80)) for masked in (False, True)]
    + [example for mode in PEERS_MODES for major, tma in ((9, True), (9, False), (8, False))
       for example in _peers_examples(*mode, tma, major)]
    # all_gather_matmul in fp32 (tests, fp32 training): pointer loads on gemm.py's FMA config
    + [aot_example(grouped_mm_peers_kernel,
                   {k: v.replace("bf16", "fp32") for k, v in dict(_PEERS_SIG, stride_bk="i32").items()},
                   dict(_GATHER, stride_bn=1), dict(GPU_CONFIG_FP32, TMA=False), arch,
                   spills_ok=FP32_SPILLS if arch == 80 else None)
       for arch in (90, 80)])
