"""Token permutation for MoE: sort each token's k copies by expert (experts are numbered
rank-major, so this is also the order by destination rank), gather them into one
contiguous buffer, and the inverse: a weighted sum of each token's k rows.

- ``sort_by_expert_kernel``: a counting sort in one program. Pass 1 builds the histogram
  of expert ids, an exclusive prefix sum turns it into bucket starts, pass 2 gives each
  copy ``start[e] + (copies of e before it)`` (a cumulative sum of one-hot rows, block by
  block, carrying per-expert running counts), so the sort is stable: within an expert,
  copies stay in token order. Copies with expert ``-1`` (dropped) get position ``-1``.
  Pass 1 also flags ids outside ``[-1, E)`` in the slot after the counts, which the MoE
  exchanges send along with them (the ids are never read on the host).
- ``gather_rows_kernel``: ``out[pos[i]] = x[i // k] (* w[i])`` for every kept copy ``i``.
- ``combine_rows_kernel``: ``out[t] = sum_j w[t, j] * y[pos[t*k + j]]`` in fp32: each
  program owns its output tile, so no atomics and a deterministic sum.
The row kernels take a 2-D grid (row blocks x column blocks of BLOCK_H): a decode-sized
batch (32 tokens of H=7168) still spreads over dozens of SMs. No program waits on another;
the sort is a single program (its cost is T*k*E/BLOCK steps).
"""

import torch
import triton
import triton.language as tl

from .interpreter import interpreting

# the flag slot of a sort whose ids are not all in [-1, E) (ops.moe raises on it)
INVALID_IDS = 2**31 - 1
INVALID_IDS_FLAG = tl.constexpr(INVALID_IDS)
SORT_BLOCK = 64  # copies per step of the sort ([SORT_BLOCK, E_PAD] one-hot tiles)
SORT_WARPS = 8
ROW_BLOCK_GPU = dict(BLOCK_R=16, BLOCK_H=256)
ROW_BLOCK_INTERPRETER = dict(BLOCK_R=64, BLOCK_H=64)


def row_blocks() -> dict:
    """BLOCK_R x BLOCK_H of the row-copy kernels here and in ``moe_dispatch``."""
    return ROW_BLOCK_INTERPRETER if interpreting() else ROW_BLOCK_GPU


def rows_grid(rows: int, H: int, cfg: dict) -> tuple[int, int]:
    """Row blocks on axis 0 (up to 2**31 - 1), column blocks on axis 1 (65535 at most: H up
    to 16M at BLOCK_H=256)."""
    return max(1, triton.cdiv(rows, cfg["BLOCK_R"])), max(1, triton.cdiv(H, cfg["BLOCK_H"]))


@triton.jit(do_not_specialize=["flag_value"])
def sort_by_expert_kernel(idx_ptr, pos_ptr, counts_ptr, n, E, flag_value,
                          BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    hist = tl.zeros([E_PAD], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(0, tl.cdiv(n, BLOCK)):
        i = b * BLOCK + tl.arange(0, BLOCK)
        e = tl.load(idx_ptr + i, mask=i < n, other=-1)  # int32 or int64, compared as loaded
        hist += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
        bad += ((e < -1) | (e >= E)).to(tl.int32)
    tl.store(counts_ptr + experts, hist, mask=experts < E)
    tl.store(counts_ptr + E, tl.where(tl.sum(bad) > 0, INVALID_IDS_FLAG, flag_value))
    running = tl.cumsum(hist, axis=0) - hist  # bucket starts, then advanced per block
    for b in range(0, tl.cdiv(n, BLOCK)):
        i = b * BLOCK + tl.arange(0, BLOCK)
        e = tl.load(idx_ptr + i, mask=i < n, other=-1)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # copies of the same expert earlier in the block
        pos = tl.sum(onehot * (before + running[None, :]), axis=1)
        pos = tl.where(e >= 0, pos, -1)
        tl.store(pos_ptr + i, pos, mask=i < n)
        running += tl.sum(onehot, axis=0)


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
    flat = topk_idx.reshape(-1).contiguous()  # reshape may keep a stride; the kernel reads 1
    pos = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
    header = torch.empty(num_experts + 1, dtype=torch.int32, device=flat.device)
    sort_by_expert_kernel[(1,)](flat, pos, header, flat.numel(), num_experts, flag_value,
                                BLOCK=SORT_BLOCK, E_PAD=triton.next_power_of_2(max(num_experts, 2)),
                                num_warps=SORT_WARPS)
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
    *[(sort_by_expert_kernel, {"idx_ptr": f"*{t}", "pos_ptr": "*i32", "counts_ptr": "*i32", "n": "i32",
                               "E": "i32", "flag_value": "i32"}, {"BLOCK": SORT_BLOCK, "E_PAD": 128},
       {"num_warps": SORT_WARPS}) for t in ("i32", "i64")],
    (gather_rows_kernel, _ROW_SIG, dict(ROW_BLOCK_GPU, WEIGHTED=True)),
    (gather_rows_kernel, _ROW_SIG, dict(ROW_BLOCK_GPU, WEIGHTED=False)),
    (combine_rows_kernel, _COMBINE_SIG, dict(ROW_BLOCK_GPU, WEIGHTED=True)),
    (combine_rows_kernel, _COMBINE_SIG, dict(ROW_BLOCK_GPU, WEIGHTED=False)),
]
