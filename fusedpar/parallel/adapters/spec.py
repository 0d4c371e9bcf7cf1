"""What the planner needs of a model family, as its adapter states it: a :class:`ModelSpec`
(sizes, attention / MLP / MoE layout, tied embeddings, the axes ``parallelize`` takes) read
from a config by :meth:`ModelAdapter.plan_spec`, and :func:`parameter_shapes`, every
parameter as one rank holds it after ``parallelize``'s tp / ep split (before FSDP).

Plain-PyTorch equivalent of :func:`parameter_shapes` at tp = ep = 1::

    [(name, p.shape) for name, p in model.named_parameters()]    # tied weights once
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["AXES", "ModelSpec", "Tensor", "hf_sizes", "parameter_shapes"]

#: Every axis of a ParallelConfig.
AXES = ("dp_replicate", "dp_shard", "tp", "cp", "ep", "pp")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only causal LM's sizes and layout.

    ``attention``: ``"gqa"`` (q/k/v/o projections, split over tp by heads), ``"fused_qkv"``
    (GPT-2's Conv1D ``c_attn``, kept whole on every tp rank, and ``c_proj``), ``"mla"``
    (DeepSeek's multi-head latent attention: ``q_lora_rank`` (0: one q_proj),
    ``kv_lora_rank``, ``rope_head_dim``, ``v_head_dim``; ``head_dim`` is q/k's). ``qk_norm``:
    ``"head"`` (a norm of head_dim on q and k: Qwen3), ``"full"`` (of q_dim and kv_dim: OLMoE).
    ``mlp``: ``"swiglu"`` or ``"gelu"`` (fc/proj with biases); ``norm``: ``"rms"`` or
    ``"layer"`` (with bias), ``layer_norms`` of them per layer. ``experts > 0``: an MoE of
    ``experts`` SwiGLU experts of ``expert_intermediate``, top-``top_k``, in every layer
    but the first ``dense_layers`` (dense MLPs of ``intermediate``); ``shared_intermediate``:
    the always-on shared expert(s)' (``shared_gate``: a sigmoid gate ``[1, hidden]``);
    ``router_unit``: the FSDP unit of the router under ep (``"experts"``: fusedpar's,
    ``"layer"``: Hugging Face's). ``positions > 0``: learned position embeddings. ``axes``:
    the ParallelConfig axes the family's adapter parallelizes."""

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
    attention: str = "gqa"
    qk_norm: str = ""
    layer_norms: int = 2
    dense_layers: int = 0
    shared_intermediate: int = 0
    shared_gate: bool = False
    router_unit: str = "layer"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    axes: tuple[str, ...] = AXES

    def __post_init__(self):
        for field in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelSpec {self.name}: {field}={getattr(self, field)} must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelSpec {self.name}: heads={self.heads} is not divisible by "
                             f"kv_heads={self.kv_heads}")
        if self.mlp not in ("swiglu", "gelu") or self.norm not in ("rms", "layer") \
                or self.attention not in ("gqa", "fused_qkv", "mla"):
            raise ValueError(f"ModelSpec {self.name}: mlp={self.mlp!r} (swiglu, gelu), "
                             f"norm={self.norm!r} (rms, layer), attention={self.attention!r} "
                             "(gqa, fused_qkv, mla)")
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

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    def num_parameters(self) -> int:
        """Every parameter (tied embeddings counted once)."""
        return sum(t.numel for t in parameter_shapes(self, tp=1, ep=1))

    def active_parameters(self) -> int:
        """Parameters one token's forward multiplies by (MoE: ``top_k`` of the experts)."""
        per_expert = 3 * self.hidden * self.expert_intermediate
        return self.num_parameters() - self.moe_layers * (self.experts - self.top_k) * per_expert


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


def hf_sizes(d: Mapping[str, Any], name: str, **layout) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json`` mapping with Llama's keys
    (``hidden_size``, ``num_hidden_layers``, ...); ``layout``: the family's other fields."""
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
               if k not in d]
    if missing:
        raise ValueError(f"model config {name}: missing {', '.join(missing)}")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    return ModelSpec(**{
        "name": name, "vocab": d["vocab_size"], "hidden": hidden, "layers": d["num_hidden_layers"],
        "heads": heads, "kv_heads": d.get("num_key_value_heads") or heads,
        "head_dim": d.get("head_dim") or hidden // heads,
        "intermediate": d.get("intermediate_size") or 4 * hidden,
        "tie_embeddings": bool(d.get("tie_word_embeddings", False)),
        "qkv_bias": bool(d.get("attention_bias", False)), **layout})


def parameter_shapes(spec: ModelSpec, tp: int, ep: int) -> list[Tensor]:
    """Every parameter as this rank's TP / EP piece (before FSDP), as ``parallelize`` leaves it."""
    h, L = spec.hidden, spec.layers
    norm = 2 if spec.norm == "layer" else 1  # weight (+ bias), 1-D [hidden]
    out = [Tensor("embed_tokens", spec.vocab // tp, h, 1, "root", "first")]
    if spec.positions:
        out.append(Tensor("embed_positions", spec.positions, h, 1, "root", "first"))
    out.append(Tensor("norm", h, 1, norm, "root", "last"))
    if not spec.tie_embeddings:
        out.append(Tensor("lm_head", spec.vocab // tp, h, 1, "root", "last"))

    def linear(name, rows, cols, bias, count=L, unit="layer"):  # [rows, cols] (+ a bias [rows])
        return [Tensor(name, rows, cols, count, unit, "layer")] + (
            [Tensor(name + ".bias", rows, 1, count, unit, "layer")] if bias else [])

    layer = [Tensor("layernorms", h, 1, spec.layer_norms * norm * L, "layer", "layer")]
    layer += _attention(spec, tp, linear)
    dense = L - spec.moe_layers
    if spec.mlp == "gelu":  # Conv1D [in, out]: c_fc column-split, c_proj row-split
        I = spec.intermediate // tp
        layer += linear("c_fc", h, I, False) + [Tensor("c_fc.bias", I, 1, L, "layer", "layer")]
        layer += linear("c_proj", I, h, False) + [Tensor("c_proj.bias", h, 1, L, "layer", "layer")]
    elif dense:
        I = spec.intermediate // tp
        layer += linear("gate_proj", I, h, False, dense) + linear("up_proj", I, h, False, dense)
        layer += linear("down_proj", h, I, False, dense)
    if spec.moe:  # whole on every tp rank (an MoE block runs on sequence shards)
        E, I, M = spec.experts, spec.expert_intermediate, spec.moe_layers
        experts_unit = "experts" if ep > 1 else "layer"
        router_unit = experts_unit if spec.router_unit == "experts" else "layer"
        layer += [Tensor("router", E, h, M, router_unit, "layer"),
                  Tensor("w13", E // ep, 2 * I * h, M, experts_unit, "layer"),
                  Tensor("w2", E // ep, h * I, M, experts_unit, "layer")]
        if spec.shared_intermediate:
            S = spec.shared_intermediate
            layer += linear("shared_gate_up", S, h, False, 2 * M) + linear("shared_down", h, S, False, M)
        if spec.shared_gate:
            layer += linear("shared_expert_gate", 1, h, False, M)
    return out + layer


def _attention(spec: ModelSpec, tp: int, linear) -> list[Tensor]:
    h = spec.hidden
    if spec.attention == "fused_qkv":  # c_attn [h, 3h] whole on every tp rank; c_proj [h/tp, h]
        return (linear("c_attn", h, 3 * h, False) + linear("c_attn.bias", 3 * h, 1, False)
                + linear("c_proj", h // tp, h, False) + linear("c_proj.bias", h, 1, False))
    if spec.attention == "mla":  # no tp (the adapter refuses it)
        H, rope, kv_rank = spec.heads, spec.rope_head_dim, spec.kv_lora_rank
        nope = spec.head_dim - rope
        q = (linear("q_a_proj", spec.q_lora_rank, h, False) + linear("q_a_layernorm", spec.q_lora_rank, 1, False)
             + linear("q_b_proj", H * spec.head_dim, spec.q_lora_rank, False)) if spec.q_lora_rank \
            else linear("q_proj", H * spec.head_dim, h, False)
        return q + (linear("kv_a_proj_with_mqa", kv_rank + rope, h, False)
                    + linear("kv_a_layernorm", kv_rank, 1, False)
                    + linear("kv_b_proj", H * (nope + spec.v_head_dim), kv_rank, False)
                    + linear("o_proj", h, H * spec.v_head_dim, False))
    bias = spec.linear_bias or spec.qkv_bias
    out = (linear("q_proj", spec.q_dim // tp, h, bias) + linear("k_proj", spec.kv_dim // tp, h, bias)
           + linear("v_proj", spec.kv_dim // tp, h, bias) + linear("o_proj", h, spec.q_dim // tp, spec.linear_bias))
    if spec.qk_norm == "head":  # one norm of head_dim, replicated
        out += linear("qk_norm", spec.head_dim, 1, False, 2 * spec.layers)
    elif spec.qk_norm == "full":  # over the projections' whole output (not split by tp here)
        out += linear("q_norm", spec.q_dim, 1, False) + linear("k_norm", spec.kv_dim, 1, False)
    return out
