"""fusedpar's own models (:mod:`fusedpar.models`: Llama- and Mixtral-style), recognised by
their structure: Llama's layout whose attention computes through a swappable ``core``
module ``(q, k, v) [B, S, H, D] -> out``, which context parallelism replaces."""

from __future__ import annotations

from torch import nn

from .base import ModelAdapter, is_hf
from .spec import ModelSpec

__all__ = ["OwnAdapter"]


class _CPCore(nn.Module):
    """The attention core ``(q, k, v) -> out`` over the cp group (causal, zigzag shards)."""

    def __init__(self, cp: nn.Module):
        super().__init__()
        self.cp = cp

    def forward(self, q, k, v):
        return self.cp.attend(q, k, v, True, None)


class OwnAdapter(ModelAdapter):
    family = "fusedpar.models.LlamaForCausalLM / MixtralForCausalLM"

    def matches(self, model: nn.Module) -> bool:
        layers = getattr(getattr(model, "model", None), "layers", None)
        return (not is_hf(model) and isinstance(layers, nn.ModuleList) and len(layers) > 0
                and all(isinstance(getattr(getattr(layer, "self_attn", None), "core", None), nn.Module)
                        for layer in layers))

    def describes(self, config):
        """fusedpar's LlamaConfig / MixtralConfig fields."""
        return "num_layers" in config and "num_heads" in config

    def plan_spec(self, config, name):
        experts = config.get("num_experts", 0)
        I = config["intermediate_size"]
        return ModelSpec(
            name=name, vocab=config["vocab_size"], hidden=config["hidden_size"],
            layers=config["num_layers"], heads=config["num_heads"], kv_heads=config["num_kv_heads"],
            head_dim=config["hidden_size"] // config["num_heads"], intermediate=I, experts=experts,
            top_k=config.get("top_k", 0) if experts else 0, expert_intermediate=I if experts else 0,
            tie_embeddings=config.get("tie_embeddings", False), router_unit="experts")

    def output(self, model, loss, logits, aux):
        """MixtralForCausalLM adds its layers' mean aux loss to the loss."""
        return model._output(loss, logits, aux)

    def aux_loss_weight(self, model):
        coef = getattr(model.config, "router_aux_loss_coef", None)
        return None if coef is None else coef / model.config.num_layers

    def apply_context_parallel(self, model, layers, cp_mesh) -> None:
        from ...nn.attention import ContextParallelAttention

        cp = ContextParallelAttention(cp_mesh)
        for layer in layers:
            layer.self_attn.core = _CPCore(cp)
