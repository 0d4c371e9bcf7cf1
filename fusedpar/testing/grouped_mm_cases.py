"""``fusedpar check`` cases of grouped_mm (``torch._grouped_mm``'s contract, a local op):
each rank's small-integer rows (encoding the rank) in groups of odd sizes, an empty one
included, bit for bit against plain torch (every partial sum is exact in fp32, fp16, bf16)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.ops import grouped_mm
from fusedpar.ops.grouped_mm import GroupedCall

from .cases import Case

SIZES, K, N = (3, 0, 5, 2), 8, 6


@dataclass
class GroupedCase(Case):
    op: str = "grouped_mm"
    label: str = "groups of rows"

    def shape(self) -> str:
        return f"a {(sum(SIZES), K)}, b {(len(SIZES), K, N)}, groups {SIZES}"

    def inputs(self, dtype, world, device) -> list:
        rows = torch.arange(sum(SIZES) * K, dtype=torch.float64).view(-1, K)
        b = (torch.arange(len(SIZES) * K * N, dtype=torch.float64).view(len(SIZES), K, N) * 5) % 3 - 1
        offs = torch.tensor(SIZES, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        # |a| <= 3 + 4 and b in {-1, 0, 1}: |sums| <= 56, exact in every dtype
        return [(((rows * 7) % 4 + r).to(dtype).to(device), b.to(dtype).to(device), offs)
                for r in range(world)]

    def call(self, args, group, backend):
        return grouped_mm(*args, backend=backend)

    def availability_call(self, args, world, group):
        return GroupedCall(*args)

    def expected(self, inputs, dtype) -> list:
        out = []
        for a, b, offs in inputs:
            ends = offs.tolist()
            parts = [a[s:e].double() @ b[g].double() for g, (s, e) in enumerate(zip([0, *ends], ends))]
            out.append(torch.cat(parts).to(dtype))
        return out

    def lower_bound(self, args, world) -> int:
        return 0

    def how(self) -> str:
        return "grouped_mm: bit for bit against plain torch per group; a local op (nothing to move)"


def cases(world: int) -> list[Case]:
    return [GroupedCase()]
