"""Mixture-of-experts modules.

- :class:`MoEBlock`: a single-process Mixtral-style MoE block (router + stacked SwiGLU
  experts), the block ``fusedpar.models`` uses.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.moe import experts_dense, topk_route


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
