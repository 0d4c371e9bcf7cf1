"""Small models for the demo and the tests, with Hugging Face's attribute names.

- :class:`LlamaForCausalLM` / :class:`LlamaConfig`: a Llama-style causal LM.
- :class:`MixtralForCausalLM` / :class:`MixtralConfig`: the same with MoE MLPs
  (:class:`fusedpar.nn.moe.MoEBlock`).
"""

from .llama import CausalLMOutput, LlamaConfig, LlamaForCausalLM, causal_lm_loss, shift_labels
from .mixtral import MixtralConfig, MixtralForCausalLM

__all__ = ["CausalLMOutput", "LlamaConfig", "LlamaForCausalLM", "MixtralConfig",
           "MixtralForCausalLM", "causal_lm_loss", "shift_labels"]
