"""Hugging Face Gemma 2 (``Gemma2ForCausalLM``): Llama's layout with four norms per layer,
and a forward that differs around the layers.

- The embeddings are scaled by ``sqrt(hidden_size)`` (inside HF's
  ``Gemma2TextScaledWordEmbedding``; under tp the vocab-parallel embedding looks rows up and
  :meth:`Gemma2Adapter.embed` scales).
- The logits are soft-capped: ``cap * tanh(logits / cap)``
  (``config.final_logit_softcapping``; elementwise, so also on a tp vocabulary shard).
- Layers alternate sliding-window and full attention (``config.layer_types``): each gets
  HF's mask for its type, and HF's own attention (eager: with the attention-logit
  soft-capping) runs on each rank's heads under tp. Under cp the ``"fusedpar_cp"`` ring
  attention applies each layer's window and soft-capping (HF passes both to it).

Plain-PyTorch equivalent: ``Gemma2ForCausalLM.forward``.
"""

from __future__ import annotations

import torch
from torch import nn

from .hf import HFAdapter, no_cache
from .spec import hf_sizes

__all__ = ["Gemma2Adapter"]


class Gemma2Adapter(HFAdapter):
    def __init__(self):
        super().__init__("Gemma2ForCausalLM (embedding scale, soft-capped logits, sliding "
                         "windows)", ("gemma2",))

    def plan_spec(self, config, name):
        """Four norms per layer, a head_dim of its own, the head tied by default."""
        return hf_sizes(config, name, layer_norms=4,
                        tie_embeddings=bool(config.get("tie_word_embeddings", True)))

    def embed(self, model, input_ids, position_ids):
        embedding = self.embedding(model)
        hidden = embedding(input_ids)
        if hasattr(embedding, "embed_scale"):  # HF's scaled embedding scaled it
            return hidden
        return hidden * torch.tensor(model.config.hidden_size ** 0.5, dtype=hidden.dtype)

    def attention_masks(self, model, input_ids, position_ids):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(config=model.config, inputs_embeds=self._dummy(model, input_ids),
                      attention_mask=None, position_ids=position_ids, **no_cache(create_causal_mask))
        masks = {"full_attention": create_causal_mask(**kwargs),
                 "sliding_attention": create_sliding_window_causal_mask(**kwargs)}
        return [masks[kind] for kind in model.config.layer_types]

    def logits(self, model, hidden):
        logits = self.head(model)(hidden)
        cap = model.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def apply_vocab_parallel(self, model, tp_mesh, backend) -> None:
        """The scaled embedding becomes a plain one on the same weight (refused with a
        ``padding_idx``, whose row gets no gradient); :meth:`embed` applies the scale."""
        scaled = self.embedding(model)
        if scaled is None:  # a pipeline stage without it
            return super().apply_vocab_parallel(model, tp_mesh, backend)
        plain = nn.Embedding(*scaled.weight.shape, padding_idx=scaled.padding_idx, device="meta")
        plain.weight = scaled.weight
        self.set_embedding(model, plain)
        super().apply_vocab_parallel(model, tp_mesh, backend)

    def layout(self, model):
        layout = super().layout(model)
        layout.sliding_window = None  # each layer gets its own mask: any length is exact
        return layout
