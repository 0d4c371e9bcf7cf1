"""Public ops. Each is also ``torch.ops.fusedpar.<name>`` (a custom op with a fake impl)."""

from . import all_gather as _all_gather_module
from . import all_gather_matmul as _all_gather_matmul_module
from . import flash_attention as _flash_attention_module
from . import grouped_mm as _grouped_mm_module
from . import matmul_reduce_scatter as _matmul_reduce_scatter_module
from . import reduce_scatter as _reduce_scatter_module
from . import ring_attention as _ring_attention_module

# every op's backend dispatcher, by op name (for ``fusedpar info``, the demo and tests)
DISPATCHERS = {
    m.OP: m.BACKENDS
    for m in (_all_gather_module, _reduce_scatter_module, _all_gather_matmul_module,
              _matmul_reduce_scatter_module, _flash_attention_module,
              _ring_attention_module, _grouped_mm_module)
}
from .moe import DISPATCH as _MOE_DISPATCH  # noqa: E402
DISPATCHERS[_MOE_DISPATCH.op] = _MOE_DISPATCH
from .moe_experts import BACKENDS as _MOE_EXPERTS  # noqa: E402
DISPATCHERS[_MOE_EXPERTS.op] = _MOE_EXPERTS

from .all_gather import all_gather, all_gather_loopback  # noqa: E402
from .all_gather_matmul import all_gather_matmul, all_gather_matmul_loopback  # noqa: E402
from .flash_attention import flash_attention  # noqa: E402
from .grouped_mm import grouped_mm  # noqa: E402
from .moe import (moe_combine, moe_combine_loopback, moe_dispatch, moe_dispatch_loopback,  # noqa: E402
                  topk_route)
from .moe_experts import moe_experts, moe_experts_loopback  # noqa: E402
from .matmul_reduce_scatter import matmul_reduce_scatter, matmul_reduce_scatter_loopback  # noqa: E402
from .reduce_scatter import reduce_scatter, reduce_scatter_loopback  # noqa: E402
from .ring_attention import ring_attention, ring_attention_loopback, ring_attention_with_lse  # noqa: E402

__all__ = ["DISPATCHERS", "all_gather", "all_gather_loopback", "all_gather_matmul",
           "all_gather_matmul_loopback", "flash_attention", "matmul_reduce_scatter", "matmul_reduce_scatter_loopback",
           "reduce_scatter", "reduce_scatter_loopback", "ring_attention", "ring_attention_loopback", "ring_attention_with_lse", "grouped_mm", "moe_combine", "moe_combine_loopback", "moe_dispatch", "moe_dispatch_loopback",
           "moe_experts", "moe_experts_loopback", "topk_route"]
