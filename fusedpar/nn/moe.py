"""Mixture-of-experts modules.

- :class:`MoEBlock`: a single-process Mixtral-style MoE block (router + stacked SwiGLU
  experts), the block ``fusedpar.models`` uses.
- :class:`ExpertParallelMoE`: the same block with its experts split over an ep group
  (``fusedpar.ops.moe_experts``), with ``.from_module(block, group)`` for a MoEBlock or a
  Hugging Face ``MixtralSparseMoeBlock``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm import resolve_group
from ..ops.moe import experts_dense, topk_route
from ..ops.moe_experts import moe_experts


class MoEBlock(nn.Module):
    """Router + ``num_experts`` SwiGLU experts stored stacked, all on this process::

        logits = router(x)                                   # nn.Linear(H, E, bias=False)
        topk_idx, topk_weights, aux_loss = fusedpar.ops.topk_route(logits, top_k)
        y = sum over each token's k experts e of
                topk_weight * (silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)) @ w2[e].T

    ``w13 [E, 2I, H]``: rows ``[:I]`` the gate (w1), ``[I:]`` the up projection (w3), as
    Hugging Face's ``gate_up_proj``; ``w2 [E, H, I]`` (``down_proj``).
    ``forward(x [..., H]) -> (y [..., H], aux_loss)``; ``aux_loss`` is the unscaled
    load-balancing loss (the model multiplies it by its coefficient).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int = 2,
                 *, renormalize: bool = True, device=None, dtype=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoEBlock: top_k={top_k} must be between 1 and num_experts={num_experts}")
        factory = dict(device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        # nn.Linear's default init, per expert (fan-in = the last dim)
        for w in (self.w13, self.w2):
            bound = 1 / w.shape[-1] ** 0.5
            nn.init.uniform_(w, -bound, bound)

    def forward(self, x: torch.Tensor):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoEBlock: x has hidden size {x.shape[-1]}, the block {self.hidden_size}")
        flat = x.reshape(-1, self.hidden_size)
        topk_idx, topk_weights, aux_loss = topk_route(self.router(flat), self.top_k,
                                                      renormalize=self.renormalize)
        y = experts_dense(flat, topk_idx, topk_weights, self.w13, self.w2)
        return y.view(x.shape), aux_loss

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}")


class ExpertParallelMoE(nn.Module):
    """A :class:`MoEBlock` whose experts live on the ranks of an ep group; the same as
    ``MoEBlock.forward`` over every rank's tokens, with this rank's share of the output::

        topk_idx, topk_weights, aux_loss = topk_route(router(x), top_k)   # this rank's tokens
        y = moe_experts(x, topk_idx, topk_weights, w13, w2, group)

    ``w13 [E_local, 2I, H]`` (rows ``[:I]`` gate, ``[I:]`` up), ``w2 [E_local, H, I]``: global
    expert ``e`` lives on rank ``e // E_local``. The router is replicated: its gradient is
    this rank's tokens' share (sum it over the group, as data parallelism does).
    ``forward(x [..., H]) -> (y, aux_loss)`` with ``aux_loss`` over this rank's tokens.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int = 2,
                 group=None, *, renormalize: bool = True, device=None, dtype=None):
        super().__init__()
        pg = resolve_group(group)
        world = dist.get_world_size(pg)
        if num_experts % world:
            raise ValueError(f"ExpertParallelMoE: num_experts={num_experts} is not divisible by the "
                             f"ep group size {world}; pick an ep size that divides it")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"ExpertParallelMoE: top_k={top_k} must be between 1 and "
                             f"num_experts={num_experts}")
        factory = dict(device=device, dtype=dtype)
        self.group_name = pg.group_name
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.num_local_experts = num_experts // world
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate_size,
                                            hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, intermediate_size,
                                           **factory))
        MoEBlock.reset_parameters(self)

    @classmethod
    def from_module(cls, block: nn.Module, group=None) -> "ExpertParallelMoE":
        """This rank's share of ``block``: a :class:`MoEBlock`, or a Hugging Face
        ``MixtralSparseMoeBlock`` (transformers 5: ``gate.weight [E, H]``,
        ``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``, SiLU; found by
        structure). Copies the router and this rank's experts; outputs stay the same."""
        router, w13, w2, top_k = _moe_weights(block)
        num_experts, two_i, hidden = w13.shape
        pg = resolve_group(group)
        out = cls(hidden, two_i // 2, num_experts, top_k, pg,
                  renormalize=getattr(block, "renormalize", True), device=w13.device, dtype=w13.dtype)
        rank, local = dist.get_rank(pg), out.num_local_experts
        with torch.no_grad():
            out.router.weight.copy_(router)
            out.w13.copy_(w13[rank * local:(rank + 1) * local])
            out.w2.copy_(w2[rank * local:(rank + 1) * local])
        return out

    def forward(self, x: torch.Tensor):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"ExpertParallelMoE: x has hidden size {x.shape[-1]}, the block "
                             f"{self.hidden_size}")
        flat = x.reshape(-1, self.hidden_size)
        topk_idx, topk_weights, aux_loss = topk_route(self.router(flat), self.top_k,
                                                      renormalize=self.renormalize)
        y = moe_experts(flat, topk_idx, topk_weights, self.w13, self.w2, self.group_name)
        return y.view(x.shape), aux_loss

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts} ({self.num_local_experts} here), "
                f"top_k={self.top_k}, group={self.group_name!r}")


def _moe_weights(block: nn.Module):
    """``(router weight [E, H], w13 [E, 2I, H], w2 [E, H, I], top_k)`` of a supported block."""
    if isinstance(block, (MoEBlock, ExpertParallelMoE)):
        if isinstance(block, ExpertParallelMoE):
            raise TypeError("ExpertParallelMoE.from_module: the block is already expert-parallel")
        return block.router.weight, block.w13, block.w2, block.top_k
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    w13, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    router = getattr(gate, "weight", None)
    if not all(isinstance(t, torch.Tensor) for t in (router, w13, w2)) or w13.dim() != 3:
        raise TypeError(f"ExpertParallelMoE.from_module: {type(block).__name__} is neither a "
                        "fusedpar MoEBlock nor a Mixtral-style block with gate.weight [E, H] and "
                        "stacked experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I]")
    act = getattr(experts, "act_fn", None)
    if act is not None and not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"ExpertParallelMoE.from_module: experts use {type(act).__name__}; only "
                         "SwiGLU (SiLU gate) experts are supported")
    num_experts, two_i, hidden = w13.shape
    if tuple(router.shape) != (num_experts, hidden) or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"ExpertParallelMoE.from_module: gate.weight {tuple(router.shape)}, "
                         f"gate_up_proj {tuple(w13.shape)} and down_proj {tuple(w2.shape)} do not "
                         "fit one hidden size and expert count")
    top_k = getattr(block, "top_k", None) or getattr(gate, "top_k", None)
    if top_k is None:
        raise TypeError("ExpertParallelMoE.from_module: the block has no top_k attribute")
    return router, w13, w2, int(top_k)
