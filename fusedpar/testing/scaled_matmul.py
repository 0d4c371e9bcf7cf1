"""``fusedpar check`` cases of all_gather_scaled_matmul and scaled_matmul_reduce_scatter: the
fused matmul cases' small-integer data (:func:`fusedpar.testing.matmul.demo_matmul_inputs`,
exact in fp8) in e4m3, with power-of-2 scales of every layout (rank-encoded where a scale
belongs to a rank), so every product is exact and compared bit for bit with float64 plain
torch rounded once to the output dtype (the case's dtype)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusedpar.ops import (all_gather_scaled_matmul, all_gather_scaled_matmul_loopback, scaled_matmul_reduce_scatter,
                          scaled_matmul_reduce_scatter_loopback)
from fusedpar.ops.scaled_matmul import (AG, ROWWISE, ROWWISE_GATHERED, ROWWISE_SHARD, RS, TENSORWISE,
                                        ScaledCall)

from .cases import Case
from .matmul import demo_matmul_inputs

FP8 = torch.float8_e4m3fn


def pow2_scale(shape, rank: int, salt: int, device) -> torch.Tensor:
    """float32 powers of two in {1/2, 1, 2} that vary along the first non-1 dim and with the rank."""
    n = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    return torch.exp2((n + rank + salt) % 3 - 1).float().to(device)


def scaled_inputs(op: str, a_shape, ns, a_mode: str, dim: int, rank: int, world: int, salt: int,
                  device, fp8=FP8):
    """Rank ``rank``'s ``(A, Bs, A_scale, B_scales)``: the integer data in ``fp8``, A's scale
    in ``a_mode`` (a gathered A's rows: the same on every rank), B scales tensorwise for the
    first B and per column for the others."""
    a, bs = demo_matmul_inputs(op, a_shape, ns, torch.float64, rank, world, salt, "cpu")
    rows = tuple(a_shape[:-1])
    if a_mode == TENSORWISE:
        a_scale = torch.full((), 0.5 if op == AG else 2.0 ** (rank % 2), dtype=torch.float32)
    elif a_mode == ROWWISE_GATHERED:
        gathered = list(rows)
        gathered[dim] *= world
        a_scale = pow2_scale(tuple(gathered) + (1,), 0, salt, "cpu")
    else:
        a_scale = pow2_scale(rows + (1,), rank, salt, "cpu")
    b_scales = [torch.full((), 0.25, dtype=torch.float32) if j == 0 else
                pow2_scale((1, n), rank if op == RS else 0, salt + j, "cpu") for j, n in enumerate(ns)]
    return (a.to(fp8).to(device), [b.to(fp8).to(device) for b in bs], a_scale.to(device),
            [s.to(device) for s in b_scales])


def oracle(op: str, dim: int, a_mode: str, reduce_op: str, inputs, dtype) -> list:
    """Each rank's expected result from every rank's inputs, in float64 rounded once to ``dtype``."""
    world = len(inputs)
    if op == AG:
        gathered = torch.cat([a.double() for a, *_ in inputs], dim)
        if a_mode == ROWWISE_SHARD:
            s = torch.cat([sc.double() for _, _, sc, *_ in inputs], dim)
        else:  # the same on every rank
            s = inputs[0][2].double()
        outs = [((gathered * s) @ (b.double() * bs_)).to(dtype)
                for b, bs_ in zip(inputs[0][1], inputs[0][3])]
        return [(gathered.to(inputs[0][0].dtype), outs)] * world
    total = sum((a.double() * sa.double()) @ (bs[0].double() * sbs[0].double())
                for a, bs, sa, sbs, *_ in inputs)
    if reduce_op == "avg":
        total = total / world
    return list(total.to(dtype).chunk(world, dim))


@dataclass
class ScaledCase(Case):
    op: str
    label: str
    a_shape: tuple
    dim: int
    ns: tuple
    a_mode: str
    reduce_op: str
    salt: int

    def shape(self) -> str:
        return f"{tuple(self.a_shape)} @ " + ", ".join(f"{self.a_shape[-1]}x{n}" for n in self.ns)

    def inputs(self, dtype, world, device) -> list:
        """Every rank's ``(A, Bs, A_scale, B_scales, out dtype)``: the case's dtype is the
        outputs' (the operands are e4m3)."""
        return [(*scaled_inputs(self.op, self.a_shape, self.ns, self.a_mode, self.dim, r, world,
                                self.salt, device), dtype) for r in range(world)]

    def call(self, args, group, backend):
        a, bs, a_scale, b_scales, dtype = args
        if self.op == AG:
            return all_gather_scaled_matmul(a, bs, a_scale, b_scales, self.dim, group,
                                            out_dtypes=[dtype] * len(bs), backend=backend)
        return scaled_matmul_reduce_scatter(a, bs[0], a_scale, b_scales[0], self.reduce_op, self.dim,
                                            group, out_dtype=dtype, backend=backend)

    def availability_call(self, args, world, group):
        a, bs, a_scale, b_scales, dtype = args
        return ScaledCall(self.op, a, self.dim, world, group, bs, a_scale, b_scales,
                          [dtype] * len(bs), reduce_op=self.reduce_op, a_mode=self.a_mode)

    def expected(self, inputs, dtype) -> list:
        return oracle(self.op, self.dim, self.a_mode, self.reduce_op, inputs, dtype)

    def lower_bound(self, args, world) -> int:
        return lower_bound(self.op, self.a_mode, args, world)

    def loopback_backends(self) -> list[str]:
        return ["triton"]

    def loopback(self, inputs, backend) -> list:
        a, bs, a_scale, b_scales, dtype = (list(x) for x in zip(*inputs))
        if self.op == AG:
            return all_gather_scaled_matmul_loopback(a, bs[0], a_scale, b_scales[0], self.dim,
                                                     out_dtypes=[dtype[0]] * len(bs[0]))
        return scaled_matmul_reduce_scatter_loopback(a, [b[0] for b in bs], a_scale, [s[0] for s in b_scales],
                                                     self.reduce_op, self.dim, out_dtype=dtype[0])


def lower_bound(op: str, a_mode: str, args, world: int) -> int:
    """all_gather_scaled_matmul: the W-1 peer shards' fp8 bytes, plus their row scales
    (float32) when the scale is the shard's; scaled_matmul_reduce_scatter: the W-1 peer
    float32 partials of this rank's output chunk."""
    a, bs, a_scale, *_ = args
    if op == AG:
        return (world - 1) * (a.numel() * a.element_size()
                              + (a_scale.numel() * 4 if a_mode == ROWWISE_SHARD else 0))
    return (world - 1) * (a.numel() // a.shape[-1]) * bs[0].shape[1] // world * 4


def cases(world: int) -> list[ScaledCase]:
    return [
        ScaledCase(AG, "dim=0 tensorwise", (5, 32), 0, (16,), TENSORWISE, "", 0),
        ScaledCase(AG, "dim=1 rowwise shard", (2, 3, 32), 1, (16, 8), ROWWISE_SHARD, "", 1),
        ScaledCase(AG, "dim=0 rowwise gathered", (3, 32), 0, (16,), ROWWISE_GATHERED, "", 2),
        ScaledCase(RS, "sum tensorwise", (3 * world, 32), 0, (16,), TENSORWISE, "sum", 3),
        ScaledCase(RS, "avg rowwise", (3 * world, 32), 0, (16,), ROWWISE, "avg", 4),
    ]
