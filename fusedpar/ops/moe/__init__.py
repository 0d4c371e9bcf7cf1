"""Mixture-of-experts ops. Modules, each importing only those listed before it:

- ``routing``: ``topk_route`` (top-k routing, the load-balancing loss, capacity) and
  ``expert_counts``;
- ``exchange``: what every exchange shares: routing checks, the sort of each token's
  copies by expert, the permutation of rows into that order and back (with autograd), and
  the exchange of per-expert counts;
- ``dispatch``: ``moe_dispatch`` / ``moe_combine`` and their loopbacks (backends
  ``reference`` and ``triton``);
- ``experts_call``: one ``moe_experts`` call and ``ExchangePlan``, the rows it exchanges;
- ``mlp``: ``swiglu``, ``experts_dense`` (the plain-torch oracle) and the grouped-GEMM
  pieces of the expert MLP;
- ``experts_pipelined``, ``experts_fused``: those backends of ``moe_experts``;
- ``experts``: ``moe_experts`` / ``moe_experts_loopback``, their dispatcher and the
  ``reference`` backend.
"""

from .dispatch import MoEHandle, moe_combine, moe_combine_loopback, moe_dispatch, moe_dispatch_loopback
from .experts import moe_experts, moe_experts_loopback
from .mlp import experts_dense, swiglu
from .routing import expert_counts, topk_route

__all__ = ["MoEHandle", "expert_counts", "experts_dense", "moe_combine", "moe_combine_loopback",
           "moe_dispatch", "moe_dispatch_loopback", "moe_experts", "moe_experts_loopback", "swiglu",
           "topk_route"]
