"""``fusedpar check`` cases of scaled_grouped_mm (``torch._scaled_grouped_mm``'s contract, a
local op): grouped_mm's case in fp8 (small integers encoding the rank, exact in e4m3) with
power-of-2 row and column scales, so every output is exact in bf16 and fp32: bit for bit
against plain torch per group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.ops import scaled_grouped_mm
from fusedpar.ops.scaled_grouped_mm import ScaledCall

from .grouped_mm_cases import SIZES, GroupedCase

K, N = 16, 16  # _scaled_mm's multiples of 16


@dataclass
class ScaledGroupedCase(GroupedCase):
    op: str = "scaled_grouped_mm"
    label: str = "fp8 groups of rows, rowwise scales"
    dtypes: tuple = (torch.bfloat16, torch.float32)  # the output dtype

    def shape(self) -> str:
        return f"a {(sum(SIZES), K)} e4m3, b {(len(SIZES), K, N)} e4m3, groups {SIZES}"

    def inputs(self, dtype, world, device) -> list:
        rows = torch.arange(sum(SIZES) * K, dtype=torch.float32).view(-1, K)
        b = (torch.arange(len(SIZES) * K * N, dtype=torch.float32).view(len(SIZES), N, K) * 5) % 3 - 1
        offs = torch.tensor(SIZES, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        scale_a = torch.exp2(torch.arange(sum(SIZES)) % 3 - 1.0).to(device)
        scale_b = torch.exp2(torch.arange(len(SIZES) * N) % 2 * 1.0).view(len(SIZES), N).to(device)
        fp8 = torch.float8_e4m3fn
        # |a| <= 3 + 4, b in {-1, 0, 1}, K = 16: |sums| <= 112, times powers of 2: exact
        return [(((rows * 7) % 4 + r).to(fp8).to(device), b.to(fp8).to(device).transpose(1, 2),
                 scale_a, scale_b, offs, dtype) for r in range(world)]

    def call(self, args, group, backend):
        a, b, scale_a, scale_b, offs, dtype = args
        return scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=dtype, backend=backend)

    def availability_call(self, args, world, group):
        a, b, scale_a, scale_b, offs, dtype = args
        return ScaledCall(a, b, offs, None, dtype, scale_a, scale_b)

    def expected(self, inputs, dtype) -> list:
        out = []
        for a, b, scale_a, scale_b, offs, _ in inputs:
            ends = offs.tolist()
            a = a.double() * scale_a.double()[:, None]
            parts = [a[s:e] @ (b[g].double() * scale_b[g].double()) for g, (s, e)
                     in enumerate(zip([0, *ends], ends))]
            out.append(torch.cat(parts).to(dtype))
        return out

    def how(self) -> str:
        return ("scaled_grouped_mm: bit for bit against plain torch per group (fp8 data and "
                "scales exact); a local op (nothing to move)")


def cases(world: int) -> list[GroupedCase]:
    return [ScaledGroupedCase()]
