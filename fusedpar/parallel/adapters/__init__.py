"""Model adapters: one per family, and the registry that finds a model's.

:func:`find_adapter` returns the first registered adapter whose ``matches(model)`` is true:
fusedpar's own models, the Hugging Face families by ``config.model_type``, and last a
fallback for any other model with Llama's layout and forward (checked by a probe). To
support another family, subclass :class:`ModelAdapter` (or :class:`HFAdapter`), override
what differs (see ``gemma2.py``: an embedding scale, soft-capped logits, per-layer masks)
and ``register_adapter(MyAdapter())`` before ``parallelize``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .base import ADAPTERS, HOW_TO_REGISTER, ModelAdapter, ModelLayout, is_hf, is_moe
from .gemma2 import Gemma2Adapter
from .generic import LlamaStyleAdapter
from .gpt2 import GPT2Adapter
from .hf import HFAdapter, deepseek_v3_facts, moe_facts, qwen_moe_facts
from .own import OwnAdapter
from .spec import AXES, ModelSpec

__all__ = ["ADAPTERS", "HFAdapter", "ModelAdapter", "ModelLayout", "ModelSpec", "adapter_for_config",
           "find_adapter", "is_hf", "is_moe", "register_adapter"]

# the built-in adapters, tried in order (the fallback last); register_adapter puts one first
ADAPTERS[:] = [
    OwnAdapter(),
    HFAdapter("Hugging Face LlamaForCausalLM", ("llama",)),
    HFAdapter("Qwen2ForCausalLM (q/k/v biases)", ("qwen2",), lambda d: {"qkv_bias": True}),
    HFAdapter("MixtralForCausalLM", ("mixtral",),
              lambda d: moe_facts(d, "intermediate_size")),
    HFAdapter("Qwen2MoeForCausalLM (a gated shared expert)", ("qwen2_moe",), qwen_moe_facts),
    HFAdapter("Qwen3MoeForCausalLM (dense and MoE layers may mix)", ("qwen3_moe",), qwen_moe_facts),
    # q/k norms over every head: a tp rank holds only some
    HFAdapter("OlmoeForCausalLM", ("olmoe",), lambda d: {
        **moe_facts(d, "intermediate_size"), "qk_norm": "full",
        "axes": tuple(a for a in AXES if a != "tp")}),
    HFAdapter("DeepseekV3ForCausalLM (multi-head latent attention: no tp / cp)", ("deepseek_v3",),
              deepseek_v3_facts),
    Gemma2Adapter(),
    GPT2Adapter(),
    LlamaStyleAdapter(),
]


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Put ``adapter`` first in the registry (it wins over the built-in ones); returns it."""
    if not isinstance(adapter, ModelAdapter):
        raise TypeError(f"register_adapter: expected a ModelAdapter, got {type(adapter).__name__}")
    ADAPTERS.insert(0, adapter)
    return adapter


def find_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter describing ``model`` (the fallback's :meth:`~ModelAdapter.layout` then
    refuses a model that is not Llama-shaped, listing the supported families)."""
    return next(a for a in ADAPTERS if a.matches(model))


def adapter_for_config(config: Mapping) -> ModelAdapter:
    """The adapter of the family a model config describes (a mapping: Hugging Face
    ``config.json`` keys, or fusedpar's LlamaConfig / MixtralConfig fields), which
    ``fusedpar plan`` reads it through; ``ValueError`` listing the known families else."""
    found = next((a for a in ADAPTERS if a.describes(config)), None)
    if found is None:
        known = ", ".join(t for a in ADAPTERS for t in a.model_types)
        raise ValueError(f"model config: model_type={config.get('model_type')!r} is not a family "
                         f"fusedpar knows (model_type {known}, or fusedpar's LlamaConfig / "
                         f"MixtralConfig fields). {HOW_TO_REGISTER}")
    return found
