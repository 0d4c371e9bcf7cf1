"""Mixture-of-experts ops: routing (``topk_route``), the single-process expert loop
(``experts_dense``), and the expert-parallel token exchange (``moe_dispatch`` /
``moe_combine``) with the expert MLP built on it (``moe_experts``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DROP_POLICIES = ("probs", "position")


# ---- routing ------------------------------------------------------------------------------


def topk_route(logits: torch.Tensor, k: int, *, renormalize: bool = True,
               capacity_factor: float | None = None, drop_policy: str = "probs"):
    """Top-k routing with Mixtral semantics and a Switch-style load-balancing loss::

        probs = logits.float().softmax(-1)                    # [T, E]
        topk_weights, topk_idx = probs.topk(k, dim=-1)        # [T, k]
        if renormalize:
            topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
        f = one_hot(topk_idx, E).sum((0, 1)) / T              # copies routed to e per token
        aux_loss = E * (f * probs.mean(0)).sum()              # = k when perfectly balanced

    (the aux loss is Hugging Face's ``load_balancing_loss_func`` for one layer; only its
    ``probs`` factor carries gradient). Returns ``(topk_idx int64, topk_weights fp32, aux_loss)``.

    Dropless by default. With ``capacity_factor`` each expert keeps at most
    ``ceil(capacity_factor * T * k / E)`` of this call's token copies; the rest are dropped:
    their ``topk_idx`` is ``-1`` and their weight 0 (dispatch skips them, so a dropped copy
    contributes nothing to the output). ``drop_policy="probs"`` keeps an expert's copies with
    the highest router probability, ``"position"`` the earliest tokens. The aux loss counts
    the copies as routed, before dropping.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("fusedpar.topk_route: logits must be a [tokens, experts] tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    tokens, experts = logits.shape
    if not 1 <= k <= experts:
        raise ValueError(f"fusedpar.topk_route: k={k} must be between 1 and the number of "
                         f"experts {experts}")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"fusedpar.topk_route: drop_policy={drop_policy!r}; choose one of "
                         f"{DROP_POLICIES}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"fusedpar.topk_route: capacity_factor={capacity_factor} must be > 0 "
                         "(or None for dropless routing)")
    probs = logits.float().softmax(dim=-1)
    topk_weights, topk_idx = probs.topk(k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    counts = torch.bincount(topk_idx.reshape(-1), minlength=experts).to(probs.dtype)
    aux_loss = experts * (counts / max(tokens, 1) * probs.mean(dim=0)).sum() if tokens else \
        probs.sum() * 0.0
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * tokens * k / experts)
        keep = _within_capacity(topk_idx, topk_weights.detach(), experts, capacity, drop_policy)
        topk_idx = torch.where(keep, topk_idx, -1)
        topk_weights = torch.where(keep, topk_weights, 0.0)
    return topk_idx, topk_weights, aux_loss


def _within_capacity(topk_idx, weights, experts, capacity, policy) -> torch.Tensor:
    """Which copies each expert keeps: its first ``capacity`` by priority (bool [T, k])."""
    flat = topk_idx.reshape(-1)
    n = flat.numel()
    position = torch.arange(n, device=flat.device)
    if policy == "probs":  # highest probability first, ties by position
        order = torch.argsort(-weights.reshape(-1), stable=True)
    else:
        order = position
    # stable sort by expert keeps the priority order within each expert
    order = order[torch.argsort(flat[order], stable=True)]
    sorted_experts = flat[order]
    starts = torch.searchsorted(sorted_experts, torch.arange(experts, device=flat.device))
    rank_in_expert = position - starts[sorted_experts]
    keep = torch.empty(n, dtype=torch.bool, device=flat.device)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(topk_idx)


# ---- the single-process expert MLP ----------------------------------------------------------


def swiglu(h13: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[.., 2I]`` tensor whose first half is the gate (w1) and
    second half the up projection (w3), as Hugging Face's ``gate_up_proj`` stores them."""
    gate, up = h13.chunk(2, dim=-1)
    return F.silu(gate) * up


def experts_dense(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The expert MLP as a plain loop over experts (Hugging Face ``MixtralExperts``)::

        y = zeros_like(x)
        for e in range(E):
            token, slot = where(topk_idx == e)
            out = swiglu(x[token] @ w13[e].T) @ w2[e].T
            y.index_add_(0, token, (out * topk_weights[token, slot, None]).to(x.dtype))

    ``x [T, H]``, ``topk_idx [T, k]`` (``-1`` = dropped), ``w13 [E, 2I, H]``, ``w2 [E, H, I]``.
    The oracle of ``moe_experts`` and the forward of ``fusedpar.nn.MoEBlock``.
    """
    y = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_idx == e)
        if token.numel() == 0:
            continue
        out = swiglu(x[token] @ w13[e].t()) @ w2[e].t()
        y = y.index_add(0, token, (out * topk_weights[token, slot, None]).to(x.dtype))
    return y
