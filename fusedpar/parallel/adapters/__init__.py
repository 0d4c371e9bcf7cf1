"""Model adapters: one per family, and the registry that finds a model's.

:func:`find_adapter` returns the first registered adapter whose ``matches(model)`` is true:
fusedpar's own models, the Hugging Face families by ``config.model_type``, and last a
fallback for any other model with Llama's layout and forward (checked by a probe). To
support another family, subclass :class:`ModelAdapter` (or :class:`HFAdapter`), override
what differs (see ``gemma2.py``: an embedding scale, soft-capped logits, per-layer masks)
and ``register_adapter(MyAdapter())`` before ``parallelize``.
"""

from __future__ import annotations

from torch import nn

from .base import ADAPTERS, ModelAdapter, ModelLayout, is_hf, is_moe
from .gemma2 import Gemma2Adapter
from .generic import LlamaStyleAdapter
from .gpt2 import GPT2Adapter
from .hf import HFAdapter
from .own import OwnAdapter

__all__ = ["ADAPTERS", "HFAdapter", "ModelAdapter", "ModelLayout", "find_adapter", "is_hf",
           "is_moe", "register_adapter"]

# the built-in adapters, tried in order (the fallback last); register_adapter puts one first
ADAPTERS[:] = [
    OwnAdapter(),
    HFAdapter("Hugging Face LlamaForCausalLM", ("llama",)),
    HFAdapter("Qwen2ForCausalLM (q/k/v biases)", ("qwen2",)),
    HFAdapter("MixtralForCausalLM", ("mixtral",)),
    HFAdapter("Qwen2MoeForCausalLM (a gated shared expert)", ("qwen2_moe",)),
    HFAdapter("Qwen3MoeForCausalLM (dense and MoE layers may mix)", ("qwen3_moe",)),
    HFAdapter("OlmoeForCausalLM", ("olmoe",)),
    HFAdapter("DeepseekV3ForCausalLM (multi-head latent attention: no tp / cp)", ("deepseek_v3",)),
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
