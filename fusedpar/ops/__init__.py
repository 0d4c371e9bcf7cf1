"""Public ops: the functions of every registered op (``fusedpar.ops.registry``). Each op is
also ``torch.ops.fusedpar.<name>`` where it is a custom op (a fake impl lets torch.compile
trace it)."""

import importlib

from . import registry

# Every op module, imported here once; each registers its op(s) when imported.
OP_MODULES = ("all_gather", "reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter",
              "flash_attention", "ring_attention", "grouped_mm", "scaled_grouped_mm", "moe",
              "scaled_matmul")

for _module in OP_MODULES:
    importlib.import_module(f"{__name__}.{_module}")

globals().update({f.__name__: f for spec in registry.specs() for f in spec.functions})
__all__ = [f.__name__ for spec in registry.specs() for f in spec.functions]
