"""Context-parallel sequence layouts: the zigzag split that balances causal attention.

The global sequence is cut into ``2W`` equal chunks; rank ``r`` holds chunks ``r`` and
``2W - 1 - r``, concatenated in that order, so every rank gets one early and one late
chunk and the same number of unmasked causal scores.
"""

from __future__ import annotations

import torch

from ..comm import resolve_group
from ..ops import all_gather
from ..ops.ring_attention import zigzag_order


def _check(seq_len: int, world: int, rank: int, what: str) -> int:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"fusedpar.parallel: rank {rank} is not in a world of size {world}")
    if seq_len % (2 * world):
        raise ValueError(
            f"fusedpar.parallel.{what}: sequence length {seq_len} is not divisible by 2 * world "
            f"size = {2 * world} (zigzag cuts it into 2W equal chunks); pad the sequence to a "
            f"multiple of {2 * world}"
        )
    return seq_len // (2 * world)


def zigzag_chunks(rank: int, world: int) -> tuple[int, int]:
    """The global chunk indices (of ``2W``) that rank ``rank`` holds, in its order."""
    return rank, 2 * world - 1 - rank


def zigzag_shard(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of the full sequence ``x`` along ``dim``::

        chunks = x.chunk(2 * world, dim)
        torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)
    """
    chunk = _check(x.shape[dim], world, rank, "zigzag_shard")
    first, second = zigzag_chunks(rank, world)
    return torch.cat([x.narrow(dim, first * chunk, chunk), x.narrow(dim, second * chunk, chunk)], dim)


def zigzag_unshard(x_local: torch.Tensor, dim: int, group=None, *,
                   backend: str | None = None) -> torch.Tensor:
    """The full sequence from every rank's zigzag part (all-gathers over ``group``)::

        parts = all_gather(x_local, group)           # rank order
        chunks = [c for p in parts for c in p.chunk(2, dim)]
        torch.cat([chunks[zigzag_order(W)[g]] for g in range(2 * W)], dim)

    Differentiable (the gradient is reduce-scattered back: ``fusedpar.ops.all_gather``,
    whose ``backend`` this passes on)."""
    pg = resolve_group(group)
    world = pg.size()
    dim = dim % x_local.dim()
    if x_local.shape[dim] % 2:
        raise ValueError(f"fusedpar.parallel.zigzag_unshard: x_local.shape[{dim}] = "
                         f"{x_local.shape[dim]} is odd; a zigzag part holds two equal chunks")
    gathered = all_gather(x_local, dim, pg, backend=backend)
    chunks = gathered.chunk(2 * world, dim)
    return torch.cat([chunks[i] for i in zigzag_order(world)], dim)


def zigzag_positions(seq_len: int, rank: int, world: int, device=None) -> torch.Tensor:
    """The global position ids (int64) of rank ``rank``'s zigzag part, e.g. for RoPE::

        zigzag_shard(torch.arange(seq_len), 0, rank, world)
    """
    chunk = _check(seq_len, world, rank, "zigzag_positions")
    first, second = zigzag_chunks(rank, world)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])
