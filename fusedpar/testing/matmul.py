"""``fusedpar check`` cases of all_gather_matmul and matmul_reduce_scatter, compared bit for
bit with a float64 plain-torch oracle on small-integer data.

The 3-D all_gather_matmul gathers the sequence dim of ``[batch, seq, hidden]`` for two Bs at
once (q/k projections sharing one gather).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusedpar.ops import (all_gather_matmul, all_gather_matmul_loopback, matmul_reduce_scatter,
                          matmul_reduce_scatter_loopback)
from fusedpar.ops.calls import MatmulCall

from .cases import Case


def demo_matmul_inputs(op: str, shape, ns, dtype, rank: int, world: int, salt: int, device):
    """Rank ``rank``'s ``(A, [B, ...])`` for a fused matmul op: small integers, exact in
    every dtype whatever the summation order.

    A: ``(7n + salt + rank) % 9 - 4`` in [-4, 4] (shifted by the rank: shards of ranks
    < 9 apart differ). Each B: entries in {-1, 0, 1} with ``c = max(1, 64 // W)`` nonzeros
    per column, the same on every rank for all_gather_matmul (the Bs are replicated) and
    rank-dependent for matmul_reduce_scatter (each rank owns a slice of K). Every partial
    sum is then an integer of magnitude at most ``4c`` (one rank) or ``4cW`` <= 256 (the
    reduction over ranks), so it is exact in bf16 (8 significant bits), fp16 and fp32, and
    an ``avg`` (sum / W) rounds once, the same way everywhere.
    """
    n = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    a = (n * 7 + salt + rank) % 9 - 4
    k = shape[-1]
    per_column = max(1, min(k, 64 // max(world, 1)))
    owner = rank if op == "matmul_reduce_scatter" else 0
    kk = torch.arange(k, dtype=torch.float64)[:, None]
    bs = []
    for j, cols in enumerate(ns):
        nn_ = torch.arange(cols, dtype=torch.float64)[None, :]
        nonzero = (kk + 5 * nn_ + 3 * owner + 7 * j + salt) % k < per_column
        sign = torch.where((kk + 2 * nn_ + owner + j) % 3 == 0, -1.0, 1.0)
        bs.append((nonzero * sign).to(dtype).to(device))
    return a.to(dtype).to(device), bs


def lower_bound(op: str, a: torch.Tensor, bs, world: int) -> int:
    """all_gather_matmul: the W-1 peer shards of A (however many Bs share the gather);
    matmul_reduce_scatter: the W-1 peer partials of this rank's output chunk."""
    if op == "all_gather_matmul":
        return (world - 1) * a.numel() * a.element_size()
    out_numel = a.numel() // a.shape[-1] * bs[0].shape[1] // world
    return (world - 1) * out_numel * a.element_size()


def oracle(op: str, dim: int, reduce_op: str, inputs, dtype) -> list:
    """Each rank's expected result from every rank's ``(A, Bs)``, in float64 plain torch
    rounded once to ``dtype`` (exact: see :func:`demo_matmul_inputs`). all_gather_matmul:
    ``(A_gathered, [A_gathered @ B, ...])``; matmul_reduce_scatter: the output chunk."""
    world = len(inputs)
    if op == "all_gather_matmul":
        gathered = torch.cat([a.double() for a, _ in inputs], dim)
        outs = [(gathered @ b.double()).to(dtype) for b in inputs[0][1]]
        return [(gathered.to(dtype), outs)] * world
    total = sum(a.double() @ bs[0].double() for a, bs in inputs)
    if reduce_op == "avg":
        total = total / world
    return list(total.to(dtype).chunk(world, dim))


@dataclass
class MatmulCase(Case):
    op: str
    label: str
    a_shape: tuple
    dim: int
    ns: tuple  # N of each B
    reduce_op: str
    salt: int

    def shape(self) -> str:
        """``(2, 3, 40) @ 40x24, 40x8``: A (or A_shard) and every B."""
        return (f"{tuple(self.a_shape)} @ "
                + ", ".join(f"{self.a_shape[-1]}x{n}" for n in self.ns))

    def inputs(self, dtype, world, device) -> list:
        return [demo_matmul_inputs(self.op, self.a_shape, self.ns, dtype, r, world, self.salt,
                                   device) for r in range(world)]

    def call(self, args, group, backend):
        """all_gather_matmul: ``(A_gathered, [outs])``; matmul_reduce_scatter: the output."""
        a, bs = args
        if self.op == "all_gather_matmul":
            return all_gather_matmul(a, bs, self.dim, group, return_A=True, backend=backend)
        return matmul_reduce_scatter(a, bs[0], self.reduce_op, self.dim, group, backend=backend)

    def availability_call(self, args, world, group):
        a, bs = args
        return MatmulCall(self.op, a, self.dim, world, group, bs, return_a=True,
                          reduce_op=self.reduce_op)

    def expected(self, inputs, dtype) -> list:
        return oracle(self.op, self.dim, self.reduce_op, inputs, dtype)

    def lower_bound(self, args, world) -> int:
        return lower_bound(self.op, *args, world)

    def loopback_backends(self) -> list[str]:
        return ["triton"]  # the fused matmul ops' loopback variants run their triton kernels

    def loopback(self, inputs, backend) -> list:
        a_shards = [a for a, _ in inputs]
        if self.op == "all_gather_matmul":
            return all_gather_matmul_loopback(a_shards, inputs[0][1], self.dim, return_A=True)
        return matmul_reduce_scatter_loopback(a_shards, [bs[0] for _, bs in inputs],
                                              self.reduce_op, self.dim)


def cases(world: int) -> list[MatmulCase]:
    return [
        MatmulCase("all_gather_matmul", "dim=1", (2, 3, 40), 1, (24, 8), "", 0),
        MatmulCase("all_gather_matmul", "dim=0", (5, 40), 0, (24,), "", 1),
        MatmulCase("matmul_reduce_scatter", "sum", (3 * world, 40), 0, (24,), "sum", 2),
        MatmulCase("matmul_reduce_scatter", "avg", (3 * world, 40), 0, (24,), "avg", 3),
    ]
