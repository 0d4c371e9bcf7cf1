"""The persistent GEMMs' shared pieces: tile order, the fp32-accumulating dot, launch
configs and grids, and the ahead-of-time variants of a persistent GEMM. The kernels live
with their op families (``matmul_reduce_scatter``, ``grouped_gemm``, whose peers kernel also runs
all_gather_matmul's GEMM)."""

import torch
import triton
import triton.language as tl

from .interpreter import interpreting


# 16-bit inputs; ptxas reports no spills for any variant with unit inner strides (what the
# JIT specializes for row-major operands; tests/kernels/test_aot.py prints registers and
# spills). sm_90: TMA loads on 128x256x64 tiles, two warpgroups, 4 stages (a sweep on the
# H100 over 128/256 tiles, 3-4 stages, 4-8 warps and warp specialisation: 0.68 ms where
# 128x128x64 took 0.76 and pointer loads 0.88 on bench_grouped_mm's uniform case). Pointer
# loads (ragged K needs masks; operands TMA cannot cover) fit 128x128x64 (128x256 spills:
# 255 registers + 300-650 B of stack). sm_80: mma.sync needs more registers: 128x128x32 on
# 8 warps. fp32 runs on FMAs (exact, no TF32) and is for tests and fp32 training only:
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
    generation (``grouped_gemm.gpu_config`` picks the TMA ones)."""
    if dtype == torch.float32:
        return dict(GPU_CONFIG_FP32)
    return dict(POINTER_CONFIG_SM90 if arch_major >= 9 else GPU_CONFIG_SM80)


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
