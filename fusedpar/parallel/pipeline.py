"""Pipeline parallelism (``pp > 1``) on ``torch.distributed.pipelining``.

``parallelize(model, {"pp": 2, "dp_shard": 2})`` cuts the decoder layers into ``pp *
pp_stages_per_rank`` stages at layer boundaries (balanced by layer count, or at
``pp_split_points``; the embedding goes with the first stage, the final norm, head and
loss with the last), keeps this rank's stages in ``model`` (the others' layers are
dropped; parameter names are unchanged, so DCP checkpoints load across pp degrees), gives
each stage TP/SP, CP, EP, activation checkpointing and FSDP2 as without pp, and wraps it
in a ``PipelineStage`` run by the config's schedule (built in ``_Run``). One training step
is ``loss = fusedpar.parallel.forward_backward(model, input_ids, labels, position_ids=None)``,
as for every other config (this data-parallel rank's rows, as
:func:`~fusedpar.parallel.shard_batch` gives them; ``position_ids`` restarting inside a row
pack documents, as without pp), which runs the schedule's step and returns the global
batch's mean token loss on every rank; then ``optimizer.step()`` as usual.

Plain-PyTorch (torchtitan-style) equivalent on a pp rank holding stage ``s`` of ``S``::

    part = model with only stage s's layers (embed_tokens on s == 0, norm + lm_head on S-1)
    parallelize part's layers (tp, cp, ep) and fully_shard them, then the stage's root
    stage = PipelineStage(part, s, S, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=sum of token losses / global
                            count of valid labels, scale_grads=False)
    schedule.step(input_ids if s == 0 else None, target=shifted labels if s == S-1,
                  position_ids=position_ids)  # keyword inputs reach every stage

Zero-bubble schedules (``ZBVZeroBubble``, ``InterleavedZeroBubble``) split each backward
into an input-gradient and a weight-gradient pass, which torch cannot do through a custom
``autograd.Function`` (pytorch issue 166577), and fusedpar's ops are such functions: a
config where a stage runs one (tp, cp, ep, fusedpar's MoE blocks) is refused, naming it.
Without them they still leave some layers' weight gradients unset under fusedpar's FSDP2
units (ZBVZeroBubble, torch 2.14), so they are refused in every config, never run with a
silently wrong gradient.
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ParallelConfigError
from .adapters import ModelAdapter, ModelLayout, is_hf, is_moe
from .config import ParallelConfig
from .decoder import run_layers, shift_labels, valid_labels
from .forward import check_sequence_length, cp_shard, token_losses
from .steps import apply_fsdp, apply_model_parallel

__all__ = ["check_pipeline", "pipeline_stages", "stage_layers"]

ZERO_BUBBLE = ("ZBVZeroBubble", "InterleavedZeroBubble")


def stage_layers(num_layers: int, cfg: ParallelConfig) -> list[range]:
    """The decoder layers of each pipeline stage: ``cfg.pp_split_points``, or as even as
    can be (the first stages get one more layer where they do not divide)."""
    stages = cfg.pp_stages
    if cfg.pp_split_points is not None:
        bounds = [0, *cfg.pp_split_points, num_layers]
    else:
        per, extra = divmod(num_layers, stages)
        bounds = [0]
        for s in range(stages):
            bounds.append(bounds[-1] + per + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_ids(cfg: ParallelConfig, pp_rank: int) -> list[int]:
    """The stages pp rank ``pp_rank`` runs: ``rank, rank + pp, ...`` (looped), or the V of
    ZBVZeroBubble: ``rank`` and ``2 * pp - 1 - rank`` (torchtitan's layout)."""
    if cfg.pp_schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * cfg.pp - 1 - pp_rank]
    return [pp_rank + k * cfg.pp for k in range(cfg.pp_stages_per_rank)]


def check_pipeline(model: nn.Module, adapter: ModelAdapter, layout: ModelLayout,
                   cfg: ParallelConfig, router_aux: bool) -> None:
    """What pp needs of the model and the other degrees, before any communication."""
    problems = []
    stages, layers = cfg.pp_stages, len(layout.layers)
    where = f"pp={cfg.pp} x {cfg.pp_stages_per_rank} stage(s) per rank = {stages} stages"
    points = cfg.pp_split_points
    if points is not None:
        if len(points) != stages - 1 or list(points) != sorted(set(points)) \
                or points[0] <= 0 or points[-1] >= layers:
            problems.append(f"pp_split_points={list(points)}: {where} need {stages - 1} increasing "
                            f"layer indices between 1 and {layers - 1} (the first layer of stages "
                            f"1..{stages - 1})")
    elif layers < stages:
        problems.append(f"{where}, but the model has {layers} decoder layers: every stage needs "
                        "at least one; lower pp or pp_stages_per_rank")
    embedding, head = adapter.embedding(model), adapter.head(model)
    if head.weight is embedding.weight:
        problems.append("the head shares the embedding's weight (tied embeddings), and the "
                        "first and last pipeline stages live on different ranks; untie them "
                        "(e.g. config.tie_word_embeddings=False) or use pp=1")
    if router_aux:
        problems.append("config.output_router_logits=True: the router aux loss spans every "
                        "layer's logits, which live on different pipeline stages; set "
                        "config.output_router_logits=False or use pp=1")
    if cfg.pp_microbatches is not None and cfg.pp_microbatches < cfg.pp and \
            cfg.pp_schedule != "GPipe":
        problems.append(f"pp_microbatches={cfg.pp_microbatches} is fewer than pp={cfg.pp}: "
                        f"{cfg.pp_schedule} needs at least one microbatch per pipeline rank")
    if cfg.pp_schedule in ZERO_BUBBLE:
        ops = _fusedpar_autograd_ops(cfg, layout)
        why = (f"this config's stages run fusedpar ops that are such functions: {'; '.join(ops)}"
               if ops else "and with fusedpar's FSDP2 unit per layer torch's zero-bubble "
               "schedules leave some layers' weight gradients unset (None: the optimizer would "
               "silently skip them)")
        problems.append(f"pp_schedule={cfg.pp_schedule} splits each backward into input- and "
                        "weight-gradient passes, which torch cannot do through a custom "
                        f"autograd.Function (pytorch issue 166577), {why}; use "
                        "pp_schedule=1F1B or Interleaved1F1B")
    if problems:
        raise ParallelConfigError(f"fusedpar.parallelize({cfg.describe()}): " + "; ".join(problems))


def _fusedpar_autograd_ops(cfg: ParallelConfig, layout: ModelLayout) -> list[str]:
    """The fusedpar ops (custom autograd.Functions) a stage of this config runs."""
    ops = []
    if cfg.tp > 1:
        ops.append(f"tp={cfg.tp}: fusedpar.ops.all_gather_matmul / matmul_reduce_scatter "
                   "(q/k/v, o, MLP projections), reduce_scatter (embedding)")
    if cfg.cp > 1:
        ops.append(f"cp={cfg.cp}: fusedpar.ops.ring_attention")
    if cfg.ep > 1:
        ops.append(f"ep={cfg.ep}: fusedpar.ops.moe_experts")
    from ..nn.moe import MoEBlock

    if cfg.ep == 1 and any(isinstance(layer.mlp, MoEBlock) for layer in layout.layers):
        ops.append("fusedpar's MoEBlock: fusedpar.ops.moe.experts_dense / topk_route")
    return ops


class _Stage(nn.Module):
    """One pipeline stage's modules of ``owner`` (the model holding this rank's stages):
    the embedding (first stage), decoder layers ``first_layer, ...``, the final norm and
    head (last stage). ``forward(input_ids or hidden) -> hidden or logits``."""

    def __init__(self, owner: nn.Module, adapter: ModelAdapter, layers: dict[int, nn.Module],
                 first: bool, last: bool):
        super().__init__()
        self.__dict__["owner"] = owner  # not a submodule: its names stay the model's
        self.adapter, self.first_layer, self.is_first, self.is_last = adapter, min(layers), first, last
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.embeddings = nn.ModuleList(adapter.embeddings(owner)) if first else None
        self.norm = adapter.final_norm(owner) if last else None
        self.head = adapter.head(owner) if last else None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``position_ids``: this microbatch's, given to every stage by the schedule (a
        keyword input reaches every stage; ``x`` only the first): where they restart inside
        a row, a Hugging Face model's mask keeps each packed document to itself."""
        owner, adapter, run = self.owner, self.adapter, self.owner._fusedpar_pipeline
        hidden = adapter.embed(owner, x, position_ids) if self.is_first else x
        masks = adapter.attention_masks(owner, position_ids, position_ids) if run.hf_masks else None
        hidden, aux = run_layers(adapter, owner, list(self.layers.values()), hidden, position_ids,
                                 masks, self.first_layer)
        if aux is not None:
            hidden = run.attach_aux(hidden, aux)
        if not self.is_last:
            return hidden
        return adapter.logits(owner, adapter.final_norm(owner)(hidden))


class _AuxToBackward(torch.autograd.Function):
    """``hidden`` unchanged; in backward, ``aux`` gets the gradient ``scale`` (its weight in
    the loss) as if it had been added to the loss (Megatron's MoEAuxLossAutoScaler): a
    stage's MoE aux loss reaches the backward without travelling to the last stage."""

    @staticmethod
    def forward(ctx, hidden, aux, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _Run:
    """One pipeline-parallel model's schedule and what a step shares with its stages (the
    global count of valid labels, the MoE aux loss); ``step`` runs it (see
    :func:`fusedpar.parallel.forward_backward`)."""

    def __init__(self, model: nn.Module, adapter: ModelAdapter, layout: ModelLayout,
                 cfg: ParallelConfig, mesh, ids: list[int], roots: list[_Stage], device,
                 tp_group: str | None, dp_group):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        self.cfg, self.roots, self.tp_group, self.dp_group = cfg, roots, tp_group, dp_group
        self.cp_group = mesh["cp"].get_group().group_name if cfg.cp > 1 else None
        self.has_first, self.has_last = 0 in ids, cfg.pp_stages - 1 in ids
        # cp: the ring attention applies each layer's window itself, as in parallelize
        self.hf_masks = is_hf(model) and cfg.cp == 1
        self.sliding_window = layout.sliding_window if cfg.cp == 1 else None
        self.microbatches = cfg.pp_microbatches or cfg.pp_stages
        weight = adapter.aux_loss_weight(model)  # the mean over microbatches of the model's aux term
        self.aux_scale = None if weight is None else weight / self.microbatches
        self.aux_values: list[torch.Tensor] = []
        # per step: microbatches x this rank's stages with MoE layers
        self.aux_calls = 0 if weight is None else self.microbatches * sum(
            any(is_moe(layer.mlp) or hasattr(layer.mlp, "aux_group") for layer in stage.layers.values())
            for stage in roots)
        self.count = None
        pp_group = mesh["pp"].get_group()
        stages = [PipelineStage(stage, s, cfg.pp_stages, device, group=pp_group)
                  for s, stage in zip(ids, roots)]
        schedule_class = get_schedule_class(cfg.pp_schedule)
        single = issubclass(schedule_class, PipelineScheduleSingle)
        self.schedule = schedule_class(stages[0] if single else stages, self.microbatches,
                                       loss_fn=self.loss_fn, scale_grads=False)
        # return_outputs=False where torch has it: the last stage would otherwise keep every
        # microbatch's logits until the next step, to return them merged (step returns the loss)
        self.step_options = ({"return_outputs": False}
                             if "return_outputs" in inspect.signature(self.schedule.step).parameters
                             else {})

    def loss_fn(self, logits, target):
        """This microbatch's share of the global mean; FSDP averages the gradients over the
        dp x cp ranks, whose sum is the true gradient (see forward.mean_loss)."""
        ranks = self.cfg.dp * self.cfg.cp
        return token_losses(logits, target, self.tp_group).sum() * (ranks / self.count)

    def attach_aux(self, hidden, aux):
        self.aux_values.append(aux.detach() * self.aux_scale)
        return _AuxToBackward.apply(hidden, aux, self.aux_scale)

    def aux_total(self, device) -> torch.Tensor:
        """This step's weighted aux losses of this rank's stages: the last ``aux_calls``
        recorded (torch >= 2.14 runs one more forward first, to infer the stages' shapes)."""
        values = self.aux_values[len(self.aux_values) - self.aux_calls:]
        return torch.stack(values).sum() if values else torch.zeros((), device=device)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor,
             position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One pipelined forward and backward over this data-parallel rank's batch; returns
        the global batch's mean token loss (plus the MoE aux loss) on every rank, the
        gradients accumulated over the microbatches in ``.grad``."""
        cfg = self.cfg
        _check_step(self, input_ids, labels, position_ids)
        target = shift_labels(labels)
        count = valid_labels(target).to(torch.float32)
        if self.dp_group is not None:
            dist.all_reduce(count, group=self.dp_group)
        self.count = count
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) if position_ids is None \
            else position_ids
        positions = positions.expand_as(input_ids)
        if self.cp_group is not None:
            input_ids, positions, target = cp_shard(self.cp_group, input_ids, positions, target)
        self.aux_values = []
        losses = []
        args = (input_ids,) if self.has_first else ()
        self.schedule.step(*args, target=target if self.has_last else None, losses=losses,
                           position_ids=positions, **self.step_options)
        total = torch.stack([l.detach().float() for l in losses]).sum() if self.has_last else \
            torch.zeros((), device=input_ids.device)
        # each last-stage rank holds its dp x cp rank's share (x dp*cp, see loss_fn), every tp
        # rank the same; each rank the aux loss of its stages' layers (the same on its dp, cp
        # and tp peers, whose tokens it was summed over)
        total = (total + self.aux_total(total.device)) / (cfg.dp * cfg.cp * cfg.tp)
        dist.all_reduce(total)
        return total


def pipeline_stages(model: nn.Module, adapter: ModelAdapter, layout: ModelLayout,
                    cfg: ParallelConfig, mesh, ep_mesh, *, activation_checkpointing: bool,
                    backend: str | None, tp_group: str | None, dp_group):
    """Keep this rank's stages in ``model``, parallelize them and build the schedule
    (``model._fusedpar_pipeline``, which :func:`fusedpar.parallel.forward_backward` runs; see
    the module docstring)."""
    pp_mesh = mesh["pp"]
    ids = stage_ids(cfg, pp_mesh.get_local_rank())
    ranges = stage_layers(len(layout.layers), cfg)
    keep = [i for s in ids for i in ranges[s]]
    stages_total = cfg.pp_stages
    adapter.keep_layers(model, keep)
    if 0 not in ids:
        adapter.set_embedding(model, None)
    if stages_total - 1 not in ids:
        adapter.set_final_norm(model, None)
        adapter.set_head(model, None)
    layers = [layout.layers[i] for i in keep]
    experts = apply_model_parallel(model, adapter, layers, cfg, mesh, ep_mesh,
                                   activation_checkpointing=activation_checkpointing, backend=backend)
    by_index = dict(zip(keep, layers))  # activation checkpointing: the wrapped layers
    roots = []
    for s in ids:
        stage = _Stage(model, adapter, {i: by_index[i] for i in ranges[s]}, s == 0, s == stages_total - 1)
        stage_experts = [(m, efsdp) for m, efsdp in experts
                         if any(m is x for layer in stage.layers.values() for x in layer.modules())]
        apply_fsdp(stage, list(stage.layers.values()), stage_experts, cfg, mesh)
        roots.append(stage)
    model._fusedpar_pipeline = _Run(model, adapter, layout, cfg, mesh, ids, roots, _device(mesh),
                                    tp_group, dp_group)
    model.forward = types.MethodType(_no_forward, model)
    return model


def _device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _no_forward(self, *args, **kwargs):
    raise TypeError("a pipeline-parallel model (pp > 1) runs a whole training step at once: "
                    "loss = fusedpar.parallel.forward_backward(model, input_ids, labels, "
                    "position_ids=None), then optimizer.step()")


def _check_step(run: _Run, input_ids, labels, position_ids) -> None:
    """Shapes the schedule would only trip over mid-step, checked first; packed rows under
    cp (whose documents would have to travel on the ring per microbatch)."""
    cfg = run.cfg
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"forward_backward: {name} must be a [batch, seq] tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if labels.shape != input_ids.shape:
        raise ValueError(f"forward_backward: labels {tuple(labels.shape)} and input_ids "
                         f"{tuple(input_ids.shape)} differ in shape")
    batch, seq = input_ids.shape
    if batch % run.microbatches:
        raise ValueError(f"forward_backward: this data-parallel rank's batch of {batch} rows does not "
                         f"split into pp_microbatches={run.microbatches}; pass a multiple of "
                         f"{run.microbatches} rows (or set pp_microbatches)")
    check_sequence_length(seq, cfg, run.sliding_window)
    if position_ids is None:
        return
    shape = getattr(position_ids, "shape", None)
    if not isinstance(position_ids, torch.Tensor) or len(shape) not in (1, 2) or shape[-1] != seq \
            or len(shape) == 2 and shape[0] not in (1, batch):
        raise ValueError(f"forward_backward: position_ids must be a tensor of input_ids' shape "
                         f"{tuple(input_ids.shape)} (or broadcast to it), got "
                         f"{type(position_ids).__name__ if shape is None else shape}")
    # one host read, only under cp
    if cfg.cp > 1 and bool((position_ids.expand_as(input_ids).diff(dim=-1) != 1).any()):
        raise ValueError(f"forward_backward: position_ids restart inside a row (packed documents), and "
                         f"pipeline_parallel_size > 1 with cp={cfg.cp} does not take packed "
                         "documents yet: unpack the rows (one document per row, padded with "
                         "labels = -100), or use cp=1 (pp takes packed rows there) or pp=1")
