"""A small Mixtral-style MoE causal language model: :class:`~fusedpar.models.llama.LlamaForCausalLM`
whose MLPs are :class:`fusedpar.nn.moe.MoEBlock` (router ``router``, stacked experts ``w13``
``[E, 2I, H]`` and ``w2`` ``[E, H, I]``).

Plain-PyTorch equivalent of the loss::

    ce = causal_lm_loss(logits, labels)
    loss = ce + router_aux_loss_coef * mean(aux_loss of each layer)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..nn.moe import MoEBlock
from .llama import CausalLMOutput, LlamaConfig, LlamaForCausalLM

__all__ = ["MixtralConfig", "MixtralForCausalLM"]


@dataclass
class MixtralConfig(LlamaConfig):
    """:class:`LlamaConfig` plus the experts."""

    num_experts: int = 4
    top_k: int = 2
    router_aux_loss_coef: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MixtralConfig: top_k={self.top_k} must be between 1 and "
                             f"num_experts={self.num_experts}")


class MixtralForCausalLM(LlamaForCausalLM):
    """Each layer's ``mlp`` is a :class:`~fusedpar.nn.moe.MoEBlock`; ``forward`` returns the
    cross-entropy plus ``router_aux_loss_coef`` times the mean of the layers' load-balancing
    losses (``output.aux_loss`` is that mean)."""

    config: MixtralConfig

    def _make_mlp(self):
        c = self.config
        return MoEBlock(c.hidden_size, c.intermediate_size, c.num_experts, c.top_k)

    def _output(self, loss, logits, aux):
        aux = aux / self.config.num_layers
        if loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux
        return CausalLMOutput(loss, logits, aux)
