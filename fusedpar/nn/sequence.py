"""The sequence-parallel region's entry and exit, and the loss-parallel cross-entropy.

Plain-PyTorch equivalent (W = tensor-parallel size, r = this rank)::

    scatter_to_sp(x, dim, group)   == x.chunk(W, dim)[r]                 # backward: all-gather
    gather_from_sp(x, dim, group)  == torch.cat(all_gather(x), dim)      # backward: split
    vocab_parallel_cross_entropy(logits_shard, target, group)
        == F.cross_entropy(torch.cat(all_gather(logits_shard), -1).float(), target,
                           ignore_index=-100, reduction="none")

These are Megatron's ``scatter_to_sequence_parallel_region`` /
``gather_from_sequence_parallel_region`` (with the split adjoint: every rank of the region
holds the same loss, so the gradient of the gathered tensor is already complete on each
rank and is split, not summed — summing would multiply every gradient by W) and its
vocab-parallel cross-entropy (torchtitan's ``loss_parallel``): the full logits are never
gathered; three all-reduces of ``[tokens]`` vectors replace a gather of ``[tokens, V]``.
"""

from __future__ import annotations

import torch

from ..comm import group_name as _group_name
from ..comm import resolve_group
from ..ops import all_gather

__all__ = ["IGNORE_INDEX", "gather_from_sp", "scatter_to_sp", "vocab_parallel_cross_entropy"]

IGNORE_INDEX = -100


def _world_rank(name: str) -> tuple[int, int]:
    pg = resolve_group(name)
    return pg.size(), pg.rank()


def _split(x: torch.Tensor, dim: int, name: str) -> torch.Tensor:
    world, rank = _world_rank(name)
    if x.shape[dim] % world:
        raise ValueError(f"sequence parallelism: dim {dim} of shape {tuple(x.shape)} is not "
                         f"divisible by the tensor-parallel size {world}; pad the sequence to a "
                         f"multiple of {world}")
    return x.chunk(world, dim)[rank].contiguous()


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, name):
        ctx.dim, ctx.name = dim, name
        return _split(x, dim, name)

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():  # fusedpar.ops.all_gather's own adjoint is not wanted here
            return all_gather(grad.contiguous(), ctx.dim, ctx.name), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, name):
        ctx.dim, ctx.name = dim, name
        with torch.no_grad():
            return all_gather(x.contiguous(), dim, name)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.name), None, None


def scatter_to_sp(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Enter the sequence-parallel region: this rank's chunk of a replicated ``x`` along
    ``dim`` (``x.chunk(W, dim)[rank]``); the backward all-gathers the gradient."""
    return _ScatterToSP.apply(x, dim % x.dim(), _group_name(group))


def gather_from_sp(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Leave the sequence-parallel region: ``torch.cat(all_gather(x), dim)`` (through
    ``fusedpar.ops.all_gather``); the backward keeps this rank's chunk of the gradient."""
    return _GatherFromSP.apply(x, dim % x.dim(), _group_name(group))


def _all_reduce(x: torch.Tensor, op: str, name: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_reduce(x, op, name)
    return torch.ops._c10d_functional.wait_tensor(out)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, name, ignore_index):
        world, rank = _world_rank(name)
        vocab_local = logits.shape[-1]
        x = logits.float()
        global_max = _all_reduce(x.detach().amax(-1), "max", name)
        x = x - global_max.unsqueeze(-1)
        start = rank * vocab_local
        outside = (target < start) | (target >= start + vocab_local)
        local_target = torch.where(outside, 0, target - start)
        picked = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        picked = _all_reduce(torch.where(outside, 0.0, picked), "sum", name)
        exp = x.exp()
        sum_exp = _all_reduce(exp.sum(-1), "sum", name)
        valid = target != ignore_index
        loss = torch.where(valid, sum_exp.log() - picked, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, outside, valid = ctx.saved_tensors
        g = softmax  # saved for this one backward: update in place
        g.scatter_add_(-1, local_target.unsqueeze(-1), (outside.float() - 1).unsqueeze(-1))
        g.mul_((grad * valid).unsqueeze(-1))
        return g.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None, *,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token cross-entropy (fp32, ``0`` where ``target == ignore_index``) of logits
    split over the vocabulary: ``logits`` ``[..., V/W]`` is rank r's columns
    ``[r*V/W, (r+1)*V/W)``, ``target`` ``[...]`` holds global ids (the same on every rank).
    Every rank returns the same losses; the gradient of ``logits`` is this rank's columns
    of ``softmax - onehot``."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
                         f"{tuple(target.shape)} disagree (expected target = logits.shape[:-1])")
    return _VocabParallelCE.apply(logits, target, _group_name(group), ignore_index)
