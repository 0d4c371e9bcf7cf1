"""The persistent GEMMs' shared pieces: tile order, the fp32-accumulating dot, tile loads
and stores (pointer loads, or TMA descriptors on Hopper), the SwiGLU epilogues, launch
configs and grids, and the ahead-of-time variants. The kernels live with their ops:
``grouped_mm`` (rows and K-grouped), ``gemm_peers`` (rows from peers: the fused expert MLP
and all_gather_matmul) and ``matmul_reduce_scatter``.

Epilogues: ``SWIGLU`` multiplies one A tile by b's gate and up columns and stores
``silu(gate) * up`` from the fp32 products (``KEEP_H``: the products too, for autograd);
``SWIGLU_VJP`` turns the gradient of SwiGLU's output into the gradients of the forward's gate
and up products. They work on column halves of a tile: whole tiles of the products spill.

TMA descriptors (host-built ``TensorDescriptor`` s) are used where the GPU has them and the
operands' layouts allow (unit inner stride, 16-byte aligned base and strides): a tile's rows
past its group's end then hold the next group's rows (the store masks them) and the K tail
reads as zeros. Elsewhere (sm_80, odd strides) pointer loads. The interpreter takes the TMA
path wherever the layouts allow, so CPU tests cover both. Accumulation is fp32 (fp32 inputs
use exact fp32 products, no TF32).

Tile shapes: a launcher that knows its GEMM's shape (rows x N) may pass it (``shape=`` of
``gemm_operands`` / ``grouped_config``): on sm_90 the 16-bit TMA config is then the tile
candidate (``TILE_CANDIDATES_SM90``) whose tiles fill the GPU's waves best (``choose_tile``),
else the one config of today.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .interpreter import interpreting


# 16-bit inputs; no variant with unit inner strides (what the JIT specializes for row-major
# operands) spills (tests/kernels/test_aot.py). sm_90: TMA loads on 128x256x64 tiles, two
# warpgroups, 4 stages (the fastest of the tile shapes benchmarks/bench_grouped_mm.py
# compared). Pointer loads (ragged K needs masks; operands TMA cannot cover) fit 128x128x64
# (128x256 spills). sm_80: mma.sync needs more registers: 128x128x32 on 8 warps. fp32 runs on FMAs (exact, no TF32) and is for tests and fp32 training only:
# 64x64x32.
GPU_CONFIG_SM90 = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4,
                       TMA=True)
POINTER_CONFIG_SM90 = dict(GPU_CONFIG_SM90, BLOCK_N=128, TMA=False)
GPU_CONFIG_SM80 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3,
                       TMA=False)
GPU_CONFIG_FP32 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
# The interpreter's cost grows with programs x loop iterations: big blocks, few programs.
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=1,
                          NUM_PROGRAMS=4)

# sm_90 16-bit TMA tile candidates for a GEMM whose shape the launcher knows (all_gather_matmul's
# gather, matmul_reduce_scatter), in order of preference: the first is GPU_CONFIG_SM90, what
# every other launch takes. ``CTAS_PER_SM``: the CTAs one SM holds at once (absent: 1), so a
# persistent grid takes SMs x that programs. An H100 SM has 228 KB of shared memory (at most
# 227 KB a block, 1 KB reserved per block) and 64K registers; a stage holds (BLOCK_M +
# BLOCK_N) x BLOCK_K x 2 B. ptxas (triton 3.8 and 3.6, sm_90a, the peers kernel's plain
# gather and matmul_reduce_scatter's GEMM, B row-major or K-major):
#   128x256: 4 x 48 KB = 192 KB, 226-255 registers x 256 threads: 1 CTA/SM
#   128x128: 4 x 32 KB = 128 KB (two need 256), 116-140 registers: 1 CTA/SM; half the
#            tile: twice the waves where 128x256 leaves a wave mostly empty (N = 1280)
#   64x256:  4 x 40 KB = 160 KB, 116-144 registers: 1 CTA/SM (on 4 warps the 64x256 fp32
#            accumulator in 128 threads spills); the same waves as 128x128, other edges
#   2x128x128: 3 x 32 KB = 96 KB (two: 194 KB), 200-240 registers x 128 threads (two: 61K):
#            2 CTAs/SM, one's epilogue under the other's mainloop; the waves of 128x256, so
#            never more efficient than 128x128 by ``tile_fit``: choose_tile never takes it
#            (the benchmark times it; on 8 warps two CTAs need <= 128 registers a thread,
#            and the peers kernel takes 134)
# Which runs faster at a shape is for benchmarks/bench_gemm_tiles.py's GPU rows to say.
TILE_CANDIDATES_SM90 = {
    "128x256": GPU_CONFIG_SM90,
    "128x128": dict(GPU_CONFIG_SM90, BLOCK_N=128),
    "64x256": dict(GPU_CONFIG_SM90, BLOCK_M=64),
    "2x128x128": dict(GPU_CONFIG_SM90, BLOCK_N=128, num_warps=4, num_stages=3, CTAS_PER_SM=2),
}
DEFAULT_TILE = "128x256"
# A candidate later in the list (smaller tiles: more bytes loaded and more epilogues per
# product) is taken only where no earlier one comes within this fraction of its efficiency
# (``choose_tile``): a guess at what a smaller tile costs, not a measurement; the GPU rows of
# benchmarks/bench_gemm_tiles.py should set it.
TILE_MARGIN = 0.1
# config keys with which a caller picks the tiles itself (no choice is made)
TILE_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "CTAS_PER_SM"})


@triton.jit
def grouped_tile(t, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of tile ``t`` of an ``m_tiles x n_tiles`` grid, GROUP_M m-tiles at a
    time down each column band (the B tiles of a group stay in L2)."""
    per_group = GROUP_M * n_tiles
    first_m = (t // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_rows
    pid_n = (t % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32. UPCAST (interpreter only): 16-bit tl.dot is broken there
    (triton#11584). fp32 operands use exact fp32 products (no TF32)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


def gpu_gemm_config(dtype: torch.dtype, arch_major: int) -> dict:
    """The pointer-load GPU launch config of the persistent GEMMs for ``dtype`` on a GPU
    generation (``gpu_config`` picks the TMA ones)."""
    if dtype == torch.float32:
        return dict(GPU_CONFIG_FP32)
    return dict(POINTER_CONFIG_SM90 if arch_major >= 9 else GPU_CONFIG_SM80)


def gemm_config(dtype: torch.dtype, device: torch.device, config: dict | None = None,
                sms: int | None = None) -> dict:
    """Block sizes and launch options: ``config`` entries override the defaults for this
    dtype, GPU generation and mode. NUM_PROGRAMS defaults to ``sms`` (the SMs the grid may
    use; default: the device's) times the config's ``CTAS_PER_SM`` (1 if absent). The GPU
    is queried here, at launch, never at import."""
    if interpreting():
        cfg = dict(INTERPRETER_CONFIG)
    else:
        cfg = gpu_gemm_config(dtype, torch.cuda.get_device_capability(device)[0])
    cfg.update(config or {})
    if "NUM_PROGRAMS" not in cfg:
        cfg["NUM_PROGRAMS"] = (sms or _sm_count(device)) * cfg.get("CTAS_PER_SM", 1)
    return cfg


_sm_counts: dict = {}


def _sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device (asked once, at a launch)."""
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[device]


class TileFit(NamedTuple):
    """How the tiles of a GEMM fill a GPU (``tile_fit``). ``slots``: the CTAs resident at
    once (SMs x CTAs per SM); ``waves``: tiles / slots; ``rounds``: the tiles the busiest
    slot computes, ceil(waves); ``wave_efficiency``: tiles / (rounds x slots), the busy
    share of the slots' rounds; ``efficiency``: rows x N / (rounds x slots x BLOCK_M x
    BLOCK_N), the share of the SMs' tile work that is the product's (the wave efficiency
    times the tiles' fill: an edge tile costs a whole tile's MMAs). At 1 CTA/SM the time
    of a persistent GEMM goes as rounds x BLOCK_M x BLOCK_N, at k CTAs/SM (sharing the SM)
    as k x that: efficiency ranks the candidates by it."""
    tiles: int
    slots: int
    waves: float
    rounds: int
    wave_efficiency: float
    efficiency: float


def _runs(rows) -> tuple[int, ...]:
    return (int(rows),) if isinstance(rows, int) else tuple(int(r) for r in rows)


def tile_fit(rows, n: int, cfg: dict, sms: int) -> TileFit:
    """The tiles of an ``M x n`` product with ``cfg``'s blocks on ``sms`` SMs. ``rows``: M,
    or the row counts of the runs or chunks the kernel tiles apart (a tile never spans two:
    the peers kernel's runs, matmul_reduce_scatter's W chunks of M / W rows)."""
    runs = _runs(rows)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles = sum(-(-r // bm) for r in runs) * -(-n // bn)
    slots = sms * cfg.get("CTAS_PER_SM", 1)
    rounds = -(-tiles // slots)
    if tiles == 0:
        return TileFit(0, slots, 0.0, 0, 1.0, 1.0)
    return TileFit(tiles, slots, tiles / slots, rounds, tiles / (rounds * slots),
                   sum(runs) * n / (rounds * slots * bm * bn))


def choose_tile(rows, n: int, sms: int) -> str:
    """The name of the sm_90 16-bit TMA tile candidate (``TILE_CANDIDATES_SM90``) for an
    ``M x n`` product (``rows``: as ``tile_fit`` takes them) on ``sms`` SMs: the first, in the
    list's order (larger tiles first), whose ``tile_fit`` efficiency is within ``TILE_MARGIN``
    of the best candidate's; ``DEFAULT_TILE`` for an empty product. Cached (host path)."""
    return _choose_tile(_runs(rows), int(n), int(sms))


@functools.lru_cache(maxsize=1024)
def _choose_tile(runs: tuple[int, ...], n: int, sms: int) -> str:
    fits = {name: tile_fit(runs, n, cfg, sms) for name, cfg in TILE_CANDIDATES_SM90.items()}
    if fits[DEFAULT_TILE].tiles == 0:
        return DEFAULT_TILE
    best = max(fit.efficiency for fit in fits.values())
    return next(name for name, fit in fits.items() if fit.efficiency >= best * (1 - TILE_MARGIN))


def persistent_grid(num_tiles: int, cfg: dict) -> tuple[int]:
    """One program per SM (``NUM_PROGRAMS``) or fewer, each looping over tiles."""
    return (min(num_tiles, cfg["NUM_PROGRAMS"]),)


SM_COUNT = {90: 132, 80: 108}  # H100 SXM, A100: NUM_PROGRAMS of the persistent grid


def aot_variants(kernel, signature: dict, **consts):
    """``AOT_EXAMPLES`` entries of a persistent GEMM on pointer loads: ``gpu_gemm_config``
    per arch and dtype (bf16 stands for both 16-bit types), A row-major (``stride_ak`` = 1),
    B contiguous (``stride_bn`` = 1) and, in 16 bits, transposed (``stride_bk`` = 1, the
    backward's Bᵀ): the JIT makes a unit stride a constexpr, so these are the binaries that
    run."""
    out = []
    for arch in SM_COUNT:
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            cfg = gpu_gemm_config(dtype, arch // 10)
            sig = {k: (f"*{name}" if v == "*T" else v) for k, v in signature.items()}
            blocks = {k: v for k, v in cfg.items() if k.isupper()}
            options = {"arch": arch, "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
            for unit in ("stride_bn", "stride_bk")[: 2 if name == "bf16" else 1]:
                unit_consts = {unit: 1, **{k: 1 for k in ("stride_ak", "stride_cn") if k in sig}}
                out.append((kernel, sig, dict(blocks, NUM_PROGRAMS=SM_COUNT[arch], UPCAST=False,
                                              **unit_consts, **consts), options))
    return out


def gpu_config(major: int, tma: bool, epilogue: str | None = None, shape: tuple | None = None,
               sms: int | None = None) -> dict:
    """The 16-bit launch config on a GPU of compute capability ``major``: TMA loads where the
    GPU has them and ``tma``; ``epilogue``: the peers kernel's gather's, on half the columns
    (SwiGLU's two accumulators, gate and up, or the VJP's two tiles of the forward's
    products). The push takes the same configs. ``shape``: ``(rows, N)`` of the product
    (rows as ``tile_fit`` takes them): on sm_90 with TMA and no epilogue, the tile
    candidate ``choose_tile`` picks for ``sms`` SMs (default: an H100's)."""
    cfg = GPU_CONFIG_SM80 if major < 9 else GPU_CONFIG_SM90 if tma else POINTER_CONFIG_SM90
    if epilogue:
        return dict(cfg, BLOCK_N=cfg["BLOCK_N"] // 2)
    if shape is not None and major == 9 and tma:
        return TILE_CANDIDATES_SM90[choose_tile(shape[0], shape[1], sms or SM_COUNT[90])]
    return cfg


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
def scale_tile(acc, sa_ptr, stride_sa, sb_ptr, stride_sb, m0, n0, m_end, N, live,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The scaled GEMMs' epilogue: ``acc * sa[m0:m0+BLOCK_M, None] * sb[None, n0:n0+BLOCK_N]``
    (fp32 rowwise scales, as ``torch._scaled_mm`` takes them; element i of ``sa`` at
    ``sa_ptr + i * stride_sa``, of ``sb`` likewise: a stride 0 repeats a tensorwise scale);
    rows past ``m_end``, columns past ``N`` and a tile that is not ``live`` (a segment of
    zeros) read no scale."""
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    sa = tl.load(sa_ptr + rm * stride_sa, mask=(rm < m_end) & live, other=0.0)
    sb = tl.load(sb_ptr + rn * stride_sb, mask=(rn < N) & live, other=0.0)
    return acc * sa[:, None] * sb[None, :]


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
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUND: tl.constexpr):
    """SwiGLU on one tile of the fp32 ``gate`` and ``up`` products at columns
    ``n0:n0+BLOCK_N``: ``c [T, N]`` gets ``silu(gate) * up``, and with KEEP_H ``h [T,
    2N]`` gets ``[gate | up]``. ``ROUND`` (the fp8 recipe's numerics: its GEMM writes the
    products in c's dtype, then torch's ``silu(gate) * up`` in that dtype): the products,
    then ``silu(gate)``, are rounded to c's dtype before the next step."""
    if ROUND:
        gate = gate.to(c_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(c_ptr.dtype.element_ty).to(tl.float32)
    if KEEP_H:
        store_tile(h_ptr, gate, m0, n0, m_end, N, 2 * N, 1, BLOCK_M, BLOCK_N)
        store_tile(h_ptr + N, up, m0, n0, m_end, N, 2 * N, 1, BLOCK_M, BLOCK_N)
    silu = gate * tl.sigmoid(gate)
    if ROUND:
        silu = silu.to(c_ptr.dtype.element_ty).to(tl.float32)
    store_tile(c_ptr, silu * up, m0, n0, m_end, N, N, 1, BLOCK_M, BLOCK_N)


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
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUND: tl.constexpr):
    """``swiglu_tile`` on the two column halves of a tile (whole tiles of both products
    spill)."""
    gate0, gate1 = column_halves(gate, BLOCK_M, BLOCK_N)
    up0, up1 = column_halves(up, BLOCK_M, BLOCK_N)
    swiglu_tile(c_ptr, h_ptr, gate0, up0, m0, n0, m_end, N, KEEP_H, BLOCK_M, BLOCK_N // 2, ROUND)
    swiglu_tile(c_ptr, h_ptr, gate1, up1, m0, n0 + BLOCK_N // 2, m_end, N, KEEP_H, BLOCK_M,
                BLOCK_N // 2, ROUND)


@triton.jit
def swiglu_vjp_epilogue(c_ptr, h_ptr, grad, m0, n0, m_end, N, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """``swiglu_vjp_tile`` on the two column halves of a tile (the forward's products are
    two more tiles: whole ones spill)."""
    grad0, grad1 = column_halves(grad, BLOCK_M, BLOCK_N)
    swiglu_vjp_tile(c_ptr, h_ptr, grad0, m0, n0, m_end, N, BLOCK_M, BLOCK_N // 2)
    swiglu_vjp_tile(c_ptr, h_ptr, grad1, m0, n0 + BLOCK_N // 2, m_end, N, BLOCK_M, BLOCK_N // 2)


EPILOGUES = ("swiglu", "swiglu_vjp")  # the gather's; the push has none


def grouped_config(a: torch.Tensor, config: dict | None = None, *, tma: bool = True,
                   epilogue: str | None = None, shape: tuple | None = None,
                   sms: int | None = None) -> dict:
    """Blocks and launch options for ``a``'s dtype and GPU (queried at launch): the TMA
    config where the GPU has TMA and ``tma``, else the pointer-load one; ``epilogue``: the
    peers kernel's gather variants (``gpu_config``). The interpreter takes the TMA
    path when ``tma`` (and its one config). ``shape``: ``(rows, N)`` of the product (rows:
    M, or the row counts of the runs or chunks the kernel tiles apart): on sm_90 the tile
    candidate that fills the waves of ``sms`` SMs best (``choose_tile``; ``sms``: the SMs
    the kernel's grid may use, default the device's; it also sets NUM_PROGRAMS' default),
    unless ``config`` sets tiles itself (``TILE_KEYS``)."""
    base = {"TMA": tma and interpreting()}
    if not interpreting() and a.dtype != torch.float32:
        if shape is not None and not (config and TILE_KEYS & config.keys()):
            sms = sms or _sm_count(a.device)
        else:
            shape = None
        base = gpu_config(torch.cuda.get_device_capability(a.device)[0], tma, epilogue, shape, sms)
    return gemm_config(a.dtype, a.device, dict(base, **(config or {})), sms)


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can cover ``t``: unit inner stride, 16-byte aligned base and
    outer strides, none zero (an expanded tensor), no empty dimension."""
    size = t.element_size()
    return (t.numel() > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(stride > 0 and stride * size % 16 == 0 for stride in t.stride()[:-1]))


def gemm_operands(a: torch.Tensor, b: torch.Tensor, config: dict | None = None, *,
                  epilogue: str | None = None, shape: tuple | None = None,
                  sms: int | None = None) -> tuple[dict, object, object, bool]:
    """``(config, a, b, b_kmajor)`` for the rows and peers kernels (and ``matmul_reduce_scatter``'s, with
    one group): TMA descriptors over
    ``a [rows, K]`` and ``b [E, K, N]`` (or, ``b_kmajor``, over its transpose ``[E, N, K]``,
    as the expert MLP passes ``w.transpose(1, 2)`` of row-major weights) where the config
    has TMA and the layouts allow, else the tensors themselves and the pointer-load config.
    ``shape``, ``sms``: the product's tiling, for the tile choice (``grouped_config``)."""
    kmajor = b.stride(2) != 1
    b_view = b.transpose(1, 2) if kmajor else b
    # swiglu reads b's up half from column N: a TMA box must start 16-byte aligned
    up_aligned = kmajor or epilogue != "swiglu" or b.shape[2] // 2 * b.element_size() % 16 == 0
    cfg = grouped_config(a, config, tma=_tma_ready(a) and _tma_ready(b_view) and up_aligned,
                         epilogue=epilogue, shape=shape, sms=sms)
    if not cfg["TMA"]:
        return cfg, a, b, False
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    return (cfg, TensorDescriptor.from_tensor(a, [bm, bk]),
            TensorDescriptor.from_tensor(b_view, [1, bn, bk] if kmajor else [1, bk, bn]), kmajor)


def launch_options(cfg: dict) -> dict:
    return dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                GROUP_M=cfg["GROUP_M"], UPCAST=interpreting(), num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])


def scaled_options(cfg: dict, scaled: bool) -> dict:
    """``launch_options`` and SCALED (fp8 operands, scales in the epilogue); fp8 dots run as
    they are in the interpreter too (it multiplies fp8 exactly; only 16-bit dots need
    UPCAST)."""
    options = dict(launch_options(cfg), SCALED=scaled)
    if scaled:
        options["UPCAST"] = False
    return options


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
    consts = dict({k: v for k, v in cfg.items() if k.isupper() and k not in ("TMA", "CTAS_PER_SM")},
                  UPCAST=False, **consts)
    if "TMA" in kernel.arg_names:  # the kernels that take descriptors
        consts.update(TMA=cfg["TMA"], B_KMAJOR=kmajor and cfg["TMA"])
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "arch": arch}
    return kernel, sig, consts, dict(options, spills_ok=spills_ok) if spills_ok else options


def fp8_example(kernel, sig: dict, consts: dict, cfg: dict, kmajor: bool = False, a: str = "fp8e4nv",
                b: str = "fp8e4nv", spills_ok: str | None = None, **types: str):
    """A scaled (fp8) GEMM variant on sm_90 (fp8 tensor cores): ``aot_example``'s 16-bit
    operands (pointers or TMA descriptors) made fp8 (``a``, ``b``: e4m3 ``fp8e4nv`` or e5m2
    ``fp8e5``), SCALED, c bf16 unless ``types`` (argument name: type) say otherwise."""
    kernel, sig, consts, options = aot_example(kernel, sig, dict(consts, SCALED=True), cfg, 90, kmajor,
                                               spills_ok)
    kinds = dict({"a": a, "a_ptr": a, "b": b, "b_ptr": b}, **types)
    sig = {k: v.replace("bf16", kinds[k]) if k in kinds else v for k, v in sig.items()}
    return kernel, sig, consts, options


def tile_candidate_examples(kernel, sig: dict, consts: dict, *, num_programs: int | None = None) -> list:
    """``AOT_EXAMPLES`` entries of a GEMM kernel that takes TMA descriptors (``aot_example``)
    for every sm_90 tile candidate but ``DEFAULT_TILE`` (the module's own entries compile
    that), with B row-major (``stride_bn`` = 1) and K-major (a Linear's weightᵀ, ``stride_bk``
    = 1). ``sig``: bf16 pointers (a unit stride it lists becomes a constexpr);
    ``num_programs``: the SMs of a kernel whose NUM_PROGRAMS is a constexpr (times the
    candidate's ``CTAS_PER_SM``)."""
    out = []
    for name, cfg in TILE_CANDIDATES_SM90.items():
        if name == DEFAULT_TILE:
            continue
        if num_programs is not None:
            cfg = dict(cfg, NUM_PROGRAMS=num_programs * cfg.get("CTAS_PER_SM", 1))
        for kmajor in (False, True):
            unit, other = B_UNIT[kmajor]
            out.append(aot_example(kernel, dict(sig, **{other: "i32"}), dict(consts, **{unit: 1}),
                                   cfg, 90, kmajor))
    return out
