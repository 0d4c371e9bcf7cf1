"""All-gather + matmul in one persistent kernel: ``C = cat(A_shards) @ B``.

Each of the W ranks holds a shard ``A_src`` of ``m_local`` rows and ``K`` columns; ``C``
(``[W*m_local, N]``) is computed tile by tile in rank-rotated shard order (step ``s`` covers
shard ``src = (rank + s) % W``, own shard first, so a rank starts on data it already has
while its peers' shards arrive). Within a shard the ``m_tiles x n_tiles`` output tiles go
in GROUP_M-grouped order; tiles never straddle shards (rows past a shard's end are masked,
so any ``m_local`` works).

Two producers feed the same consumer, chosen by the constexpr ``PULL``:

- ``PULL=True`` (the CPU interpreter, or any machine without a copy engine): a tile of a
  peer's shard waits for that peer's READY flag and input fingerprint, then loads the
  rows straight from the peer's symmetric data region (the peer staged its shard there,
  contiguous ``[m_local, K]``); the own shard comes from ``a_ptr``. With ``STORE_A`` the
  tiles of n-tile 0 also write the A blocks they loaded into ``ag_ptr`` (``[W*m_local, K]``),
  so the gathered A comes out of the same kernel.
- ``PULL=False`` (GPU): a copy engine on a side stream copies shard ``src`` into
  ``ag_ptr`` and then writes the epoch into this rank's ``GATHERED + src`` pad word
  (``stream_write_value32``); a tile waits for that word and reads A from ``ag_ptr``.

A program checks the flag of a shard once, when it reaches its first tile of that shard.
A failed wait (timeout, or a fingerprint mismatch, recorded in the STATUS words) makes
every tile of that shard skip its loads and stores: the kernel never hangs and never
reads unsynchronised data. Accumulation is fp32; fp32 inputs use ``input_precision="ieee"``
(no TF32), so fp32 results are as exact as fp32 FMAs.
"""

import torch
import triton
import triton.language as tl

from .signal import GATHERED, PER_CALL_ARGS, data_ptr, pad_ptr, wait_flag, wait_ready_and_match

# GPU configs, chosen so that the variants the launchers produce (unit-stride B or Bᵀ, aligned
# pointers; tests/kernels/test_aot.py prints registers and spills) compile without spills:
# sm_90 (H100/H200), 16-bit: 128x128x64 tiles, 8 warps (two wgmma warpgroups), 4 stages =
# 128 KiB of shared memory (128x256 spills in gemm_rs: 255 registers + 300-650 B of stack).
# sm_80, 16-bit: mma.sync needs more registers: 128x128x32. fp32 runs on FMAs (exact, no
# TF32) and is for tests and fp32 training only: 64x64x32.
GPU_CONFIG_16BIT = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
GPU_CONFIG_16BIT_SM80 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)
GPU_CONFIG_FP32 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
# The interpreter's cost grows with programs x loop iterations: big blocks, few programs.
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=1,
                          NUM_PROGRAMS=4)


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


# One binary for every rank and epoch (an int argument equal to 1 is otherwise a constexpr).
@triton.jit(do_not_specialize=PER_CALL_ARGS)
def ag_gemm_kernel(a_ptr, b_ptr, c_ptr, ag_ptr, pad_table, rank, world_size, epoch, meta, timeout_ns,
                   m_local, N, K, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, PULL: tl.constexpr,
                   STORE_A: tl.constexpr, UPCAST: tl.constexpr):
    m_tiles = tl.cdiv(m_local, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    shard_tiles = m_tiles * n_tiles
    num_tiles = world_size * shard_tiles
    my_pad = pad_ptr(pad_table, rank)
    shard_elems = tl.cast(m_local, tl.int64) * K
    checked = tl.full([], -1, tl.int32)  # the step whose flag this program checked last
    ok = tl.full([], 0, tl.int1)
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        step = tile // shard_tiles
        src = (rank + step) % world_size
        if step != checked:
            checked = step
            if PULL:
                ok = tl.full([], 1, tl.int1)
                if src != rank:
                    ok = wait_ready_and_match(pad_table, rank, src, epoch, meta, timeout_ns)
            else:
                ok = wait_flag(my_pad, GATHERED + src, src, epoch, timeout_ns, 1)  # TIMEOUT_READY
        if ok:
            pid_m, pid_n = grouped_tile(tile - step * shard_tiles, m_tiles, n_tiles, GROUP_M)
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rk = tl.arange(0, BLOCK_K)
            row_ok = rm < m_local
            col_ok = rn < N
            if PULL:
                a_base = a_ptr
                if src != rank:
                    a_base = data_ptr(pad_table, src, a_ptr.dtype.element_ty)
            else:
                a_base = ag_ptr + src * shard_elems
            a_rows = rm.to(tl.int64) * K
            a_ptrs = a_base + a_rows[:, None] + rk[None, :]
            b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                k_ok = rk < K - k * BLOCK_K
                a_mask = row_ok[:, None] & k_ok[None, :]
                a = tl.load(a_ptrs, mask=a_mask, other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if STORE_A:
                    if pid_n == 0:
                        ag_ptrs = ag_ptr + src * shard_elems + a_rows[:, None] + (k * BLOCK_K + rk)[None, :]
                        tl.store(ag_ptrs, a, mask=a_mask)
                acc = mma(a, b, acc, UPCAST)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K * stride_bk
            c_rows = (src * m_local + rm).to(tl.int64) * stride_cm
            c_ptrs = c_ptr + c_rows[:, None] + rn[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def interpreting() -> bool:
    """Whether the kernels were decorated in interpreter mode (TRITON_INTERPRET=1 at import)."""
    return type(ag_gemm_kernel).__name__ == "InterpretedFunction"


def gpu_gemm_config(dtype: torch.dtype, arch_major: int) -> dict:
    """The GPU launch config of the persistent GEMMs for ``dtype`` on a GPU generation."""
    if dtype == torch.float32:
        return dict(GPU_CONFIG_FP32)
    return dict(GPU_CONFIG_16BIT if arch_major >= 9 else GPU_CONFIG_16BIT_SM80)


def gemm_config(dtype: torch.dtype, device: torch.device, config: dict | None = None) -> dict:
    """Block sizes and launch options: ``config`` entries override the defaults for this
    dtype, GPU generation and mode. NUM_PROGRAMS defaults to the SM count. The GPU is
    queried here, at launch, never at import."""
    if interpreting():
        cfg = dict(INTERPRETER_CONFIG)
    else:
        cfg = gpu_gemm_config(dtype, torch.cuda.get_device_capability(device)[0])
    cfg.update(config or {})
    if "NUM_PROGRAMS" not in cfg:
        cfg["NUM_PROGRAMS"] = torch.cuda.get_device_properties(device).multi_processor_count
    return cfg


def persistent_grid(num_tiles: int, cfg: dict) -> tuple[int]:
    """One program per SM (``NUM_PROGRAMS``) or fewer, each looping over tiles."""
    return (min(num_tiles, cfg["NUM_PROGRAMS"]),)


def ag_gemm(a_shard_staged: torch.Tensor, b: torch.Tensor, c: torch.Tensor, ag: torch.Tensor | None,
            pad_table: torch.Tensor, rank: int, world_size: int, epoch: int, meta: int, timeout_ns: int,
            *, pull: bool, store_a: bool, config: dict | None = None) -> None:
    """Fill ``c`` (``[W*m_local, N]``, any strides) with ``cat(A_shards) @ b``.

    ``a_shard_staged``: this rank's shard, contiguous ``[m_local, K]`` (in ``pull`` mode, the
    copy staged in this rank's data region: peers read theirs from their regions).
    ``b``: ``[K, N]``, any strides. ``ag``: contiguous ``[W*m_local, K]``: written with the
    gathered A when ``store_a`` (``pull`` only), read from when not ``pull``; may be None
    otherwise. Waits for peers' READY (``pull``) or this rank's GATHERED flags (not ``pull``)
    at ``epoch``; a failure is recorded in this rank's STATUS words and the tiles of that
    shard are skipped.

    This kernel is persistent (``NUM_PROGRAMS`` = one per SM) and spins, so nothing it waits
    on may need an SM: in ``pull`` mode on a GPU (loopback) every view has staged and
    signalled before any view launches it; in copy-engine mode the READY wait runs before the
    launch (``all_gather_matmul``) and the GATHERED flags are written by the copy engine's
    stream (``stream_write_value32``), which needs no SM.
    """
    m_local, K = a_shard_staged.shape
    N = b.shape[1]
    if b.shape[0] != K or tuple(c.shape) != (world_size * m_local, N):
        raise ValueError(f"ag_gemm: A shard {tuple(a_shard_staged.shape)}, B {tuple(b.shape)}, "
                         f"C {tuple(c.shape)} do not fit world size {world_size}")
    if not a_shard_staged.is_contiguous():
        raise ValueError("ag_gemm: the staged A shard must be contiguous")
    if store_a and not pull:
        raise ValueError("ag_gemm: store_a needs pull=True (otherwise the copy engine fills ag)")
    if (store_a or not pull) and (ag is None or not ag.is_contiguous()
                                  or tuple(ag.shape) != (world_size * m_local, K)):
        raise ValueError(f"ag_gemm: ag must be a contiguous [{world_size * m_local}, {K}] tensor")
    cfg = gemm_config(a_shard_staged.dtype, a_shard_staged.device, config)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    num_tiles = world_size * triton.cdiv(m_local, bm) * triton.cdiv(N, bn)
    if num_tiles == 0:
        return
    grid = persistent_grid(num_tiles, cfg)
    ag_gemm_kernel[grid](
        a_shard_staged, b, c, ag if ag is not None else a_shard_staged, pad_table, rank, world_size,
        epoch, meta, timeout_ns, m_local, N, K, b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        NUM_PROGRAMS=cfg["NUM_PROGRAMS"], PULL=pull, STORE_A=store_a, UPCAST=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


SM_COUNT = {90: 132, 80: 108}  # H100 SXM, A100: NUM_PROGRAMS of the persistent grid


def aot_variants(kernel, signature: dict, **consts):
    """``AOT_EXAMPLES`` entries of a persistent GEMM: what ``gemm_config`` picks per arch and
    dtype (bf16 stands for both 16-bit types), for B contiguous (``stride_bn`` = 1) and, in
    16 bits, transposed (``stride_bk`` = 1, the backward's Bᵀ): the JIT makes a unit stride
    a constexpr."""
    out = []
    for arch in SM_COUNT:
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            cfg = gpu_gemm_config(dtype, arch // 10)
            sig = {k: (f"*{name}" if v == "*T" else v) for k, v in signature.items()}
            blocks = {k: v for k, v in cfg.items() if k.isupper()}
            options = {"arch": arch, "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
            for unit in ("stride_bn", "stride_bk")[: 2 if name == "bf16" else 1]:
                unit_consts = {unit: 1, **({"stride_cn": 1} if "stride_cn" in sig else {})}
                out.append((kernel, sig, dict(blocks, NUM_PROGRAMS=SM_COUNT[arch], UPCAST=False,
                                              **unit_consts, **consts), options))
    return out


_SIG = {"a_ptr": "*T", "b_ptr": "*T", "c_ptr": "*T", "ag_ptr": "*T", "pad_table": "*i64",
        "rank": "i32", "world_size": "i32", "epoch": "i32", "meta": "i32", "timeout_ns": "i64",
        "m_local": "i32", "N": "i32", "K": "i32", "stride_bk": "i32", "stride_bn": "i32",
        "stride_cm": "i32", "stride_cn": "i32"}

AOT_EXAMPLES = [
    # the GPU path: the copy engine gathers A, the GEMM waits on GATHERED flags
    *aot_variants(ag_gemm_kernel, _SIG, PULL=False, STORE_A=False),
    # loopback on one GPU (benchmarks only): tiles pull A from the peers' regions and store it
    *[(k, sig, consts, dict(options, spills_ok="loopback pull path: the A block stays live to be stored"))
      for k, sig, consts, options in aot_variants(ag_gemm_kernel, _SIG, PULL=True, STORE_A=True)
      if sig["a_ptr"] == "*bf16"],
]
