"""``fusedpar.parallelize(model, config)``: FSDP2 + TP/SP + CP + EP on a whole causal LM.

Plain-PyTorch (torchtitan-style) equivalent, for ``mesh = config.build_mesh()``::

    for block in model.model.layers:                       # 1. TP/SP (fused shared gathers)
        parallelize_module(block, mesh["tp"], llama_tp_plan)  # an MoE block: no "mlp" entries,
        # it runs on the sequence shard; ep (below) borrows the tp ranks for its tokens
    parallelize_module(model, mesh["tp"], {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)})
    # 2. CP: ContextParallelAttention in each attention, batch zigzag-sharded in forward
    # 3. EP: ExpertParallelMoE in each fusedpar MoE block, ExpertParallelExperts as each HF
    #    block's experts: DTensors Shard(0) on the ep axis, FSDP-sharded over "efsdp"
    # 4. activation checkpointing per block (optional)
    for block in model.model.layers:                       # 5. FSDP2, per block then root
        fully_shard(block, mesh=mesh["dp_replicate", "dp_shard_cp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard_cp"], mp_policy=mp)
    with loss_parallel(): loss = cross_entropy(model(input_ids), shifted labels)

The model's ``forward(input_ids, labels=None, position_ids=None, attention_mask=None)``
(the mask all ones: no padding; no other arguments) is replaced by one that
takes this data-parallel rank's batch (:func:`shard_batch`; the same on every rank of a
tp/cp group), shards the sequence for CP itself, keeps the logits split over the
vocabulary (``output.logits`` is ``[B, S_local, V/tp]``) and returns the mean token loss
over the valid labels of the whole global batch (every rank returns the same value, the
single process's, however the ignored labels fall across ranks; ``_mean_loss``), computed
by a vocab-parallel cross-entropy; fusedpar's MoE blocks
add the load-balancing loss of the whole global batch (see ``_global_aux_loss``), and so
does a Hugging Face MoE model whose config asks for it (``output_router_logits``, see
``_RouterAuxLoss``), so the loss and every gradient are the single process's on the
global batch.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ParallelConfigError
from ..models.llama import (IGNORE_INDEX, CausalLMOutput, LlamaForCausalLM, decoder_forward,
                            shift_labels)
from ..nn import ColumnParallelLinear, sync_replicated_grads
from ..nn.embedding import VocabParallelEmbedding
from ..nn.sequence import vocab_parallel_cross_entropy
from .config import ParallelConfig, get_submesh
from .fsdp import shard_model
from .tp import apply_tp

__all__ = ["ModelLayout", "find_layout", "parallelize", "shard_batch"]

SUPPORTED = (
    "fusedpar.models.LlamaForCausalLM / MixtralForCausalLM and Hugging Face transformers "
    "LlamaForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, "
    "Qwen3MoeForCausalLM, OlmoeForCausalLM, DeepseekV3ForCausalLM, found by structure: "
    "model.embed_tokens, model.layers[i] with self_attn (q,k,v,o_proj linear layers for tp / "
    "cp), input_layernorm, post_attention_layernorm and a dense mlp (gate_proj/up_proj/"
    "down_proj) or an MoE mlp (fusedpar.nn.moe.MoEBlock or HF's gate router + stacked "
    "experts; dense and MoE layers may mix), model.norm, model.rotary_emb, lm_head"
)
_OWN_PLAN_HINT = (
    "For another architecture build your own plan from the same pieces: "
    "fusedpar.parallel.apply_tp(block, mesh['tp']) per block, "
    "fusedpar.nn.VocabParallelEmbedding / ColumnParallelLinear for the embedding and head, "
    "fusedpar.nn.sequence.vocab_parallel_cross_entropy for the loss, and "
    "fusedpar.parallel.fsdp.shard_model for FSDP2"
)


@dataclass
class ModelLayout:
    """What :func:`find_layout` found: the blocks and the sizes the config must divide.
    ``heads`` / ``kv_heads`` / ``head_dim`` are None, and ``attention`` says why, when the
    attention is not Llama-style q/k/v/o projections (tp and cp cannot split it);
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


def _is_moe(mlp: nn.Module) -> bool:
    from ..nn.moe import MoEBlock

    return isinstance(mlp, MoEBlock) or (hasattr(mlp, "experts") and hasattr(mlp, "gate"))


def find_layout(model: nn.Module) -> ModelLayout:
    """Recognise a Llama/Qwen2/Mixtral-style causal LM by its structure, or raise a
    ``TypeError`` listing what is supported and how to write one's own plan."""
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
        elif not _is_moe(mlp) and not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            problems.append(f"model.layers[{i}].mlp ({type(mlp).__name__}) is neither a "
                            "gate/up/down MLP nor a known MoE block")
        for n in ("input_layernorm", "post_attention_layernorm"):
            if not isinstance(getattr(layer, n, None), nn.Module):
                problems.append(f"no model.layers[{i}].{n}")
    if not problems:
        problems += _outer_forward_problems(model)
    if problems:
        raise TypeError(f"fusedpar.parallelize: {type(model).__name__} is not a supported model "
                        f"({'; '.join(problems)}). Supported: {SUPPORTED}. {_OWN_PLAN_HINT}")
    attn = layers[0].self_attn
    head_dim = getattr(attn, "head_dim", None)
    attention = [f"self_attn.{n} is not a linear layer" for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                 if getattr(getattr(attn, n, None), "weight", None) is None]
    if not isinstance(head_dim, int):
        attention.append(f"{type(attn).__name__} has no int head_dim")
    moe = [layer.mlp for layer in layers if _is_moe(layer.mlp)]
    dense = [layer.mlp for layer in layers if not _is_moe(layer.mlp)]
    experts = None
    if moe:
        experts = getattr(moe[0], "num_experts", None) or getattr(getattr(moe[0], "experts", None), "num_experts", None)
    layout = ModelLayout(
        layers=layers, moe=bool(moe),
        heads=None if attention else attn.q_proj.weight.shape[0] // head_dim,
        kv_heads=None if attention else attn.k_proj.weight.shape[0] // head_dim,
        head_dim=None if attention else head_dim, vocab=model.lm_head.weight.shape[0],
        intermediate=dense[0].gate_proj.weight.shape[0] if dense else None, experts=experts,
        attention="; ".join(attention) or None)
    layout.hf_aux_loss_problem = _hf_aux_loss_problem(model, layout)
    layout.sliding_window = _sliding_window(getattr(model, "config", None))
    return layout


def _outer_forward_problems(model: nn.Module) -> list[str]:
    """What ``model``'s own forward does around its layers that the parallelized forward
    (``decoder_forward``: embed_tokens -> layers -> norm, then lm_head) would not: scaled
    embeddings (Gemma), scaled or soft-capped logits (Cohere, Granite, Gemma 2). Found by
    running the model's forward with its layers taken out on four tokens, in eval mode
    and without the router aux loss, and comparing what reaches ``model.norm`` and what
    leaves ``lm_head`` with what the parallelized forward computes. fusedpar's own models
    (whose forward is ``decoder_forward``) and models on the meta device are not run."""
    first = next(model.parameters(), None)
    if isinstance(model, LlamaForCausalLM) or first is None or first.is_meta:
        return []
    inner, config = model.model, getattr(model, "config", None)
    layers, training = inner.layers, model.training
    router_logits = getattr(config, "output_router_logits", None)
    seen = {}
    hooks = [inner.norm.register_forward_pre_hook(lambda _, args: seen.setdefault("embedded", args[0])),
             model.lm_head.register_forward_hook(lambda *out: seen.setdefault("logits", out[2]))]
    ids = torch.arange(4, device=first.device)[None] % model.lm_head.weight.shape[0]
    inner.layers = nn.ModuleList()
    if router_logits:
        config.output_router_logits = False
    try:
        with torch.no_grad():
            logits = model.eval()(input_ids=ids).logits
            embedded = inner.embed_tokens(ids)
            decoder_forward(model, ids, None)  # e.g. a rotary embedding wanting a layer type
    except Exception as e:  # noqa: BLE001 - reported as the reason
        return [f"running its forward and the parallelized one without its layers failed "
                f"({type(e).__name__}: {e})"]
    finally:
        inner.layers = layers
        model.train(training)
        for hook in hooks:
            hook.remove()
        if router_logits:
            config.output_router_logits = router_logits
    problems = []
    if "embedded" not in seen or not torch.equal(seen["embedded"], embedded):
        problems.append("its forward changes the embeddings before the first layer (scales them?)")
    if "logits" not in seen or not torch.equal(seen["logits"].float(), logits.float()):
        problems.append("its forward changes lm_head's logits (scales or caps them?)")
    return problems


def _sliding_window(config) -> int | None:
    """The attention window of a Hugging Face config whose layers use one (Mistral; Qwen2 with
    ``use_sliding_window``; models listing ``sliding_attention`` in ``layer_types``), else None."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    return window if layer_types is None or "sliding_attention" in layer_types else None


def _check(layout: ModelLayout, cfg: ParallelConfig) -> None:
    """Everything the model and config must agree on, before any communication."""
    problems = []
    split = [f"{axis}={getattr(cfg, axis)}" for axis in ("tp", "cp") if getattr(cfg, axis) > 1]
    if split and layout.attention:
        problems.append(f"{' and '.join(split)}: tensor and context parallelism split Llama-style "
                        "attention (q/k/v/o projections, an int head_dim), and this model's is "
                        f"not ({layout.attention}); use tp=1 and cp=1 (dp_shard, dp_replicate and "
                        "ep split it)")
    if cfg.tp > 1:
        for what, size in (("attention heads", layout.heads), ("KV heads", layout.kv_heads),
                           ("vocab size", layout.vocab), ("intermediate size", layout.intermediate)):
            if size is not None and size % cfg.tp:
                problems.append(f"{what} {size} is not divisible by tp={cfg.tp}")
    if layout.hf_aux_loss_problem:
        problems.append(layout.hf_aux_loss_problem)
    if cfg.ep > 1:
        if not layout.moe:
            problems.append(f"ep={cfg.ep} but the model has no MoE blocks")
        elif layout.experts is not None and layout.experts % cfg.ep:
            problems.append(f"{layout.experts} experts are not divisible by ep={cfg.ep}")
    if problems:
        raise ParallelConfigError(f"fusedpar.parallelize({cfg.describe()}): " + "; ".join(problems))


# ---- the forward of a parallelized model ---------------------------------------------------------


@dataclass
class _Plan:
    config: ParallelConfig
    mesh: object
    tp_group: str | None
    cp_group: str | None
    loss_group: str | None  # dp_cp: the ranks holding other tokens (None when one)
    router_aux: _RouterAuxLoss | None = None
    sliding_window: int | None = None
    hf_masks: bool = False  # a Hugging Face model whose layers get HF's attention masks


def _check_batch(model: nn.Module, args, kwargs) -> None:
    """Forward pre-hook ahead of FSDP's (which all-gathers): bad shapes fail before any
    communication."""
    unknown = sorted(set(kwargs) - set(_FORWARD_ARGS))
    if unknown or len(args) + len(kwargs) > len(_FORWARD_ARGS):
        raise TypeError(f"parallelized forward takes {', '.join(_FORWARD_ARGS)}; got "
                        f"{len(args)} positional and {', '.join(unknown) or 'no other'} keyword "
                        "arguments")
    input_ids = kwargs["input_ids"] if "input_ids" in kwargs else (args[0] if args else None)
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError("parallelized forward: pass input_ids (a [batch, seq] tensor)")
    plan = model._fusedpar_plan
    _sequence_checks(plan, input_ids)
    positions = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    if plan.cp_group is not None and _is_hf(model) and positions is not None \
            and bool((positions.diff(dim=-1) != 1).any()):  # one host read, only when passed
        raise ValueError("parallelized forward: position_ids restart inside a row (packed "
                         "sequences), which Hugging Face models attend to as separate "
                         "documents; context parallelism attends over the whole row: use cp=1 "
                         "or unpacked rows")
    mask = kwargs.get("attention_mask", args[3] if len(args) > 3 else None)
    if mask is not None and not bool(mask.all()):  # one host read, only when a mask is passed
        raise ValueError("parallelized forward: attention_mask masks some positions, and the "
                         "parallelized forward runs causal attention over whole rows; pass no "
                         "attention_mask (right padding with labels = -100 at the pads gives the "
                         "same cross-entropy) or pack the sequences")


def _sequence_checks(plan: _Plan, input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"parallelized forward: input_ids must be [batch, seq], got "
                         f"{tuple(input_ids.shape)}")
    seq, cfg = input_ids.shape[1], plan.config
    if cfg.cp > 1 and seq % (2 * cfg.cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2*cp = {2 * cfg.cp} (context "
                         f"parallelism cuts it into 2*cp zigzag chunks); pad it to a multiple")
    if cfg.tp > 1 and (seq // cfg.cp) % cfg.tp:
        raise ValueError(f"sequence length {seq} (per cp rank {seq // cfg.cp}) is not divisible by "
                         f"tp={cfg.tp} (sequence parallelism splits it); pad it to a multiple")
    if plan.sliding_window is not None and seq > plan.sliding_window:
        raise ValueError(f"sequence length {seq} exceeds the model's sliding window "
                         f"{plan.sliding_window} (config.sliding_window), and the parallelized "
                         "forward attends over the whole causal prefix; use sequences of at most "
                         "that length")


def _mean_loss(per_token: torch.Tensor, target: torch.Tensor, group: str | None, ranks: int):
    """The mean over the valid tokens of the whole global batch, as one process computes it,
    whatever each rank's share of ignored labels. ``group``: the ranks holding other tokens
    (``dp_cp``, ``ranks`` of them; None when one), over which the sum and count are
    all-reduced; each rank's gradient is scaled by ``ranks``, because FSDP averages the
    gradients over them while the true gradient is their sum."""
    total, count = per_token.sum(), (target != IGNORE_INDEX).sum()
    if group is None:
        return total / count
    both = torch.stack([total.detach(), count.to(total.dtype)])
    both = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(both, "sum", group))
    scaled = total * ranks / both[1]
    return both[0] / both[1] + (scaled - scaled.detach())


def _parallel_forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
    """``input_ids`` / ``labels`` / ``position_ids``: this data-parallel rank's batch, the
    full sequence (the same on every rank of a tp / cp group). ``attention_mask``: only all
    ones (checked in ``_check_batch``). No ``**kwargs``: Hugging Face's Trainer then
    divides the loss by the gradient-accumulation steps itself instead of passing
    ``num_items_in_batch``, which this forward would not use."""
    plan: _Plan = self._fusedpar_plan
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    target = None if labels is None else shift_labels(labels)
    if plan.cp_group is not None:
        input_ids, position_ids, target = _cp_shard(plan, input_ids, position_ids, target)
    if plan.router_aux is not None:
        plan.router_aux.logits.clear()  # what a recompute in the last backward recorded
    mask = _hf_attention_mask(self, input_ids, position_ids) if plan.hf_masks else None
    hidden, aux = decoder_forward(self, input_ids, position_ids, mask)
    logits = self.lm_head(hidden)
    loss = None
    if target is not None:
        if plan.tp_group is not None:
            per_token = vocab_parallel_cross_entropy(logits, target, plan.tp_group)
        else:
            per_token = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(),
                                        ignore_index=IGNORE_INDEX, reduction="none")
        loss = _mean_loss(per_token, target, plan.loss_group, plan.config.dp * plan.config.cp)
    if plan.router_aux is not None:  # Hugging Face MoE: its forward's load-balancing term
        aux = plan.router_aux.loss()
        loss = None if loss is None else loss + plan.router_aux.coef * aux
    output = getattr(self, "_output", None)
    return output(loss, logits, aux) if output is not None else CausalLMOutput(loss, logits, aux)


_FORWARD_ARGS = tuple(inspect.signature(_parallel_forward).parameters)[1:]


def _hf_attention_mask(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor):
    """The mask a Hugging Face model's own forward gives its layers
    (``transformers.masking_utils.create_causal_mask``): None where the attention is causal by
    itself (sdpa, flash), the causal mask for eager attention, and a block-diagonal one
    where ``position_ids`` restart (packed sequences). Only the batch and sequence sizes
    and the dtype of the (dummy) embeddings matter to it; the layers may see sequence
    shards, the mask spans the whole sequence, as attention does."""
    from transformers.masking_utils import create_causal_mask

    embeds = torch.empty(*input_ids.shape, 0, dtype=model.model.embed_tokens.weight.dtype,
                         device=input_ids.device)
    return create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                              past_key_values=None, position_ids=position_ids)


def _cp_shard(plan: _Plan, *tensors):
    from .cp import zigzag_shard

    pg = dist.distributed_c10d._resolve_process_group(plan.cp_group)
    return tuple(None if t is None else zigzag_shard(t, 1, pg.rank(), pg.size()) for t in tensors)


# ---- the steps ---------------------------------------------------------------------------------


def _apply_tensor_parallel(model: nn.Module, layout: ModelLayout, tp_mesh, backend) -> None:
    """TP + SP on attention and dense MLPs; an MoE block stays whole and runs on this rank's
    sequence shard (its tokens reach the experts through ep; ``_sync_moe_over_tp``)."""
    for layer in layout.layers:
        apply_tp(layer, tp_mesh, sequence_parallel=True, backend=backend,
                 split_mlp=not _is_moe(layer.mlp))
    inner = model.model
    tied = model.lm_head.weight is inner.embed_tokens.weight
    inner.embed_tokens = VocabParallelEmbedding.from_embedding(
        inner.embed_tokens, tp_mesh, sequence_parallel=True, backend=backend)
    model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, tp_mesh, sequence_parallel=True,
                                                     backend=backend)
    if tied:
        model.lm_head.weight = inner.embed_tokens.weight
    sync_replicated_grads(inner.norm, tp_mesh)  # the final norm runs on sequence shards


class _CPCore(nn.Module):
    """fusedpar's own attention core ``(q, k, v) [B, S, H, D] -> out`` over the cp group."""

    def __init__(self, cp: nn.Module):
        super().__init__()
        self.cp = cp

    def forward(self, q, k, v):
        return self.cp.attend(q, k, v, True, None)


def _apply_context_parallel(model: nn.Module, layout: ModelLayout, cp_mesh) -> None:
    from ..models.llama import SDPAttention
    from ..nn.attention import ContextParallelAttention, set_hf_context_parallel_group

    cp = ContextParallelAttention(cp_mesh)
    own = [layer.self_attn for layer in layout.layers
           if isinstance(getattr(layer.self_attn, "core", None), SDPAttention)]
    for attn in own:
        attn.core = _CPCore(cp)
    if len(own) != len(layout.layers):  # Hugging Face: its AttentionInterface
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "_attn_implementation"):
            raise TypeError(f"fusedpar.parallelize: cp needs fusedpar's attention core or a "
                            f"Hugging Face model (config._attn_implementation); "
                            f"{type(model).__name__} has neither")
        set_hf_context_parallel_group(cp_mesh)
        config._attn_implementation = "fusedpar_cp"


def _sync_moe_over_tp(layout: ModelLayout, tp_mesh, ep: int) -> None:
    """With tp > 1 each rank's MoE blocks see its sequence shard, other tokens than its tp
    peers': the gradients of their replicated parameters are summed over tp. Left out: the
    parameters that ep splits (each owner gets every rank's tokens' gradients through the
    exchange) and fusedpar's router under ep (summed over the ep group, which holds the tp
    ranks or sits beside them in efsdp, in the experts' FSDP unit)."""
    from ..nn.moe import ExpertParallelMoE

    for layer in layout.layers:
        if isinstance(layer.mlp, ExpertParallelMoE):
            continue
        if _is_moe(layer.mlp):
            sync_replicated_grads(layer.mlp, tp_mesh, skip=(layer.mlp.experts,) if ep > 1 else ())


def _apply_expert_parallel(model: nn.Module, layout: ModelLayout, ep_mesh) -> list[nn.Module]:
    """Split the experts of each MoE block over the 1-D ``ep_mesh`` and return the modules
    holding them (FSDP2 shards those over ``efsdp``). fusedpar's ``MoEBlock`` becomes an
    ``ExpertParallelMoE`` (same parameter names); its router sees only this rank's tokens
    and sits in the experts' FSDP unit, so its gradient is also summed over the ep group.
    A Hugging Face block keeps its router (in the layer's FSDP unit, reduced over every
    data-parallel rank) and gets ``ExpertParallelExperts`` under HF's names."""
    from ..nn.moe import ExpertParallelExperts, ExpertParallelMoE, MoEBlock

    units = []
    for layer in layout.layers:
        if isinstance(layer.mlp, MoEBlock):
            layer.mlp = ExpertParallelMoE.from_module(layer.mlp, ep_mesh)
            sync_replicated_grads(layer.mlp.router, ep_mesh)
            units.append(layer.mlp)
        elif _is_moe(layer.mlp):  # dense layers (DeepSeek-V3's first ones) stay as they are
            layer.mlp.experts = ExpertParallelExperts.from_module(layer.mlp, ep_mesh)
            units.append(layer.mlp.experts)
    return units


class _RouterAuxLoss:
    """A Hugging Face MoE model's forward adds ``router_aux_loss_coef *
    load_balancing_loss_func(router logits of every layer)`` to the loss when
    ``config.output_router_logits``; the parallelized forward replaces HF's, so this keeps
    that term: forward hooks record each MoE layer's router logits, and :meth:`loss` is
    the same loss over the tokens of every rank of ``group`` (the single process's on the
    global batch; see :func:`fusedpar.nn.moe.load_balancing_loss` for ``grad_scale``)."""

    def __init__(self, model: nn.Module, layout: ModelLayout, group: str, grad_scale: float):
        self.top_k, self.coef = model.num_experts_per_tok, model.router_aux_loss_coef
        self.group, self.grad_scale = group, grad_scale
        self.logits: list[torch.Tensor] = []
        for layer in layout.layers:
            if _is_moe(layer.mlp):
                layer.mlp.gate.register_forward_hook(self._record)

    def _record(self, gate, args, output) -> None:
        self.logits.append(output[0] if isinstance(output, tuple) else output)

    def loss(self) -> torch.Tensor:
        from ..nn.moe import load_balancing_loss

        logits, self.logits = torch.cat(self.logits), []
        topk_idx = logits.softmax(-1).topk(self.top_k, dim=-1).indices  # as HF recomputes it
        return load_balancing_loss(logits, topk_idx, self.group, self.grad_scale)


def _is_hf(model: nn.Module) -> bool:
    """A Hugging Face transformers model (whose own forward builds its attention masks)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _adds_router_aux_loss(model: nn.Module, layout: ModelLayout) -> bool:
    """Whether ``model`` is a Hugging Face MoE model whose forward adds a router aux loss."""
    return (layout.moe and hasattr(model, "router_aux_loss_coef")
            and bool(getattr(getattr(model, "config", None), "output_router_logits", False)))


def _hf_aux_loss_problem(model: nn.Module, layout: ModelLayout) -> str | None:
    """Why the parallelized forward cannot add ``model``'s router aux loss (None: it can, or
    there is none): it reproduces Mixtral's ``load_balancing_loss_func`` (the Switch loss
    over every layer's logits at once), checked against the model's own on random logits."""
    from ..ops.moe import topk_route

    if not _adds_router_aux_loss(model, layout):
        return None
    hf_loss = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    experts, k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if hf_loss is not None and isinstance(experts, int) and isinstance(k, int):
        g = torch.Generator().manual_seed(0)
        logits = tuple(torch.randn(6, experts, generator=g) for _ in range(2))
        try:
            if torch.allclose(hf_loss(logits, experts, k, None), topk_route(torch.cat(logits), k)[2]):
                return None
        except Exception:  # noqa: BLE001 - another signature: not the loss reproduced here
            pass
    return (f"config.output_router_logits=True, and {type(model).__name__}'s load-balancing "
            "loss is not the Mixtral / Switch one the parallelized forward reproduces; set "
            "config.output_router_logits=False")


def _global_aux_loss(layout: ModelLayout, cfg: ParallelConfig, group: str) -> None:
    """fusedpar's MoE blocks compute the load-balancing loss of the whole global batch (the
    single-process loss), summing the routing statistics over ``group``, every rank holding
    other tokens (dp_replicate x dp_shard x cp, x tp under sequence parallelism); FSDP
    averages gradients over the data-parallel ranks (tp sums them first), so the aux loss's
    gradient is scaled by their number."""
    from ..nn.moe import set_aux_loss_group

    ranks = cfg.dp * cfg.cp
    if ranks * cfg.tp == 1:
        return
    for layer in layout.layers:
        if hasattr(layer.mlp, "aux_group"):
            set_aux_loss_group(layer.mlp, group, ranks)


def _apply_activation_checkpointing(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def _dtype(name: str | None):
    return None if name is None else getattr(torch, name)


def parallelize(model: nn.Module, config: ParallelConfig | Mapping | None = None, *,
                activation_checkpointing: bool = False, mesh=None, device_type: str | None = None,
                backend: str | None = None) -> nn.Module:
    """Parallelize ``model`` in place over every rank of the default process group and
    return it (see the module docstring for the plain-PyTorch equivalent).

    - ``config``: a :class:`~fusedpar.parallel.ParallelConfig` or a dict of its keys
      (fusedpar's, Axolotl's or torchtitan's names); None = FSDP over every rank.
      ``param_dtype`` / ``reduce_dtype`` set FSDP2's ``MixedPrecisionPolicy``;
      ``fsdp_comm="fusedpar"`` (default) runs FSDP2's collectives on fusedpar's ops,
      ``"torch"`` on torch's.
    - ``mesh``: a mesh from ``config.build_mesh()`` (built here when None, on
      ``device_type``: "cuda" when available, else "cpu").
    - ``backend``: forced backend of the fused TP ops (default: chosen per call).

    Raises :class:`~fusedpar.errors.ParallelConfigError` (a ValueError) before any
    communication when the config does not fit the world size or the model (heads, KV
    heads, vocabulary or intermediate size not divisible by tp, experts by ep, an axis
    whose module is not available), ``TypeError`` for an unsupported model. The model
    keeps its parameter names (``state_dict`` keys), so Hugging Face checkpoints still
    map onto it; its parameters become DTensors (see :mod:`fusedpar.parallel.checkpoint`).
    After the call, ``model.fusedpar_mesh`` is the mesh and ``model.fusedpar_config`` the
    resolved config.
    """
    if getattr(model, "_fusedpar_plan", None) is not None:
        raise ValueError("fusedpar.parallelize: this model is already parallelized")
    if config is None:
        config = ParallelConfig()
    elif isinstance(config, Mapping):
        config = ParallelConfig.from_dict(config)
    elif not isinstance(config, ParallelConfig):
        raise TypeError(f"fusedpar.parallelize: config must be a ParallelConfig or a dict, got "
                        f"{type(config).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("fusedpar.parallelize: torch.distributed is not initialized; launch with "
                           "torchrun (or call init_process_group) first")
    cfg = config.validate(dist.get_world_size())
    layout = find_layout(model)
    _check(layout, cfg)
    # ---- communication starts here
    if mesh is None:
        mesh = cfg.build_mesh(device_type)
    tp_mesh = mesh["tp"]
    if cfg.tp > 1:
        _apply_tensor_parallel(model, layout, tp_mesh, backend)
    if cfg.cp > 1:
        _apply_context_parallel(model, layout, mesh["cp"])
    expert_units = []
    if cfg.ep > 1:
        ep_mesh = cfg.build_ep_mesh(device_type)
        experts = _apply_expert_parallel(model, layout, ep_mesh["ep"])
        efsdp = ep_mesh["dp_replicate", "efsdp"] if cfg.dp_replicate > 1 else ep_mesh["efsdp"]
        expert_units = [(block, efsdp) for block in experts]
    dp_cp = get_submesh(mesh, "dp_cp").get_group().group_name
    # the ranks whose MoE blocks see other tokens: every one under tp (sequence shards)
    tokens_group = dist.group.WORLD.group_name if cfg.tp > 1 else dp_cp
    if layout.moe:
        if cfg.tp > 1:
            _sync_moe_over_tp(layout, tp_mesh, cfg.ep)
        _global_aux_loss(layout, cfg, tokens_group)
    router_aux = None
    if _adds_router_aux_loss(model, layout):
        router_aux = _RouterAuxLoss(model, layout, tokens_group, cfg.dp * cfg.cp)
    if activation_checkpointing:
        _apply_activation_checkpointing(model)
    dp_mesh = get_submesh(mesh, ("dp_replicate", "dp_shard_cp") if cfg.dp_replicate > 1 else "dp_shard_cp")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=_dtype(cfg.param_dtype), reduce_dtype=_dtype(cfg.reduce_dtype))
    shard_model(model, list(model.model.layers), dp_mesh, mp, comm=cfg.fsdp_comm,
                extra_units=expert_units)
    for block, _ in expert_units:
        # reduced over efsdp (x dp_replicate) but averaged over every data-parallel rank:
        # the ep ranks' tokens already met in the experts (torchtitan's divide factor)
        block.set_gradient_divide_factor(float(cfg.dp_replicate * cfg.dp_shard * cfg.cp))
        # sum then divide (fusedpar's reduce_scatter has no PREMUL_SUM); with one efsdp rank
        # FSDP divides by the factor itself and would divide twice under forced sums
        block.set_force_sum_reduction_for_comms(cfg.efsdp > 1)
    model._fusedpar_plan = _Plan(cfg, mesh, tp_mesh.get_group().group_name if cfg.tp > 1 else None,
                                 mesh["cp"].get_group().group_name if cfg.cp > 1 else None,
                                 dp_cp if cfg.dp * cfg.cp > 1 else None, router_aux,
                                 layout.sliding_window,
                                 hf_masks=_is_hf(model) and cfg.cp == 1)
    model.fusedpar_mesh, model.fusedpar_config = mesh, cfg
    model.forward = types.MethodType(_parallel_forward, model)
    model.register_forward_pre_hook(_check_batch, prepend=True, with_kwargs=True)
    return model


def shard_batch(batch, mesh):
    """This rank's part of a global batch: tensors (or a dict / tuple / list of them) split
    along dim 0 over the data-parallel ranks (``dp_replicate x dp_shard``); every rank of a
    tp / cp group gets the same part (the parallelized forward shards the sequence for CP
    itself). Same as ``t.chunk(dp, 0)[dp_rank]``; the batch size must divide by dp."""
    dp_mesh = get_submesh(mesh, "dp")
    dp, rank = dp_mesh.size(), dp_mesh.get_local_rank()

    def split(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.shape[0] % dp:
            raise ValueError(f"shard_batch: batch size {t.shape[0]} is not divisible by the "
                             f"data-parallel size {dp} (dp_replicate x dp_shard)")
        return t.chunk(dp, 0)[rank]

    if isinstance(batch, Mapping):
        return {k: split(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(split(t) for t in batch)
    return split(batch)
