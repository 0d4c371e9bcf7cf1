"""``fusedpar check`` cases of all_gather and reduce_scatter: odd sizes, the scattered dim a
multiple of W, each compared bit for bit with the ``reference`` backend (on a group) or with
plain torch (loopback)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusedpar.ops import (all_gather, all_gather_loopback, protocol, reduce_scatter,
                          reduce_scatter_loopback, registry)
from fusedpar.ops.calls import CollectiveCall

from .cases import Case


def demo_input(op: str, shape, dtype, rank: int, world: int, salt: int, device) -> torch.Tensor:
    """Rank ``rank``'s input: small integers that encode the rank, exact in every dtype.

    all_gather: ``(7n + salt) % 13 + 16 (rank + 1)``. reduce_scatter: small values chosen
    so that every element's sum over ranks is ``3W`` or ``4W`` (the last rank tops up):
    partial sums stay exact in bf16 and the average is an integer.
    """
    n = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    if op == "all_gather":
        v = (n * 7 + salt) % 13 + 16 * (rank + 1)
    else:
        def part(r):
            return (n * 7 + salt + r) % 3 + 1

        if rank < world - 1:
            v = part(rank)
        else:
            others = sum((part(r) for r in range(world - 1)), torch.zeros_like(n))
            v = world * (3 + n % 2) - others
    return v.to(dtype).to(device)


def symmetric_backend_names(op: str) -> list[str]:
    """``op``'s symmetric-memory backends in priority order: those its ``*_loopback``
    variant takes."""
    return [name for name, b in registry.get(op).dispatcher.backends.items()
            if isinstance(b, protocol.SymmetricBackend)]


def lower_bound(op: str, x: torch.Tensor, world: int) -> int:
    """all_gather: the W-1 peer shards, ``(W-1)|x|``; reduce_scatter: the W-1 peer partials
    of this rank's chunk, ``(W-1)|x|/W``."""
    if op == "all_gather":
        return (world - 1) * x.numel() * x.element_size()
    return (world - 1) * (x.numel() // world) * x.element_size()


@dataclass
class CollectiveCase(Case):
    op: str
    label: str
    input_shape: tuple
    dim: int
    reduce_op: str
    salt: int
    against_oracle_backend = True

    def shape(self) -> str:
        return str(tuple(self.input_shape))

    def inputs(self, dtype, world, device) -> list:
        return [(demo_input(self.op, self.input_shape, dtype, r, world, self.salt, device),)
                for r in range(world)]

    def call(self, args, group, backend):
        (x,) = args
        if self.op == "all_gather":
            return all_gather(x, self.dim, group, backend=backend)
        return reduce_scatter(x, self.reduce_op, self.dim, group, backend=backend)

    def availability_call(self, args, world, group):
        return CollectiveCall(self.op, args[0], self.dim, world, group, self.reduce_op)

    def expected(self, inputs, dtype) -> list:
        xs = [x for (x,) in inputs]
        world = len(xs)
        if self.op == "all_gather":
            return [torch.cat(xs, self.dim)] * world
        total = sum(x.double() for x in xs)
        if self.reduce_op == "avg":
            total = total / world
        return list(total.to(dtype).chunk(world, self.dim))

    def lower_bound(self, args, world) -> int:
        return lower_bound(self.op, args[0], world)

    def loopback_backends(self) -> list[str]:
        return symmetric_backend_names(self.op)

    def loopback(self, inputs, backend) -> list:
        xs = [x for (x,) in inputs]
        if self.op == "all_gather":
            return all_gather_loopback(xs, self.dim, backend=backend)
        return reduce_scatter_loopback(xs, self.reduce_op, self.dim, backend=backend)


def cases(world: int) -> list[CollectiveCase]:
    return [
        CollectiveCase("all_gather", "dim=0", (3, 5), 0, "", 0),
        CollectiveCase("all_gather", "dim=1", (3, 5), 1, "", 1),
        CollectiveCase("reduce_scatter", "sum", (3 * world, 5), 0, "sum", 2),
        CollectiveCase("reduce_scatter", "avg", (3 * world, 5), 0, "avg", 3),
    ]
