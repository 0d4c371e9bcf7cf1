"""The expert-parallel SwiGLU expert MLP (``moe_experts``): dispatch -> grouped GEMM ->
SwiGLU -> grouped GEMM -> combine."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import resolve_group
from ..errors import BackendNotSupportedError
from .grouped_mm import grouped_mm
from .moe import moe_combine, moe_dispatch, swiglu


def check_expert_weights(op: str, x, w13, w2) -> None:
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fusedpar.{op}: w13 must be [E_local, 2I, H] and w2 [E_local, H, I], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"fusedpar.{op}: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 "
                         f"{tuple(w2.shape)} do not fit: need w13 [E_local, 2I, H={x.shape[1]}] and "
                         "w2 [E_local, H, I]")


def moe_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, group=None, *, backend: str | None = None):
    """The expert-parallel SwiGLU expert MLP; with every rank's tokens and experts in one
    process it is ``experts_dense(x, topk_idx, topk_weights, cat(w13s), cat(w2s))``. Here::

        recv_x, tokens_per_expert, handle = moe_dispatch(x, topk_idx, topk_weights, E, group)
        offs = tokens_per_expert.cumsum(0).int()
        h = swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs))
        return moe_combine(grouped_mm(h, w2.transpose(1, 2), offs), handle)

    ``w13 [E_local, 2I, H]`` / ``w2 [E_local, H, I]``: this rank's experts (global expert
    ``rank * E_local + e``). Gradients for x, w13, w2 and topk_weights.
    Backend: ``reference`` (the unfused ops above).
    """
    group = resolve_group(group)
    check_expert_weights("moe_experts", x, w13, w2)
    if backend not in (None, "", "reference"):
        raise BackendNotSupportedError(f"fusedpar.moe_experts: backend={backend!r}; only "
                                       "'reference' exists")
    num_experts = w13.shape[0] * dist.get_world_size(group)
    recv_x, tokens_per_expert, handle = moe_dispatch(x, topk_idx, topk_weights, num_experts, group)
    offs = tokens_per_expert.cumsum(0).to(torch.int32)
    h = swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs))
    return moe_combine(grouped_mm(h, w2.transpose(1, 2), offs), handle)
