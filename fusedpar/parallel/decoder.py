"""What a causal LM's forward is made of, for fusedpar's own models and the parallelized
forward alike: the decoder (embeddings, layers, final norm) as a model adapter describes it,
Hugging Face's label shift and the mean token loss. It imports no adapter: the caller passes
the model's (``fusedpar.parallel.adapters.find_adapter``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.sequence import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "CausalLMOutput", "causal_lm_loss", "run_decoder", "run_layers",
           "shift_labels", "valid_labels"]


@dataclass
class CausalLMOutput:
    """``loss`` (None without labels), ``logits`` ``[B, S, V]`` (under tensor parallelism
    this rank's vocabulary shard ``[B, S, V/tp]``), ``aux_loss`` (MoE models, else None)."""

    loss: torch.Tensor | None
    logits: torch.Tensor
    aux_loss: torch.Tensor | None = None


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal shift: position ``i`` predicts ``labels[:, i + 1]``; the last
    position predicts nothing (``-100``)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def valid_labels(target: torch.Tensor) -> torch.Tensor:
    """How many labels the loss counts (those not ``IGNORE_INDEX``; ``target`` shifted)."""
    return (target != IGNORE_INDEX).sum()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy with the causal shift, in fp32::

        F.cross_entropy(logits.float().flatten(0, -2), shift_labels(labels).flatten(),
                        ignore_index=-100)
    """
    return F.cross_entropy(logits.float().flatten(0, -2), shift_labels(labels).flatten(),
                           ignore_index=IGNORE_INDEX)


def run_layers(adapter, model: nn.Module, layers, hidden: torch.Tensor,
               position_ids: torch.Tensor, masks: list | None, first: int = 0):
    """``layers`` (decoder layers ``first``, ``first + 1``, ... of ``model``) on ``hidden``;
    returns the hidden states and the summed auxiliary loss of MoE layers (or None)."""
    position_embeddings = adapter.rotary(model)(hidden, position_ids)
    aux = None
    for i, layer in enumerate(layers, first):
        out = layer(hidden, position_embeddings=position_embeddings,
                    attention_mask=None if masks is None else masks[i], position_ids=position_ids)
        if isinstance(out, tuple):
            hidden, layer_aux = out
            aux = layer_aux if aux is None else aux + layer_aux
        else:
            hidden = out
    return hidden, aux


def run_decoder(adapter, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                attention_masks: list | None = None):
    """Embeddings, decoder layers and final norm of ``model`` as ``adapter`` describes them;
    returns the hidden states and the summed auxiliary loss of MoE layers (or None).
    ``attention_masks``: one per layer, as they are (None: causal attention by itself)."""
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
    hidden = adapter.embed(model, input_ids, position_ids)
    hidden, aux = run_layers(adapter, model, adapter.layers(model), hidden, position_ids,
                             attention_masks)
    return adapter.final_norm(model)(hidden), aux
