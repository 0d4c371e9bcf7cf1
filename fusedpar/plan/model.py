"""The sizes of a model that the planner needs, from a fusedpar config, a Hugging Face
config (JSON file or dict: Llama / Qwen2 / Mistral / Mixtral / Qwen-MoE / GPT-2 keys), or a
model instance.

Plain-PyTorch equivalent: reading ``model.config`` by hand; the planner never builds the
model (except :mod:`fusedpar.plan.dry_run`, on fake tensors).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["ModelSpec", "model_spec"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only causal LM's sizes.

    ``mlp``: ``"swiglu"`` (gate/up/down, Llama) or ``"gelu"`` (fc/proj with biases, GPT-2);
    ``norm``: ``"rms"`` (weight) or ``"layer"`` (weight and bias); ``experts > 0`` makes every
    layer's MLP a mixture of ``experts`` SwiGLU experts of ``expert_intermediate`` with a
    top-``top_k`` router (Mixtral); ``qkv_bias`` (Qwen2), ``linear_bias`` (every linear, GPT-2);
    ``positions > 0``: learned position embeddings of that many rows (GPT-2), else rotary.
    """

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    tie_embeddings: bool = False
    mlp: str = "swiglu"
    norm: str = "rms"
    qkv_bias: bool = False
    linear_bias: bool = False
    positions: int = 0

    def __post_init__(self):
        for field in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelSpec {self.name}: {field}={getattr(self, field)} must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelSpec {self.name}: heads={self.heads} is not divisible by "
                             f"kv_heads={self.kv_heads}")
        if self.mlp not in ("swiglu", "gelu") or self.norm not in ("rms", "layer"):
            raise ValueError(f"ModelSpec {self.name}: mlp={self.mlp!r} (swiglu, gelu), "
                             f"norm={self.norm!r} (rms, layer)")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"ModelSpec {self.name}: top_k={self.top_k} must be between 1 and "
                             f"experts={self.experts}")

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def num_parameters(self) -> int:
        """Every parameter (tied embeddings counted once)."""
        return sum(t.numel for t in parameter_shapes(self, tp=1, ep=1))

    def active_parameters(self) -> int:
        """Parameters one token's forward multiplies by (MoE: ``top_k`` of the experts)."""
        total = self.num_parameters()
        if not self.moe:
            return total
        per_expert = 3 * self.hidden * self.expert_intermediate
        return total - self.layers * (self.experts - self.top_k) * per_expert


def _first(d: Mapping, *keys, default=None):
    for key in keys:
        if d.get(key) is not None:
            return d[key]
    return default


def _from_hf(d: Mapping[str, Any], name: str) -> ModelSpec:
    """A Hugging Face ``config.json`` mapping (Llama, Qwen2, Mistral, Mixtral, Qwen2/3-MoE,
    OLMoE, GPT-2 keys)."""
    model_type = d.get("model_type", "")
    if "n_embd" in d or model_type == "gpt2":  # GPT-2: Conv1D blocks, learned positions
        hidden = d["n_embd"]
        return ModelSpec(
            name=name, vocab=d["vocab_size"], hidden=hidden, layers=d["n_layer"],
            heads=d["n_head"], kv_heads=d["n_head"], head_dim=hidden // d["n_head"],
            intermediate=d.get("n_inner") or 4 * hidden, tie_embeddings=d.get("tie_word_embeddings", True),
            mlp="gelu", norm="layer", linear_bias=True, positions=d.get("n_positions", 1024))
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
               if k not in d]
    if missing:
        raise ValueError(f"model config {name}: missing {', '.join(missing)}; the planner reads "
                         "Hugging Face Llama / Qwen2 / Mistral / Mixtral / Qwen-MoE / GPT-2 keys "
                         "or fusedpar's LlamaConfig / MixtralConfig fields")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    experts = _first(d, "num_local_experts", "num_experts", default=0) or 0
    intermediate = d.get("intermediate_size") or 4 * hidden
    return ModelSpec(
        name=name, vocab=d["vocab_size"], hidden=hidden, layers=d["num_hidden_layers"],
        heads=heads, kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads, intermediate=intermediate,
        experts=experts, top_k=d.get("num_experts_per_tok", 0) if experts else 0,
        expert_intermediate=(d.get("moe_intermediate_size") or intermediate) if experts else 0,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=bool(d.get("attention_bias", model_type == "qwen2")))


def _from_fusedpar(cfg: Any, name: str) -> ModelSpec:
    """``fusedpar.models.LlamaConfig`` / ``MixtralConfig`` (or their ``to_dict()``)."""
    d = cfg if isinstance(cfg, Mapping) else dataclasses.asdict(cfg)
    experts = d.get("num_experts", 0)
    return ModelSpec(
        name=name, vocab=d["vocab_size"], hidden=d["hidden_size"], layers=d["num_layers"],
        heads=d["num_heads"], kv_heads=d["num_kv_heads"], head_dim=d["hidden_size"] // d["num_heads"],
        intermediate=d["intermediate_size"], experts=experts, top_k=d.get("top_k", 0) if experts else 0,
        expert_intermediate=d["intermediate_size"] if experts else 0,
        tie_embeddings=d.get("tie_embeddings", False))


def model_spec(model: Any, name: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a ``ModelSpec``, a fusedpar ``LlamaConfig`` /
    ``MixtralConfig``, a model holding one (``model.config``: fusedpar's or a Hugging Face
    ``PretrainedConfig``), a Hugging Face config mapping, or a path to a JSON file of either
    kind (fusedpar's fields or Hugging Face's ``config.json``)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, os.PathLike)):
        with open(model) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"model config {model}: expected a JSON object, got {type(data).__name__}")
        return model_spec(data, name or os.path.basename(os.fspath(model)))
    config = getattr(model, "config", model)  # an nn.Module holding its config
    if hasattr(config, "to_diff_dict") and hasattr(config, "to_dict"):  # transformers' PretrainedConfig
        return _from_hf(config.to_dict(), name or type(config).__name__)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return _from_fusedpar(config, name or type(config).__name__)
    if isinstance(config, Mapping):
        if "num_layers" in config and "num_heads" in config:
            return _from_fusedpar(config, name or "model")
        return _from_hf(config, name or config.get("model_type") or "model")
    raise TypeError(f"model_spec: cannot read model sizes from {type(model).__name__}; pass a "
                    "fusedpar LlamaConfig / MixtralConfig, a Hugging Face config (or a model "
                    "holding one), a config mapping or a JSON file path")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A parameter after TP / EP: ``count`` tensors of ``[dim0, rest]`` in FSDP unit ``unit``
    (``"root"``, ``"layer"``, ``"experts"``); ``stage`` ``"first"`` / ``"last"`` / ``"layer"``
    says which pipeline stage holds it."""

    name: str
    dim0: int
    rest: int
    count: int
    unit: str
    stage: str

    @property
    def numel(self) -> int:
        return self.count * self.dim0 * self.rest


def parameter_shapes(spec: ModelSpec, tp: int, ep: int) -> list[Tensor]:
    """Every parameter as this rank's TP / EP piece (before FSDP)."""
    h, L = spec.hidden, spec.layers
    norms = 2 if spec.norm == "layer" else 1  # weight (+ bias), 1-D [hidden]
    out = [Tensor("embed_tokens", spec.vocab // tp, h, 1, "root", "first")]
    if spec.positions:
        out.append(Tensor("embed_positions", spec.positions, h, 1, "root", "first"))
    out.append(Tensor("norm", h, 1, norms, "root", "last"))
    if not spec.tie_embeddings:
        out.append(Tensor("lm_head", spec.vocab // tp, h, 1, "root", "last"))

    def linear(name, out_rows, in_cols, bias, unit="layer"):  # [out, in] (+ a bias [out])
        return [Tensor(name, out_rows, in_cols, L, unit, "layer")] + (
            [Tensor(name + ".bias", out_rows, 1, L, unit, "layer")] if bias else [])

    bias, qkv_bias = spec.linear_bias, spec.linear_bias or spec.qkv_bias
    layer = [Tensor("layernorms", h, 1, 2 * norms * L, "layer", "layer")]
    layer += linear("q_proj", spec.q_dim // tp, h, qkv_bias) + linear("k_proj", spec.kv_dim // tp, h, qkv_bias)
    layer += linear("v_proj", spec.kv_dim // tp, h, qkv_bias) + linear("o_proj", h, spec.q_dim // tp, bias)
    if spec.moe:
        E, I = spec.experts, spec.expert_intermediate
        experts_unit = "experts" if ep > 1 else "layer"
        layer += [Tensor("router", E, h, L, experts_unit, "layer"),
                  Tensor("w13", E // ep, 2 * I * h, L, experts_unit, "layer"),
                  Tensor("w2", E // ep, h * I, L, experts_unit, "layer")]
    elif spec.mlp == "swiglu":
        I = spec.intermediate // tp
        layer += linear("gate_proj", I, h, False) + linear("up_proj", I, h, False) + linear("down_proj", h, I, False)
    else:
        I = spec.intermediate // tp
        layer += linear("c_fc", I, h, bias) + linear("c_proj", h, I, bias)
    return out + layer
