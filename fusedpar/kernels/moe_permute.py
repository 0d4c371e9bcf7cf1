"""Token permutation for MoE: sort each token's k copies by expert (experts are numbered
rank-major, so this is also the order by destination rank), gather them into one
contiguous buffer, and the inverse: a weighted sum of each token's k rows.

- the sort, a stable counting sort over ``cdiv(T*k, SORT_BLOCK)`` blocks of copies in three
  launches, so that no program's work grows with ``T*k * E``: ``expert_ranks_kernel`` (one
  program per block) gives each copy its rank among the block's earlier copies of its expert
  (a ``[SORT_BLOCK, SORT_BLOCK]`` comparison, whatever E) and the block's copies per expert;
  ``expert_offsets_kernel`` (one program, ``blocks x E`` counts) sums them into the histogram
  and turns each block's counts into where its copies of each expert start (the bucket start
  plus the copies in earlier blocks); ``expert_positions_kernel`` (one program per block)
  adds that start to each copy's rank. Within an expert copies stay in token order. Copies
  with expert ``-1`` (dropped) get position ``-1``. Ids outside ``[-1, E)`` are flagged in the
  slot after the counts, which the MoE exchanges send along with them (the ids are never read
  on the host).
- ``gather_rows_kernel``: ``out[pos[i]] = x[i // k] (* w[i])`` for every kept copy ``i``.
- ``gather_rows_float8_kernel``: the same gather casting each copy to fp8 on the way (a
  float8 dispatch's rows: the fp8 bytes, then the fp32 scale's bytes, as uint8).
- ``combine_rows_kernel``: ``out[t] = sum_j w[t, j] * y[pos[t*k + j]]`` in fp32: each
  program owns its output tile, so no atomics and a deterministic sum.
The row kernels take a 2-D grid (row blocks x column blocks of BLOCK_H): a decode-sized
batch (32 tokens of H=7168) still spreads over dozens of SMs. No program waits on another.
"""

import torch
import triton
import triton.language as tl

from .interpreter import interpreting
from .signal import cdiv

# the flag slot of a sort whose ids are not all in [-1, E) (ops.moe raises on it)
INVALID_IDS = 2**31 - 1
INVALID_IDS_FLAG = tl.constexpr(INVALID_IDS)
SORT_BLOCK = 64  # copies per program of the sort ([SORT_BLOCK, SORT_BLOCK] comparisons)
SORT_WARPS = 8
SCAN_TILE = 4096  # counts per step of the sort's one-program scan ([rows, E_PAD] tiles)
ROW_BLOCK_GPU = dict(BLOCK_R=16, BLOCK_H=256)
ROW_BLOCK_INTERPRETER = dict(BLOCK_R=64, BLOCK_H=64)


def row_blocks() -> dict:
    """BLOCK_R x BLOCK_H of the row-copy kernels here and in ``moe_dispatch``."""
    return ROW_BLOCK_INTERPRETER if interpreting() else ROW_BLOCK_GPU


def rows_grid(rows: int, H: int, cfg: dict) -> tuple[int, int]:
    """Row blocks on axis 0 (up to 2**31 - 1), column blocks on axis 1 (65535 at most: H up
    to 16M at BLOCK_H=256)."""
    return max(1, cdiv(rows, cfg["BLOCK_R"])), max(1, cdiv(H, cfg["BLOCK_H"]))


@triton.jit
def expert_ranks_kernel(idx_ptr, rank_ptr, counts_ptr, bad_ptr, n, E, BLOCK: tl.constexpr):
    """Block ``b`` of the copies: ``rank[i]`` = the block's copies of ``i``'s expert before
    ``i``; ``counts[b, e]`` = the block's copies of expert ``e`` (``counts`` zeroed: only
    experts present are written); ``bad[b]`` = the block's ids outside ``[-1, E)``."""
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    i = b * BLOCK + j
    e = tl.load(idx_ptr + i, mask=i < n, other=-1)  # int32 or int64, compared as loaded
    same = e[:, None] == e[None, :]
    before = tl.sum((same & (j[None, :] < j[:, None])).to(tl.int32), axis=1)
    total = tl.sum(same.to(tl.int32), axis=1)
    tl.store(rank_ptr + i, before, mask=i < n)
    # the block's last copy of each expert writes its count: one store per (block, expert)
    last = (before + 1 == total) & (e >= 0) & (e < E)
    tl.store(counts_ptr + b.to(tl.int64) * E + e, total, mask=last)
    tl.store(bad_ptr + b, tl.sum(((e < -1) | (e >= E)).to(tl.int32)))


@triton.jit(do_not_specialize=["flag_value"])
def expert_offsets_kernel(counts_ptr, bad_ptr, header_ptr, blocks, E, flag_value,
                          E_PAD: tl.constexpr, ROWS: tl.constexpr):
    """One program over ``counts [blocks, E]``: ``header`` = the copies per expert, then
    ``flag_value`` (``INVALID_IDS`` if a block saw a bad id); then, in place,
    ``counts[b, e]`` = bucket start of ``e`` + copies of ``e`` in blocks before ``b``."""
    experts = tl.arange(0, E_PAD)
    rows = tl.arange(0, ROWS)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    bad = tl.zeros([ROWS], dtype=tl.int32)
    for r in range(0, blocks, ROWS):
        b = r + rows
        tile = counts_ptr + b.to(tl.int64)[:, None] * E + experts[None, :]
        total += tl.sum(tl.load(tile, mask=(b < blocks)[:, None] & (experts < E)[None, :], other=0), axis=0)
        bad += tl.load(bad_ptr + b, mask=b < blocks, other=0)
    tl.store(header_ptr + experts, total, mask=experts < E)
    tl.store(header_ptr + E, tl.where(tl.sum(bad) > 0, INVALID_IDS_FLAG, flag_value))
    running = tl.cumsum(total, axis=0) - total  # bucket starts, then advanced per row tile
    for r in range(0, blocks, ROWS):
        b = r + rows
        tile = counts_ptr + b.to(tl.int64)[:, None] * E + experts[None, :]
        mask = (b < blocks)[:, None] & (experts < E)[None, :]
        c = tl.load(tile, mask=mask, other=0)
        tl.store(tile, tl.cumsum(c, axis=0) - c + running[None, :], mask=mask)
        running += tl.sum(c, axis=0)


@triton.jit
def expert_positions_kernel(idx_ptr, pos_ptr, starts_ptr, n, E, BLOCK: tl.constexpr):
    """Block ``b``: ``pos[i]`` (holding ``i``'s rank in the block) += where block ``b``'s copies
    of ``i``'s expert start; ``-1`` for a dropped copy; an id ``>= E`` keeps ``i`` (in
    bounds; the call raises on the flag)."""
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(idx_ptr + i, mask=i < n, other=-1)
    valid = (e >= 0) & (e < E)
    start = tl.load(starts_ptr + b.to(tl.int64) * E + e, mask=valid & (i < n), other=0)
    rank = tl.load(pos_ptr + i, mask=i < n, other=0)
    pos = tl.where(valid, start + rank, tl.where(e < 0, -1, i))
    tl.store(pos_ptr + i, pos, mask=i < n)


@triton.jit
def gather_rows_kernel(x_ptr, pos_ptr, w_ptr, out_ptr, n, H, k,
                       WEIGHTED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pos = tl.load(pos_ptr + i, mask=i < n, other=-1)
    keep = pos >= 0
    src = (i // k).to(tl.int64) * H
    dst = pos.to(tl.int64) * H
    mask = keep[:, None] & (h < H)[None, :]
    row = tl.load(x_ptr + src[:, None] + h[None, :], mask=mask, other=0.0)
    if WEIGHTED:
        w = tl.load(w_ptr + i, mask=keep, other=0.0)
        row = (row.to(tl.float32) * w[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + dst[:, None] + h[None, :], row, mask=mask)


@triton.jit
def _round_to_fp8_grid(v, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """``v`` (fp32, within the fp8 range) rounded to the nearest fp8 value, ties to even: a
    multiple of the ulp of its binade (2^(exponent - MANTISSA), subnormals below MIN_EXP)."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    ulp = ((exponent - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    t = tl.abs(v) / ulp  # exact: a power of 2
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & (r % 2 == 1), r - 1, r)
    return tl.where(v < 0, -r, r) * ulp


@triton.jit
def gather_rows_float8_kernel(x_ptr, pos_ptr, out_ptr, n, H, k, FP8_MAX: tl.constexpr,
                              E5M2: tl.constexpr, POW2: tl.constexpr, RTNE: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row ``pos[i]`` of ``out [rows, H + 4]`` (uint8) = copy i's token ``x[i // k]`` cast as
    ``float8_scales.quantize(x, dtype, -1, POW2)`` casts it: its H fp8 bytes, then the bytes
    of its fp32 scale (the reciprocal of the multiplier, little-endian). One program owns
    BLOCK_R copies and walks H twice: the row's amax, then the cast (round to nearest even,
    saturating, as torch casts; ``RTNE``: rounded explicitly first, for the interpreter, whose
    fp8 cast does not round so)."""
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pos = tl.load(pos_ptr + i, mask=i < n, other=-1)
    keep = pos >= 0
    src = (i // k).to(tl.int64) * H
    dst = pos.to(tl.int64) * (H + 4)
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        row = tl.load(x_ptr + src[:, None] + h[None, :], mask=keep[:, None] & (h < H)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(row.to(tl.float32)), axis=1))
    # torchao's amax_to_scale: the division in fp64, then fp32; a power of 2 by its exponent bits
    s = (FP8_MAX / tl.maximum(amax.to(tl.float64), 1e-12)).to(tl.float32)
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = keep[:, None] & (h < H)[None, :]
        row = tl.load(x_ptr + src[:, None] + h[None, :], mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(row * s[:, None], -FP8_MAX), FP8_MAX)
        if RTNE:  # the interpreter's fp8 cast does not round to nearest even: round first
            q = _round_to_fp8_grid(q, 2 if E5M2 else 3, -14 if E5M2 else -6)
        q = q.to(tl.float8e5) if E5M2 else q.to(tl.float8e4nv)
        tl.store(out_ptr + dst[:, None] + h[None, :], q.to(tl.uint8, bitcast=True), mask=mask)
    bits = tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), s).to(tl.int32, bitcast=True)
    for b in tl.static_range(4):
        tl.store(out_ptr + dst + H + b, ((bits >> (8 * b)) & 0xFF).to(tl.uint8), mask=keep)


@triton.jit
def combine_rows_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, T, H, k,
                        WEIGHTED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for j in range(0, k):
        pos = tl.load(pos_ptr + t * k + j, mask=t_ok, other=-1)
        keep = pos >= 0
        row = tl.load(y_ptr + pos.to(tl.int64)[:, None] * H + h[None, :],
                      mask=keep[:, None] & (h < H)[None, :], other=0.0).to(tl.float32)
        if WEIGHTED:
            w = tl.load(w_ptr + t * k + j, mask=t_ok & keep, other=0.0)
            row = row * w[:, None]
        acc += row
    tl.store(out_ptr + t.to(tl.int64)[:, None] * H + h[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & (h < H)[None, :])


def sort_by_expert(topk_idx: torch.Tensor, num_experts: int,
                   flag_value: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos, header)``: each copy's row in the expert-sorted buffer (``-1`` if dropped),
    int32 ``[T*k]``, and int32 ``[num_experts + 1]``: the histogram, then ``flag_value``, or
    ``INVALID_IDS`` if ``topk_idx`` (int32 or int64 ``[T, k]``) holds an id outside
    ``[-1, num_experts)``. Such an id counts nowhere and gets a position in ``[0, T*k)``, or
    ``-1`` if negative: memory-safe (the callers send the flag with the counts, and the call
    raises)."""
    flat = topk_idx.reshape(-1).contiguous()  # reshape may keep a stride; the kernels read 1
    n, E = flat.numel(), num_experts
    blocks = max(1, cdiv(n, SORT_BLOCK))
    pos = torch.empty(n, dtype=torch.int32, device=flat.device)
    header = torch.empty(E + 1, dtype=torch.int32, device=flat.device)
    counts = torch.zeros(blocks, E, dtype=torch.int32, device=flat.device)
    bad = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    expert_ranks_kernel[(blocks,)](flat, pos, counts, bad, n, E, BLOCK=SORT_BLOCK, num_warps=SORT_WARPS)
    e_pad = triton.next_power_of_2(max(E, 2))
    expert_offsets_kernel[(1,)](counts, bad, header, blocks, E, flag_value, E_PAD=e_pad,
                                ROWS=max(1, SCAN_TILE // e_pad), num_warps=SORT_WARPS)
    expert_positions_kernel[(blocks,)](flat, pos, counts, n, E, BLOCK=SORT_BLOCK, num_warps=SORT_WARPS)
    return pos, header


def gather_rows(x: torch.Tensor, pos: torch.Tensor, k: int, rows: int,
                weights: torch.Tensor | None = None) -> torch.Tensor:
    """``out[pos[i]] = x[i // k] (* weights[i])``: ``[rows, H]``, rows no copy lands on are
    zero. ``x`` contiguous ``[T, H]``; ``weights`` fp32 contiguous ``[T*k]`` or None."""
    H = x.shape[1]
    out = x.new_zeros(rows, H)  # rows past the kept copies (padding) stay zero
    n = pos.numel()
    if n and H:
        cfg = row_blocks()
        gather_rows_kernel[rows_grid(n, H, cfg)](
            x, pos, weights if weights is not None else x, out, n, H, k,
            WEIGHTED=weights is not None, **cfg)
    return out


def gather_rows_float8(x: torch.Tensor, pos: torch.Tensor, k: int, rows: int, dtype: torch.dtype,
                       pow2: bool) -> torch.Tensor:
    """``gather_rows`` casting each copy to fp8 ``dtype`` (one scale per row, rounded down to
    a power of 2 if ``pow2``): ``[rows, H + 4]`` uint8, each row the fp8 bytes then the fp32
    scale's (``ops.moe.exchange.pack_float8``'s layout); rows no copy lands on are zero.
    ``x`` contiguous ``[T, H]``. On CUDA compute capability 8.9+ (Triton has no e4m3 cast
    before)."""
    H = x.shape[1]
    out = x.new_zeros(rows, H + 4, dtype=torch.uint8)
    n = pos.numel()
    if n:
        cfg = row_blocks()
        gather_rows_float8_kernel[(max(1, cdiv(n, cfg["BLOCK_R"])),)](
            x, pos, out, n, H, k, FP8_MAX=torch.finfo(dtype).max, E5M2=dtype == torch.float8_e5m2,
            POW2=pow2, RTNE=interpreting(), **cfg)
    return out


def combine_rows(y: torch.Tensor, pos: torch.Tensor, k: int, tokens: int,
                 weights: torch.Tensor | None = None, out_dtype=None) -> torch.Tensor:
    """``out[t] = sum_j weights[t*k+j] * y[pos[t*k+j]]`` (dropped copies add nothing),
    accumulated in fp32: ``[tokens, H]``. ``y`` contiguous ``[rows, H]``."""
    H = y.shape[1]
    out = torch.empty(tokens, H, dtype=out_dtype or y.dtype, device=y.device)
    if tokens and H:
        cfg = row_blocks()
        combine_rows_kernel[rows_grid(tokens, H, cfg)](
            y, pos, weights if weights is not None else y, out, tokens, H, k,
            WEIGHTED=weights is not None, **cfg)
    elif tokens:
        out.zero_()
    return out


_ROW_SIG = {"x_ptr": "*bf16", "pos_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32",
            "H": "i32", "k": "i32"}
_COMBINE_SIG = {"y_ptr": "*bf16", "pos_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*bf16", "T": "i32",
                "H": "i32", "k": "i32"}

AOT_EXAMPLES = [
    *[entry for t in ("i32", "i64") for entry in (
        (expert_ranks_kernel, {"idx_ptr": f"*{t}", "rank_ptr": "*i32", "counts_ptr": "*i32", "bad_ptr": "*i32",
                               "n": "i32", "E": "i32"}, {"BLOCK": SORT_BLOCK}, {"num_warps": SORT_WARPS}),
        (expert_positions_kernel, {"idx_ptr": f"*{t}", "pos_ptr": "*i32", "starts_ptr": "*i32", "n": "i32",
                                   "E": "i32"}, {"BLOCK": SORT_BLOCK}, {"num_warps": SORT_WARPS}))],
    *[(expert_offsets_kernel, {"counts_ptr": "*i32", "bad_ptr": "*i32", "header_ptr": "*i32", "blocks": "i32",
                               "E": "i32", "flag_value": "i32"}, {"E_PAD": e_pad, "ROWS": SCAN_TILE // e_pad},
       {"num_warps": SORT_WARPS}) for e_pad in (8, 128, 256)],
    (gather_rows_kernel, _ROW_SIG, dict(ROW_BLOCK_GPU, WEIGHTED=True)),
    (gather_rows_kernel, _ROW_SIG, dict(ROW_BLOCK_GPU, WEIGHTED=False)),
    # a float8 dispatch's rows: the fp8 bytes and their scale, as uint8 (moe_dispatch(float8=))
    *[(gather_rows_float8_kernel, {"x_ptr": f"*{t}", "pos_ptr": "*i32", "out_ptr": "*u8", "n": "i32",
                                   "H": "i32", "k": "i32"},
       dict(ROW_BLOCK_GPU, FP8_MAX=448.0, E5M2=False, POW2=True, RTNE=False), {"arch": 90})
      for t in ("bf16", "fp32")],  # Triton casts to e4m3 from sm_89 on (ops.moe: torch's cast before)
    (combine_rows_kernel, _COMBINE_SIG, dict(ROW_BLOCK_GPU, WEIGHTED=True)),
    (combine_rows_kernel, _COMBINE_SIG, dict(ROW_BLOCK_GPU, WEIGHTED=False)),
]
