"""Matmul + reduce-scatter: ``P = A @ B`` into this rank's symmetric data region with a
READY flag per finished row chunk (``matmul_reduce_scatter``), and the local sum of a chunk's partials
once they are here (``reduce_chunks``).

``A`` is ``[M, K]`` with ``M = W * m_chunk``; chunk ``c`` is rows ``[c*m_chunk, (c+1)*m_chunk)``
of ``P`` and is reduced on rank ``c``. One persistent kernel computes the tiles in
rank-rotated chunk order: step ``s`` covers chunk ``c = (rank + 1 + s) % W``, so peers'
chunks come first and the own chunk last (rank ``c`` can fetch a peer's partial while
both still compute). Tiles never straddle chunks; within a chunk, GROUP_M-grouped order.

Before its first store every program waits until every peer's DONE flag reached the last
epoch (nobody still reads our partials: a bounded wait on flags that need none of this
kernel's SMs). After storing a tile, the program counts it in this rank's ``CHUNK_TILES + c``
pad word; the program that finishes chunk ``c`` sets the count back to 0, publishes our
fingerprint and raises ``READY + rank = epoch`` in rank ``c``'s pad (release, system scope).
Rank ``c`` then sums the W partials of its chunk: in a group on a GPU it copies each peer's
partial into a local staging buffer once that flag is up (the copy engine, overlapping the
GEMM) and ``reduce_chunks`` sums them with its own; in a loopback or on CPU
``reduce_scatter.reduce_scatter_pull`` reads them where they are. Either closes the call
(``signal.end_call``).

``SCALED`` (scaled_matmul_reduce_scatter): fp8 ``A`` and ``B``, each tile multiplied by A's
row scales and B's column scales in the epilogue (``gemm.scale_tile``; a stride 0 repeats a
tensorwise scale) and stored as float32 partials, which the same reduction sums in float32
and rounds once to the output dtype (``reduce_chunks`` writes it; after the pull, a cast).
"""

import torch
import triton
import triton.language as tl

from ..comm import layout
from .gemm import (B_UNIT, SM_COUNT, aot_example, aot_variants, fp8_example, gemm_operands, gpu_config,
                   grouped_tile, persistent_grid, scale_tile, scaled_options, store_tile,
                   tile_candidate_examples, tile_product, tile_product_tma)
from .gemm_peers import Descriptors, tma_addressable
from .interpreter import interpreting
from .reduce_scatter import BLOCK, NUM_WARPS, reduce_scatter_grid
from .signal import (DONE, META, PER_CALL_ARGS, TIMEOUT_DONE, call_epoch, cdiv, end_call, pad_ptr,
                     sm_count, wait_peers)

READY = tl.constexpr(layout.READY)
CHUNK_TILES = tl.constexpr(layout.CHUNK_TILES)
# fp8 (SCALED) on a GPU: 128x128 tiles. The TMA default's 128x256 float32 accumulator with
# the scales' epilogue spills 240-320 B (ptxas, sm_90a, triton 3.6 and 3.8); 128x128x64 (the
# pointer loads' tiles too) spills none. Which fp8 tile runs fastest is for GPU rows to say.
SCALED_CONFIG = dict(BLOCK_N=128)


def _config(config: dict | None, scaled: bool) -> dict | None:
    """The launch config's overrides: ``SCALED_CONFIG`` under ``config`` for fp8 on a GPU."""
    return dict(SCALED_CONFIG, **(config or {})) if scaled and not interpreting() else config


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def matmul_reduce_scatter_kernel(a, b, p_ptr, pad_table, rank, world_size, epoch, meta, timeout_ns,
                   m_chunk, N, K, stride_am, stride_ak, stride_bk, stride_bn, sa_ptr, stride_sa,
                   sb_ptr, stride_sb,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, TMA: tl.constexpr,
                   B_KMAJOR: tl.constexpr, SCALED: tl.constexpr, UPCAST: tl.constexpr):
    """``a``, ``b``: pointers, or TMA descriptors over ``a [M, K]`` and ``b`` as ``[1, K, N]``
    (``B_KMAJOR``: its transpose ``[1, N, K]``; the strides are then unused). A TMA tile's
    rows past its chunk read the next chunk's rows: computed, never stored. ``SCALED``
    (fp8 ``a`` and ``b``: scaled_matmul_reduce_scatter): a tile is the product times
    ``sa[row] * sb[col]`` (``gemm.scale_tile``: element i of ``sa`` at ``sa_ptr + i *
    stride_sa``, a stride 0 repeats a tensorwise scale; of ``sb`` likewise), stored to a
    float32 ``p``; the scale pointers are unused otherwise."""
    m_tiles = tl.cdiv(m_chunk, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    chunk_tiles = m_tiles * n_tiles
    num_tiles = world_size * chunk_tiles
    my_pad = pad_ptr(pad_table, rank)
    epoch = call_epoch(pad_table, rank, epoch)
    wait_peers(my_pad, DONE, rank, world_size, epoch - 1, epoch, timeout_ns, TIMEOUT_DONE)
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        step = tile // chunk_tiles
        chunk = (rank + 1 + step) % world_size
        pid_m, pid_n = grouped_tile(tile - step * chunk_tiles, m_tiles, n_tiles, GROUP_M)
        m0 = chunk * m_chunk + pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        chunk_end = (chunk + 1) * m_chunk
        if TMA:
            acc = tile_product_tma(a, b, m0, n0, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, B_KMAJOR, UPCAST)
        else:
            acc = tile_product(a, b, m0, n0, chunk_end, N, 0, K, stride_am, stride_ak, stride_bk,
                               stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        if SCALED:
            acc = scale_tile(acc, sa_ptr, stride_sa, sb_ptr, stride_sb, m0, n0, chunk_end, N, True,
                             BLOCK_M, BLOCK_N)
        store_tile(p_ptr, acc, m0, n0, chunk_end, N, N, 1, BLOCK_M, BLOCK_N)
        # every thread's stores of this tile happen before the count (and, through the
        # acq_rel chain on the counter, before the release of the chunk's flag)
        tl.debug_barrier()
        done = tl.atomic_add(my_pad + CHUNK_TILES + chunk, 1, sem="acq_rel", scope="sys")
        if done + 1 == chunk_tiles:  # the chunk's last tile: the others are counted
            tl.atomic_xchg(my_pad + CHUNK_TILES + chunk, 0, sem="relaxed", scope="sys")
            tl.atomic_xchg(my_pad + META, meta, sem="relaxed", scope="sys")
            tl.atomic_xchg(pad_ptr(pad_table, chunk) + READY + rank, epoch, sem="release", scope="sys")


@triton.jit(do_not_specialize=["rank", "world_size", "epoch"])
def reduce_chunks_kernel(out_ptr, own_ptr, stage_ptr, pad_table, rank, world_size, epoch, n, divisor,
                         BLOCK: tl.constexpr):
    """``out = sum over src in rank order of src's partial / divisor``, in fp32, rounded once:
    the own partial at ``own_ptr``, peer ``src``'s at row ``(rank - 1 - src) % W`` of
    ``stage_ptr`` (``[W - 1, n]``, the order the peers finish them). Ends the call
    (``signal.end_call``): DONE, and the NaNs of a failed call."""
    n = tl.cast(n, tl.int64)
    for block in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = block * BLOCK + tl.arange(0, BLOCK)  # int64, as n is
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for src in range(0, world_size):
            if src == rank:
                acc += tl.load(own_ptr + offs, mask=mask, other=0).to(tl.float32)
            else:
                row = (rank - 1 - src + world_size) % world_size
                acc += tl.load(stage_ptr + row * n + offs, mask=mask, other=0).to(tl.float32)
        # div_rn: fp32 ``/`` compiles to an approximate division (the average rounds as torch's)
        tl.store(out_ptr + offs, tl.math.div_rn(acc, divisor).to(out_ptr.dtype.element_ty), mask=mask)
    end_call(pad_table, rank, world_size, epoch, out_ptr, n, out_ptr, 0, True, True, False)


def reduce_chunks(out: torch.Tensor, own: torch.Tensor, stage: torch.Tensor, pad_table: torch.Tensor,
                  rank: int, world_size: int, epoch: int, divisor: float = 1.0) -> None:
    """Fill ``out`` (contiguous, ``n`` elements) with the sum of this rank's partial ``own``
    and the peers' partials in ``stage`` (contiguous ``[W - 1, n]``, row ``j`` from rank
    ``(rank - 1 - j) % W``), divided by ``divisor``: summed in rank order in fp32 and rounded
    once, so the result is the same whichever order the partials arrived in. Then it raises
    DONE of ``epoch`` in every peer's pad, and NaN-fills ``out`` if this rank recorded a
    failure."""
    n = out.numel()
    if own.numel() != n or tuple(stage.shape) != (world_size - 1, n) or not (
            out.is_contiguous() and own.is_contiguous() and stage.is_contiguous()):
        raise ValueError(f"reduce_chunks: out ({out.numel()}), own ({own.numel()}) and stage "
                         f"{tuple(stage.shape)} must be contiguous with n and [W - 1 = "
                         f"{world_size - 1}, n] elements")
    grid = reduce_scatter_grid(1, n, sm_count(out.device))
    reduce_chunks_kernel[grid](out, own, stage, pad_table, rank, world_size, epoch, n, divisor,
                               BLOCK=BLOCK, num_warps=NUM_WARPS)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor, pad_table: torch.Tensor, rank: int,
            world_size: int, epoch: int, meta: int, timeout_ns: int, *,
            config: dict | None = None, sms: int | None = None, scales: tuple | None = None) -> None:
    """Fill ``p`` (contiguous ``[M, N]``, a view of this rank's symmetric data region) with
    ``a @ b`` (``a``: ``[M, K]``, ``b``: ``[K, N]``, any strides; ``M = W * m_chunk``), raising
    ``READY + rank = epoch`` in rank ``c``'s pad (after publishing ``meta``) as soon as chunk
    ``c`` of ``p`` is complete. It first waits (bounded by ``timeout_ns``) for every peer's
    DONE of the last epoch, flags that need none of its SMs, so its persistent grid
    (``NUM_PROGRAMS``, one program per SM by default) may hold every SM; a caller that spins
    on its flags from another stream leaves ``REDUCER_SMS`` free. It loads through TMA
    descriptors where the GPU has them and the layouts allow (as the grouped GEMM does), on
    the tiles that fill the waves of ``sms`` SMs best (default: the device's;
    ``gemm.choose_tile``), with a program per SM of them. ``scales`` (fp8 ``a`` and ``b``,
    a float32 ``p``): ``(sa, stride_sa, sb, stride_sb)``, float32 row scales of ``a`` and
    column scales of ``b`` (stride 0: tensorwise), applied in the epilogue: ``p = (a @ b) *
    sa[:, None] * sb[None, :]`` (on ``SCALED_CONFIG``'s tiles, which ``AOT_EXAMPLES`` compiles in fp8).
    """
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K or tuple(p.shape) != (M, N) or M % world_size:
        raise ValueError(f"matmul_reduce_scatter: A {tuple(a.shape)}, B {tuple(b.shape)}, P {tuple(p.shape)} do not "
                         f"fit world size {world_size} (M must be divisible by it)")
    if not p.is_contiguous():
        raise ValueError("matmul_reduce_scatter: p must be contiguous")
    m_chunk = M // world_size
    if m_chunk == 0 or N == 0:
        raise ValueError("matmul_reduce_scatter: empty output: no tile would raise the chunks' READY flags")
    scaled = scales is not None
    cfg, a_arg, b_arg, kmajor = gemm_operands(a, b.unsqueeze(0), _config(config, scaled),
                                              shape=None if scaled else ([m_chunk] * world_size, N), sms=sms)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    num_tiles = world_size * cdiv(m_chunk, bm) * cdiv(N, bn)
    sa, stride_sa, sb, stride_sb = scales or (p, 0, p, 0)
    matmul_reduce_scatter_kernel[persistent_grid(num_tiles, cfg)](
        a_arg, b_arg, p, pad_table, rank, world_size, epoch, meta, timeout_ns, m_chunk, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), sa, stride_sa, sb, stride_sb,
        NUM_PROGRAMS=cfg["NUM_PROGRAMS"], TMA=cfg["TMA"], B_KMAJOR=kmajor, **scaled_options(cfg, scaled))


class ScatterLaunch:
    """``matmul_reduce_scatter`` for every call of one signature (shapes, strides, dtype,
    SMs): the config, grid and launch options made once, TMA descriptors kept
    (``gemm_peers.Descriptors``). ``scaled``: scaled_matmul_reduce_scatter's (fp8, every call
    passes ``scales``)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, world_size: int, sms: int | None = None,
                 scaled: bool = False):
        M, K = a.shape
        N = b.shape[1]
        self.sms, self.world = sms, world_size
        # fp8 takes SCALED_CONFIG's tiles (the variants AOT_EXAMPLES compiles)
        self.cfg, _, _, self.kmajor = gemm_operands(
            a, b.unsqueeze(0), _config(None, scaled), shape=None if scaled else ([M // world_size] * world_size, N),
            sms=sms)
        cfg = self.cfg
        self.m_chunk, self.N, self.K = M // world_size, N, K
        self.strides = (*a.stride(), *b.stride())
        self.grid = persistent_grid(world_size * cdiv(self.m_chunk, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), cfg)
        self.options = dict(scaled_options(cfg, scaled), NUM_PROGRAMS=cfg["NUM_PROGRAMS"], TMA=cfg["TMA"],
                            B_KMAJOR=self.kmajor)
        self.descriptors = Descriptors(cfg, self.kmajor)

    def __call__(self, a, b, p, pad_table, rank, epoch, meta, timeout_ns, scales=None) -> None:
        if self.cfg["TMA"]:
            if not tma_addressable(a, b):  # the general launcher decides
                matmul_reduce_scatter(a, b, p, pad_table, rank, self.world, epoch, meta, timeout_ns,
                                      sms=self.sms, scales=scales)
                return
            a_arg, b_arg = self.descriptors.a(a), self.descriptors.b(b)
        else:
            a_arg, b_arg = a, b
        sa, stride_sa, sb, stride_sb = scales or (p, 0, p, 0)
        matmul_reduce_scatter_kernel[self.grid](
            a_arg, b_arg, p, pad_table, rank, self.world, epoch, meta, timeout_ns, self.m_chunk,
            self.N, self.K, *self.strides, sa, stride_sa, sb, stride_sb, **self.options)


# SMs a GEMM of a group call leaves to the kernel that waits for the peers' flags on the
# side stream (one program; the copies themselves run on the copy engine)
REDUCER_SMS = 1

_SIG = {"a": "*T", "b": "*T", "p_ptr": "*T", "pad_table": "*i64", "rank": "i32",
        "world_size": "i32", "epoch": "i32", "meta": "i32", "timeout_ns": "i64", "m_chunk": "i32",
        "N": "i32", "K": "i32",
        "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32",
        "sa_ptr": "*fp32", "stride_sa": "i32", "sb_ptr": "*fp32", "stride_sb": "i32"}
_SIG16 = {k: v.replace("*T", "*bf16") for k, v in _SIG.items()}
_PERSISTENT = dict(NUM_PROGRAMS=SM_COUNT[90] - REDUCER_SMS)  # a group call's GEMM on sm_90
# triton 3.6, sm_90, fp32 pointer loads: the DONE wait's values cross the tile loop on the stack
FP32_SPILLS = "fp32 FMA tiles on sm_90 under triton 3.6, 16 B (tests and fp32 training only)"
AOT_EXAMPLES = (
    # pointer loads: sm_80, and sm_90 where TMA cannot cover the operands
    [(kernel, sig, consts, dict(options, spills_ok=FP32_SPILLS) if sig["a"] == "*fp32" else options)
     for kernel, sig, consts, options in aot_variants(matmul_reduce_scatter_kernel, _SIG, TMA=False,
                                                      B_KMAJOR=False, SCALED=False)]
    # sm_90 with TMA loads: B row-major, or a Linear's weightᵀ
    + [aot_example(matmul_reduce_scatter_kernel, _SIG16, {B_UNIT[kmajor][0]: 1, "SCALED": False},
                   dict(gpu_config(9, True), **_PERSISTENT), 90, kmajor)
       for kmajor in (False, True)]
    # scaled_matmul_reduce_scatter's (fp8 with float32 partials, sm_90 only: sm_80 has no fp8
    # tensor cores and the op refuses it): TMA on SCALED_CONFIG's tiles with B row-major or K-major
    # (torch._scaled_mm's layout; the scattered output columns' Aᵀ), e5m2 x e4m3; pointer loads
    # (K not a multiple of 16)
    + [fp8_example(matmul_reduce_scatter_kernel, _SIG16,
                   {B_UNIT[kmajor][0]: 1, **({} if tma else {"stride_ak": 1})},
                   dict(gpu_config(9, tma), **_PERSISTENT, **SCALED_CONFIG), kmajor, a, p_ptr="fp32")
       for tma, kmajor, a in ((True, False, "fp8e4nv"), (True, True, "fp8e4nv"), (True, True, "fp8e5"),
                              (False, False, "fp8e4nv"), (False, True, "fp8e5"))]
    + [(reduce_chunks_kernel,
        {"out_ptr": f"*{out}", "own_ptr": f"*{t}", "stage_ptr": f"*{t}", "pad_table": "*i64",
         "rank": "i32", "world_size": "i32", "epoch": "i32", "n": "i32", "divisor": "fp32"},
        {"BLOCK": BLOCK}, {"num_warps": NUM_WARPS})
       # the scaled op's float32 partials summed into a 16-bit output
       for t, out in (("bf16", "bf16"), ("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "fp16"))]
    # the other sm_90 tiles the GEMM may choose (``gemm.choose_tile``)
    + tile_candidate_examples(matmul_reduce_scatter_kernel, _SIG16, {"SCALED": False},
                              num_programs=SM_COUNT[90] - REDUCER_SMS))
