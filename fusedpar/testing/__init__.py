"""Check cases shared by ``fusedpar check`` and ``tests/``: rank-encoded inputs whose results
are exact (or bounded) in every dtype, their plain-torch oracles and the bytes a rank must
receive.

- :mod:`.cases`: what a case is (:class:`~fusedpar.testing.cases.Case`) and the comparisons;
- :mod:`.collectives`, :mod:`.matmul`: the cases of all_gather / reduce_scatter and of the
  fused matmul ops (each op names its module in ``register(..., checks=...)``);
- :mod:`.parallel`: a Llama block under tp, ring_attention under cp, moe_experts under ep.
"""
