"""``HFAdapter``: what every Hugging Face transformers causal LM with Llama's layout shares
(its attention masks, its ``AttentionInterface`` for context parallelism, its router aux
loss, a sliding window in its config); a family is a subclass naming its ``model_type``."""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from .base import ModelAdapter, ModelLayout, is_hf
from .spec import AXES, hf_sizes

__all__ = ["HFAdapter", "deepseek_v3_facts", "moe_facts", "qwen_moe_facts"]


def no_cache(mask_function) -> dict:
    """The keyword that tells transformers' mask builders there is no KV cache: ``cache``
    where the installed transformers names it so (its ``past_key_values`` is deprecated
    there and warns on every call), else ``past_key_values``."""
    return {"cache" if "cache" in inspect.signature(mask_function).parameters
            else "past_key_values": None}


class HFAdapter(ModelAdapter):
    """A transformers model whose ``config.model_type`` is one of ``model_types``; the
    families with Llama's layout and forward differ in nothing else (see
    :data:`fusedpar.parallel.adapters.ADAPTERS`)."""

    def __init__(self, family: str, model_types: tuple[str, ...], facts=None):
        self.family, self.model_types, self.facts = family, model_types, facts

    def plan_spec(self, config, name):
        """Llama's keys, and what ``facts(config)`` (a dict of :class:`ModelSpec` fields)
        says differs in this family."""
        return hf_sizes(config, name, **(self.facts(config) if self.facts else {}))

    def matches(self, model: nn.Module) -> bool:
        return is_hf(model) and getattr(model.config, "model_type", None) in self.model_types

    def attention_masks(self, model, input_ids, position_ids):
        """The mask HF's own forward gives every layer
        (``transformers.masking_utils.create_causal_mask``): None where the attention is
        causal by itself (sdpa, flash), the causal mask for eager attention, and a
        block-diagonal one where ``position_ids`` restart (packed sequences). Only the batch
        and sequence sizes and the dtype of the (dummy) embeddings matter to it; the layers
        may see sequence shards, the mask spans the whole sequence, as attention does."""
        from transformers.masking_utils import create_causal_mask

        mask = create_causal_mask(config=model.config, inputs_embeds=self._dummy(model, input_ids),
                                  attention_mask=None, position_ids=position_ids,
                                  **no_cache(create_causal_mask))
        return [mask] * model.config.num_hidden_layers

    def _dummy(self, model, input_ids):
        dtype = next(model.parameters()).dtype  # a pipeline stage may lack the embedding
        return torch.empty(*input_ids.shape, 0, dtype=dtype, device=input_ids.device)

    def apply_context_parallel(self, model, layers, cp_mesh) -> None:
        from ...nn.attention import set_hf_context_parallel_group

        set_hf_context_parallel_group(cp_mesh)
        model.config._attn_implementation = "fusedpar_cp"

    def layout(self, model) -> ModelLayout:
        layout = super().layout(model)
        layout.hf_aux_loss_problem = _hf_aux_loss_problem(model, layout)
        layout.sliding_window = _sliding_window(model.config)
        return layout


def adds_router_aux_loss(model: nn.Module, layout: ModelLayout) -> bool:
    """Whether ``model`` is a Hugging Face MoE model whose forward adds a router aux loss."""
    return (layout.moe and hasattr(model, "router_aux_loss_coef")
            and bool(getattr(getattr(model, "config", None), "output_router_logits", False)))


def _hf_aux_loss_problem(model: nn.Module, layout: ModelLayout) -> str | None:
    """Why the parallelized forward cannot add ``model``'s router aux loss (None: it can, or
    there is none): it reproduces Mixtral's ``load_balancing_loss_func`` (the Switch loss
    over every layer's logits at once), checked against the model's own on random logits."""
    from ...ops.moe import topk_route

    if not adds_router_aux_loss(model, layout):
        return None
    hf_loss = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    experts, k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if hf_loss is not None and isinstance(experts, int) and isinstance(k, int):
        g = torch.Generator().manual_seed(0)
        logits = tuple(torch.randn(6, experts, generator=g) for _ in range(2))
        try:
            if torch.allclose(hf_loss(logits, experts, k, None), topk_route(torch.cat(logits), k)[2]):
                return None
        except Exception:  # noqa: BLE001 - another signature: not the loss reproduced here
            pass
    return (f"config.output_router_logits=True, and {type(model).__name__}'s load-balancing "
            "loss is not the Mixtral / Switch one the parallelized forward reproduces; set "
            "config.output_router_logits=False")


def _sliding_window(config) -> int | None:
    """The attention window of a Hugging Face config whose layers use one (Mistral; Qwen2 with
    ``use_sliding_window``; models listing ``sliding_attention`` in ``layer_types``), else None."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    return window if layer_types is None or "sliding_attention" in layer_types else None


def moe_facts(d, intermediate: str) -> dict:
    """The MoE fields of a Hugging Face config whose experts' intermediate size is
    ``d[intermediate]`` (the experts' count under any of its families' names: config.json
    files and transformers' configs name it differently)."""
    experts = next(d[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if d.get(k))
    return {"experts": experts, "top_k": d["num_experts_per_tok"], "expert_intermediate": d[intermediate]}


def qwen_moe_facts(d) -> dict:
    """Qwen2-MoE / Qwen3-MoE: ``mlp_only_layers`` dense; Qwen2-MoE's gated shared expert and
    q/k/v biases, Qwen3-MoE's q/k norms."""
    facts = {**moe_facts(d, "moe_intermediate_size"),
             "dense_layers": len(d.get("mlp_only_layers") or ())}
    if d.get("shared_expert_intermediate_size"):
        facts.update(shared_intermediate=d["shared_expert_intermediate_size"], shared_gate=True,
                     qkv_bias=True)
    else:
        facts["qk_norm"] = "head"
    return facts


def deepseek_v3_facts(d) -> dict:
    """Multi-head latent attention (no tp / cp), ``first_k_dense_replace`` dense layers, then
    routed experts beside ``n_shared_experts`` shared ones."""
    rope, nope = d["qk_rope_head_dim"], d["qk_nope_head_dim"]
    return {**moe_facts(d, "moe_intermediate_size"), "attention": "mla",
            "head_dim": nope + rope, "rope_head_dim": rope, "q_lora_rank": d.get("q_lora_rank") or 0,
            "kv_lora_rank": d["kv_lora_rank"], "v_head_dim": d["v_head_dim"],
            "kv_heads": d["num_attention_heads"], "dense_layers": d.get("first_k_dense_replace", 0),
            "shared_intermediate": d.get("n_shared_experts", 0) * d["moe_intermediate_size"],
            "axes": tuple(a for a in AXES if a not in ("tp", "cp"))}
