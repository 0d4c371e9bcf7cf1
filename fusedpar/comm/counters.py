"""Counts the bytes each op moved between ranks, to compare with the lower bound.

Fused kernels add what they read from peers into a device-side int64 counter, so nothing
synchronizes on the hot path; the totals are read (and synchronized) only when asked for.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

_active: list["ByteCounter"] = []


class ByteCounter:
    """Bytes moved to this rank from its peers, per ``(op, backend)``.

    >>> with fusedpar.comm.count_bytes() as c:
    ...     fusedpar.ops.all_gather(x, 0, group)
    >>> c.total()                     # an int: bytes this rank received
    """

    def __init__(self):
        self._counts: dict[tuple[str, str], list] = defaultdict(list)

    def add(self, op: str, backend: str, nbytes: int | torch.Tensor) -> None:
        # a tensor is a device counter filled in by a kernel; read it lazily
        self._counts[(op, backend)].append(nbytes)

    def by_op(self) -> dict[tuple[str, str], int]:
        return {k: sum(int(v) for v in vals) for k, vals in self._counts.items()}

    def total(self) -> int:
        return sum(self.by_op().values())


def record(op: str, backend: str, nbytes: int | torch.Tensor) -> None:
    """Called by op backends; a no-op unless a ``count_bytes()`` block is open."""
    for counter in _active:
        counter.add(op, backend, nbytes)


def counting() -> bool:
    return bool(_active)


@contextlib.contextmanager
def count_bytes():
    counter = ByteCounter()
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)
