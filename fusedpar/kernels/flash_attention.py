"""Flash attention (forward and backward) on ``[B, S, H, D]`` or packed ``[T, H, D]`` tensors.

Forward: one program per (query block, batch, head); it streams K/V blocks with the online
softmax (base-2 exponent, fp32 statistics) and writes the output and the natural-log
log-sum-exp ``lse`` (fp32, ``[B, H, S]``; packed: ``[H, T]``). GQA/MQA: query head ``h``
reads K/V head ``h // (H // H_kv)`` in place (no repeat in memory). Masks (``mask_args``):
causal, or a band (sliding window: key ``j`` is visible to query ``i`` iff
``i + diag - left <= j <= i + diag + right``), aligned top-left (``diag = 0``, as SDPA's
``is_causal``), bottom-right (``diag = S_k - S_q``, as flash-attn) or at any runtime
``diag_offset`` (a block of a larger attention: a ring block); K/V blocks a query block
cannot see are never loaded, and a row that sees no key gets output 0 and lse -inf.
Soft-capping (Gemma 2) caps the scaled scores at ``softcap * tanh(s / softcap)`` before the
mask; the backward multiplies by its derivative. The forward and dQ kernels run
the K/V blocks that every row of their query block sees whole (most blocks of a long
sequence) in a loop of their own that computes no mask. Any head dim ``D <= 256`` runs in
a ``BLOCK_D = next_pow2(D)`` register tile with the tail masked; any sequence length runs
with masked tails.

Backward (from the saved ``lse`` and ``delta = rowsum(dO * O) - dlse``): one kernel per
K/V block for dK/dV that loops over the query heads of its KV group (so GQA needs no
atomics), and one kernel per query block for dQ. ``delta`` and ``lse`` may come from a
larger computation (ring attention's merged output), which is what makes a block's
backward exact there: ``P = exp(S * scale - lse)`` is then that block's share of the
global softmax.

Packed sequences (``cu_seqlens``, int32 cumulative ends, flash-attn's convention; k/v's
own ``cu_seqlens_k`` when their lengths differ): batch index ``b`` is document ``b`` of q
and of k/v, each masked with its own lengths; masking never crosses documents.

Ring forward (ring_attention's ``triton`` backend), two kernels per ring step:
``ring_kv_copy_kernel`` waits for a peer's READY flag (``signal.wait_ready_and_match``:
wall-clock bounded, fingerprint checked) and copies the K/V rows this rank's queries can
see from the peer's symmetric data region into a local slot, counting the bytes, so each
peer's K/V crosses the link once whatever the number of query blocks and GQA heads;
``ring_attn_step_kernel`` folds one block of a local K/V into the online-softmax state
(``m``, ``l``, ``acc`` in fp32 between steps; the last launch writes out and lse, and ends
the call: DONE to the peers, NaN in a failed call's outputs). The host gives each launch its
geometry (``ops/ring_attention/blocks.py``): query rows, key rows and the band with its diagonal; key
blocks every row of a query block sees whole run without masks, and only a band's edges, key
tails and query blocks straddling the row range compute them. Both take the epoch from the
device (``signal.call_epoch``), and ``RingCopy`` / ``RingStep`` make a launch's arguments
once per call signature, so the ring's calls can be replayed from a CUDA graph.

Every grid keeps its long axis on axis 0 (flattened query block x batch x head).
"""

import torch
import triton
import triton.language as tl

from .gemm import mma
from .interpreter import interpreting
from .signal import (PER_CALL_ARGS, STATUS, call_epoch, cdiv, data_ptr, end_call, pad_ptr,
                     sm_count, spinning_grid, wait_ready_and_match)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_HEAD_DIM = 256

# GPU configs per (arch, BLOCK_D); chosen to compile without register spills (see
# AOT_EXAMPLES; tests/kernels/test_aot.py compiles each). Forward tiles are BLOCK_M x
# BLOCK_N; the backward's dK/dV program owns BLOCK_N keys and walks BLOCK_M query rows,
# the dQ program owns BLOCK_M rows and walks BLOCK_N keys.
_FWD_SM90 = {64: dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
             128: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
             256: dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)}
# sm_80 at head dim 128: 64-row tiles, two programs per SM (128 rows on 8 warps spill)
_FWD_SM80 = {64: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
             128: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
             256: dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1)}
# dK/dV at head dim 128: 128 keys per program, so its query tiles (Q, dO) are loaded once per
# 128 keys at the occupancy 64 keys would have (one 8-warp program per SM)
_DKDV_SM90 = {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
              128: dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=2),
              256: dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1)}
# dQ's tiles hold 64 or 128 query rows: with 32, Triton compiles its dots to mma.sync, not
# Hopper's wgmma (tests/kernels/test_aot.py checks which one each variant gets)
# (8 warps at head dim 256: with 4, its two loops, unmasked and masked, spill)
_DQ_SM90 = {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
            128: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
            256: dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)}
_BWD_SM80 = {64: dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=1),
             128: dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=1),
             256: dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1)}
# The ring kernel carries fp32 state between steps: more registers than the plain forward.
# sm_80 at head dim 128: 64-row tiles, two programs per SM (128 rows on 8 warps spill in the
# last step, which normalises and stores the output)
_RING_SM90 = {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
              128: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
              256: dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1)}
_RING_SM80 = {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
              128: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
              256: dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=1)}
_TABLES = {"fwd": (_FWD_SM90, _FWD_SM80), "dkdv": (_DKDV_SM90, _BWD_SM80),
           "dq": (_DQ_SM90, _BWD_SM80), "ring": (_RING_SM90, _RING_SM80)}
# Soft-capping: the score tile's side to halve per (kernel, sm_90) (the keys of the forward's,
# the ring step's and dQ's tile, the query rows of dK/dV's, whose keys are its wgmma rows); at
# full size the tanh and its derivative spill (the ring step, with its state, on sm_80 too)
_SOFTCAP_HALVES = {("fwd", True): "BLOCK_N", ("dq", True): "BLOCK_N", ("dkdv", True): "BLOCK_M",
                   ("ring", True): "BLOCK_N", ("ring", False): "BLOCK_N"}
# Variants left on mma.sync on sm_90 (head dim 256), and why
_MMA_SYNC_OK = {"dkdv": "every wgmma tile spills: the dK and dV accumulators are [BLOCK_N, 256] fp32"}
# Variants allowed to spill, and why: (kernel, arch, BLOCK_D, softcap, the call's end)
_SPILLS_OK = {("ring", 80, 64, True, True): "4 words per thread stored before the K/V loop and "
              "loaded after it (the call's end: DONE to the peers), triton 3.8 only, 32 B"}
# The ring's K/V copy: one pass of BLOCK elements per loop iteration (the same on every arch).
# Its grid is capped at a quarter of the SMs, so its bandwidth is the bytes each program has
# in flight over the latency: 16384 bf16 elements on 8 warps are eight 16-byte loads per
# thread issued before their stores (32 KB a program)
COPY_CONFIG = dict(BLOCK=16384, num_warps=8)
# The interpreter's cost grows with programs x loop iterations: few, mid-sized blocks.
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)


@triton.jit
def _seq_bounds(cu_seqlens_q_ptr, cu_seqlens_k_ptr, b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """``(first query row, first key row, query length, key length)`` of batch entry /
    document ``b``."""
    if VARLEN:
        start_q = tl.load(cu_seqlens_q_ptr + b)
        start_k = tl.load(cu_seqlens_k_ptr + b)
        return (start_q, start_k, tl.load(cu_seqlens_q_ptr + b + 1) - start_q,
                tl.load(cu_seqlens_k_ptr + b + 1) - start_k)
    else:
        zero = tl.full([], 0, tl.int32)
        return zero, zero, seqlen_q, seqlen_k


@triton.jit
def _unmasked_keys(len_k, first_row, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """End of the key blocks (from 0) that rows ``first_row`` onward see whole: inside
    ``len_k`` and, causal, before ``first_row``."""
    full = len_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        full = tl.minimum(full, first_row // BLOCK_N * BLOCK_N)
    return full


@triton.jit
def _diagonal(diag_offset, len_q, len_k, BOTTOM_RIGHT: tl.constexpr):
    """The key on query row 0's diagonal: ``diag_offset``, plus the document's
    ``len_k - len_q`` with BOTTOM_RIGHT (packed documents of other key lengths)."""
    if BOTTOM_RIGHT:
        return diag_offset + len_k - len_q
    else:
        return diag_offset


@triton.jit
def _key_ranges(first_row, len_q, len_k, diag, win_left, win_right, CAUSAL: tl.constexpr,
                WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lo, full_lo, full_hi, hi)`` for the query block of rows ``first_row`` onward: it
    sees keys in ``[lo, hi)`` only (blocks outside are never loaded), the blocks of
    ``[full_lo, full_hi)`` whole (no mask); ``lo``, ``full_lo``, ``full_hi`` are block
    starts. Row ``i``'s band is keys ``i + diag - win_left .. i + diag + win_right``
    (WINDOW; CAUSAL: up to ``i + diag``; rows with ``i + diag < 0`` see no key)."""
    if WINDOW:
        last_row = tl.minimum(first_row + BLOCK_M, len_q) - 1
        lo = tl.maximum(first_row + diag - win_left, 0) // BLOCK_N * BLOCK_N
        hi = tl.maximum(tl.minimum(len_k, last_row + diag + win_right + 1), lo)
        full_lo = tl.minimum(tl.cdiv(tl.maximum(last_row + diag - win_left, 0), BLOCK_N) * BLOCK_N, hi)
        full_hi = tl.maximum(tl.minimum(len_k, tl.maximum(first_row + diag + win_right + 1, 0))
                             // BLOCK_N * BLOCK_N, full_lo)
    else:
        lo = 0
        full_lo = 0
        hi = len_k
        if CAUSAL:
            hi = tl.minimum(len_k, first_row + diag + BLOCK_M)
        full_hi = _unmasked_keys(len_k, tl.maximum(first_row + diag, 0), CAUSAL, BLOCK_N)
    return lo, full_lo, full_hi, hi


@triton.jit
def _in_band(visible, keys, diags, win_left, win_right, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``visible`` where each key is in its query row's band (``diags``: the row's diagonal
    key; ``keys`` and ``diags`` broadcast to ``visible``)."""
    if CAUSAL:
        visible = visible & (keys <= diags)
    if WINDOW:
        visible = visible & (keys >= diags - win_left) & (keys <= diags + win_right)
    return visible


@triton.jit
def _tanh_exp2(y):
    """``tanh(y / (2 log2(e)))`` from one exp2 (1 at +inf, -1 at -inf)."""
    return 1.0 - 2.0 / (1.0 + tl.exp2(y))


@triton.jit
def _attend_block(q, k_base, v_base, stride_ks, stride_vs, cols, n_ok, offs_d, d_ok, visible,
                  m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr, MASKED: tl.constexpr = True,
                  cap_in=1.0, SOFTCAP: tl.constexpr = False):
    """One online-softmax step: fold keys ``cols`` (``visible[row, key]``) into the running
    row max ``m_i`` (base 2), row sum ``l_i`` and fp32 output ``acc``. Not ``MASKED``: every
    row sees every key (``n_ok`` and ``visible`` unused), so no mask is computed. SOFTCAP:
    scores are ``qk_scale * _tanh_exp2(q.k * cap_in)``."""
    if MASKED:
        k_ok = n_ok[None, :] & d_ok[:, None]
        v_ok = n_ok[:, None] & d_ok[None, :]
    else:
        k_ok = d_ok[:, None]
        v_ok = d_ok[None, :]
    kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None], mask=k_ok, other=0.0)
    qk = mma(q, kt, tl.zeros([q.shape[0], kt.shape[1]], tl.float32), UPCAST)
    if SOFTCAP:  # qk_scale * tanh, folded
        qk = qk_scale - (2.0 * qk_scale) / (1.0 + tl.exp2(qk * cap_in))
    else:
        qk = qk * qk_scale
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
    p = tl.exp2(qk - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=v_ok, other=0.0)
    acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _visible_rows(rows_ok, n_ok, ROWS: tl.constexpr):
    """``[rows, keys]``: the keys inside the range, on the rows ``rows_ok`` with ROWS."""
    if ROWS:
        return rows_ok[:, None] & n_ok[None, :]
    else:
        return n_ok[None, :]


@triton.jit
def _attend_keys(q, k_base, v_base, stride_ks, stride_vs, lo, full_lo, full_hi, hi, len_k, rows_ok,
                 diags, offs_n, offs_d, d_ok, m_i, l_i, acc, qk_scale, cap_in, win_left, win_right,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Fold the key blocks of ``_key_ranges``' ``(lo, full_lo, full_hi, hi)`` into the state:
    the blocks every row sees whole without masks (most of a long sequence); the window's
    left edge before them, the diagonal or right edge and the tail past ``len_k`` after
    them, masked to each row's band (``diags``: its diagonal key) and, with ROWS, to the
    rows ``rows_ok`` (without, rows past the end are never stored: no mask for them, whose
    registers the forward's widest variants lack)."""
    if WINDOW:
        for start_n in range(lo, full_lo, BLOCK_N):
            cols = start_n + offs_n
            n_ok = cols < len_k
            visible = _in_band(_visible_rows(rows_ok, n_ok, ROWS), cols[None, :], diags[:, None],
                               win_left, win_right, CAUSAL, WINDOW)
            m_i, l_i, acc = _attend_block(q, k_base, v_base, stride_ks, stride_vs, cols, n_ok,
                                          offs_d, d_ok, visible, m_i, l_i, acc, qk_scale, UPCAST,
                                          True, cap_in, SOFTCAP)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, stride_ks, stride_vs, start_n + offs_n,
                                      rows_ok, offs_d, d_ok, rows_ok, m_i, l_i, acc, qk_scale,
                                      UPCAST, False, cap_in, SOFTCAP)
    for start_n in range(full_hi, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < len_k
        visible = _in_band(_visible_rows(rows_ok, n_ok, ROWS), cols[None, :], diags[:, None],
                           win_left, win_right, CAUSAL, WINDOW)
        m_i, l_i, acc = _attend_block(q, k_base, v_base, stride_ks, stride_vs, cols, n_ok, offs_d,
                                      d_ok, visible, m_i, l_i, acc, qk_scale, UPCAST, True, cap_in,
                                      SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _store_rows(o_rows, stride_os, lse_rows, offs_m, m_ok, offs_d, d_ok, m_i, l_i, acc):
    """Normalise and store the output rows and their natural-log lse (a row that saw no key:
    output 0, lse -inf)."""
    l_div = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(o_rows + offs_m[:, None] * stride_os + offs_d[None, :],
             (acc / l_div[:, None]).to(o_rows.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_rows + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=m_ok)


@triton.jit
def _scales(sm_scale, softcap, SOFTCAP: tl.constexpr):
    """``(qk_scale, cap_in)``: base-2 scores are ``qk_scale * q.k``, or with SOFTCAP
    ``qk_scale * _tanh_exp2(q.k * cap_in)`` (``softcap * tanh(q.k * sm_scale / softcap)``)."""
    if SOFTCAP:
        return softcap * 1.4426950408889634, sm_scale / softcap * 2.8853900817779268
    else:
        return sm_scale * 1.4426950408889634, 1.0


@triton.jit(do_not_specialize=["diag_offset"])
def flash_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
                     sm_scale, softcap, win_left, win_right, diag_offset,
                     n_heads, kv_group, seqlen_q, seqlen_k, head_dim, m_blocks,
                     stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                     stride_lb, stride_lh,
                     CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
                     SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)  # (query block, batch, head) flattened on the long axis
    m_block = pid % m_blocks
    b = (pid // m_blocks) // n_heads
    h = (pid // m_blocks) % n_heads
    hk = h // kv_group
    start_q, start_k, len_q, len_k = _seq_bounds(cu_seqlens_q_ptr, cu_seqlens_k_ptr, b, seqlen_q,
                                                 seqlen_k, VARLEN)
    if m_block * BLOCK_M < len_q:
        q_base = q_ptr + b.to(tl.int64) * stride_qb + start_q.to(tl.int64) * stride_qs + h * stride_qh
        k_base = k_ptr + b.to(tl.int64) * stride_kb + start_k.to(tl.int64) * stride_ks + hk * stride_kh
        v_base = v_ptr + b.to(tl.int64) * stride_vb + start_k.to(tl.int64) * stride_vs + hk * stride_vh
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        m_ok = offs_m < len_q
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        qk_scale, cap_in = _scales(sm_scale, softcap, SOFTCAP)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        diag = _diagonal(diag_offset, len_q, len_k, BOTTOM_RIGHT)
        lo, full_lo, full_hi, hi = _key_ranges(m_block * BLOCK_M, len_q, len_k, diag, win_left,
                                               win_right, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
        m_i, l_i, acc = _attend_keys(q, k_base, v_base, stride_ks, stride_vs, lo, full_lo, full_hi,
                                     hi, len_k, m_ok, offs_m + diag, offs_n, offs_d, d_ok, m_i, l_i,
                                     acc, qk_scale, cap_in, win_left, win_right, CAUSAL, WINDOW,
                                     SOFTCAP, UPCAST, BLOCK_N, ROWS=False)
        _store_rows(o_ptr + b.to(tl.int64) * stride_ob + start_q.to(tl.int64) * stride_os
                    + h * stride_oh, stride_os,
                    lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + start_q, offs_m, m_ok,
                    offs_d, d_ok, m_i, l_i, acc)


@triton.jit(do_not_specialize=["diag_offset"])
def flash_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                          cu_seqlens_q_ptr, cu_seqlens_k_ptr, sm_scale, softcap, win_left,
                          win_right, diag_offset, n_kv_heads, kv_group, seqlen_q, seqlen_k, head_dim, n_blocks,
                          stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                          stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                          stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                          stride_lb, stride_lh,
                          CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
                          SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)  # (key block, batch, KV head)
    n_block = pid % n_blocks
    b = (pid // n_blocks) // n_kv_heads
    hk = (pid // n_blocks) % n_kv_heads
    start_q, start_k, len_q, len_k = _seq_bounds(cu_seqlens_q_ptr, cu_seqlens_k_ptr, b, seqlen_q,
                                                 seqlen_k, VARLEN)
    if n_block * BLOCK_N < len_k:
        row0 = start_q.to(tl.int64)
        key0 = start_k.to(tl.int64)
        b64 = b.to(tl.int64)
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        n_ok = offs_n < len_k
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + b64 * stride_kb + key0 * stride_ks + hk * stride_kh
                    + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + b64 * stride_vb + key0 * stride_vs + hk * stride_vh
                    + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        qk_scale, cap_in = _scales(sm_scale, softcap, SOFTCAP)
        # the query rows whose band meets these keys: [lo, hi)
        diag = _diagonal(diag_offset, len_q, len_k, BOTTOM_RIGHT)
        lo = 0
        hi = len_q
        if CAUSAL:  # earlier rows see none of these keys
            lo = tl.maximum(n_block * BLOCK_N - diag, 0) // BLOCK_M * BLOCK_M
        if WINDOW:
            lo = tl.maximum(n_block * BLOCK_N - diag - win_right, 0) // BLOCK_M * BLOCK_M
            hi = tl.minimum(len_q, tl.minimum(n_block * BLOCK_N + BLOCK_N, len_k) - diag + win_left)
        for j in range(0, kv_group):
            h = hk * kv_group + j
            q_base = q_ptr + b64 * stride_qb + row0 * stride_qs + h * stride_qh
            do_base = do_ptr + b64 * stride_dob + row0 * stride_dos + h * stride_doh
            stat_base = b64 * stride_lb + h * stride_lh + start_q
            for start_m in range(lo, hi, BLOCK_M):
                rows = start_m + offs_m
                m_ok = rows < len_q
                qt = tl.load(q_base + rows[None, :] * stride_qs + offs_d[:, None],
                             mask=m_ok[None, :] & d_ok[:, None], other=0.0)
                lse = tl.load(lse_ptr + stat_base + rows, mask=m_ok, other=0.0)
                delta = tl.load(delta_ptr + stat_base + rows, mask=m_ok, other=0.0)
                qkt = mma(k, qt, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST)
                if SOFTCAP:
                    qkt = _tanh_exp2(qkt * cap_in)
                pt = tl.exp2(qkt * qk_scale - lse[None, :] * 1.4426950408889634)
                visible = _in_band(n_ok[:, None] & m_ok[None, :], offs_n[:, None],
                                   (rows + diag)[None, :], win_left, win_right, CAUSAL, WINDOW)
                pt = tl.where(visible, pt, 0.0)
                pt_ds = pt  # dS = pt_ds * (dP - delta): P, times tanh's derivative with SOFTCAP
                if SOFTCAP:  # (applied now: the tanh tile dies before the next dots)
                    pt_ds = pt * (1.0 - qkt * qkt)
                do = tl.load(do_base + rows[:, None] * stride_dos + offs_d[None, :],
                             mask=m_ok[:, None] & d_ok[None, :], other=0.0)
                dv = mma(pt.to(do.dtype), do, dv, UPCAST)
                dpt = mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST)
                dst = pt_ds * (dpt - delta[None, :])
                dk = mma(dst.to(qt.dtype), tl.trans(qt), dk, UPCAST)
        dk = dk * sm_scale
        tl.store(dk_ptr + b64 * stride_dkb + key0 * stride_dks + hk * stride_dkh
                 + offs_n[:, None] * stride_dks + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty),
                 mask=kv_mask)
        tl.store(dv_ptr + b64 * stride_dvb + key0 * stride_dvs + hk * stride_dvh
                 + offs_n[:, None] * stride_dvs + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty),
                 mask=kv_mask)


@triton.jit
def _dq_block(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, cols, diags, m_ok, len_k,
              offs_d, d_ok, qk_scale, cap_in, win_left, win_right, CAUSAL: tl.constexpr,
              WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
              MASKED: tl.constexpr):
    """``dq`` plus the keys ``cols``' share (``lse`` already in base 2; ``diags``: each
    row's diagonal key). Not ``MASKED``: every row sees every key (a key past ``len_k`` must
    be masked: its zero K row would turn an overflowed ``p`` into NaN)."""
    if MASKED:
        n_ok = cols < len_k
        kv_ok = n_ok[None, :] & d_ok[:, None]
    else:
        kv_ok = d_ok[:, None]
    kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None], mask=kv_ok, other=0.0)
    vt = tl.load(v_base + cols[None, :] * stride_vs + offs_d[:, None], mask=kv_ok, other=0.0)
    qk = mma(q, kt, tl.zeros([q.shape[0], kt.shape[1]], tl.float32), UPCAST)
    if SOFTCAP:
        qk = _tanh_exp2(qk * cap_in)
    p = tl.exp2(qk * qk_scale - lse[:, None])
    if MASKED:
        visible = _in_band(m_ok[:, None] & n_ok[None, :], cols[None, :], diags[:, None], win_left,
                           win_right, CAUSAL, WINDOW)
        p = tl.where(visible, p, 0.0)
    if SOFTCAP:  # tanh's derivative, applied before the dot: the tanh tile dies here
        p = p * (1.0 - qk * qk)
    dp = mma(do, vt, tl.zeros([q.shape[0], kt.shape[1]], tl.float32), UPCAST)
    ds = p * (dp - delta[:, None])
    return mma(ds.to(kt.dtype), tl.trans(kt), dq, UPCAST)


@triton.jit(do_not_specialize=["diag_offset"])
def flash_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_seqlens_q_ptr,
                        cu_seqlens_k_ptr, sm_scale, softcap, win_left, win_right, diag_offset,
                        n_heads, kv_group,
                        seqlen_q, seqlen_k, head_dim, m_blocks,
                        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                        stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                        stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh,
                        CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
                        SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)  # (query block, batch, head)
    m_block = pid % m_blocks
    b = (pid // m_blocks) // n_heads
    h = (pid // m_blocks) % n_heads
    hk = h // kv_group
    start_q, start_k, len_q, len_k = _seq_bounds(cu_seqlens_q_ptr, cu_seqlens_k_ptr, b, seqlen_q,
                                                 seqlen_k, VARLEN)
    if m_block * BLOCK_M < len_q:
        row0 = start_q.to(tl.int64)
        key0 = start_k.to(tl.int64)
        b64 = b.to(tl.int64)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        m_ok = offs_m < len_q
        row_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + b64 * stride_qb + row0 * stride_qs + h * stride_qh
                    + offs_m[:, None] * stride_qs + offs_d[None, :], mask=row_mask, other=0.0)
        do = tl.load(do_ptr + b64 * stride_dob + row0 * stride_dos + h * stride_doh
                     + offs_m[:, None] * stride_dos + offs_d[None, :], mask=row_mask, other=0.0)
        stat_base = b64 * stride_lb + h * stride_lh + start_q
        lse = tl.load(lse_ptr + stat_base + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + stat_base + offs_m, mask=m_ok, other=0.0)
        k_base = k_ptr + b64 * stride_kb + key0 * stride_ks + hk * stride_kh
        v_base = v_ptr + b64 * stride_vb + key0 * stride_vs + hk * stride_vh
        qk_scale, cap_in = _scales(sm_scale, softcap, SOFTCAP)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        diag = _diagonal(diag_offset, len_q, len_k, BOTTOM_RIGHT)
        diags = offs_m + diag
        lo, full_lo, full_hi, hi = _key_ranges(m_block * BLOCK_M, len_q, len_k, diag, win_left,
                                               win_right, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
        # as in the forward: the window's left edge, whole key blocks without masks, then the
        # diagonal or right edge and the tail
        if WINDOW:
            for start_n in range(lo, full_lo, BLOCK_N):
                dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs,
                               start_n + offs_n, diags, m_ok, len_k, offs_d, d_ok, qk_scale, cap_in,
                               win_left, win_right, CAUSAL, WINDOW, SOFTCAP, UPCAST, MASKED=True)
        for start_n in range(full_lo, full_hi, BLOCK_N):
            dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs,
                           start_n + offs_n, diags, m_ok, len_k, offs_d, d_ok, qk_scale, cap_in,
                           win_left, win_right, CAUSAL, WINDOW, SOFTCAP, UPCAST, MASKED=False)
        for start_n in range(full_hi, hi, BLOCK_N):
            dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs,
                           start_n + offs_n, diags, m_ok, len_k, offs_d, d_ok, qk_scale, cap_in,
                           win_left, win_right, CAUSAL, WINDOW, SOFTCAP, UPCAST, MASKED=True)
        dq = dq * sm_scale
        tl.store(dq_ptr + b64 * stride_dqb + row0 * stride_dqs + h * stride_dqh
                 + offs_m[:, None] * stride_dqs + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty),
                 mask=row_mask)


@triton.jit(do_not_specialize=PER_CALL_ARGS + ["src", "row_lo", "row_hi"])
def ring_kv_copy_kernel(slot_ptr, pad_table, stats_ptr, rank, world_size, epoch, meta, timeout_ns,
                        src, row_lo, row_hi, segments, seqlen, row_elems,
                        BLOCK: tl.constexpr, ELEM_BYTES: tl.constexpr):
    """Rows ``[row_lo, row_hi)`` of ``src``'s staged K/V (``segments`` = 2B runs of ``seqlen``
    rows of ``row_elems`` elements) into the same places of ``slot``, once ``src`` is READY
    with our fingerprint; adds the bytes copied to ``stats``. With no rows it only checks.
    ``epoch``: ``signal.call_epoch``'s (0: this call's, read from the device)."""
    epoch = call_epoch(pad_table, rank, epoch)
    ok = wait_ready_and_match(pad_table, rank, src, epoch, meta, timeout_ns)
    if ok:  # a failed wait is recorded: the attention steps see it and skip this source
        peer = data_ptr(pad_table, src, slot_ptr.dtype.element_ty)
        span = (row_hi - row_lo) * row_elems
        pieces = tl.cdiv(span, BLOCK)
        offs = tl.arange(0, BLOCK)
        moved = tl.zeros([], tl.int64)
        for t in range(tl.program_id(0), segments * pieces, tl.num_programs(0)):
            within = (t % pieces) * BLOCK + offs
            at = ((t // pieces).to(tl.int64) * seqlen + row_lo) * row_elems + within
            inside = within < span
            tl.store(slot_ptr + at, tl.load(peer + at, mask=inside), mask=inside)
            moved += tl.sum(inside.to(tl.int64)) * ELEM_BYTES
        if moved > 0:
            tl.atomic_add(stats_ptr, moved)


@triton.jit(do_not_specialize=["rank", "src", "row_lo", "row_hi", "key_lo", "key_hi", "diag",
                               "world_size", "epoch"])
def ring_attn_step_kernel(q_ptr, kv_ptr, acc_ptr, stat_ptr, o_ptr, lse_ptr, pad_table, rank, src,
                          row_lo, row_hi, key_lo, key_hi, diag, sm_scale, softcap, win_left,
                          win_right, batch, n_heads, kv_group, seqlen, head_dim, m_blocks,
                          stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                          world_size, epoch,
                          CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                          FIRST: tl.constexpr, LAST: tl.constexpr, END: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          UPCAST: tl.constexpr):
    """One ring step: fold keys ``[key_lo, key_hi)`` of ``src``'s K/V (local memory,
    ``[2, B, S_local, H_kv, D]``) into the online-softmax state of this rank's query rows
    ``[row_lo, row_hi)`` (the others keep theirs), kept in fp32 between steps
    (``acc [B, S, H, D]``, ``stat = [m, l]`` ``[2, B, H, S]``). Local row i sees local key j
    iff ``i + diag - win_left <= j <= i + diag + win_right`` (WINDOW), ``j <= i + diag``
    (CAUSAL), or always. FIRST starts the state, LAST writes ``out`` and the natural-log
    ``lse`` instead. END (the call's last launch, after every K/V copy): the last program
    to finish ends the call (``signal.end_call``: DONE[rank] = the call's epoch (``epoch``,
    ``call_epoch``'s) in every peer's pad, and ``out`` (contiguous) and ``lse`` NaN-filled
    if this rank recorded a failure)."""
    pid = tl.program_id(0)  # (query block, batch, head) flattened on the long axis
    m_block = pid % m_blocks
    b = ((pid // m_blocks) // n_heads).to(tl.int64)
    h = (pid // m_blocks) % n_heads
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen
    d_ok = offs_d < head_dim
    row_mask = m_ok[:, None] & d_ok[None, :]
    stat_rows = stat_ptr + (b * n_heads + h) * seqlen + offs_m
    stat_half = batch * n_heads * tl.cast(seqlen, tl.int64)
    acc_rows = acc_ptr + ((b * seqlen + offs_m[:, None]) * n_heads + h) * head_dim + offs_d[None, :]
    failed = tl.zeros([], tl.int32)
    if src != rank:  # the copy of src's K/V gave up (recorded): never read that slot
        failed = tl.load(pad_ptr(pad_table, rank) + STATUS, volatile=True)
    first_row = m_block * BLOCK_M
    work = (failed == 0) & (first_row + BLOCK_M > row_lo) & (first_row < row_hi)
    # a middle step neither loads nor stores the state of a query block that sees none of
    # its keys (half of them in a zigzag step from a later rank); the first step writes
    # every block's, the last reads every block's
    keep = m_ok
    if not FIRST and not LAST:
        keep = m_ok & work
    if FIRST:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    else:
        m_i = tl.load(stat_rows, mask=keep, other=float("-inf"))
        l_i = tl.load(stat_rows + stat_half, mask=keep, other=0.0)
        acc = tl.load(acc_rows, mask=keep[:, None] & d_ok[None, :], other=0.0)
    if work:
        n_kv_heads = n_heads // kv_group
        stride_ks = n_kv_heads * head_dim
        stride_kb = tl.cast(seqlen, tl.int64) * stride_ks
        # keys indexed from key_lo here
        k_base = kv_ptr + b * stride_kb + tl.cast(key_lo, tl.int64) * stride_ks + (h // kv_group) * head_dim
        v_base = k_base + batch * stride_kb  # K, then V
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs
                    + offs_d[None, :], mask=row_mask, other=0.0)
        qk_scale, cap_in = _scales(sm_scale, softcap, SOFTCAP)
        len_k = key_hi - key_lo
        lo, full_lo, full_hi, hi = _key_ranges(tl.maximum(first_row, row_lo), row_hi, len_k,
                                               diag - key_lo, win_left, win_right, CAUSAL, WINDOW,
                                               BLOCK_M, BLOCK_N)
        if (first_row < row_lo) | (tl.minimum(first_row + BLOCK_M, seqlen) > row_hi):
            full_hi = full_lo  # rows outside the range share the block: every key block masked
        m_i, l_i, acc = _attend_keys(q, k_base, v_base, stride_ks, stride_ks, lo, full_lo, full_hi,
                                     hi, len_k, (offs_m >= row_lo) & (offs_m < row_hi),
                                     offs_m + diag - key_lo, offs_n, offs_d, d_ok, m_i, l_i, acc,
                                     qk_scale, cap_in, win_left, win_right, CAUSAL, WINDOW, SOFTCAP,
                                     UPCAST, BLOCK_N, ROWS=True)
    if LAST:
        _store_rows(o_ptr + b * stride_ob + h * stride_oh, stride_os,
                    lse_ptr + (b * n_heads + h) * seqlen, offs_m, m_ok, offs_d, d_ok, m_i, l_i, acc)
    else:
        tl.store(stat_rows, m_i, mask=keep)
        tl.store(stat_rows + stat_half, l_i, mask=keep)
        tl.store(acc_rows, acc, mask=keep[:, None] & d_ok[None, :])
    if END:  # stat_half = B * H * S: lse's elements; out's, times D
        end_call(pad_table, rank, world_size, epoch, o_ptr,
                 stat_half * head_dim, lse_ptr, stat_half, True, True, False)


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def gpu_config(kernel: str, sm90: bool, d: int, softcap: bool = False) -> dict:
    """The table's block sizes and launch options of ``kernel`` at ``BLOCK_D = d``; with
    softcap one side of the score tile is halved where ``_SOFTCAP_HALVES`` says, so the
    tanh and its derivative fit the registers."""
    cfg = dict(_TABLES[kernel][0 if sm90 else 1][d])
    side = _SOFTCAP_HALVES.get((kernel, sm90)) if softcap else None
    if side:
        cfg[side] //= 2
    return cfg


def attn_config(head_dim: int, device: torch.device, kernel: str, config: dict | None = None,
                softcap: bool = False) -> dict:
    """Block sizes and launch options of ``kernel`` ("fwd", "dkdv", "dq" or "ring") for this head
    dim and GPU generation (queried at launch, never at import); ``config`` overrides them."""
    if interpreting():
        cfg = dict(INTERPRETER_CONFIG)
    else:
        sm90 = torch.cuda.get_device_capability(device)[0] >= 9
        cfg = gpu_config(kernel, sm90, max(64, block_d(head_dim)), softcap)
    cfg.update(config or {})
    return cfg


def _layout(x: torch.Tensor):
    """``(stride_b, stride_s, stride_h)`` of a ``[B, S, H, D]`` or packed ``[S, H, D]`` tensor
    (last dim contiguous)."""
    if x.dim() == 3:
        return 0, x.stride(0), x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def _stat_strides(lse: torch.Tensor):
    """``(stride_b, stride_h)`` of an lse/delta tensor ``[B, H, S]`` or packed ``[H, T]``."""
    if lse.dim() == 2:
        return 0, lse.stride(0)
    return lse.stride(0), lse.stride(1)


def _geometry(q, k, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k):
    """``(batch, seqlen_q, seqlen_k, cu_q, cu_k, varlen)``; packed: the longest documents,
    and ``cu_k is cu_q`` when k's documents are q's."""
    if cu_seqlens is not None:  # the kernels read them with stride 1
        cu_q = cu_seqlens.contiguous()
        cu_k = cu_q if cu_seqlens_k is None else cu_seqlens_k.contiguous()
        return cu_q.numel() - 1, max_seqlen, max_seqlen_k or max_seqlen, cu_q, cu_k, True
    return q.shape[0], q.shape[1], k.shape[1], q, q, False  # q: any pointer; never read


def mask_args(causal: bool, window: tuple[int, int], softcap: float, bottom_right: bool,
              seqlen_q: int, seqlen_k: int, per_document: bool, diag_offset: int = 0):
    """``(constexprs, runtime args)`` of a mask: row ``i`` sees keys ``i + diag - left`` to
    ``i + diag + right`` (-1 unbounded); causal sets ``right = 0`` (flash-attn's rule).
    ``diag`` is ``diag_offset``, plus ``len_k - len_q`` bottom-right: one runtime offset,
    except for packed documents of other key lengths (``per_document``: the kernels add
    each document's own, BOTTOM_RIGHT). A side reaching past every key is unbounded, and
    the kernels get the simplest variant: none (no mask), CAUSAL (``right = 0`` only) or
    WINDOW (a runtime band; an unbounded side there is one past every key)."""
    left, right = window
    right = 0 if causal else right
    per_document = bool(bottom_right) and per_document
    if bottom_right and not per_document:
        diag_offset += seqlen_k - seqlen_q
    reach = max(seqlen_q, seqlen_k) + abs(diag_offset)
    left, right = (-1 if side >= reach else side for side in (left, right))
    is_causal = left < 0 and right == 0
    is_window = not is_causal and (left >= 0 or right >= 0)
    unbounded = seqlen_q + seqlen_k + abs(diag_offset)
    consts = dict(CAUSAL=is_causal, WINDOW=is_window,
                  BOTTOM_RIGHT=per_document and (is_causal or is_window), SOFTCAP=softcap > 0)
    if not is_window:
        left = right = 0
    runtime = (float(softcap) if softcap > 0 else 1.0, unbounded if left < 0 else left,
               unbounded if right < 0 else right, diag_offset)
    return consts, runtime


def flash_attn_forward(q, k, v, out, lse, causal: bool, sm_scale: float, cu_seqlens=None,
                       max_seqlen: int = 0, config: dict | None = None, *,
                       window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                       bottom_right: bool = False, cu_seqlens_k=None, max_seqlen_k: int = 0,
                       diag_offset: int = 0) -> None:
    """Fill ``out`` (like q) and ``lse`` (fp32 ``[B, H, S_q]``, packed ``[H, T_q]``).

    q: ``[B, S_q, H, D]``, k/v: ``[B, S_k, H_kv, D]`` (``H % H_kv == 0``), or packed
    ``[T, H, D]`` with ``cu_seqlens`` (int32, ``[docs + 1]``) and ``max_seqlen`` (k/v's:
    ``cu_seqlens_k`` and ``max_seqlen_k``, default q's); the last dim of every tensor
    contiguous. ``window``, ``bottom_right``, ``diag_offset`` (the key on query row 0's
    diagonal, top-left; a block of a larger attention): see ``mask_args``; ``softcap > 0``: scores
    ``softcap * tanh(scores / softcap)``. A row that sees no key gets output 0 and lse
    -inf. Checks are the op's job."""
    batch, seqlen_q, seqlen_k, cu_q, cu_k, varlen = _geometry(q, k, cu_seqlens, max_seqlen,
                                                              cu_seqlens_k, max_seqlen_k)
    n_heads, n_kv_heads, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    masks, mask_values = mask_args(causal, window, softcap, bottom_right, seqlen_q, seqlen_k,
                                   varlen and cu_k is not cu_q, diag_offset)
    cfg = attn_config(head_dim, q.device, "fwd", config, masks["SOFTCAP"])
    m_blocks = cdiv(seqlen_q, cfg["BLOCK_M"])
    grid = (m_blocks * batch * n_heads,)
    if grid[0] == 0:
        return
    flash_fwd_kernel[grid](
        q, k, v, out, lse, cu_q, cu_k, sm_scale, *mask_values, n_heads, n_heads // n_kv_heads,
        seqlen_q, seqlen_k, head_dim, m_blocks, *_layout(q), *_layout(k), *_layout(v),
        *_layout(out), *_stat_strides(lse), **masks, VARLEN=varlen, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d(head_dim), UPCAST=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def flash_attn_backward(q, k, v, do, lse, delta, dq, dk, dv, causal: bool, sm_scale: float,
                        cu_seqlens=None, max_seqlen: int = 0, config: dict | None = None, *,
                        window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        bottom_right: bool = False, cu_seqlens_k=None, max_seqlen_k: int = 0,
                        diag_offset: int = 0) -> None:
    """Fill ``dq``, ``dk``, ``dv`` (shaped like q, k, v) for upstream ``do``; the mask and
    packing as in ``flash_attn_forward``.

    ``lse``: the forward's log-sum-exp; ``delta``: ``rowsum(do * out) - dlse``, fp32, laid out
    like ``lse``. Both may come from a larger attention that this call is a block of."""
    batch, seqlen_q, seqlen_k, cu_q, cu_k, varlen = _geometry(q, k, cu_seqlens, max_seqlen,
                                                              cu_seqlens_k, max_seqlen_k)
    n_heads, n_kv_heads, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    masks, mask_values = mask_args(causal, window, softcap, bottom_right, seqlen_q, seqlen_k,
                                   varlen and cu_k is not cu_q, diag_offset)

    def launch_options(kernel: str) -> dict:
        cfg = attn_config(head_dim, q.device, kernel, config, masks["SOFTCAP"])
        return dict(**masks, VARLEN=varlen, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                    BLOCK_D=block_d(head_dim), UPCAST=interpreting(), num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"])

    strides = (*_layout(q), *_layout(k), *_layout(v), *_layout(do))
    options = launch_options("dkdv")
    n_blocks = cdiv(seqlen_k, options["BLOCK_N"])
    if n_blocks * batch * n_kv_heads:
        flash_bwd_dkdv_kernel[(n_blocks * batch * n_kv_heads,)](
            q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, sm_scale, *mask_values, n_kv_heads,
            n_heads // n_kv_heads, seqlen_q, seqlen_k, head_dim, n_blocks, *strides, *_layout(dk),
            *_layout(dv), *_stat_strides(lse), **options)
    options = launch_options("dq")
    m_blocks = cdiv(seqlen_q, options["BLOCK_M"])
    if m_blocks * batch * n_heads:
        flash_bwd_dq_kernel[(m_blocks * batch * n_heads,)](
            q, k, v, do, lse, delta, dq, cu_q, cu_k, sm_scale, *mask_values, n_heads,
            n_heads // n_kv_heads, seqlen_q, seqlen_k, head_dim, m_blocks, *strides, *_layout(dq),
            *_stat_strides(lse), **options)


def ring_copy_programs(pieces: int, sms: int | None) -> int:
    """Programs of a K/V copy (it spins on a READY flag, so ``spinning_grid``); on a GPU at
    most a quarter of the SMs: the attention of the previous ring step runs beside it."""
    if sms is not None:
        pieces = min(pieces, max(1, sms // 4))
    return spinning_grid(pieces, sms)


class RingCopy:
    """``ring_kv_copy`` into one slot for every call of a signature: the grid and every
    argument but the byte counter made once. ``launch(q, out, lse, stats)`` (the ring's
    launches share one signature; the copy takes ``stats`` only)."""

    def __init__(self, slot, pad_table, rank: int, world_size: int, epoch: int, meta: int,
                 timeout_ns: int, src: int, rows: tuple[int, int],
                 block: int = COPY_CONFIG["BLOCK"], sms: int | None = None):
        lo, hi = rows
        segments, seqlen = slot.shape[0] * slot.shape[1], slot.shape[2]
        row_elems = slot.shape[3] * slot.shape[4]
        pieces = segments * cdiv(max(hi - lo, 1) * row_elems, block)
        self.grid = (ring_copy_programs(pieces, sms),)
        self.slot, self.pad_table = slot, pad_table
        self.args = (rank, world_size, epoch, meta, timeout_ns, src, lo, hi, segments, seqlen, row_elems)
        self.options = {"BLOCK": block, "ELEM_BYTES": slot.element_size(),
                        "num_warps": COPY_CONFIG["num_warps"]}

    def __call__(self, q, out, lse, stats) -> None:
        ring_kv_copy_kernel[self.grid](self.slot, self.pad_table, stats, *self.args, **self.options)


def ring_kv_copy(slot, pad_table, rank: int, world_size: int, epoch: int, meta: int,
                 timeout_ns: int, src: int, rows: tuple[int, int], stats,
                 block: int = COPY_CONFIG["BLOCK"]) -> None:
    """Copy rows ``rows = (lo, hi)`` (of S_local) of ``src``'s staged K/V (its symmetric
    data region, ``[2, B, S_local, H_kv, D]`` like ``slot``) into ``slot`` once ``src``'s
    READY flag is at ``epoch`` (``signal.call_epoch``'s: 0 is the call's, from the device)
    and its fingerprint equals ``meta`` (wall-clock bounded; a failure is recorded in this
    rank's STATUS words and nothing is copied); adds the bytes copied to ``stats``.
    ``lo == hi`` only checks. The grid is capped (``ring_copy_programs``) and loops; what it
    waits on (a peer staging and signalling on its own device) needs none of this device's
    SMs. ``block``: elements per pass (tests make it small: many passes per segment)."""
    RingCopy(slot, pad_table, rank, world_size, epoch, meta, timeout_ns, src, rows, block,
             sm_count(slot.device))(None, None, None, stats)


def ring_attn_state(q):
    """The fp32 state ring steps carry: ``(acc [B, S, H, D], stat [2, B, H, S])``."""
    b, s, h, _ = q.shape
    return (torch.empty(q.shape, dtype=torch.float32, device=q.device),
            torch.empty(2, b, h, s, dtype=torch.float32, device=q.device))


def _contiguous_layout(shape) -> tuple[int, int, int]:
    """``_layout`` of a contiguous ``[B, S, H, D]`` tensor of ``shape``."""
    _, s, h, d = shape
    return s * h * d, h * d, d


class RingStep:
    """``ring_attn_step`` of one block for every call of a signature: the config, grid and
    every argument but ``q``, ``out`` and ``lse`` made once (``q`` and ``out`` must have
    the strides of the ``q`` and ``out_layout`` given here). ``launch(q, out, lse, stats)``.

    ``end``: the call's last launch ends it (``ring_attn_step_kernel``'s END: every K/V copy
    of the call precedes it in stream order); ``out`` must then be contiguous. ``world_size``
    and ``epoch`` (``signal.call_epoch``'s) only matter there."""

    def __init__(self, q, kv, state, pad_table, rank: int, src: int, rows: int,
                 keys: tuple[int, int], causal: bool, sm_scale: float, first: bool, last: bool,
                 config: dict | None = None, *, row_hi: int | None = None, diag: int = 0,
                 window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 out_layout: tuple[int, int, int] | None = None, world_size: int = 1,
                 epoch: int = 0, end: bool = False):
        batch, seqlen, n_heads, head_dim = q.shape
        masks, mask_values = mask_args(causal, window, softcap, False, seqlen, seqlen, False, diag)
        del masks["BOTTOM_RIGHT"]
        cfg = attn_config(head_dim, q.device, "ring", config, masks["SOFTCAP"])
        m_blocks = cdiv(seqlen, cfg["BLOCK_M"])
        cap, left, right, diag = mask_values
        self.grid = (m_blocks * batch * n_heads,)
        self.kv, (self.acc, self.stat) = kv, state
        self.args = (pad_table, rank, src, rows, seqlen if row_hi is None else row_hi, keys[0],
                     keys[1], diag, sm_scale, cap, left, right, batch, n_heads,
                     n_heads // kv.shape[3], seqlen, head_dim, m_blocks, *_layout(q),
                     *(out_layout or _contiguous_layout(q.shape)), world_size, epoch)
        self.options = {**masks, "FIRST": first, "LAST": last, "END": end,
                        "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
                        "BLOCK_D": block_d(head_dim), "UPCAST": interpreting(),
                        "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}

    def __call__(self, q, out, lse, stats=None) -> None:
        ring_attn_step_kernel[self.grid](q, self.kv, self.acc, self.stat, out, lse, *self.args,
                                         **self.options)


def ring_attn_step(q, kv, state, out, lse, pad_table, rank: int, src: int, rows: int,
                   keys: tuple[int, int], causal: bool, sm_scale: float, first: bool, last: bool,
                   config: dict | None = None, *, row_hi: int | None = None, diag: int = 0,
                   window: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> None:
    """Fold keys ``keys = (lo, hi)`` of ``src``'s K/V (local: this rank's own, or a slot
    ``ring_kv_copy`` filled; ``[2, B, S_local, H_kv, D]`` contiguous) into the attention
    of this rank's query rows ``rows`` to ``row_hi`` (default: the end; ``q [B, S_local, H,
    D]``; the other rows keep their state); ``state`` from ``ring_attn_state``. The mask is
    ``flash_attn_forward``'s in local indices with the diagonal at key ``i + diag`` for row
    i (causal, ``window``, ``softcap``); ``causal`` at ``diag = 0`` is the own block.
    ``last`` writes ``out`` (like q) and ``lse`` (fp32 ``[B, H, S_local]``, contiguous).
    Skips a peer's K/V if this rank recorded a failure. One program per (query block,
    batch, head); it waits on nothing. (The ring's plan keeps ``RingStep`` launches.)"""
    RingStep(q, kv, state, pad_table, rank, src, rows, keys, causal, sm_scale, first, last,
             config, row_hi=row_hi, diag=diag, window=window, softcap=softcap,
             out_layout=_layout(out))(q, out, lse)


# The mask variants compiled ahead of time (of those ``mask_args`` picks): causal; a sliding
# window (Mistral, Qwen2); and every switch on (a window with softcap, bottom-right, over
# packed documents of other key lengths: the most registers, and the code of each switch)
MASK_VARIANTS = [dict(CAUSAL=True), dict(WINDOW=True),
                 dict(WINDOW=True, SOFTCAP=True, BOTTOM_RIGHT=True, VARLEN=True)]


def _aot_examples():
    i32 = "i32"
    cu_seqlens = {"cu_seqlens_q_ptr": "*i32", "cu_seqlens_k_ptr": "*i32"}
    mask_values = {"sm_scale": "fp32", "softcap": "fp32", "win_left": i32, "win_right": i32,
                   "diag_offset": i32}
    strides4 = {f"stride_{t}{a}": i32 for t in ("q", "k", "v", "o") for a in "bsh"}
    fwd_sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16",
               "lse_ptr": "*fp32", **cu_seqlens, **mask_values, "n_heads": i32,
               "kv_group": i32, "seqlen_q": i32, "seqlen_k": i32, "head_dim": i32, "m_blocks": i32,
               **strides4, "stride_lb": i32, "stride_lh": i32}
    grad_strides = {f"stride_{t}{a}": i32 for t in ("q", "k", "v", "do") for a in "bsh"}
    dkdv_sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "do_ptr": "*bf16",
                "lse_ptr": "*fp32", "delta_ptr": "*fp32", "dk_ptr": "*bf16", "dv_ptr": "*bf16",
                **cu_seqlens, **mask_values, "n_kv_heads": i32, "kv_group": i32,
                "seqlen_q": i32, "seqlen_k": i32, "head_dim": i32, "n_blocks": i32, **grad_strides,
                **{f"stride_{t}{a}": i32 for t in ("dk", "dv") for a in "bsh"},
                "stride_lb": i32, "stride_lh": i32}
    dq_sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "do_ptr": "*bf16",
              "lse_ptr": "*fp32", "delta_ptr": "*fp32", "dq_ptr": "*bf16", **cu_seqlens,
              **mask_values, "n_heads": i32, "kv_group": i32, "seqlen_q": i32, "seqlen_k": i32,
              "head_dim": i32, "m_blocks": i32, **grad_strides,
              **{f"stride_dq{a}": i32 for a in "bsh"}, "stride_lb": i32, "stride_lh": i32}
    step_sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "acc_ptr": "*fp32", "stat_ptr": "*fp32",
                "o_ptr": "*bf16", "lse_ptr": "*fp32", "pad_table": "*i64", "rank": i32,
                "src": i32, "row_lo": i32, "row_hi": i32, "key_lo": i32, "key_hi": i32, "diag": i32,
                "sm_scale": "fp32", "softcap": "fp32", "win_left": i32, "win_right": i32,
                "batch": i32, "n_heads": i32, "kv_group": i32, "seqlen": i32, "head_dim": i32,
                "m_blocks": i32,
                **{f"stride_{t}{a}": i32 for t in ("q", "o") for a in "bsh"},
                "world_size": i32, "epoch": i32}
    copy_sig = {"slot_ptr": "*bf16", "pad_table": "*i64", "stats_ptr": "*i64", "rank": i32,
                "world_size": i32, "epoch": i32, "meta": i32, "timeout_ns": "i64", "src": i32,
                "row_lo": i32, "row_hi": i32, "segments": i32, "seqlen": i32, "row_elems": i32}
    out = []
    for arch in (90, 80):
        def options(kernel: str, d: int, softcap: bool = False, end: bool = False, arch: int = arch) -> dict:
            cfg = gpu_config(kernel, arch == 90, d, softcap)
            mma_sync_ok = _MMA_SYNC_OK.get(kernel, "") if d == 256 else ""
            return dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], arch=arch,
                        mma_sync_ok=mma_sync_ok,
                        spills_ok=_SPILLS_OK.get((kernel, arch, d, softcap, end), ""))

        for d in (64, 128, 256):
            for kernel, sig, name in ((flash_fwd_kernel, fwd_sig, "fwd"),
                                      (flash_bwd_dkdv_kernel, dkdv_sig, "dkdv"),
                                      (flash_bwd_dq_kernel, dq_sig, "dq")):
                for variant in MASK_VARIANTS:
                    softcap = variant.get("SOFTCAP", False)
                    cfg = gpu_config(name, arch == 90, d, softcap)
                    consts = {**dict(CAUSAL=False, WINDOW=False, BOTTOM_RIGHT=False, SOFTCAP=False,
                                     VARLEN=False), **variant, "BLOCK_M": cfg["BLOCK_M"],
                              "BLOCK_N": cfg["BLOCK_N"], "BLOCK_D": d, "UPCAST": False}
                    out.append((kernel, sig, consts, options(name, d, softcap)))
            # the own (causal) block first, a peer's block in the middle (state in and
            # out), a peer's block last, ending the call; a window's band in the middle, and
            # last with softcap; a one-rank ring's own block, first and last
            for mask, first, last in ((dict(CAUSAL=True), True, False), ({}, False, False),
                                      ({}, False, True), (dict(WINDOW=True), False, False),
                                      (dict(WINDOW=True, SOFTCAP=True), False, True),
                                      ({"CAUSAL": True}, True, True)):
                softcap = mask.get("SOFTCAP", False)
                cfg = gpu_config("ring", arch == 90, d, softcap)
                consts = {**dict(CAUSAL=False, WINDOW=False, SOFTCAP=False), **mask, "FIRST": first,
                          "LAST": last, "END": last, "BLOCK_M": cfg["BLOCK_M"],
                          "BLOCK_N": cfg["BLOCK_N"], "BLOCK_D": d, "UPCAST": False}
                out.append((ring_attn_step_kernel, step_sig, consts, options("ring", d, softcap, last)))
        out.append((ring_kv_copy_kernel, copy_sig, dict(BLOCK=COPY_CONFIG["BLOCK"], ELEM_BYTES=2),
                    dict(num_warps=COPY_CONFIG["num_warps"], arch=arch)))
    return out


AOT_EXAMPLES = _aot_examples()
