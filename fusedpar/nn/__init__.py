"""Drop-in ``nn.Module``s built on fusedpar's fused ops.

- :class:`ColumnParallelLinear`, :class:`RowParallelLinear`: tensor-parallel (optionally
  sequence-parallel) ``nn.Linear`` replacements, with ``.from_linear(linear, group)``.
- :class:`SharedGather`: one input gather for several column layers (q/k/v, gate/up).
- :func:`sync_replicated_grads`: sum a replicated module's gradients over the TP group
  (norms under sequence parallelism).
"""

from .linear import ColumnParallelLinear, RowParallelLinear, SharedGather, sync_replicated_grads
from .embedding import VocabParallelEmbedding  # noqa: E402
from .sequence import gather_from_sp, scatter_to_sp, vocab_parallel_cross_entropy  # noqa: E402
from .moe import ExpertParallelMoE, MoEBlock  # noqa: E402
from .attention import ContextParallelAttention  # noqa: E402

__all__ = ["ContextParallelAttention", "VocabParallelEmbedding", "gather_from_sp", "scatter_to_sp", "vocab_parallel_cross_entropy", "ExpertParallelMoE", "MoEBlock", "ColumnParallelLinear", "RowParallelLinear", "SharedGather", "sync_replicated_grads"]
