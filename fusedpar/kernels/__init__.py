"""Triton kernels, one module per family, each with plain launcher functions.

Every module lists its ``@triton.jit`` entry kernels in ``AOT_EXAMPLES`` as
``(kernel, signature, constexprs)``; CI compiles each for sm_90 and sm_80 ahead of time
(tests/kernels/test_aot.py), and a test fails if a kernel is missing from the list.
"""

import importlib

FAMILIES = ["signal", "all_gather", "reduce_scatter", "ag_gemm", "gemm_rs"]


def aot_examples():
    """Every registered kernel with its example signature: ``[(module, kernel, sig, consts)]``."""
    out = []
    for family in FAMILIES:
        module = importlib.import_module(f"{__name__}.{family}")
        out += [(family, kernel, sig, consts) for kernel, sig, consts in module.AOT_EXAMPLES]
    return out
