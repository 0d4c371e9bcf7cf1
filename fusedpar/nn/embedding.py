"""Vocabulary-parallel embedding (Megatron's ``VocabParallelEmbedding``, torch's
``RowwiseParallel`` on an ``nn.Embedding``).

Plain-PyTorch equivalent (W = tensor-parallel size, r = this rank, ``full`` an ``nn.Embedding``)::

    weight = full.weight.chunk(W, 0)[r]                  # rows [r*V/W, (r+1)*V/W)
    y = full(ids)                                        # every rank the same ids
    return y.chunk(W, dim=1)[r] if sequence_parallel else y

Each rank looks up the ids in its rows (zeros elsewhere) and the partial results are summed:
with ``sequence_parallel=True`` by one ``fusedpar.ops.reduce_scatter`` along the sequence
(which enters the sequence-parallel region: its adjoint is the all-gather), else by an
all-reduce. The weight is a ``Shard(0)`` DTensor on the tensor-parallel axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from ..ops import reduce_scatter
from .linear import TPLinear, local, reduce_from_tp

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(TPLinear):
    """``nn.Embedding(num_embeddings, embedding_dim)`` split by rows over ``group``.

    ``forward(ids [B, S])`` → ``[B, S/W, D]`` (``sequence_parallel=True``, S divisible by
    W) or ``[B, S, D]`` replicated. ``from_embedding(emb, group, ...)`` shards an existing
    embedding. ``group`` as for :class:`~fusedpar.nn.ColumnParallelLinear`.
    """

    WEIGHT_PLACEMENT = Shard(0)
    bias = None

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, *,
                 sequence_parallel: bool = False, backend: str | None = None, device=None,
                 dtype=None):
        super().__init__(embedding_dim, num_embeddings, group, sequence_parallel, None, backend)
        self._check_divisible(num_embeddings, "num_embeddings")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = num_embeddings // self.tp_size
        weight = torch.empty(self.rows_per_rank, embedding_dim, device=device, dtype=dtype)
        self.weight = self._param(weight, self.WEIGHT_PLACEMENT)
        if not weight.is_meta:
            full = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
            nn.init.normal_(full)  # nn.Embedding's init, drawn in full (seed every rank alike)
            with torch.no_grad():
                local(self.weight).copy_(self.shard_weight(full))

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp_size, dim=0)[self.tp_rank]

    @classmethod
    def from_embedding(cls, embedding: nn.Module, group=None, *, sequence_parallel: bool = False,
                       backend: str | None = None):
        """This rank's rows of ``embedding.weight`` ``[V, D]`` in a new layer (a copy)."""
        weight = embedding.weight
        if weight.dim() != 2:
            raise ValueError(f"{cls.__name__}.from_embedding: expected a [V, D] weight, got "
                             f"{tuple(weight.shape)}")
        if getattr(embedding, "padding_idx", None) is not None or getattr(embedding, "max_norm", None):
            raise ValueError(f"{cls.__name__}.from_embedding: padding_idx / max_norm are not supported")
        if type(embedding).forward is not nn.Embedding.forward:
            raise ValueError(f"{cls.__name__}.from_embedding: {type(embedding).__name__}.forward does "
                             "more than look rows up (a scale?), which this layer would drop")
        layer = cls(weight.shape[0], weight.shape[1], group, sequence_parallel=sequence_parallel,
                    backend=backend, device="meta", dtype=weight.dtype)
        with torch.no_grad():
            layer.weight = layer._param(layer.shard_weight(weight.detach()).clone(),
                                        cls.WEIGHT_PLACEMENT, weight.requires_grad)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.tp_rank * self.rows_per_rank
        outside = (ids < start) | (ids >= start + self.rows_per_rank)
        y = F.embedding(torch.where(outside, 0, ids - start), local(self.weight))
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            if ids.dim() < 2 or ids.shape[-1] % self.tp_size:
                raise ValueError(f"VocabParallelEmbedding(sequence_parallel=True): ids of shape "
                                 f"{tuple(ids.shape)}: the sequence (last dim) must be divisible "
                                 f"by the tensor-parallel size {self.tp_size}")
            return reduce_scatter(y, "sum", ids.dim() - 1, self.group_name, backend=self.backend)
        return reduce_from_tp(y, self.group_name)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"tp={self.tp_rank}/{self.tp_size}, sequence_parallel={self.sequence_parallel}")
