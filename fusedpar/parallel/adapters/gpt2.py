"""Hugging Face GPT-2 (``GPT2LMHeadModel``): ``transformer.{wte, wpe, h, ln_f}`` and a head
tied to ``wte``; each block ``ln_1 -> attn (c_attn: fused q/k/v, c_proj) -> ln_2 -> mlp
(c_fc, c_proj)``, LayerNorms with biases, no rotary embedding. Its projections are
``Conv1D``: ``y = x @ weight + bias`` with ``weight`` stored ``[in, out]``.

Plain-PyTorch equivalent of the forward it describes (``GPT2LMHeadModel.forward``)::

    t = model.transformer
    hidden = t.drop(t.wte(input_ids) + t.wpe(position_ids))     # GPT2Adapter.embed
    for block in t.h:
        hidden = block(hidden, attention_mask=mask)
    logits = model.lm_head(t.ln_f(hidden))

Under tp (sequence parallel) the projections become :class:`Conv1DParallel` layers that keep
the Conv1D names and global shapes, so DCP checkpoints and Hugging Face state dicts load
across every config.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ...nn.linear import TPLinear, copy_to_tp, local
from ...ops import all_gather_matmul, matmul_reduce_scatter
from .base import ModelLayout
from .spec import ModelSpec
from .hf import HFAdapter

__all__ = ["Conv1DParallel", "GPT2Adapter"]


class Conv1DParallel(TPLinear):
    """A Hugging Face ``Conv1D`` split over the tp group, taking and giving sequence shards
    (``[B, S/W, in]``). Plain-PyTorch equivalent (``full`` the Conv1D, W ranks, r this rank)::

        x = torch.cat(all_gather(x_shard), dim=1)                         # column, qkv
        column: (x @ full.weight + full.bias).chunk(W, -1)[r]
        qkv:    torch.cat([y.chunk(W, -1)[r] for y in (x @ full.weight + full.bias).chunk(3, -1)], -1)
        row:    reduce_scatter(x_local @ full.weight.chunk(W, 0)[r], dim=1) + full.bias

    ``column``: weight ``Shard(1)``, bias ``Shard(0)``; ``row``: weight ``Shard(0)``, bias
    ``Replicate()``. ``qkv`` (GPT-2's fused ``c_attn``): this rank's heads are three column
    ranges of one weight, which no DTensor placement DCP can save describes, so the weight
    and bias stay whole (``Replicate()``, FSDP still shards them over dp); each rank
    multiplies only its heads' columns and the gradients are summed over tp."""

    PLACEMENTS = {"column": (Shard(1), Shard(0)), "row": (Shard(0), Replicate()),
                  "qkv": (Replicate(), Replicate())}

    def __init__(self, conv: nn.Module, tp_mesh, kind: str, backend: str | None = None):
        in_features, out_features = conv.weight.shape
        super().__init__(in_features, out_features, tp_mesh, True, None, backend)
        self.kind = kind
        split = {"column": out_features, "row": in_features, "qkv": out_features // 3}[kind]
        self._check_divisible(split, {"row": "in_features"}.get(kind, "out_features per part"))
        for name, placement in zip(("weight", "bias"), self.PLACEMENTS[kind]):
            full = getattr(conv, name).detach()
            part = full if isinstance(placement, Replicate) else \
                full.chunk(self.tp_size, placement.dim)[self.tp_rank]
            setattr(self, name, self._param(part.clone(), placement, getattr(conv, name).requires_grad))
        self.train(conv.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, dim = local(self.weight), local(self.bias), self._seq_dim(x)
        if self.kind == "row":
            y = matmul_reduce_scatter(x, weight, "sum", dim, self.group_name, backend=self.backend)
            return y + copy_to_tp(bias, self.group_name)
        if self.kind == "qkv":
            weight, bias = copy_to_tp(weight, self.group_name), copy_to_tp(bias, self.group_name)
            part = self.out_features // 3
            width = part // self.tp_size
            starts = [p * part + self.tp_rank * width for p in range(3)]
            weights = [weight.narrow(1, s, width) for s in starts]
            bias = torch.cat([bias.narrow(0, s, width) for s in starts])
        else:
            weights = [weight]
        _, outs = all_gather_matmul(x, weights, dim, self.group_name, return_A=False,
                                    backend=self.backend)
        return torch.cat(outs, -1) + bias


def _no_rotary(hidden, position_ids):
    """GPT-2 embeds positions (``wpe``) instead of rotating q and k."""
    return None


class GPT2Adapter(HFAdapter):
    def __init__(self):
        super().__init__("GPT2LMHeadModel (Conv1D projections, fused q/k/v, learned positions, "
                         "tied head)", ("gpt2",))

    # ---- where the parts are
    def embedding(self, model):
        return model.transformer.wte

    def set_embedding(self, model, module):
        """The token embedding; the position embedding goes with it (a pipeline stage
        without the first layers holds neither)."""
        model.transformer.wte = module
        if module is None:
            model.transformer.wpe = None

    def embeddings(self, model):
        return [model.transformer.wte, model.transformer.wpe]

    def layer_container(self, model):
        return model.transformer.h

    def keep_layers(self, model, keep):
        layers = model.transformer.h
        model.transformer.h = nn.ModuleDict({str(i): layers[i] for i in keep})

    def final_norm(self, model):
        return model.transformer.ln_f

    def set_final_norm(self, model, module):
        model.transformer.ln_f = module

    def rotary(self, model):
        return _no_rotary

    # ---- its forward around the layers
    def embed(self, model, input_ids, position_ids):
        """Token plus position embeddings, then the embedding dropout. Under tp the token
        embedding gives this rank's sequence shard, so the positions are cut the same way."""
        t, tokens = model.transformer, self.embedding(model)
        if getattr(tokens, "sequence_parallel", False):
            position_ids = position_ids.chunk(tokens.tp_size, -1)[tokens.tp_rank]
        return t.drop(tokens(input_ids) + t.wpe(position_ids))

    # ---- the parallelisms
    def apply_tp(self, layer, tp_mesh, backend, split_mlp, float8=None):
        """c_attn (q/k/v) and c_fc column-split, both c_proj row-split (:class:`Conv1DParallel`);
        the attention keeps this rank's heads; ln_1 / ln_2 run on sequence shards. ``float8``
        has nothing to take: Conv1D layers are not ``nn.Linear``, which torchao converts."""
        from ...nn import sync_replicated_grads

        attn, mlp, world = layer.attn, layer.mlp, tp_mesh.size()
        attn.c_attn = Conv1DParallel(attn.c_attn, tp_mesh, "qkv", backend)
        attn.c_proj = Conv1DParallel(attn.c_proj, tp_mesh, "row", backend)
        mlp.c_fc = Conv1DParallel(mlp.c_fc, tp_mesh, "column", backend)
        mlp.c_proj = Conv1DParallel(mlp.c_proj, tp_mesh, "row", backend)
        attn.split_size //= world  # c_attn's output: this rank's q | k | v
        attn.num_heads //= world
        attn.embed_dim //= world
        sync_replicated_grads(layer, tp_mesh)

    def apply_vocab_parallel(self, model, tp_mesh, backend):
        """wte and the tied head split over the vocabulary (as for Llama); wpe looks up this
        rank's sequence shard of the positions, so its gradient is summed over tp."""
        from ...nn import sync_replicated_grads

        super().apply_vocab_parallel(model, tp_mesh, backend)
        if model.transformer.wpe is not None:
            sync_replicated_grads(model.transformer.wpe, tp_mesh)

    def plan_spec(self, config, name):
        """GPT-2's keys (``n_embd``, ``n_layer``, ``n_head``, ``n_inner``, ``n_positions``);
        the head tied by default, the fused q/k/v whole on every tp rank."""
        hidden, heads = config["n_embd"], config["n_head"]
        return ModelSpec(
            name=name, vocab=config["vocab_size"], hidden=hidden, layers=config["n_layer"], heads=heads,
            kv_heads=heads, head_dim=hidden // heads, intermediate=config.get("n_inner") or 4 * hidden,
            tie_embeddings=bool(config.get("tie_word_embeddings", True)), mlp="gelu", norm="layer",
            linear_bias=True, positions=config.get("n_positions", 1024), attention="fused_qkv")

    def layout(self, model):
        config, layers = model.config, self.layers(model)
        return ModelLayout(
            layers=layers, moe=False, heads=config.n_head, kv_heads=config.n_head,
            head_dim=config.n_embd // config.n_head, vocab=config.vocab_size,
            intermediate=config.n_inner or 4 * config.n_embd, experts=None)
