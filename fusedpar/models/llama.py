"""A small Llama-style causal language model with Hugging Face's attribute names.

Plain-PyTorch equivalent: ``transformers.LlamaForCausalLM`` (same parameter names, same
maths: RMSNorm, rotary embeddings with ``rotate_half``, GQA attention, SwiGLU MLP, the
shifted mean cross-entropy), written without transformers so the demo and the tests need
nothing but torch. ``fusedpar.parallelize`` treats it exactly like the Hugging Face model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.decoder import IGNORE_INDEX, CausalLMOutput, causal_lm_loss, shift_labels
from ..parallel.forward import decoder_forward

__all__ = ["CausalLMOutput", "IGNORE_INDEX", "LlamaConfig", "LlamaForCausalLM", "causal_lm_loss",
           "shift_labels"]

@dataclass
class LlamaConfig:
    """Sizes of :class:`LlamaForCausalLM` (defaults: a tiny model for tests and the demo)."""

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"LlamaConfig: hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads={self.num_heads} is not divisible by "
                             f"num_kv_heads={self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.hidden_size // self.num_heads} must be "
                             "even (rotary embeddings rotate pairs)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """``(cos, sin)`` ``[B, S, head_dim]`` for the given position ids (HF's layout)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, S, H, D]``; ``cos``/``sin`` ``[B or 1, S, D]``."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


class SDPAttention(nn.Module):
    """The attention core on ``[B, S, H, D]`` q/k/v after RoPE (causal, GQA by repeating
    K/V heads). The module ``fusedpar.parallelize`` swaps for context parallelism."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Attention(nn.Module):
    """Head counts are read from the projections' shapes (``view(..., -1, head_dim)``), so
    a tensor-parallel shard of the projections needs no attribute changes."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.core = SDPAttention()

    def forward(self, hidden_states, position_embeddings, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape)
        cos, sin = position_embeddings
        out = self.core(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.o_proj(out.flatten(-2)), None


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """HF's ``LlamaDecoderLayer`` calling convention: ``layer(hidden_states,
    position_embeddings=(cos, sin), ...)``. With an MoE ``mlp`` (returning ``(y, aux)``)
    the layer returns ``(hidden_states, aux_loss)``."""

    def __init__(self, config: LlamaConfig, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config) if mlp is None else mlp

    def forward(self, hidden_states, position_embeddings, **kwargs):
        attn, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                 position_embeddings=position_embeddings)
        hidden_states = hidden_states + attn
        out = self.mlp(self.post_attention_layernorm(hidden_states))
        if isinstance(out, tuple):
            y, aux = out
            return hidden_states + y, aux
        return hidden_states + out


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, make_mlp=None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, None if make_mlp is None else make_mlp())
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


class LlamaForCausalLM(nn.Module):
    """``model.embed_tokens``, ``model.layers[i].self_attn.{q,k,v,o}_proj``,
    ``.mlp.{gate,up,down}_proj``, ``.input_layernorm``, ``.post_attention_layernorm``,
    ``model.norm``, ``lm_head``: the names of ``transformers.LlamaForCausalLM``, so its
    ``state_dict`` loads into that model (``rotary_emb.inv_freq`` is not saved).

    ``forward(input_ids [B, S], labels=None, position_ids=None) -> CausalLMOutput``; the
    loss is the mean token cross-entropy with HF's shift (:func:`causal_lm_loss`).
    """

    def __init__(self, config: LlamaConfig, *, device=None, dtype=None, seed: int | None = None):
        super().__init__()
        self.config = config
        if seed is not None:
            torch.manual_seed(seed)
        self.model = LlamaModel(config, self._make_mlp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to(device=device, dtype=dtype)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With ``config.tie_embeddings``, make ``lm_head`` share the embedding's weight.
        ``__init__`` does; moving to or from the meta device (``to_empty``) gives each
        module a new Parameter, so call it again after that (as Hugging Face models ask)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    _make_mlp = None  # MoE variants: a method returning a new MLP module

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> CausalLMOutput:
        hidden, aux = decoder_forward(self, input_ids, position_ids)
        logits = self.lm_head(hidden)
        loss = None if labels is None else causal_lm_loss(logits, labels)
        return self._output(loss, logits, aux)

    def _output(self, loss, logits, aux):
        return CausalLMOutput(loss, logits)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
