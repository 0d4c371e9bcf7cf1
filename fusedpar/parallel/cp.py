"""Context-parallel sequence layouts: the zigzag split that balances causal attention.

The global sequence is cut into ``2W`` equal chunks; rank ``r`` holds chunks ``r`` and
``2W - 1 - r``, concatenated in that order, so every rank gets one early and one late
chunk and the same number of unmasked causal scores. Packed documents (``cu_seqlens``) can
be split the same way one document at a time (``layout="zigzag_docs"``), which balances
each document's causal work; :func:`sequence_shard` and :func:`sequence_unshard` take
every ``ring_attention`` layout.
"""

from __future__ import annotations

import torch

from ..comm import resolve_group
from ..ops import all_gather
from ..ops.flash_attention import host_list
from ..ops.ring_attention.call import LAYOUTS, check_documents, layout_positions
from ..ops.ring_attention.blocks import rank_chunks


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
    _check(x.shape[dim], world, rank, "zigzag_shard")
    return sequence_shard(x, dim, rank, world)


def zigzag_unshard(x_local: torch.Tensor, dim: int, group=None, *,
                   backend: str | None = None) -> torch.Tensor:
    """The full sequence from every rank's zigzag part (all-gathers over ``group``)::

        parts = all_gather(x_local, group)           # rank order
        firsts, seconds = zip(*(p.chunk(2, dim) for p in parts))
        torch.cat([*firsts, *reversed(seconds)], dim)

    Differentiable (the gradient is reduce-scattered back: ``fusedpar.ops.all_gather``,
    whose ``backend`` this passes on)."""
    dim = dim % x_local.dim()
    if x_local.shape[dim] % 2:
        raise ValueError(f"fusedpar.parallel.zigzag_unshard: x_local.shape[{dim}] = "
                         f"{x_local.shape[dim]} is odd; a zigzag part holds two equal chunks")
    return sequence_unshard(x_local, dim, group, backend=backend)


def _documents(what: str, layout: str, cu_seqlens, total: int, world: int):
    """``zigzag_docs``' ``[start, end)`` document ranges from ``cu_seqlens`` (None for the
    other layouts), checked against the sequence length ``total``."""
    if layout not in LAYOUTS:
        raise ValueError(f"fusedpar.parallel.{what}: layout={layout!r}; choose one of {LAYOUTS}")
    if layout != "zigzag_docs":
        return None
    check_documents(f"parallel.{what}", cu_seqlens, world)
    ends = host_list(cu_seqlens)  # the copy check_documents read: no second device read
    if ends[0] != 0 or ends[-1] != total:
        raise ValueError(f"fusedpar.parallel.{what}: cu_seqlens runs from {ends[0]} to {ends[-1]} "
                         f"but the sequence has {total} positions; it must be [0, ..., {total}]")
    return list(zip(ends, ends[1:]))


def sequence_shard(x: torch.Tensor, dim: int, rank: int, world: int, *, layout: str = "zigzag",
                   cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Rank ``rank``'s part of the full sequence ``x`` along ``dim`` in ``ring_attention``'s
    ``layout``; ``"zigzag_docs"`` (``cu_seqlens``: the packed documents' cumulative ends,
    each a multiple of ``2W`` long) is, per document::

        torch.cat([zigzag_shard(x.narrow(dim, a, b - a), dim, rank, world)
                   for a, b in zip(cu_seqlens, cu_seqlens[1:])], dim)
    """
    total = x.shape[dim]
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"fusedpar.parallel: rank {rank} is not in a world of size {world}")
    documents = _documents("sequence_shard", layout, cu_seqlens, total, world)
    parts = 2 * world if layout == "zigzag" else world
    if total % parts:
        raise ValueError(f"fusedpar.parallel.sequence_shard: sequence length {total} is not "
                         f"divisible by {parts} (layout {layout!r}); pad it to a multiple of {parts}")
    chunks = rank_chunks(layout, world, rank, total // world, documents)
    return torch.cat([x.narrow(dim, start, n) for _, start, n in chunks], dim)


def sequence_unshard(x_local: torch.Tensor, dim: int, group=None, *, layout: str = "zigzag",
                     cu_seqlens: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """The full sequence from every rank's ``layout`` part (the inverse of
    :func:`sequence_shard`; all-gathers over ``group``). Differentiable, as
    :func:`zigzag_unshard`."""
    pg = resolve_group(group)
    world, dim = pg.size(), dim % x_local.dim()
    documents = _documents("sequence_unshard", layout, cu_seqlens, world * x_local.shape[dim], world)
    gathered = all_gather(x_local, dim, pg, backend=backend)
    positions = layout_positions(layout, world, x_local.shape[dim], documents, x_local.device)
    return gathered.index_select(dim, positions.argsort())


def zigzag_positions(seq_len: int, rank: int, world: int, device=None) -> torch.Tensor:
    """The global position ids (int64) of rank ``rank``'s zigzag part, e.g. for RoPE::

        zigzag_shard(torch.arange(seq_len), 0, rank, world)
    """
    chunk = _check(seq_len, world, rank, "zigzag_positions")
    first, second = zigzag_chunks(rank, world)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])
