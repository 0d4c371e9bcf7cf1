"""The per-axis steps of ``parallelize``, in torchtitan's order: TP/SP, CP, EP, activation
checkpointing, FSDP2 (see :mod:`fusedpar.parallel.parallelize` for the plain-PyTorch
equivalent), and the config checks that precede them. Each step takes the model (or a
pipeline stage's part of it), its adapter and the decoder layers it holds."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ParallelConfigError
from ..nn import sync_replicated_grads
from .adapters import ModelAdapter, ModelLayout, is_moe
from .config import ParallelConfig, get_submesh
from .fsdp import shard_model

__all__ = ["apply_all", "apply_fsdp", "apply_model_parallel", "check", "tokens_group"]


def check(model: nn.Module, adapter: ModelAdapter, layout: ModelLayout, cfg: ParallelConfig) -> None:
    """Everything the model and config must agree on, before any communication."""
    problems = []
    split = [f"{axis}={getattr(cfg, axis)}" for axis in ("tp", "cp") if getattr(cfg, axis) > 1]
    if split and layout.attention:
        problems.append(f"{' and '.join(split)}: tensor and context parallelism split Llama-style "
                        "attention (q/k/v/o projections, an int head_dim), and this model's is "
                        f"not ({layout.attention}); use tp=1 and cp=1 (dp_shard, dp_replicate and "
                        "ep split it)")
    problems += adapter.parallel_problems(model, cfg.tp, cfg.cp)
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


def apply_all(model: nn.Module, adapter: ModelAdapter, layers: list[nn.Module], cfg: ParallelConfig,
              mesh, ep_mesh, *, activation_checkpointing: bool, backend: str | None) -> None:
    """TP/SP, CP, EP, activation checkpointing (:func:`apply_model_parallel`), then FSDP2
    (:func:`apply_fsdp`) on ``model`` holding ``layers``."""
    experts = apply_model_parallel(model, adapter, layers, cfg, mesh, ep_mesh,
                                   activation_checkpointing=activation_checkpointing, backend=backend)
    apply_fsdp(model, layers, experts, cfg, mesh)


def apply_model_parallel(model: nn.Module, adapter: ModelAdapter, layers: list[nn.Module],
                         cfg: ParallelConfig, mesh, ep_mesh, *, activation_checkpointing: bool,
                         backend: str | None) -> list[tuple[nn.Module, object]]:
    """TP/SP, CP, EP and activation checkpointing on ``model`` holding ``layers`` (a
    pipeline stage's part lacks some of the layers, and the embedding or the norm and head:
    those are None); ``layers`` is updated in place. Returns the expert-parallel modules
    with the mesh FSDP2 shards each over. ``ep_mesh``: :meth:`ParallelConfig.build_ep_mesh`'s
    (None when ep == 1)."""
    tp_mesh = mesh["tp"]
    moe = any(is_moe(layer.mlp) for layer in layers)
    if cfg.tp > 1:
        float8 = None
        if cfg.float8 is not None:  # the layers float8.convert made torchao's, in fp8 under tp too
            from .float8 import tp_recipe
            float8 = tp_recipe(cfg)
        for layer in layers:
            adapter.apply_tp(layer, tp_mesh, backend, split_mlp=not is_moe(layer.mlp), float8=float8)
        adapter.apply_vocab_parallel(model, tp_mesh, backend)
        if adapter.final_norm(model) is not None:  # it runs on sequence shards
            sync_replicated_grads(adapter.final_norm(model), tp_mesh)
    if cfg.cp > 1:
        adapter.apply_context_parallel(model, layers, mesh["cp"])
    expert_units = []
    if cfg.ep > 1:
        # float8: the experts and their dispatch in fp8 where the recipe casts per token
        experts = _apply_expert_parallel(layers, ep_mesh["ep"],
                                         cfg.float8 if cfg.float8 not in (None, "tensorwise") else None)
        efsdp = ep_mesh["dp_replicate", "efsdp"] if cfg.dp_replicate > 1 else ep_mesh["efsdp"]
        expert_units = [(block, efsdp) for block in experts]
    if moe:
        if cfg.tp > 1:
            _sync_moe_over_tp(layers, tp_mesh, cfg.ep)
        _global_aux_loss(layers, cfg, tokens_group(cfg, mesh))
    if activation_checkpointing:
        layers[:] = _checkpoint_layers(adapter.layer_container(model), layers)
    return expert_units


def apply_fsdp(root: nn.Module, layers: list[nn.Module], expert_units: list, cfg: ParallelConfig,
               mesh) -> None:
    """FSDP2 per layer (and expert unit), then ``root``, over ``dp_shard_cp`` (HSDP with
    ``dp_replicate``), with the config's mixed precision and collectives."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dp_mesh = get_submesh(mesh, ("dp_replicate", "dp_shard_cp") if cfg.dp_replicate > 1 else "dp_shard_cp")
    mp = MixedPrecisionPolicy(param_dtype=_dtype(cfg.param_dtype), reduce_dtype=_dtype(cfg.reduce_dtype))
    shard_model(root, layers, dp_mesh, mp, comm=cfg.fsdp_comm, extra_units=expert_units)
    for block, _ in expert_units:
        # reduced over efsdp (x dp_replicate) but averaged over every data-parallel rank:
        # the ep ranks' tokens already met in the experts (torchtitan's divide factor)
        block.set_gradient_divide_factor(float(cfg.dp_replicate * cfg.dp_shard * cfg.cp))
        # sum then divide (fusedpar's reduce_scatter has no PREMUL_SUM); with one efsdp rank
        # FSDP divides by the factor itself and would divide twice under forced sums
        block.set_force_sum_reduction_for_comms(cfg.efsdp > 1)


def tokens_group(cfg: ParallelConfig, mesh) -> str:
    """The ranks whose MoE blocks see other tokens of the same step: every rank of this
    pipeline stage under tp (sequence shards), else dp_cp."""
    if cfg.tp > 1 and cfg.pp > 1:  # every rank of this stage
        return mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp").get_group().group_name
    if cfg.tp > 1:
        return dist.group.WORLD.group_name
    return get_submesh(mesh, "dp_cp").get_group().group_name


def _sync_moe_over_tp(layers: list[nn.Module], tp_mesh, ep: int) -> None:
    """With tp > 1 each rank's MoE blocks see its sequence shard, other tokens than its tp
    peers': the gradients of their replicated parameters are summed over tp. Left out: the
    parameters that ep splits (each owner gets every rank's tokens' gradients through the
    exchange) and fusedpar's router under ep (summed over the ep group, which holds the tp
    ranks or sits beside them in efsdp, in the experts' FSDP unit)."""
    from ..nn.moe import ExpertParallelMoE

    for layer in layers:
        if isinstance(layer.mlp, ExpertParallelMoE):
            continue
        if is_moe(layer.mlp):
            sync_replicated_grads(layer.mlp, tp_mesh, skip=(layer.mlp.experts,) if ep > 1 else ())


def _apply_expert_parallel(layers: list[nn.Module], ep_mesh, float8: str | None) -> list[nn.Module]:
    """Split the experts of each MoE block over the 1-D ``ep_mesh`` and return the modules
    holding them (FSDP2 shards those over ``efsdp``). fusedpar's ``MoEBlock`` becomes an
    ``ExpertParallelMoE`` (same parameter names); its router sees only this rank's tokens
    and sits in the experts' FSDP unit, so its gradient is also summed over the ep group.
    A Hugging Face block keeps its router (in the layer's FSDP unit, reduced over every
    data-parallel rank) and gets ``ExpertParallelExperts`` under HF's names. ``float8``: a
    rowwise recipe for the experts' GEMMs and dispatch, or None."""
    from ..nn.moe import ExpertParallelExperts, ExpertParallelMoE, MoEBlock

    units = []
    for layer in layers:
        if isinstance(layer.mlp, MoEBlock):
            layer.mlp = ExpertParallelMoE.from_module(layer.mlp, ep_mesh, float8=float8)
            sync_replicated_grads(layer.mlp.router, ep_mesh)
            units.append(layer.mlp)
        elif is_moe(layer.mlp):  # dense layers (DeepSeek-V3's first ones) stay as they are
            layer.mlp.experts = ExpertParallelExperts.from_module(layer.mlp, ep_mesh, float8=float8)
            units.append(layer.mlp.experts)
    return units


def _global_aux_loss(layers: list[nn.Module], cfg: ParallelConfig, group: str) -> None:
    """fusedpar's MoE blocks compute the load-balancing loss of the whole global batch (the
    single-process loss), summing the routing statistics over ``group``, every rank holding
    other tokens (dp_replicate x dp_shard x cp, x tp under sequence parallelism); FSDP
    averages gradients over the data-parallel ranks (tp sums them first), so the aux loss's
    gradient is scaled by their number."""
    from ..nn.moe import set_aux_loss_group

    ranks = cfg.dp * cfg.cp
    if ranks * cfg.tp == 1:
        return
    for layer in layers:
        if hasattr(layer.mlp, "aux_group"):
            set_aux_loss_group(layer.mlp, group, ranks)


def _checkpoint_layers(container: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """Each of ``layers`` wrapped in torch's ``checkpoint_wrapper``, in its place in
    ``container`` (the module holding the model's decoder layers)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = []
    for name, layer in list(container.named_children()):
        if any(layer is l for l in layers):
            new = checkpoint_wrapper(layer, preserve_rng_state=False)
            setattr(container, name, new)
            wrapped.append(new)
    return wrapped


def _dtype(name: str | None):
    return None if name is None else getattr(torch, name)


class RouterAuxLoss:
    """A Hugging Face MoE model's forward adds ``router_aux_loss_coef *
    load_balancing_loss_func(router logits of every layer)`` to the loss when
    ``config.output_router_logits``; the parallelized forward replaces HF's, so this keeps
    that term: forward hooks record each MoE layer's router logits, and :meth:`loss` is
    the same loss over the tokens of every rank of ``group`` (the single process's on the
    global batch; see :func:`fusedpar.nn.moe.load_balancing_loss` for ``grad_scale``)."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], group: str, grad_scale: float):
        self.top_k, self.coef = model.num_experts_per_tok, model.router_aux_loss_coef
        self.group, self.grad_scale = group, grad_scale
        self.logits: list[torch.Tensor] = []
        for layer in layers:
            if is_moe(layer.mlp):
                layer.mlp.gate.register_forward_hook(self._record)

    def _record(self, gate, args, output) -> None:
        self.logits.append(output[0] if isinstance(output, tuple) else output)

    def loss(self) -> torch.Tensor:
        from ..nn.moe import load_balancing_loss

        logits, self.logits = torch.cat(self.logits), []
        topk_idx = logits.softmax(-1).topk(self.top_k, dim=-1).indices  # as HF recomputes it
        return load_balancing_loss(logits, topk_idx, self.group, self.grad_scale)
