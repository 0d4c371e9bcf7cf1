"""Triton kernels, one module per family, each with plain launcher functions.

Every module lists, in ``AOT_EXAMPLES``, each variant its launchers produce on a GPU as
``(kernel, signature, constexprs[, options])``: ``constexprs`` and ``options``
(``num_warps``, ``num_stages``, ``arch`` (90 or 80; absent = both), ``spills_ok`` (why a
variant may spill), ``mma_sync_ok`` (why its dots may miss wgmma on sm_90)) exactly as the
launcher picks them. CI compiles each for sm_90a and sm_80 ahead of time and requires no
spills and wgmma dots on sm_90 (tests/kernels/test_aot.py); a test fails if a kernel is
missing from the list.
"""

import importlib

FAMILIES = ["signal", "all_gather", "reduce_scatter", "matmul_reduce_scatter", "flash_attention", "grouped_mm",
            "gemm_peers", "moe_permute", "moe_dispatch"]


def aot_examples():
    """Every registered variant: ``[(family, kernel, signature, constexprs, options)]``."""
    out = []
    for family in FAMILIES:
        module = importlib.import_module(f"{__name__}.{family}")
        for kernel, sig, consts, *options in module.AOT_EXAMPLES:
            out.append((family, kernel, sig, consts, dict(*options)))
    return out
