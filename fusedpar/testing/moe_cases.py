"""``fusedpar check`` cases of the MoE ops over the whole group: moe_dispatch and
moe_combine bit for bit against plain torch as their docstrings define them (small-integer
rows that encode the rank and token, each token routed to two experts, several on one rank),
and moe_experts (dispatch, SwiGLU experts, combine) forward and backward within ``ATOL`` of
float64 plain torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.ops.moe import moe_combine, moe_dispatch, moe_experts
from fusedpar.ops.moe.dispatch import RoutingCall
from fusedpar.ops.moe.experts_call import ExpertsCall

from .cases import Case
from .parallel import EP_EXPERTS, EP_HIDDEN, EP_TOKENS, EP_TOPK, ep_case

EXPERTS, TOKENS, HIDDEN, TOP_K = 8, 5, 6, 2
ATOL = 5e-5  # fp32 sums of every rank's tokens against float64: 1.7e-5 measured at W=4


def _routing(rank: int, world: int, dtype, device):
    """Rank ``rank``'s tokens (``(7n) % 3 + 2 (rank + 1)``: at most 10), two distinct experts
    each, the weights 0.5 / 0.5 (exact sums in every dtype)."""
    n = torch.arange(TOKENS * HIDDEN, dtype=torch.float64).view(TOKENS, HIDDEN)
    x = ((n * 7) % 3 + 2 * (rank + 1)).to(dtype).to(device)
    gen = torch.Generator().manual_seed(50 + rank)
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    return x, idx.to(device), torch.full((TOKENS, TOP_K), 0.5, device=device)


def _copies(inputs, rank: int, world: int) -> list[tuple[int, int, int, int]]:
    """``(local expert, source rank, token, slot)`` of every copy that lands on ``rank``,
    in moe_dispatch's order."""
    local = EXPERTS // world
    return sorted((int(e) % local, s, t, j) for s, (_, idx, _) in enumerate(inputs)
                  for t in range(TOKENS) for j, e in enumerate(idx[t].tolist()) if e // local == rank)


def _row_bound(inputs, rank: int, world: int, element: int, back: bool) -> int:
    """One row per (token, other rank holding one of its experts): the rows ``rank``
    receives in dispatch (``back=False``) or gets back in combine."""
    local = EXPERTS // world
    pairs = {(s, t, int(e) // local) for s, (_, idx, _) in enumerate(inputs) for t in range(TOKENS)
             for e in idx[t].tolist()}
    mine = {p for p in pairs if p[2] != p[0] and (p[0] == rank if back else p[2] == rank)}
    return len(mine) * HIDDEN * element


@dataclass
class DispatchCase(Case):
    op: str = "moe_dispatch"
    label: str = f"{EXPERTS} experts, top-{TOP_K}"
    back = False  # the lower bound of the rows coming back (combine)

    def shape(self) -> str:
        return str((TOKENS, HIDDEN))

    def inputs(self, dtype, world, device) -> list:
        return [_routing(r, world, dtype, device) for r in range(world)]

    def call(self, args, group, backend):
        recv_x, per_expert, _ = moe_dispatch(*args, EXPERTS, group, backend=backend)
        return recv_x, per_expert

    def availability_call(self, args, world, group):
        return RoutingCall(*args, EXPERTS, group, world)

    def expected(self, inputs, dtype) -> list:
        world, out = len(inputs), []
        for r in range(world):
            copies = _copies(inputs, r, world)
            rows = [inputs[s][0][t] for _, s, t, _ in copies]
            recv = torch.stack(rows) if rows else inputs[r][0][:0]
            counts = torch.bincount(torch.tensor([e for e, *_ in copies], dtype=torch.long),
                                    minlength=EXPERTS // world)
            out.append((recv, counts.to(torch.int32).to(inputs[r][0].device)))
        return out

    def lower_bound(self, args, world) -> int:
        import torch.distributed as dist

        inputs = self.inputs(args[0].dtype, world, args[0].device)
        return _row_bound(inputs, dist.get_rank(), world, args[0].element_size(), self.back)

    def how(self) -> str:
        return ("moe_dispatch / moe_combine: bit for bit against their docstrings' plain torch; "
                "lower bound a row per token and other rank holding one of its experts")


@dataclass
class CombineCase(DispatchCase):
    """The dispatch's rows times ``2 (1 + their expert)``, sent back and summed per token."""

    back = True

    def title(self) -> str:
        return "moe_combine"

    def call(self, args, group, backend):
        recv_x, per_expert, handle = moe_dispatch(*args, EXPERTS, group, backend=backend)
        return moe_combine(recv_x * self._factors(per_expert, group).to(recv_x.dtype), handle)

    @staticmethod
    def _factors(per_expert, group):
        import torch.distributed as dist

        local = per_expert.numel()
        experts = dist.get_rank(group) * local + torch.arange(local, device=per_expert.device)
        return (2 * (1 + experts)).repeat_interleave(per_expert.long()).unsqueeze(1)

    def expected(self, inputs, dtype) -> list:
        return [(x.double() * (2 * (1 + idx.double()) * w.double()).sum(1, keepdim=True)).to(dtype)
                for x, idx, w in inputs]


@dataclass
class ExpertsCase(Case):
    """``ep_case``'s tokens and experts over the whole group, each rank its share of the experts."""

    op: str = "moe_experts"
    label: str = f"{EP_EXPERTS} experts, top-{EP_TOPK}"
    dtypes = (torch.float32,)
    atol = ATOL

    def shape(self) -> str:
        return str((EP_TOKENS, EP_HIDDEN))

    def inputs(self, dtype, world, device) -> list:
        return [ep_case(r, world, device) for r in range(world)]

    def call(self, args, group, backend):
        (x, weights, w13, w2, g), idx, _, _ = args
        leaves = [t.clone().requires_grad_() for t in (x, weights, w13, w2)]
        y = moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], group, backend=backend)
        (y * g).sum().backward()
        return dict(zip(("output", "input grad", "topk_weights grad", "grad of w13", "grad of w2"),
                        [y.detach()] + [t.grad for t in leaves]))

    def availability_call(self, args, world, group):
        (x, weights, w13, w2, _), idx, _, _ = args
        return ExpertsCall(x, idx, weights, w13, w2, group)

    def expected(self, inputs, dtype) -> list:
        return [dict(zip(("output", "input grad", "topk_weights grad", "grad of w13", "grad of w2"),
                         args[2])) for args in inputs]

    def lower_bound(self, args, world) -> int:
        (x, *_), _, _, ((rows_in, _), (rows_out, _)) = args
        return 2 * (rows_in + rows_out) * EP_HIDDEN * x.element_size()

    def how(self) -> str:
        return (f"moe_experts: max |error| <= {ATOL:g} over the output and the x, topk_weights, "
                "w13 and w2 grads against float64 plain torch; lower bound a row per token and "
                "other rank holding one of its experts, in and back, forward and backward")


def cases(world: int) -> list[Case]:
    return [DispatchCase(), CombineCase(), ExpertsCase()]
