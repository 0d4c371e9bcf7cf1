"""Drop-in ``nn.Module``s built on fusedpar's fused ops.

- :class:`ColumnParallelLinear`, :class:`RowParallelLinear`: tensor-parallel (optionally
  sequence-parallel) ``nn.Linear`` replacements, with ``.from_linear(linear, group)``;
  ``float8=recipe`` computes in fp8 as torchao's ``Float8Linear`` on the fused fp8 ops.
- :func:`column_parallel_float8`, :func:`row_parallel_float8`: the same fp8 linears as
  functions of an input and a weight shard.
- :class:`SharedGather`: one input gather for several column layers (q/k/v, gate/up).
- :func:`sync_replicated_grads`: sum a replicated module's gradients over the TP group
  (norms under sequence parallelism).
"""

from .linear import ColumnParallelLinear, RowParallelLinear, SharedGather, sync_replicated_grads
from .float8_linear import column_parallel_float8, row_parallel_float8  # noqa: E402
from .embedding import VocabParallelEmbedding  # noqa: E402
from .sequence import gather_from_sp, scatter_to_sp, vocab_parallel_cross_entropy  # noqa: E402
from .moe import ExpertParallelMoE, MoEBlock  # noqa: E402
from .attention import ContextParallelAttention  # noqa: E402

__all__ = ["ContextParallelAttention", "VocabParallelEmbedding", "gather_from_sp", "scatter_to_sp", "vocab_parallel_cross_entropy", "ExpertParallelMoE", "MoEBlock", "ColumnParallelLinear", "RowParallelLinear", "SharedGather", "sync_replicated_grads", "column_parallel_float8", "row_parallel_float8"]
