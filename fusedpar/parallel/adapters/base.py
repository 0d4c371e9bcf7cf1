"""``ModelAdapter``: where a causal LM family keeps its parts and what its forward does
around them, so ``parallelize`` and the pipeline stages need no knowledge of any family.

The defaults describe Hugging Face's Llama layout (``model.embed_tokens``,
``model.layers[i].{self_attn,mlp,input_layernorm,post_attention_layernorm}``,
``model.norm``, ``model.rotary_emb``, ``lm_head``) with a plain forward: embed -> layers ->
norm -> head. A family overrides only what differs. Plain-PyTorch equivalent of the
forward it describes::

    hidden = model.model.embed_tokens(input_ids)                 # adapter.embed
    cos_sin = model.model.rotary_emb(hidden, position_ids)
    for i, layer in enumerate(model.model.layers):
        hidden = layer(hidden, position_embeddings=cos_sin, attention_mask=masks[i])
    logits = model.lm_head(model.model.norm(hidden))             # adapter.logits
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..decoder import CausalLMOutput
from .spec import ModelSpec, hf_sizes

__all__ = ["ModelAdapter", "ModelLayout", "is_hf", "is_moe"]


@dataclass
class ModelLayout:
    """What :meth:`ModelAdapter.layout` found: the blocks and the sizes the config must
    divide. ``heads`` / ``kv_heads`` / ``head_dim`` are None, and ``attention`` says why,
    when the attention is not Llama-style q/k/v/o projections (tp and cp cannot split it);
    ``intermediate`` is the dense MLPs' (None without one), ``experts`` the MoE blocks'."""

    layers: list[nn.Module]
    moe: bool
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    vocab: int
    intermediate: int | None
    experts: int | None
    attention: str | None = None
    hf_aux_loss_problem: str | None = None
    sliding_window: int | None = None


def is_moe(mlp: nn.Module) -> bool:
    """fusedpar's ``MoEBlock`` or a Hugging Face MoE block (a ``gate`` router and ``experts``)."""
    from ...nn.moe import MoEBlock

    return isinstance(mlp, MoEBlock) or (hasattr(mlp, "experts") and hasattr(mlp, "gate"))


def is_hf(model: nn.Module) -> bool:
    """A Hugging Face transformers model (whose own forward builds its attention masks)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


class ModelAdapter:
    """One model family. Subclasses set :attr:`family` (shown in errors) and override
    :meth:`matches` and whatever of their structure or forward differs from the defaults."""

    family: str = "Llama-style"
    #: The Hugging Face ``config.model_type`` values of this family (for the planner).
    model_types: tuple[str, ...] = ()

    def matches(self, model: nn.Module) -> bool:
        """Whether this adapter describes ``model`` (by its structure or config)."""
        raise NotImplementedError

    # ---- what the planner needs -----------------------------------------------------------

    def describes(self, config: Mapping) -> bool:
        """Whether a model config (a mapping: Hugging Face ``config.json`` keys) is of this
        family."""
        return config.get("model_type") in self.model_types

    def plan_spec(self, config: Mapping, name: str) -> ModelSpec:
        """The planner's facts about a model of this family (see :class:`ModelSpec`), read
        from its config (a mapping, as :meth:`describes` takes)."""
        return hf_sizes(config, name)

    # ---- where the parts are ---------------------------------------------------------------

    def embedding(self, model: nn.Module) -> nn.Module:
        return model.model.embed_tokens

    def set_embedding(self, model: nn.Module, module: nn.Module | None) -> None:
        model.model.embed_tokens = module

    def embeddings(self, model: nn.Module) -> list[nn.Module]:
        """Every module :meth:`embed` runs (the first pipeline stage holds them)."""
        return [self.embedding(model)]

    def layer_container(self, model: nn.Module) -> nn.Module:
        """The module holding the decoder layers (a ``ModuleList``, or the ``ModuleDict``
        :meth:`keep_layers` leaves)."""
        return model.model.layers

    def layers(self, model: nn.Module) -> list[nn.Module]:
        """The decoder layers in order (pipeline stages are cut between them)."""
        return list(self.layer_container(model).children())

    def keep_layers(self, model: nn.Module, keep: list[int]) -> None:
        """Drop every decoder layer not in ``keep`` (this rank's pipeline stages'); the kept
        ones keep their names (``model.layers.<i>``: a ``ModuleDict`` by index)."""
        layers = model.model.layers
        model.model.layers = nn.ModuleDict({str(i): layers[i] for i in keep})

    def final_norm(self, model: nn.Module) -> nn.Module:
        return model.model.norm

    def set_final_norm(self, model: nn.Module, module: nn.Module | None) -> None:
        model.model.norm = module

    def head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def set_head(self, model: nn.Module, module: nn.Module | None) -> None:
        model.lm_head = module

    def rotary(self, model: nn.Module) -> nn.Module:
        return model.model.rotary_emb

    # ---- what the model's forward does around its layers ------------------------------------

    def embed(self, model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input; ``position_ids`` are ``input_ids``' (a cp rank's zigzag
        shard too), for families that embed positions."""
        return self.embedding(model)(input_ids)

    def attention_masks(self, model: nn.Module, input_ids: torch.Tensor,
                        position_ids: torch.Tensor) -> list | None:
        """One attention mask per decoder layer of the whole model, by index (None: every
        layer's attention is causal by itself). Only the shape of ``input_ids`` matters."""
        return None

    def logits(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(model)(hidden)

    def output(self, model: nn.Module, loss, logits, aux):
        """The forward's result; fusedpar's MoE models add their aux loss here."""
        return CausalLMOutput(loss, logits, aux)

    def aux_loss_weight(self, model: nn.Module) -> float | None:
        """The weight of the decoder layers' summed aux loss (the ``(hidden, aux)`` their
        MoE blocks return) in the model's loss; None when the loss has no such term."""
        return None

    # ---- what the parallelisms need --------------------------------------------------------

    def forward_problems(self, model: nn.Module) -> list[str]:
        """What the model's forward does that the parallelized one (the methods above)
        would not; none for a known family."""
        return []

    def apply_tp(self, layer: nn.Module, tp_mesh, backend: str | None, split_mlp: bool,
                 float8=None) -> None:
        """Tensor + sequence parallelism on one decoder layer
        (:func:`fusedpar.parallel.tp.apply_tp`: Llama's q/k/v/o and gate/up/down; ``float8``
        as there)."""
        from ..tp import apply_tp

        apply_tp(layer, tp_mesh, sequence_parallel=True, backend=backend, split_mlp=split_mlp,
                 float8=float8)

    def parallel_problems(self, model: nn.Module, tp: int, cp: int) -> list[str]:
        """Why this family cannot take the given tp / cp (beyond the divisibility checks)."""
        return []

    def apply_context_parallel(self, model: nn.Module, layers: list[nn.Module], cp_mesh) -> None:
        """Make every layer's attention run over the cp group (the zigzag shards)."""
        raise TypeError(f"fusedpar.parallelize: cp needs fusedpar's attention core or a Hugging "
                        f"Face model (config._attn_implementation); {type(model).__name__} has "
                        "neither")

    def apply_vocab_parallel(self, model: nn.Module, tp_mesh, backend) -> None:
        """The embedding row-split over tp (its output sequence-sharded) and the head
        column-split (its input gathered), where ``model`` has them (a pipeline stage may
        not); a tied head keeps sharing the embedding's weight."""
        from ...nn import ColumnParallelLinear
        from ...nn.embedding import VocabParallelEmbedding

        embedding, head = self.embedding(model), self.head(model)
        tied = embedding is not None and head is not None and head.weight is embedding.weight
        if embedding is not None:
            self.set_embedding(model, VocabParallelEmbedding.from_embedding(
                embedding, tp_mesh, sequence_parallel=True, backend=backend))
        if head is not None:
            self.set_head(model, ColumnParallelLinear.from_linear(
                head, tp_mesh, sequence_parallel=True, backend=backend))
        if tied:
            self.head(model).weight = self.embedding(model).weight

    def layout(self, model: nn.Module) -> ModelLayout:
        """The decoder layers and the sizes the config must divide; ``TypeError`` listing
        what is missing when ``model`` lacks a part (see :func:`find_adapter`)."""
        problems = self.structure_problems(model) or self.forward_problems(model)
        if problems:
            raise unsupported(model, problems)
        layers = self.layers(model)
        attn = layers[0].self_attn
        head_dim = getattr(attn, "head_dim", None)
        attention = [f"self_attn.{n} is not a linear layer" for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                     if getattr(getattr(attn, n, None), "weight", None) is None]
        if not isinstance(head_dim, int):
            attention.append(f"{type(attn).__name__} has no int head_dim")
        moe = [layer.mlp for layer in layers if is_moe(layer.mlp)]
        dense = [layer.mlp for layer in layers if not is_moe(layer.mlp)]
        experts = None
        if moe:
            experts = (getattr(moe[0], "num_experts", None)
                       or getattr(getattr(moe[0], "experts", None), "num_experts", None))
        return ModelLayout(
            layers=layers, moe=bool(moe),
            heads=None if attention else attn.q_proj.weight.shape[0] // head_dim,
            kv_heads=None if attention else attn.k_proj.weight.shape[0] // head_dim,
            head_dim=None if attention else head_dim, vocab=self.head(model).weight.shape[0],
            intermediate=dense[0].gate_proj.weight.shape[0] if dense else None, experts=experts,
            attention="; ".join(attention) or None)

    def structure_problems(self, model: nn.Module) -> list[str]:
        """The parts the defaults expect that ``model`` lacks."""
        problems = []
        inner = getattr(model, "model", None)
        for owner, owner_name, names in ((model, "", ("model", "lm_head")),
                                         (inner, "model.", ("embed_tokens", "layers", "norm", "rotary_emb"))):
            if owner is None:
                continue
            problems += [f"no {owner_name}{n}" for n in names if not isinstance(getattr(owner, n, None), nn.Module)]
        layers = list(getattr(inner, "layers", None) or [])
        if not problems and not layers:
            problems.append("model.layers is empty")
        for i, layer in enumerate(layers):
            mlp = getattr(layer, "mlp", None)
            if not isinstance(getattr(layer, "self_attn", None), nn.Module):
                problems.append(f"no model.layers[{i}].self_attn")
            if mlp is None:
                problems.append(f"no model.layers[{i}].mlp")
            elif not is_moe(mlp) and not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                problems.append(f"model.layers[{i}].mlp ({type(mlp).__name__}) is neither a "
                                "gate/up/down MLP nor a known MoE block")
            for n in ("input_layernorm", "post_attention_layernorm"):
                if not isinstance(getattr(layer, n, None), nn.Module):
                    problems.append(f"no model.layers[{i}].{n}")
        return problems


#: Every adapter find_adapter tries, in order (fusedpar.parallel.adapters fills it).
ADAPTERS: list[ModelAdapter] = []

HOW_TO_REGISTER = (
    "For another family, subclass fusedpar.parallel.adapters.ModelAdapter (where the "
    "embeddings, decoder layers, norm and head are, what its forward does around them) and "
    "call fusedpar.parallel.adapters.register_adapter(MyAdapter()) before parallelize; or "
    "build your own plan from the pieces: fusedpar.parallel.apply_tp(block, mesh['tp']) per "
    "block, fusedpar.nn.VocabParallelEmbedding / ColumnParallelLinear for the embedding and "
    "head, fusedpar.nn.sequence.vocab_parallel_cross_entropy for the loss, and "
    "fusedpar.parallel.fsdp.shard_model for FSDP2"
)


def unsupported(model: nn.Module, problems: list[str]) -> TypeError:
    supported = "; ".join(a.family for a in ADAPTERS)
    return TypeError(f"fusedpar.parallelize: {type(model).__name__} is not a supported model "
                     f"({'; '.join(problems)}). Supported families: {supported}. {HOW_TO_REGISTER}")
