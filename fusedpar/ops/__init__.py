"""Public ops. Each is also ``torch.ops.fusedpar.<name>`` (a custom op with a fake impl)."""

from . import all_gather as _all_gather_module
from . import reduce_scatter as _reduce_scatter_module

# every op's backend dispatcher, by op name (for ``fusedpar info``, the demo and tests)
DISPATCHERS = {m.OP: m.BACKENDS for m in (_all_gather_module, _reduce_scatter_module)}

from .all_gather import all_gather, all_gather_loopback  # noqa: E402
from .reduce_scatter import reduce_scatter, reduce_scatter_loopback  # noqa: E402

__all__ = ["DISPATCHERS", "all_gather", "all_gather_loopback", "reduce_scatter",
           "reduce_scatter_loopback"]
