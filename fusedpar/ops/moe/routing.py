"""Top-k routing (``topk_route``): which experts each token goes to, with what weight, and
the Switch load-balancing loss; ``expert_counts``, the copies routed to each expert."""

from __future__ import annotations

import math

import torch

DROP_POLICIES = ("probs", "position")


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
    ``probs`` factor carries gradient). Returns ``(topk_idx int64, topk_weights fp32 (fp64
    for fp64 logits), aux_loss)``.

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
    probs = (logits if logits.dtype == torch.float64 else logits.float()).softmax(dim=-1)
    topk_weights, topk_idx = probs.topk(k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    counts = expert_counts(topk_idx, experts, probs.dtype)
    aux_loss = experts * (counts / max(tokens, 1) * probs.mean(dim=0)).sum() if tokens else \
        probs.sum() * 0.0
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * tokens * k / experts)
        keep = _within_capacity(topk_idx, topk_weights.detach(), experts, capacity, drop_policy)
        topk_idx = torch.where(keep, topk_idx, -1)
        topk_weights = torch.where(keep, topk_weights, 0.0)
    return topk_idx, topk_weights, aux_loss


def expert_counts(topk_idx: torch.Tensor, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Copies routed to each expert (``-1``, dropped, counts nowhere): ``bincount`` without
    its host read of the largest id (a CUDA graph could not capture that)."""
    flat = topk_idx.reshape(-1)
    kept = (flat >= 0) & (flat < experts)  # an id out of range counts nowhere (callers flag it)
    ones = kept.to(dtype)
    return ones.new_zeros(experts).index_add_(0, torch.where(kept, flat, 0), ones)


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


def rows_sent(topk_idx: torch.Tensor, experts_per_rank: int, world: int) -> torch.Tensor:
    """``[2, world]``: the rows a rank routing its tokens to ``topk_idx`` (ids of the ep
    group's experts, rank r holding ``experts_per_rank`` of them from ``r *
    experts_per_rank``) sends each rank (itself too): one per token and rank holding one
    of its experts; one per routed copy."""
    owner = (topk_idx // experts_per_rank).cpu().long()
    held = torch.nn.functional.one_hot(owner, world).amax(1)  # [T, ranks]
    return torch.stack([held.sum(0), torch.bincount(owner.flatten(), minlength=world)])


def rows_received(sent: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From every rank's :func:`rows_sent` (``[src, 2, dst]``): the rows ``rank`` receives
    in one exchange, into its experts and back to its tokens (each ``[per token and rank,
    per copy]``)."""
    others = torch.arange(sent.shape[0]) != rank
    return sent[others, :, rank].sum(0), sent[rank][:, others].sum(1)
