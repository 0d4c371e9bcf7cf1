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

The model's family is found by :func:`fusedpar.parallel.adapters.find_adapter` (where
its parts are, what its forward does around them); with ``pp > 1`` the layers are cut into
pipeline stages first and each stage gets the steps above (:mod:`fusedpar.parallel.pipeline`).
One training step is the same call in every config: ``loss = forward_backward(model,
input_ids, labels)`` (pp: the schedule's step; otherwise forward + ``backward``). Without pp, the
model's ``forward(input_ids, labels=None, position_ids=None, attention_mask=None)``
(the mask all ones: no padding; no other arguments) is replaced by one that
takes this data-parallel rank's batch (:func:`shard_batch`; the same on every rank of a
tp/cp group), shards the sequence for CP itself, keeps the logits split over the
vocabulary (``output.logits`` is ``[B, S_local, V/tp]``) and returns the mean token loss
over the valid labels of the whole global batch (every rank returns the same value, the
single process's, however the ignored labels fall across ranks; ``forward.mean_loss``), computed
by a vocab-parallel cross-entropy; fusedpar's MoE blocks
add the load-balancing loss of the whole global batch (see ``steps._global_aux_loss``), and so
does a Hugging Face MoE model whose config asks for it (``output_router_logits``, see
``steps.RouterAuxLoss``), so the loss and every gradient are the single process's on the
global batch.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..comm.groups import settle_gloo_workers_at_exit
from .adapters import find_adapter, is_hf
from .adapters.hf import adds_router_aux_loss
from .config import ParallelConfig, get_submesh
from .forward import Plan, check_attention_mask, check_batch, parallel_forward
from .pipeline import check_pipeline, pipeline_stages
from .steps import RouterAuxLoss, apply_all, check, tokens_group

__all__ = ["forward_backward", "parallelize", "shard_batch"]


GENERATE_HINT = (
    "generate() on a model parallelized by fusedpar: its forward takes whole training "
    "sequences (no KV cache, logits split over tp ranks). Gather the weights into the plain "
    "model and generate with that: `plain = fusedpar.integrations.hf.unparallelized(model)` "
    "on every rank (fusedpar.parallel.checkpoint.full_state_dict loaded into "
    "type(model)(model.config)), then `plain.generate(...)`")


def _refuse_generate(*args, **kwargs):
    raise NotImplementedError(GENERATE_HINT)


def parallelize(model: nn.Module, config: ParallelConfig | Mapping | None = None, *,
                activation_checkpointing: bool = False, mesh=None, device_type: str | None = None,
                backend: str | None = None) -> nn.Module:
    """Parallelize ``model`` in place over every rank of the default process group and
    return it (see the module docstring for the plain-PyTorch equivalent).

    - ``config``: a :class:`~fusedpar.parallel.ParallelConfig` or a dict of its keys
      (fusedpar's, Axolotl's or torchtitan's names); None = FSDP over every rank.
      ``param_dtype`` / ``reduce_dtype`` set FSDP2's ``MixedPrecisionPolicy``;
      ``fsdp_comm="fusedpar"`` (default) runs FSDP2's collectives on fusedpar's ops,
      ``"torch"`` on torch's. ``float8``: torchao float8 training with fp8 FSDP all-gathers
      (:mod:`fusedpar.parallel.float8`).
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
    if getattr(model, "fusedpar_mesh", None) is not None:
        raise ValueError("fusedpar.parallelize: this model is already parallelized")
    cfg = _resolve(config)
    float8 = None
    if cfg.float8 is not None:  # torchao is imported only for float8 (the fp8 extra)
        from . import float8
    adapter = find_adapter(model)
    layout = adapter.layout(model)
    check(model, adapter, layout, cfg)
    if cfg.pp > 1:
        check_pipeline(model, adapter, layout, cfg, adds_router_aux_loss(model, layout))
    # ---- communication starts here
    if mesh is None:
        mesh = cfg.build_mesh(device_type)
    if mesh.device_type == "cpu":
        settle_gloo_workers_at_exit()  # the model holds gloo groups past destroy_process_group
    ep_mesh = cfg.build_ep_mesh(device_type) if cfg.ep > 1 else None
    tp_group = mesh["tp"].get_group().group_name if cfg.tp > 1 else None
    if float8 is not None:
        float8.convert(model, adapter.head(model), layout.layers, cfg,
                       activation_checkpointing=activation_checkpointing, device_type=mesh.device_type)
    if cfg.pp > 1:
        pipeline_stages(model, adapter, layout, cfg, mesh, ep_mesh,
                        activation_checkpointing=activation_checkpointing, backend=backend,
                        tp_group=tp_group, dp_group=get_submesh(mesh, "dp").get_group() if cfg.dp > 1 else None)
        if float8 is not None:
            float8.install_hooks(model)
        model.fusedpar_mesh, model.fusedpar_config = mesh, cfg
        return model
    router_aux = None
    if adds_router_aux_loss(model, layout):
        router_aux = RouterAuxLoss(model, layout.layers, tokens_group(cfg, mesh), cfg.dp * cfg.cp)
    apply_all(model, adapter, layout.layers, cfg, mesh, ep_mesh,
              activation_checkpointing=activation_checkpointing, backend=backend)
    if float8 is not None:
        float8.install_hooks(model)
    dp_cp = get_submesh(mesh, "dp_cp").get_group().group_name
    model._fusedpar_plan = Plan(adapter, cfg, mesh, tp_group,
                                mesh["cp"].get_group().group_name if cfg.cp > 1 else None,
                                dp_cp if cfg.dp * cfg.cp > 1 else None, router_aux,
                                # cp: the ring attention applies each layer's window itself
                                layout.sliding_window if cfg.cp == 1 else None,
                                hf_masks=is_hf(model) and cfg.cp == 1)
    model.fusedpar_mesh, model.fusedpar_config = mesh, cfg
    model.forward = types.MethodType(parallel_forward, model)
    if hasattr(model, "generate"):  # Hugging Face models: refuse at once, saying what works
        model.generate = _refuse_generate
    model.register_forward_pre_hook(check_batch, prepend=True, with_kwargs=True)
    return model


def _resolve(config) -> ParallelConfig:
    """``config`` as a ParallelConfig validated against the default group's world size."""
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
    return config.validate(dist.get_world_size())


def forward_backward(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                     position_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One forward and backward on this data-parallel rank's batch (``[batch, seq]``, as
    :func:`shard_batch` gives it), the same call for every config: a pipeline-parallel model
    (``pp > 1``) runs its schedule's step (the microbatches through every stage, forward
    and backward), any other model ``model(input_ids, labels=labels,
    position_ids=position_ids).loss.backward()``. Returns the loss (detached: the global
    batch's mean token loss, the same on every rank); the gradients are in ``.grad``, and
    ``optimizer.step()`` / ``zero_grad()`` stay the caller's. ``attention_mask``: None or
    all ones (a Hugging Face batch's; the parallelized forward attends over whole rows).

    Plain-PyTorch equivalent on one process (which this also runs, for any model whose
    forward takes these arguments and returns ``.loss``)::

        loss = model(input_ids, labels=labels, position_ids=position_ids,
                     attention_mask=attention_mask).loss  # the mask only where given
        loss.backward()
    """
    pipeline = getattr(model, "_fusedpar_pipeline", None)
    if pipeline is not None:
        check_attention_mask(attention_mask)
        return pipeline.step(input_ids, labels, position_ids)
    mask = {} if attention_mask is None else {"attention_mask": attention_mask}
    # the output (and its logits) dropped at once: not held through the backward
    loss = getattr(model(input_ids, labels=labels, position_ids=position_ids, **mask), "loss", None)
    if loss is None:
        raise TypeError(f"forward_backward: {type(model).__name__}'s forward returned no loss "
                        "(output.loss); pass a causal LM that computes it from labels")
    loss.backward()
    return loss.detach()


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
