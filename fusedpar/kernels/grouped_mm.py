"""The grouped GEMM of ``grouped_mm``: the tiles of every group in one persistent launch
(``torch._grouped_mm`` contract: ``offs`` holds int32 cumulative group ends, read on the
device, so there is no host loop and no device-to-host sync).

- ``grouped_mm_rows_kernel`` (forward and dgrad): ``a [T, K]`` times ``b [E, K, N]``; the
  rows ``offs[g-1]:offs[g]`` of ``a`` are multiplied by ``b[g]``. The programs walk the
  groups in order, each keeping a running count of the tiles before the current group, and
  take every NUM_PROGRAMS-th tile of the concatenated tile list (GROUP_M-grouped within a
  group). Rows past ``offs[-1]`` get zeros (a padded buffer's tail), so no output row is
  left unwritten. It also runs the expert MLPs' SwiGLU epilogues (``gemm.py``).
- ``grouped_mm_k_kernel`` (wgrad): ``a [M, K_total]`` times ``b [K_total, N]`` with groups
  along K: ``c[g] = a[:, offs[g-1]:offs[g]] @ b[offs[g-1]:offs[g]]``; an empty group gives
  zeros. Its tile count ``E * m_tiles * n_tiles`` is known on the host.
- ``zero_rows_past_kernel``: zeros in the rows that another GEMM (``torch._grouped_mm``,
  ``torch.bmm``) leaves unwritten or computes over padding: the rows past ``offs[-1]``, or
  past each count of the masked layout. The bound is read on the device; a program (a block
  of rows, all columns) whose block lies before it returns at once, so the rows it covers
  are never touched.

None waits on anything: the GEMMs' grids are capped at NUM_PROGRAMS (the SM count) only
because they are persistent.
"""

import torch
import triton
import triton.language as tl

from .gemm import (EPILOGUES, GPU_CONFIG_SM80, POINTER_CONFIG_SM90, B_UNIT, add_tile_product, aot_example,
                   fp8_example, gemm_operands, gpu_config, grouped_config, grouped_tile, scale_tile,
                   scaled_options, store_tile, swiglu_epilogue, swiglu_vjp_epilogue, tile_pair,
                   tile_pair_tma, tile_product, tile_product_tma)
from .moe_permute import ROW_BLOCK_GPU, row_blocks
from .signal import cdiv


@triton.jit
def grouped_mm_rows_kernel(a, b, c_ptr, h_ptr, offs_ptr, sa_ptr, sb_ptr, T, N, K, E, pad_rows,
                           stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                           stride_cm, stride_cn, stride_sbg,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
                           MASKED: tl.constexpr, SWIGLU: tl.constexpr, KEEP_H: tl.constexpr,
                           SWIGLU_VJP: tl.constexpr, SCALED: tl.constexpr, UPCAST: tl.constexpr):
    """``a``, ``b``: pointers, or TMA descriptors (``TMA``; the strides are then unused).
    ``SCALED`` (fp8 ``a``, ``b``): the product of row r of group g times ``sa[r] *
    sb[g * stride_sbg + n]`` (``scaled_grouped_mm``); the pointers are unused otherwise.
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
                swiglu_epilogue(c_ptr, h_ptr, gate, up, m0, n0, end, N, KEEP_H, BLOCK_M, BLOCK_N, False)
            elif SWIGLU_VJP:
                swiglu_vjp_epilogue(c_ptr, h_ptr, acc, m0, n0, end, N, BLOCK_M, BLOCK_N)
            else:
                if SCALED:
                    acc = scale_tile(acc, sa_ptr, 1, sb_ptr + tl.cast(g, tl.int64) * stride_sbg, 1, m0, n0,
                                     end, N, k_hi > 0, BLOCK_M, BLOCK_N)
                store_tile(c_ptr, acc, m0, n0, end, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)
            tile += step
        first += group_tiles
        start = end


@triton.jit
def grouped_mm_k_kernel(a_ptr, b_ptr, c_ptr, offs_ptr, sa_ptr, sb_ptr, M, N, E, pad_rows, sources,
                        stride_am, stride_ak, stride_bk, stride_bn,
                        stride_ce, stride_cm, stride_cn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, MASKED: tl.constexpr, SCALED: tl.constexpr,
                        UPCAST: tl.constexpr):
    """``MASKED``: ``offs_ptr`` holds counts; group g's K starts at ``g * pad_rows``. Else
    ``offs_ptr`` holds the ends of ``sources * E`` segments, source-major, and group g sums
    the products over its segments ``s * E + g``. ``SCALED`` (fp8 ``a``, ``b``; one source):
    ``c[g, m, n]`` times ``sa[g * M + m] * sb[g * N + n]``."""
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
        if SCALED:
            acc = scale_tile(acc, sa_ptr + tl.cast(g, tl.int64) * M, 1, sb_ptr + tl.cast(g, tl.int64) * N, 1,
                             m0, n0, M, N, True, BLOCK_M, BLOCK_N)
        store_tile(c_ptr + tl.cast(g, tl.int64) * stride_ce, acc, m0, n0, M, N, stride_cm,
                   stride_cn, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["first", "R"])
def zero_rows_past_kernel(c_ptr, ends_ptr, first, R, C, stride_cg, stride_cr, stride_cc,
                          BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """``c[g, ends[first + g]:, :] = 0`` for ``c [G, R, C]``; program ``g * r_tiles + i``
    owns block i of the rows of ``c[g]`` (all its columns)."""
    r_tiles = tl.cdiv(R, BLOCK_R)
    g = tl.program_id(0) // r_tiles
    r0 = (tl.program_id(0) % r_tiles) * BLOCK_R
    end = tl.minimum(tl.maximum(tl.load(ends_ptr + first + g), 0), R)
    if r0 + BLOCK_R > end:  # else the block holds products: nothing to do
        r = r0 + tl.arange(0, BLOCK_R)
        rows = c_ptr + tl.cast(g, tl.int64) * stride_cg + r.to(tl.int64)[:, None] * stride_cr
        past = ((r >= end) & (r < R))[:, None]
        for h0 in range(0, C, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            tl.store(rows + h.to(tl.int64)[None, :] * stride_cc,
                     tl.zeros([BLOCK_R, BLOCK_H], c_ptr.dtype.element_ty), mask=past & (h < C)[None, :])


def zero_rows_past(c: torch.Tensor, ends: torch.Tensor, first: int = 0) -> None:
    """``c[g, ends[first + g]:] = 0`` for every g (each bound clamped to ``[0, R]``), read
    on the device: ``c [G, R, C]`` with unit stride along C (vector stores; any other
    strides), ``ends`` int32 contiguous. The rows past ``offs[-1]`` of a ``[T, N]`` output
    are ``zero_rows_past(out[None], offs, E - 1)``."""
    G, R, C = c.shape
    if G and R and C:
        cfg = row_blocks()
        zero_rows_past_kernel[(G * cdiv(R, cfg["BLOCK_R"]),)](
            c, ends, first, R, C, c.stride(0), c.stride(1), c.stride(2), **cfg)


def grouped_mm_rows(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, c: torch.Tensor,
                    config: dict | None = None, *, pad_rows: int | None = None,
                    epilogue: str | None = None, h: torch.Tensor | None = None,
                    scales: tuple | None = None) -> None:
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

    ``scales`` (fp8 ``a`` and ``b``, no epilogue): ``(sa, sb)``, fp32 ``sa [T]`` (unit stride)
    and ``sb [E, N]`` (unit stride along N): row r of group g is multiplied by ``sa[r] *
    sb[g]``, in the epilogue (``scaled_grouped_mm``). fp8 operands go to ``tl.dot`` as they
    are, in the interpreter too (it multiplies fp8 exactly; only 16-bit dots need UPCAST).
    """
    if epilogue is not None and (scales is not None or epilogue not in EPILOGUES or pad_rows is not None
                                 or not c.is_contiguous() or h is not None and not h.is_contiguous()):
        raise ValueError(f"grouped_mm_rows: epilogue={epilogue!r} needs offs (no pad_rows) and "
                         f"contiguous c and h; the epilogues are {EPILOGUES}")
    swiglu = epilogue == "swiglu"
    T, K = a.shape
    E, N = b.shape[0], b.shape[2] // 2 if swiglu else b.shape[2]
    if T == 0 or N == 0:
        return
    cfg, a_arg, b_arg, kmajor = gemm_operands(a, b, config, epilogue=epilogue)
    n_tiles = cdiv(N, cfg["BLOCK_N"])
    bound = (cdiv(T, cfg["BLOCK_M"]) + 2 * E + 1) * n_tiles
    grid = (min(bound, cfg["NUM_PROGRAMS"]),)
    sa, sb = scales or (c, c)
    grouped_mm_rows_kernel[grid](
        a_arg, b_arg, c, c if h is None else h, offs, sa, sb, T, N, K, E, pad_rows or 0, a.stride(0),
        a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        sb.stride(0) if scales else 0, TMA=cfg["TMA"], B_KMAJOR=kmajor, MASKED=pad_rows is not None,
        SWIGLU=swiglu, KEEP_H=swiglu and h is not None, SWIGLU_VJP=epilogue == "swiglu_vjp",
        **scaled_options(cfg, scales is not None))


def grouped_mm_k(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, c: torch.Tensor,
                 config: dict | None = None, *, pad_rows: int | None = None, sources: int = 1,
                 scales: tuple | None = None) -> None:
    """``c[g] = a[:, offs[g-1]:offs[g]] @ b[offs[g-1]:offs[g]]`` (zeros for an empty group).
    With ``pad_rows`` (P), ``offs`` holds counts and group g's K range is
    ``g*P : g*P + min(offs[g], P)``. With ``sources`` (S), ``offs`` holds the ends of ``S *
    E`` segments of K, source-major (segment ``s * E + g`` is source s's share of group g,
    as the expert MLP's received rows lie), and ``c[g]`` sums g's S segments: one launch
    and one write of ``c``, not S.

    ``a [M, K_total]``, ``b [K_total, N]``, ``c [E, M, N]`` (any strides), ``offs`` int32 ``[S * E]``.
    ``scales`` (fp8 ``a`` and ``b``, one source): ``(sa, sb)``, contiguous fp32 ``sa [E * M]``
    and ``sb [E * N]``: ``c[g]`` times ``sa[g*M:(g+1)*M, None] * sb[None, g*N:(g+1)*N]``.
    """
    if sources < 1 or offs.shape[0] % sources or pad_rows is not None and sources != 1 or (
            scales is not None and sources != 1):
        raise ValueError(f"grouped_mm_k: {offs.shape[0]} group ends for sources={sources} "
                         f"(pad_rows={pad_rows}); need sources * E ends, and one source with pad_rows "
                         "or scales")
    M, N, E = a.shape[0], b.shape[1], offs.shape[0] // sources
    cfg = grouped_config(a, config, tma=False)  # ragged K: masked pointer loads
    tiles = E * cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    if tiles == 0:
        return
    sa, sb = scales or (c, c)
    grouped_mm_k_kernel[(min(tiles, cfg["NUM_PROGRAMS"]),)](
        a, b, c, offs, sa, sb, M, N, E, pad_rows or 0, sources, a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), c.stride(0), c.stride(1), c.stride(2), MASKED=pad_rows is not None,
        **scaled_options(cfg, scales is not None))


# unit inner strides are constexprs, as the JIT specializes them for row-major operands
_ROWS_UNIT = {"stride_ak": 1, "stride_bn": 1, "stride_cn": 1}
_K_UNIT = {"stride_am": 1, "stride_bn": 1, "stride_cn": 1}  # a = x.t() of a row-major x
_ROWS_SIG = {"a": "*bf16", "b": "*bf16", "c_ptr": "*bf16", "h_ptr": "*bf16", "offs_ptr": "*i32",
             "sa_ptr": "*fp32", "sb_ptr": "*fp32", "T": "i32", "N": "i32", "K": "i32", "E": "i32",
             "pad_rows": "i32", "stride_am": "i32", "stride_be": "i32", "stride_bk": "i32",
             "stride_cm": "i32", "stride_sbg": "i32"}
_K_SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "offs_ptr": "*i32", "sa_ptr": "*fp32",
          "sb_ptr": "*fp32", "M": "i32", "N": "i32", "E": "i32", "pad_rows": "i32", "sources": "i32",
          "stride_ak": "i32", "stride_bk": "i32", "stride_ce": "i32", "stride_cm": "i32"}


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


_ZERO_SIG = {"c_ptr": "*bf16", "ends_ptr": "*i32", "first": "i32", "R": "i32", "C": "i32",
             "stride_cg": "i32", "stride_cr": "i32"}
_NO_EPILOGUE = dict(SWIGLU=False, KEEP_H=False, SWIGLU_VJP=False, SCALED=False)


# the fp8 variants: the rows kernel on TMA with b column-major (torch's contract for
# scaled_grouped_mm, and the float8 recipes' dgrad) or row-major, e5m2 x e4m3 (the
# tensorwise recipe's dgrad), on pointer loads (unaligned operands); the K kernel (wgrad:
# a = gradᵀ, b = the input, as float8_grouped_mm passes them)
FP8_AOT_EXAMPLES = (
    [fp8_example(grouped_mm_rows_kernel, _ROWS_SIG, dict(_ROWS_UNIT, MASKED=masked, **_NO_EPILOGUE),
                  gpu_config(9, tma), kmajor, a)
     for tma, kmajor, a in ((True, True, "fp8e4nv"), (True, False, "fp8e4nv"), (True, True, "fp8e5"),
                            (False, False, "fp8e4nv"))
     for masked in (False, True)]
    + [fp8_example(grouped_mm_k_kernel, _K_SIG, dict(_K_UNIT, MASKED=False), POINTER_CONFIG_SM90, a=a)
       for a in ("fp8e4nv", "fp8e5")])

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
    + [aot_example(grouped_mm_k_kernel, _K_SIG, dict(_K_UNIT, MASKED=masked, SCALED=False), cfg, arch)
       for cfg, arch in ((POINTER_CONFIG_SM90, 90), (GPU_CONFIG_SM80, 80)) for masked in (False, True)]
    # out_dtype=torch.float32 with 16-bit inputs: the same tiles, fp32 stores
    + [aot_example(grouped_mm_rows_kernel, dict(_ROWS_SIG, c_ptr="*fp32", h_ptr="*fp32"),
                   dict(_ROWS_UNIT, MASKED=masked, **_NO_EPILOGUE), gpu_config(major, tma), major * 10)
       for major, tma in ((9, True), (9, False), (8, False)) for masked in (False, True)]
    + [aot_example(grouped_mm_k_kernel, dict(_K_SIG, c_ptr="*fp32"), dict(_K_UNIT, MASKED=masked, SCALED=False),
                   cfg, arch)
       for cfg, arch in ((POINTER_CONFIG_SM90, 90), (GPU_CONFIG_SM80, 80)) for masked in (False, True)]
    + [(zero_rows_past_kernel, dict(_ZERO_SIG, c_ptr=c), dict(ROW_BLOCK_GPU, stride_cc=1))
       for c in ("*bf16", "*fp32")]
    + FP8_AOT_EXAMPLES)
