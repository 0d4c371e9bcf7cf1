"""The forward of a parallelized causal LM (the decoder of ``decoder.py`` as the model's
adapter describes it) and the mean token loss over the valid labels of the whole global batch.

Plain-PyTorch equivalent of the parallelized forward on one process::

    hidden = decoder_forward(model, input_ids, position_ids)[0]  # embed -> layers -> norm
    logits = model.lm_head(hidden)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), shift_labels(labels).flatten(),
                           ignore_index=-100)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .adapters import ModelAdapter, find_adapter, is_hf
from .decoder import IGNORE_INDEX, CausalLMOutput, run_decoder, shift_labels, valid_labels

__all__ = ["decoder_forward", "mean_loss"]

def decoder_forward(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                    attention_masks: list | None = None, adapter: ModelAdapter | None = None):
    """:func:`~fusedpar.parallel.decoder.run_decoder` with ``model``'s adapter (default:
    found by :func:`~fusedpar.parallel.adapters.find_adapter`)."""
    return run_decoder(find_adapter(model) if adapter is None else adapter, model, input_ids,
                       position_ids, attention_masks)


def mean_loss(per_token: torch.Tensor, target: torch.Tensor, group: str | None, ranks: int):
    """The mean over the valid tokens of the whole global batch, as one process computes it,
    whatever each rank's share of ignored labels. ``group``: the ranks holding other tokens
    (``dp_cp``, ``ranks`` of them; None when one), over which the sum and count are
    all-reduced; each rank's gradient is scaled by ``ranks``, because FSDP averages the
    gradients over them while the true gradient is their sum."""
    total, count = per_token.sum(), valid_labels(target)
    if group is None:
        return total / count
    both = torch.stack([total.detach(), count.to(total.dtype)])
    both = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(both, "sum", group))
    scaled = total * ranks / both[1]
    return both[0] / both[1] + (scaled - scaled.detach())


def token_losses(logits: torch.Tensor, target: torch.Tensor, tp_group: str | None) -> torch.Tensor:
    """Each position's cross-entropy (0 where ignored), over a tp vocabulary shard when
    ``tp_group`` is set."""
    from ..nn.sequence import vocab_parallel_cross_entropy

    if tp_group is not None:
        return vocab_parallel_cross_entropy(logits, target, tp_group)
    return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="none")


@dataclass
class Plan:
    """What the parallelized forward needs to know about the parallelization."""

    adapter: ModelAdapter
    config: object  # the resolved ParallelConfig
    mesh: object
    tp_group: str | None
    cp_group: str | None
    loss_group: str | None  # dp_cp: the ranks holding other tokens (None when one)
    router_aux: object = None  # steps.RouterAuxLoss for a Hugging Face MoE model's aux loss
    sliding_window: int | None = None
    hf_masks: bool = False  # a Hugging Face model whose layers get HF's attention masks
    documents: torch.Tensor | None = None  # cp: this call's packed row's cu_seqlens (check_batch's)


def check_batch(model: nn.Module, args, kwargs) -> None:
    """Forward pre-hook ahead of FSDP's (which all-gathers): bad shapes fail before any
    communication. Under cp, packed rows' documents go to ``plan.documents``: the rows'
    documents one after another (a row's end ends a document), as the forward flattens them."""
    unknown = sorted(set(kwargs) - set(FORWARD_ARGS))
    if unknown or len(args) + len(kwargs) > len(FORWARD_ARGS):
        raise TypeError(f"parallelized forward takes {', '.join(FORWARD_ARGS)}; got "
                        f"{len(args)} positional and {', '.join(unknown) or 'no other'} keyword "
                        "arguments")
    input_ids = kwargs["input_ids"] if "input_ids" in kwargs else (args[0] if args else None)
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError("parallelized forward: pass input_ids (a [batch, seq] tensor)")
    plan = model._fusedpar_plan
    sequence_checks(plan, input_ids)
    positions = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    plan.documents = None
    if plan.cp_group is not None and is_hf(model) and positions is not None:
        restarts = (positions.expand_as(input_ids).diff(dim=-1) != 1).cpu()  # one host read
        if bool(restarts.any()):
            rows_end = torch.ones(restarts.shape[0], 1, dtype=torch.bool)
            plan.documents = document_ends(torch.cat([restarts, rows_end], 1).flatten()[:-1],
                                           positions.device)
    check_attention_mask(kwargs.get("attention_mask", args[3] if len(args) > 3 else None))


def check_attention_mask(mask: torch.Tensor | None) -> None:
    """None or all ones: the parallelized forward attends over whole causal rows."""
    if mask is not None and not bool(mask.all()):  # one host read, only when a mask is passed
        raise ValueError("parallelized forward: attention_mask masks some positions, and the "
                         "parallelized forward runs causal attention over whole rows; pass no "
                         "attention_mask (right padding with labels = -100 at the pads gives the "
                         "same cross-entropy) or pack the sequences")


def document_ends(restarts: torch.Tensor, device) -> torch.Tensor:
    """The cu_seqlens (int32 ``[0, end_1, ..., T]``) of a packed row from ``restarts`` (host
    bools, True where position i + 1 does not follow position i), as Hugging Face finds
    packed documents from position_ids."""
    from ..ops.flash_attention import from_host_list

    ends = (restarts.nonzero().flatten() + 1).tolist()
    # made from host values, so cp_shard's and every layer's attention's reads are free
    return from_host_list([0, *ends, restarts.numel() + 1], device)


def sequence_checks(plan: Plan, input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"parallelized forward: input_ids must be [batch, seq], got "
                         f"{tuple(input_ids.shape)}")
    check_sequence_length(input_ids.shape[1], plan.config, plan.sliding_window)


def check_sequence_length(seq: int, cfg, sliding_window: int | None) -> None:
    """A sequence length cp and tp can split (and within a sliding-window model's window)."""
    if cfg.cp > 1 and seq % (2 * cfg.cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2*cp = {2 * cfg.cp} (context "
                         f"parallelism cuts it into 2*cp zigzag chunks); pad it to a multiple")
    if cfg.tp > 1 and (seq // cfg.cp) % cfg.tp:
        raise ValueError(f"sequence length {seq} (per cp rank {seq // cfg.cp}) is not divisible by "
                         f"tp={cfg.tp} (sequence parallelism splits it); pad it to a multiple")
    if sliding_window is not None and seq > sliding_window:
        raise ValueError(f"sequence length {seq} exceeds the model's sliding window "
                         f"{sliding_window} (config.sliding_window), and the parallelized "
                         "forward attends over the whole causal prefix; use sequences of at most "
                         "that length")


def parallel_forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
    """``input_ids`` / ``labels`` / ``position_ids``: this data-parallel rank's batch, the
    full sequence (the same on every rank of a tp / cp group). Under cp, packed rows
    (``position_ids`` restarting) run as one packed row of the B rows' documents, each
    document attending alone on the ring, sharded as :func:`cp_shard` says (the logits are
    then this cp rank's part of that row, ``[1, B*T/cp, V]``). ``attention_mask``: only all
    ones (checked in :func:`check_batch`). No ``**kwargs``: Hugging Face's Trainer then
    divides the loss by the gradient-accumulation steps itself instead of passing
    ``num_items_in_batch``, which this forward would not use."""
    plan: Plan = self._fusedpar_plan
    adapter = plan.adapter
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    target = None if labels is None else shift_labels(labels)
    if plan.documents is not None:  # the rows' documents as one packed row (ring_attention's B = 1)
        input_ids, position_ids, target = (None if t is None else t.reshape(1, -1)
                                           for t in (input_ids, position_ids.expand_as(input_ids), target))
    if plan.cp_group is not None:
        input_ids, position_ids, target = cp_shard(plan.cp_group, input_ids, position_ids, target,
                                                   documents=plan.documents)
    if plan.router_aux is not None:
        plan.router_aux.logits.clear()  # what a recompute in the last backward recorded
    masks = adapter.attention_masks(self, input_ids, position_ids) if plan.hf_masks else None
    if plan.documents is not None:  # the fusedpar_cp attention takes 1-D masks as cu_seqlens
        masks = [plan.documents] * len(adapter.layers(self))
    hidden, aux = decoder_forward(self, input_ids, position_ids, masks, adapter)
    logits = adapter.logits(self, hidden)
    loss = None
    if target is not None:
        per_token = token_losses(logits, target, plan.tp_group)
        loss = mean_loss(per_token, target, plan.loss_group, plan.config.dp * plan.config.cp)
    if plan.router_aux is not None:  # Hugging Face MoE: its forward's load-balancing term
        aux = plan.router_aux.loss()
        loss = None if loss is None else loss + plan.router_aux.coef * aux
    return adapter.output(self, loss, logits, aux)


FORWARD_ARGS = tuple(inspect.signature(parallel_forward).parameters)[1:]


def cp_shard(cp_group: str, *tensors, documents: torch.Tensor | None = None):
    """This cp rank's zigzag chunks of each tensor's sequence (dim 1); None stays None. A
    packed row (``documents``: its cu_seqlens) whose documents are all multiples of ``2 cp``
    long is cut per document (``layout="zigzag_docs"``: every document's causal work is
    balanced over the cp ranks); any other row is cut whole (``"zigzag"``: the same results,
    the work balanced over the row only, so a rank may hold more of the long documents'
    late tokens). ``ops.ring_attention.call.packed_layout`` decides, as the attention does."""
    from ..ops.ring_attention.call import packed_layout
    from .cp import sequence_shard

    pg = dist.distributed_c10d._resolve_process_group(cp_group)
    # documents: read to the host once (host_list), here and by every layer's attention
    layout = "zigzag" if documents is None else packed_layout(documents, pg.size())
    return tuple(None if t is None else sequence_shard(t, 1, pg.rank(), pg.size(), layout=layout,
                                                       cu_seqlens=documents) for t in tensors)
