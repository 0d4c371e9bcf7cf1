"""The persistent GEMMs' shared pieces: tile order, the fp32-accumulating dot, launch
configs and grids, and the ahead-of-time variants of a persistent GEMM. The kernels live
with their op families (``gemm_rs``, ``grouped_gemm``, whose peers kernel also runs
all_gather_matmul's GEMM)."""

import torch
import triton
import triton.language as tl


# Pointer-load GPU configs, chosen so that the variants the launchers produce (unit-stride B
# or Bᵀ, aligned pointers; tests/kernels/test_aot.py prints registers and spills) compile
# without spills: sm_90 (H100/H200), 16-bit: 128x128x64 tiles, 8 warps (two wgmma
# warpgroups), 4 stages (128x256 spills with pointer loads: 255 registers + 300-650 B of
# stack; with TMA loads it fits, see grouped_gemm.gpu_config). sm_80, 16-bit: mma.sync needs
# more registers: 128x128x32. fp32 runs on FMAs (exact, no TF32) and is for tests and fp32
# training only: 64x64x32.
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


def interpreting() -> bool:
    """Whether the kernels were decorated in interpreter mode (TRITON_INTERPRET=1 at import)."""
    return type(grouped_tile).__name__ == "InterpretedFunction"


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
