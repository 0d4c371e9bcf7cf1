"""The GEMM over rows that come from peers: the fused expert MLP of ``ops/moe`` and
all_gather_matmul's GEMM (one expert, a block per source shard), also in fp8 with the scales
in its epilogue (``SCALED``: all_gather_scaled_matmul).

``grouped_mm_peers_kernel``: the rows come in blocks listed in a table of ``(src, expert,
peer_row, local_row, rows)``, ordered own rank first; A rows are local (``a[local_row]``).
Tiles cover runs of blocks (consecutive blocks of one expert whose rows follow each other,
``block_runs``), not single blocks, so a source's last partial tile costs no tile of its own.
Gather mode (``PUSH=False``): the sources' rows were copied into ``a`` by a producer that
raises this rank's ``GATHERED + src`` flag after each source's block (the copy engine on a
GPU), and a tile waits for the flags of the sources it holds rows of, so a source's rows are
multiplied as soon as they land; C goes to ``c[local_row]``. A failed wait (recorded in
STATUS) makes the program skip the tiles that hold that source's rows. Push (``PUSH=True``):
each row of a C tile goes straight into its source's region at its block's ``peer_row``
onward. The gather takes the SwiGLU epilogues of ``gemm.py``.
"""

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm import (EPILOGUES, GPU_CONFIG_FP32, B_UNIT, aot_example, fp8_example, gemm_operands, gpu_config,
                   grouped_tile, scale_tile, scaled_options, store_tile, swiglu_epilogue, swiglu_vjp_epilogue,
                   tile_candidate_examples, tile_pair, tile_pair_tma, tile_product, tile_product_tma)
from .signal import (cdiv, GATHERED, INTERPRETER_PROGRAMS, call_epoch, data_ptr, end_call, fence_async_proxy,
                     pad_ptr, sm_count, wait_word)

# triton 3.8 (not 3.6) spills 28 B in the SwiGLU gather that keeps the products
GATHER_KEEP_H_SPILLS = "per-tile scalars outside the K loop, triton 3.8 only, 28 B"
# triton 3.6, 128x256 tiles with a K-major B: the closing ticket's values (signal.end_call) go
# to the stack once before the tile loop and come back once after it (SASS: 3 stores in the
# prologue, 2 loads at the end), 28 B
END_SPILLS = "the closing ticket's values, stored before the tile loop and loaded after, triton 3.6, 28 B"


@triton.jit
def overlaps(start, n, m0, BLOCK_M: tl.constexpr):
    """Whether rows ``start : start + n`` and ``m0 : m0 + BLOCK_M`` share one (never when
    ``n`` is 0)."""
    return tl.maximum(start, m0) < tl.minimum(start + n, m0 + BLOCK_M)


@triton.jit
def wait_run_rows(blocks_ptr, b0, nb, run_row, m0, my_pad, epoch, timeout_ns, checked, ok,
                  TMA: tl.constexpr, BLOCK_M: tl.constexpr):
    """Wait for the GATHERED flag (1: this call's rows landed) of every source whose block
    of the run (blocks ``b0 : b0 + nb``, starting at received row ``run_row``) holds one of
    the tile's rows ``m0 : m0 + BLOCK_M``; ``checked`` / ``ok``: the source this program
    waited for last and how that went (a source is polled once per change, not per tile).
    Returns ``(tile_ok, checked, ok)``."""
    tile_ok = tl.full([], 1, tl.int1)
    for blk in range(b0, b0 + nb):
        start = tl.load(blocks_ptr + blk * 5 + 3) - run_row
        if overlaps(start, tl.load(blocks_ptr + blk * 5 + 4), m0, BLOCK_M):
            src = tl.load(blocks_ptr + blk * 5)
            if src != checked:
                checked = src
                ok = wait_word(my_pad, GATHERED + src, 1, src, epoch, timeout_ns, 1)  # TIMEOUT_READY
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
                            stride_bk, stride_bn, g_ptr, c_numel, g_numel, stride_am, sa_ptr,
                            stride_sa, sb_ptr, stride_sb, stride_sbe,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, PUSH: tl.constexpr, TMA: tl.constexpr,
                            B_KMAJOR: tl.constexpr, SWIGLU: tl.constexpr, KEEP_H: tl.constexpr,
                            SWIGLU_VJP: tl.constexpr, SCALED: tl.constexpr, UPCAST: tl.constexpr,
                            END: tl.constexpr):
    """``a``, ``b``: pointers, or TMA descriptors (``TMA``; b's strides are then unused).
    Tiles cover runs (``runs_ptr``: first block, blocks, rows), not blocks: a tile may hold
    the rows of several sources, so a source's partial tile does not cost a whole one.
    The gather stores C tiles to ``c`` (``[rows, N]``), or with an epilogue (``h`` is
    ``[rows, 2N]``, the gate and up products side by side): ``SWIGLU``: b holds ``[gate | up]`` along its ``2N`` columns; C tiles are ``silu(a @
    gate) * (a @ up)`` from the fp32 products, and with ``KEEP_H`` both products also go to
    ``h``. ``SWIGLU_VJP``: the product P = a @ b is the gradient of SwiGLU's output; C
    (``[rows, 2N]``) gets the gradients of the gate and up products, read from ``h``.
    ``SCALED`` (fp8 ``a`` and ``b``: all_gather_scaled_matmul's plain gather, the fp8 expert
    MLP's SwiGLU gather and push): the products times ``sa[row] * sb[expert][col]``
    (``gemm.scale_tile``: element i of ``sa`` at ``sa_ptr + i * stride_sa``, a stride 0
    repeats a tensorwise scale; expert e's column j of ``sb`` at ``sb_ptr + e * stride_sbe +
    j * stride_sb`` in the SwiGLU gather and the push; the plain gather has one B and adds
    no expert offset, which would cost its fp32-output sm_90 variant 20 B more spills),
    before the epilogue: with ``SWIGLU`` the gate and up products are scaled (their columns j
    and N + j of ``sb``), rounded to c's dtype and SwiGLU'd as torch does in that dtype
    (``gemm.swiglu_tile``'s ROUND: the fp8 recipe's numbers); the scale pointers are unused
    otherwise. ``stride_am``: a's row stride on pointer loads
    (K, or more where each row of the staged rows carries its scale after its K elements).
    ``END``: the kernel ends the call: its last program NaN-fills ``c`` (``c_numel``
    elements) and ``g`` (``g_numel``, maybe 0) if this rank recorded a failure."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    my_pad = pad_ptr(pad_table, rank)
    call = call_epoch(pad_table, rank, epoch)
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
                                                     call, timeout_ns, checked, ok, TMA, BLOCK_M)
            if tile_ok:
                if TMA:
                    if SWIGLU:
                        gate, up = tile_pair_tma(a, b, local_row + m0, n0, N + n0, expert, K,
                                                 BLOCK_M, BLOCK_N, BLOCK_K, B_KMAJOR, UPCAST)
                    else:
                        acc = tile_product_tma(a, b, local_row + m0, n0, expert, K, BLOCK_M,
                                               BLOCK_N, BLOCK_K, B_KMAJOR, UPCAST)
                else:
                    a_rows = a + local_row.to(tl.int64) * stride_am
                    b_expert = b + tl.cast(expert, tl.int64) * stride_be
                    if SWIGLU:
                        gate, up = tile_pair(a_rows, b_expert, m0, n0, N + n0, rows, b_cols, K, stride_am, 1,
                                             stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
                    else:
                        acc = tile_product(a_rows, b_expert, m0, n0, rows, N, 0, K, stride_am, 1,
                                           stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
                if SCALED:
                    sa_rows = sa_ptr + local_row.to(tl.int64) * stride_sa
                    sb_expert = sb_ptr
                    if SWIGLU or PUSH:  # the expert MLP's (the plain gather has one B)
                        sb_expert += tl.cast(expert, tl.int64) * stride_sbe
                    if SWIGLU:
                        gate = scale_tile(gate, sa_rows, stride_sa, sb_expert, stride_sb, m0, n0, rows,
                                          N, True, BLOCK_M, BLOCK_N)
                        up = scale_tile(up, sa_rows, stride_sa, sb_expert + N * stride_sb, stride_sb, m0,
                                        n0, rows, N, True, BLOCK_M, BLOCK_N)
                    else:
                        acc = scale_tile(acc, sa_rows, stride_sa, sb_expert, stride_sb, m0, n0, rows, N,
                                         True, BLOCK_M, BLOCK_N)
                if SWIGLU:  # gate columns past N read up columns: computed, never stored
                    swiglu_epilogue(c_base, h_base, gate, up, m0, n0, rows, N, KEEP_H, BLOCK_M, BLOCK_N,
                                    SCALED)
                elif SWIGLU_VJP:
                    swiglu_vjp_epilogue(c_base, h_base, acc, m0, n0, rows, N, BLOCK_M, BLOCK_N)
                elif not PUSH:
                    store_tile(c_base, acc, m0, n0, rows, N, N, 1, BLOCK_M, BLOCK_N)
                else:
                    push_tile(pad_table, c_ptr, blocks_ptr, b0, nb, local_row, acc, m0, n0, rows,
                              N, c_row, BLOCK_M, BLOCK_N)
            tile += tl.num_programs(0)
        first += group_tiles
    if END:
        end_call(pad_table, rank, world_size, epoch, c_ptr, c_numel, g_ptr, g_numel, True, False,
                 False)


def peers_grid(tiles: int, sms: int | None, cfg: dict) -> tuple[int]:
    """The peers kernel spins on flags: a grid of programs that are all resident at once
    (``CTAS_PER_SM`` per SM, 1 by default) on all SMs but one, each looping over tiles in
    the order of the tile list, so the resident programs take the sources' tiles in the
    order their rows land, and no tile waits in an unlaunched program while resident ones
    spin on later sources. The SM left free runs what the flags wait for (the copy
    stream's READY wait and DONE signal, one program each)."""
    if sms is None:
        return (max(1, min(tiles, INTERPRETER_PROGRAMS)),)
    return (max(1, min(tiles, max(sms - 1, 1) * cfg.get("CTAS_PER_SM", 1))),)


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
                     epilogue: str | None = None, h: torch.Tensor | None = None,
                     config: dict | None = None, ends_call: bool = False,
                     gathered: torch.Tensor | None = None, scales: tuple | None = None) -> None:
    """One launch over the row blocks in ``blocks`` (int32 ``[G, 5]``: src, expert,
    peer_row, local_row, rows), tiled by ``runs`` (int32 ``[R, 3]``, ``block_runs``; their
    rows ``run_rows`` on the host): a tile may hold several sources' rows of one expert, so
    each source's last partial tile costs none of its own.

    Gather (not ``push``): a tile waits for this rank's ``GATHERED + src`` flag of each
    source it holds rows of to be 1 (the producer copied that source's rows into ``a``
    first; ``epoch`` is the call's, for the interpreter's deadline); with ``P = a[local_row:+rows] @ b[expert]``, the ``epilogue`` writes
    ``c[local_row:+rows]``:

    - None: ``c = P`` (all_gather_matmul: one expert, a block per source shard).
    - ``"swiglu"``: b's columns are ``[gate | up]`` and ``c = swiglu(P)`` (``ops.moe.swiglu``
      from fp32 products: no ``[rows, 2N]`` round trip through memory); given ``h``, it
      also gets ``P``.
    - ``"swiglu_vjp"``: ``c [rows, 2N] = vjp(swiglu, h)(P)``, SwiGLU's backward at the
      forward's products ``h [rows, 2N]``.

    Push (no epilogue): ``src's region[(c_row + peer_row:+rows) * N] =
    a[local_row:+rows] @ b[expert]``; ``c`` only gives the dtype. ``a``, ``c`` and ``h``
    contiguous; ``b [E, K, N]`` any strides. ``config``: overrides of the launch config
    (``gemm.gemm_operands``). ``ends_call`` (the plain gather): its last program NaN-fills
    ``c`` and ``gathered`` (contiguous, optional) if this rank recorded a failure
    (all_gather_matmul; the expert MLP's calls end in ``protocol.release``). ``scales`` (fp8
    ``a`` and ``b``; the plain gather, the ``"swiglu"`` gather or the push): ``(sa, stride_sa,
    sb, stride_sb[, stride_sbe])``, fp32 row scales of ``a`` and column scales of ``b`` (stride
    0: tensorwise; ``stride_sbe``: between experts' column scales, default 0), applied before
    the epilogue: ``P = (a @ b[e]) * sa[:, None] * sb[e][None, :]``, and the ``"swiglu"``
    epilogue rounds the scaled products to c's dtype first, as the fp8 recipe's GEMM writes
    them (``gemm.swiglu_tile``'s ROUND). ``a``'s rows may then be strided (each staged row
    carrying its scale after its K elements: pointer loads).
    Waits: the GATHERED flags it spins on are raised by the copy engine (``stream_write_value32``
    on a side stream, after a one-program READY wait there) or, without one, before this
    launch in stream order; the grid (``peers_grid``) leaves one SM free for that wait.
    """
    if epilogue not in (None, *EPILOGUES) or push and epilogue is not None or (
            scales is not None and epilogue not in (None, "swiglu")):
        raise ValueError(f"grouped_mm_peers: push={push} with epilogue={epilogue!r}, scales "
                         f"{'given' if scales is not None else 'none'}; the gather takes None (the "
                         f"product, scaled or not) or one of {EPILOGUES} (scaled: 'swiglu' only), "
                         "the push None")
    swiglu = epilogue == "swiglu"
    K, N = b.shape[1], b.shape[2] // 2 if swiglu else b.shape[2]
    sms = sm_count(a.device)
    # the tile candidates are compiled for the plain gather (in 16 bits; fp8 takes the default tiles)
    plain = not push and epilogue is None and scales is None
    cfg, a_arg, b_arg, kmajor = gemm_operands(a, b, config, epilogue=epilogue,
                                              shape=(run_rows, N) if plain else None,
                                              sms=max(sms - 1, 1) if sms else None)
    tiles = sum(cdiv(r, cfg["BLOCK_M"]) for r in run_rows) * cdiv(N, cfg["BLOCK_N"])
    if tiles == 0 and not ends_call:
        return
    g = c if gathered is None else gathered
    sa, stride_sa, sb, stride_sb, stride_sbe = (*scales, 0)[:5] if scales is not None else (c, 0, c, 0, 0)
    grouped_mm_peers_kernel[peers_grid(tiles, sms, cfg)](
        a_arg, b_arg, c, c if h is None else h, blocks, runs, pad_table, rank, world_size, epoch,
        timeout_ns, runs.shape[0], N, K, c_row, b.stride(0), b.stride(1), b.stride(2),
        g, c.numel(), 0 if gathered is None else g.numel(), a.stride(0), sa, stride_sa, sb, stride_sb,
        stride_sbe,
        PUSH=push, TMA=cfg["TMA"], B_KMAJOR=kmajor, SWIGLU=swiglu, KEEP_H=swiglu and h is not None,
        SWIGLU_VJP=epilogue == "swiglu_vjp", END=ends_call, **scaled_options(cfg, scales is not None))


class Descriptors:
    """TMA descriptors of a launch signature's operands, kept by address: a host descriptor
    costs a dozen Python calls, and a call's tensors often sit where the last call's did (a
    buffer, weights, activations the allocator hands back). ``a(t)``: ``t [rows, K]`` in
    ``[BLOCK_M, BLOCK_K]`` boxes; ``b(t)``: ``t [K, N]`` as ``[1, K, N]`` (or, ``kmajor``, its
    transpose ``[1, N, K]``) in the config's boxes."""

    KEEP = 8

    def __init__(self, cfg: dict, kmajor: bool):
        self.cfg, self.kmajor = cfg, kmajor
        self._kept: dict = {}

    def a(self, t: torch.Tensor):
        key = (t.data_ptr(), t.shape[0], "a")
        desc = self._kept.get(key)
        return desc if desc is not None else self._keep(key, t, [self.cfg["BLOCK_M"], self.cfg["BLOCK_K"]])

    def b(self, t: torch.Tensor):
        key = (t.data_ptr(), t.shape[0], "b")
        desc = self._kept.get(key)
        if desc is not None:
            return desc
        bn, bk = self.cfg["BLOCK_N"], self.cfg["BLOCK_K"]
        if self.kmajor:
            return self._keep(key, t.t().unsqueeze(0), [1, bn, bk])
        return self._keep(key, t.unsqueeze(0), [1, bk, bn])

    def _keep(self, key, t: torch.Tensor, block: list[int]):
        if len(self._kept) >= self.KEEP:
            self._kept.clear()
        desc = self._kept[key] = TensorDescriptor.from_tensor(t, block)
        return desc


def tma_addressable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether descriptors made for tensors of these shapes and strides can take these
    tensors: their addresses 16-byte aligned (a view may start anywhere)."""
    return a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0


class GatherLaunch:
    """``grouped_mm_peers`` of all_gather_matmul (the plain gather of one B, ending the
    call) for every call of one signature: the config, grid and launch options made once,
    and the TMA descriptors kept (``Descriptors``). ``a`` ``[rows, K]``, ``b`` ``[K, N]``;
    ``scaled``: all_gather_scaled_matmul's (fp8, every call passes ``scales``)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, run_rows: list[int], config: dict | None = None,
                 scaled: bool = False):
        self.config = config
        sms = sm_count(a.device)
        # the tiles that fill the waves of the SMs the grid takes (``peers_grid``: all but one);
        # fp8 takes the default tiles (the variants AOT_EXAMPLES compiles)
        self.cfg, _, _, self.kmajor = gemm_operands(a, b.unsqueeze(0), config,
                                                    shape=None if scaled else (run_rows, b.shape[1]),
                                                    sms=max(sms - 1, 1) if sms else None)
        cfg = self.cfg
        self.K, self.N = b.shape
        self.b_strides = (0, *b.stride())
        tiles = sum(cdiv(r, cfg["BLOCK_M"]) for r in run_rows) * cdiv(self.N, cfg["BLOCK_N"])
        self.grid = peers_grid(tiles, sms, cfg)
        self.options = scaled_options(cfg, scaled)
        self.descriptors = Descriptors(cfg, self.kmajor)

    def __call__(self, a, b, c, blocks, runs, run_rows, pad_table, rank, world_size, timeout_ns,
                 gathered=None, scales=None) -> None:
        cfg = self.cfg
        if cfg["TMA"]:
            if not tma_addressable(a, b):  # the general launcher decides
                grouped_mm_peers(a, b.unsqueeze(0), c, blocks, runs, run_rows, pad_table, rank,
                                 world_size, 0, timeout_ns, push=False, config=self.config,
                                 ends_call=True, gathered=gathered, scales=scales)
                return
            a_arg, b_arg = self.descriptors.a(a), self.descriptors.b(b)
        else:
            a_arg, b_arg = a, b
        g = c if gathered is None else gathered
        stride_be, stride_bk, stride_bn = self.b_strides
        sa, stride_sa, sb, stride_sb = scales or (c, 0, c, 0)
        grouped_mm_peers_kernel[self.grid](
            a_arg, b_arg, c, c, blocks, runs, pad_table, rank, world_size, 0, timeout_ns,
            runs.shape[0], self.N, self.K, 0, stride_be, stride_bk, stride_bn, g, c.numel(),
            0 if gathered is None else g.numel(), a.stride(0), sa, stride_sa, sb, stride_sb, 0,
            PUSH=False, TMA=cfg["TMA"], B_KMAJOR=self.kmajor,
            SWIGLU=False, KEEP_H=False, SWIGLU_VJP=False, END=True, **self.options)


_PEERS_SIG = {"a": "*bf16", "b": "*bf16", "c_ptr": "*bf16", "h_ptr": "*bf16", "blocks_ptr": "*i32",
              "runs_ptr": "*i32", "pad_table": "*i64", "rank": "i32", "world_size": "i32",
              "epoch": "i32", "timeout_ns": "i64", "num_runs": "i32", "N": "i32", "K": "i32",
              "c_row": "i32", "stride_be": "i32", "g_ptr": "*bf16", "c_numel": "i32", "g_numel": "i32",
              "stride_am": "i32", "sa_ptr": "*fp32", "stride_sa": "i32", "sb_ptr": "*fp32",
              "stride_sb": "i32", "stride_sbe": "i32"}


_GATHER = dict(PUSH=False, SWIGLU=False, KEEP_H=False, SWIGLU_VJP=False, SCALED=False, END=False)
# the peers kernel's variants with the B layouts the expert MLP passes (kmajor: ``B_UNIT``):
# the forward's SwiGLU gather (b = w13ᵀ) with and without the gate/up products kept, the
# backward's VJP gather (b = w2), the push (w2ᵀ in the forward, w13 in the backward); and
# all_gather_matmul's plain gather (B row-major, or a Linear's weightᵀ)
PEERS_MODES = [(dict(_GATHER, END=True), None, (True, False)),
               (dict(_GATHER, SWIGLU=True), "swiglu", (True,)),
               (dict(_GATHER, SWIGLU=True, KEEP_H=True), "swiglu", (True,)),
               (dict(_GATHER, SWIGLU_VJP=True), "swiglu_vjp", (False,)),
               (dict(_GATHER, PUSH=True), None, (True, False))]


def _peers_examples(mode: dict, epilogue: str | None, layouts: tuple, tma: bool, major: int) -> list:
    cfg = gpu_config(major, tma, epilogue)
    spills = (GATHER_KEEP_H_SPILLS if mode["KEEP_H"] and cfg["TMA"]
              else END_SPILLS if mode["END"] and cfg["TMA"] and cfg["BLOCK_N"] == 256 else None)
    return [aot_example(grouped_mm_peers_kernel, dict(_PEERS_SIG, **{B_UNIT[kmajor][1]: "i32"}),
                        dict(mode, **{B_UNIT[kmajor][0]: 1}), cfg, major * 10, kmajor, spills)
            for kmajor in layouts]


# fp32 is the exact path for tests and fp32 training, not a fast one
FP32_SPILLS = ("fp32 FMA tiles: sm_80, 32 B under triton 3.8; sm_90, 60 B under triton 3.6 with the "
               "closing ticket (tests and fp32 training only)")
# measured (tests/kernels/aot_compile.py's ptxas counts), where in the kernel not located;
# the bf16 output on the same tiles does not spill
FP8_FP32_SPILLS = ("fp8 with a float32 output on 128x256 TMA tiles: 60 B under triton 3.8, 52 B under "
                   "triton 3.6 (the bfloat16 output spills none)")
AOT_EXAMPLES = (
    [example for mode in PEERS_MODES for major, tma in ((9, True), (9, False), (8, False))
     for example in _peers_examples(*mode, tma, major)]
    # all_gather_matmul in fp32 (tests, fp32 training): pointer loads on gemm.py's FMA config
    + [aot_example(grouped_mm_peers_kernel,
                   {k: v.replace("bf16", "fp32") for k, v in dict(_PEERS_SIG, stride_bk="i32").items()},
                   dict(_GATHER, END=True, stride_bn=1), dict(GPU_CONFIG_FP32, TMA=False), arch,
                   spills_ok=FP32_SPILLS)
       for arch in (90, 80)]
    # all_gather_matmul's plain gather on the other sm_90 tiles it may choose (``choose_tile``)
    + tile_candidate_examples(grouped_mm_peers_kernel, _PEERS_SIG, dict(_GATHER, END=True))
    # all_gather_scaled_matmul's (fp8, sm_90): TMA on the default tiles with B row-major or
    # column-major (torch._scaled_mm's layout), e5m2 x e4m3, a float32 output; pointer loads (A
    # rows that carry their scales: rowwise scales of the shards)
    + [fp8_example(grouped_mm_peers_kernel, dict(_PEERS_SIG, **{B_UNIT[kmajor][1]: "i32"}),
                   dict(_GATHER, END=True, **{B_UNIT[kmajor][0]: 1}), gpu_config(9, tma), kmajor, a,
                   spills_ok=FP8_FP32_SPILLS if out == "fp32" else None, g_ptr=a, c_ptr=out, h_ptr=out)
       for tma, kmajor, a, out in ((True, True, "fp8e4nv", "bf16"), (True, False, "fp8e4nv", "bf16"),
                                   (True, True, "fp8e5", "bf16"), (True, True, "fp8e4nv", "fp32"),
                                   (False, True, "fp8e4nv", "bf16"), (False, False, "fp8e5", "bf16"))]
    # the fp8 expert MLP's (moe_experts' fused backend with float8, sm_90; e4m3, bf16 out): the
    # SwiGLU gather of rows that carry their scales (pointer loads: a row stride of H + 4 bytes),
    # the products kept or not, b the cast w13ᵀ (K-major); the push of the rowwise-cast rows
    # (TMA, or pointer loads where they are not 16-byte aligned) with the cast w2ᵀ (K-major,
    # the forward) or the cast w13 for the input gradient (row-major, the backward). sm_80
    # has no fp8 tensor cores: no variant there, as for all_gather_scaled_matmul
    + [fp8_example(grouped_mm_peers_kernel, dict(_PEERS_SIG, **{B_UNIT[kmajor][1]: "i32"}),
                   dict(mode, **{B_UNIT[kmajor][0]: 1}), gpu_config(9, tma, epilogue), kmajor)
       for mode, epilogue, tma, kmajor in ((dict(_GATHER, SWIGLU=True), "swiglu", False, True),
                                           (dict(_GATHER, SWIGLU=True, KEEP_H=True), "swiglu", False, True),
                                           (dict(_GATHER, PUSH=True), None, True, True),
                                           (dict(_GATHER, PUSH=True), None, False, True),
                                           (dict(_GATHER, PUSH=True), None, True, False),
                                           (dict(_GATHER, PUSH=True), None, False, False))])
