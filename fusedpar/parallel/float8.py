"""float8 training under FSDP2: ``parallelize(model, {"float8": RECIPE})``.

Plain-torchao equivalent (torchtitan's float8 converter), RECIPE one of torchao's
``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``::

    config = Float8LinearConfig.from_recipe_name(RECIPE)      # tensorwise: and
    config = replace(config, enable_fsdp_float8_all_gather=True)  # fp8 all-gather
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    ... fully_shard ...
    for step in ...:                                          # tensorwise: each step
        loss.backward(); optimizer.step()
        precompute_float8_dynamic_scale_for_fsdp(model)

``keep`` leaves out the output head, linears whose dims are not multiples of 16 (what
``torch._scaled_mm`` takes) and the config's ``float8_exclude`` names; ``float8_include``
names are converted even where the defaults leave them out.

FSDP2 all-gathers the converted weights in fp8 (``float8_all_gather``, default):

- tensorwise: torchao's weight subclass (``WeightWithDynamicFloat8CastTensor``); its scales
  are precomputed by ``precompute_float8_dynamic_scale_for_fsdp`` in a forward pre-hook of
  every FSDP unit holding such a weight, whenever a weight changed since the last time
  (parameter version counters: an optimizer step, a checkpoint load), so once per optimizer
  step with no call in the user's loop.
- rowwise recipes (torchao has no fp8 all-gather for them): :class:`RowwiseFloat8Weight`.
  The forward's all-gather moves the weight cast to fp8 with one scale per row (the
  forward GEMM's operand: each rank casts its own rows) and those scales; the backward's
  moves it cast as ``grad_input``'s GEMM takes it (rowwise: one scale per column, the
  column amax all-reduced over the shard group; ``rowwise_with_gw_hp``: one scale), so
  the numbers are torchao's ``Float8Linear``'s. The forward's fp8 weight is kept for
  nothing: each layer is re-gathered for backward, which needs FSDP2 to reshard it after
  forward (the decoder layers' units; under pp a unit that torch's pipelining keeps
  unsharded after a backward is resharded before its next forward). Not under activation
  checkpointing (the recomputed forward runs in backward), nor for weights whose rows
  FSDP2 would pad (not divisible by ``dp_shard * cp``): those are gathered in
  ``param_dtype`` and cast by torchao as without FSDP.

Under tp the projections the recipe converts become fusedpar's TP layers with ``float8``
(``ColumnParallelLinear`` / ``RowParallelLinear``: the fused fp8 ops, torchao's numbers), so
the TP all-gathers move fp8 inputs; their FSDP all-gather moves ``param_dtype`` weights.

Under cp FSDP2 shards every weight over ``dp_shard * cp`` ranks (the flattened
``dp_shard_cp`` axis, its shard mesh), and the weight scales are reduced over that mesh:
tensorwise's amax in ``precompute_float8_dynamic_scale_for_fsdp`` (``foreach_norm`` over
the DTensor shards: one all-reduce), rowwise's backward column amax in
:meth:`RowwiseFloat8Weight.fsdp_pre_all_gather`; so every rank holding a shard of a weight
gathers it with the same scales, the whole weight's. Each rank casts its own (zigzag)
tokens, as torchao's ``Float8Linear`` under torchtitan's cp: an activation's tensorwise
scale and rowwise's per-feature scales of the weight gradient are those tokens', and the
weight gradient is the sum of the ranks' (FSDP's reduce-scatter)::

    for r in range(cp):  # one process: what the cp ranks compute together
        chunks = x.chunk(2 * cp, dim=-2)
        y_r = float8_linear(torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=-2))

Master weights, gradients (reduce-scatter in ``reduce_dtype``), optimizer state and
checkpoints stay in high precision: a float8 run's DCP checkpoint loads into a float8 or
a bf16 config. gloo has no float8 dtype: fusedpar's FSDP all-gather moves fp8 as bytes
(:class:`~fusedpar.parallel.fsdp.FusedparAllGather`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map_only

from ..errors import ParallelConfigError
from ..ops.float8_scales import CPU_SCALED_MM_TAKES_ROWS

INSTALL_HINT = "pip install fusedpar[fp8]"

try:
    from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                precompute_float8_dynamic_scale_for_fsdp)
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
except ImportError as e:  # the fp8 extra is not installed
    raise ImportError(f"float8 training needs torchao ({e}): {INSTALL_HINT}") from None

__all__ = ["Float8LinearGatheredRowwise", "RowwiseFloat8Weight", "convert", "install_hooks"]

aten = torch.ops.aten


def convert(model: nn.Module, head: nn.Module | None, layers: list[nn.Module], cfg,
            *, activation_checkpointing: bool, device_type: str) -> None:
    """``convert_to_float8_training`` on ``model`` with ``cfg.float8``'s recipe (see the
    module docstring), before TP/FSDP; rowwise weights in ``layers`` get
    :class:`RowwiseFloat8Weight` when they can be all-gathered in fp8 (not under activation
    checkpointing; rows divisible by FSDP's shard degree). ``cfg``: resolved. Raises
    ``ParallelConfigError`` for a compute dtype ``_scaled_mm`` cannot output, a rowwise
    recipe on ``device_type`` "cpu" where torch's CPU ``_scaled_mm`` takes no rowwise scales
    (but for fake parameters: ``fusedpar plan --dry-run`` computes nothing),
    a forced layer whose dims are not multiples of 16 and when nothing would be converted."""
    config = Float8LinearConfig.from_recipe_name(cfg.float8)
    tensorwise = cfg.float8 == "tensorwise"
    fsdp_fp8 = cfg.float8_all_gather and cfg.tp == 1  # under tp the TP ops move the fp8
    if tensorwise and fsdp_fp8:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    problems, converted = [], []

    def keep(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        odd = [d for d in module.weight.shape if d % 16]
        if any(s in name for s in cfg.float8_include):
            if odd:
                problems.append(f"{name} {tuple(module.weight.shape)}")
            converted.append(name)
            return True
        if module is head or odd or any(s in name for s in cfg.float8_exclude):
            return False
        converted.append(name)
        return True

    computes = {getattr(torch, cfg.param_dtype)} if cfg.param_dtype else \
        {m.weight.dtype for m in model.modules() if isinstance(m, nn.Linear)}
    if computes - {torch.float32, torch.bfloat16, torch.float16}:
        raise ParallelConfigError(
            f"float8={cfg.float8!r}: the linear layers compute in {sorted(map(str, computes))}, "
            "and torch._scaled_mm outputs float32, bfloat16 or float16 only; cast the model "
            "(model.float()) or set param_dtype='bfloat16'")
    dry_run = isinstance(next(model.parameters(), None), FakeTensor)  # computes nothing
    if not tensorwise and device_type == "cpu" and not CPU_SCALED_MM_TAKES_ROWS and not dry_run:
        raise ParallelConfigError(
            f"float8={cfg.float8!r} on CPU: torchao's rowwise GEMMs call torch._scaled_mm with "
            f"rowwise scales, which torch {torch.__version__} takes on CUDA only; use "
            "float8='tensorwise' on CPU, or a torch whose CPU _scaled_mm takes them (2.14 does)")
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    if problems:
        raise ParallelConfigError(
            f"float8_include={cfg.float8_include}: forced layer(s) {', '.join(problems)} have "
            "dims that are not multiples of 16, which torch._scaled_mm cannot take; remove "
            "them from float8_include")
    if not converted:
        raise ParallelConfigError(
            f"float8={cfg.float8!r}: no linear layer to convert (the head, layers whose dims are "
            f"not multiples of 16 and float8_exclude={cfg.float8_exclude} are left out)")
    # rows split evenly only (FSDP2 pads an uneven shard, which its row scales would not be);
    # one shard: FSDP2 gathers nothing (its one-rank path copies a single all-gather input)
    shards = cfg.dp_shard * cfg.cp
    if not tensorwise and fsdp_fp8 and not activation_checkpointing and shards > 1:
        for layer in layers:
            for module in layer.modules():
                if isinstance(module, Float8Linear) and module.out_features % shards == 0:
                    module.__class__ = Float8LinearGatheredRowwise
                    module.weight = nn.Parameter(RowwiseFloat8Weight(
                        module.weight.data, module.linear_mm_config,
                        module.config.cast_config_weight.target_dtype),
                        requires_grad=module.weight.requires_grad)


def tp_recipe(cfg):
    """For ``apply_tp``'s ``float8``: a projection :func:`convert` made torchao's
    ``Float8Linear`` computes in ``cfg.float8`` through the fused fp8 ops, the others in
    high precision."""
    return lambda layer: cfg.float8 if isinstance(layer, Float8Linear) else None


def install_hooks(model: nn.Module) -> None:
    """Forward pre-hooks on the FSDP units of a parallelized ``model`` (prepended: they run
    before FSDP2's all-gather). Tensorwise fp8 all-gather: torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` when one of the float8 weights changed since
    it last ran (so once per optimizer step, every weight sharded: one all-reduce), on the
    outermost units (the model, or each pipeline stage), whose forward a compiled layer is
    inside of, not around. Rowwise: ``unit.reshard()`` when the unit is still unsharded
    from a backward (torch's pipelining keeps units unsharded across microbatches), so
    FSDP2 gathers the forward's cast again."""
    from torch.distributed.fsdp import FSDPModule

    weights = [p for p in model.parameters()
               if isinstance(getattr(p, "_local_tensor", None), WeightWithDynamicFloat8CastTensor)
               and not isinstance(p._local_tensor, RowwiseFloat8Weight)]
    scales = _PrecomputeScales(model, weights)
    owned = {id(w) for w in weights}
    units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    for name, unit in units.items():
        outer = not any(other == "" or name.startswith(other + ".") for other in units if other != name)
        mine = [p for p in unit.parameters() if id(p) in owned]
        if mine and outer:
            unit.register_forward_pre_hook(functools.partial(scales.refresh, mine), prepend=True)
        rowwise = [m for m in unit.modules() if isinstance(m, Float8LinearGatheredRowwise)]
        if rowwise:
            unit.register_forward_pre_hook(functools.partial(_regather_for_forward, rowwise), prepend=True)


def _regather_for_forward(linears: list[nn.Module], unit, args) -> None:
    if any(isinstance(m.weight, GatheredFloat8Weight) and m.weight._axiswise_dim != -1 for m in linears):
        unit.reshard()


class _PrecomputeScales:
    def __init__(self, model: nn.Module, weights: list[torch.Tensor]):
        self.model, self.weights, self.versions = model, weights, {}

    @torch.compiler.disable  # host logic: a whole compiled model breaks its graph here
    def refresh(self, weights: list[torch.Tensor], module, args) -> None:
        """Before ``module``'s all-gather: recompute every scale if one of its ``weights``
        changed (parameter version counters)."""
        if any(self.versions.get(id(w)) != w._version for w in weights):
            precompute_float8_dynamic_scale_for_fsdp(self.model)
            self.versions = {id(w): w._version for w in self.weights}


class GatheredFloat8Weight(Float8TrainingTensor):
    """The unsharded weight FSDP2 builds from the all-gathered fp8 data and scales: a
    torchao ``Float8TrainingTensor`` that keeps its (row or column) scales through
    FSDP2's ``as_strided`` to the parameter's shape and ``nn.Parameter``'s detach."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func in (aten.as_strided.default, aten.detach.default):
            t = args[0]
            return cls(func(t._data, *args[1:], **(kwargs or {})), t._scale, t._orig_dtype,
                       t._linear_mm_config, t._gemm_input_role, t._axiswise_dim)
        return super().__torch_dispatch__(func, types, args, kwargs)


class RowwiseFloat8Weight(WeightWithDynamicFloat8CastTensor):
    """A rowwise-recipe ``Float8Linear``'s sharded weight (torchao's
    ``WeightWithDynamicFloat8CastTensor``, with FSDP2 all-gather hooks for rowwise
    scales): forward gathers (fp8 rows, row scales), backward (fp8 cast for
    ``grad_input``, unused scales of the same shape) with that cast's scales
    all-reduced beforehand. See the module docstring."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        return tree_map_only(WeightWithDynamicFloat8CastTensor,
                             lambda t: cls(t._tensor, t._linear_mm_config, t._dtype), out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        c = module.config
        rows = hp_tensor_to_float8_dynamic(
            self._tensor, self._dtype, self._linear_mm_config, gemm_input_role=GemmInputRole.WEIGHT,
            scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1,
            round_scales_to_power_of_2=c.round_scales_to_power_of_2)
        if torch._C._current_graph_task_id() == -1:  # forward
            return (rows._data, rows._scale), (None, None)
        cast = c.cast_config_weight_for_grad_input
        axis = get_maybe_axiswise_dim(0, cast.scaling_granularity)
        w = hp_tensor_to_float8_dynamic(
            self._tensor, cast.target_dtype, self._linear_mm_config, reduce_amax=True,
            gemm_input_role=GemmInputRole.WEIGHT, device_mesh=mesh,
            scaling_granularity=cast.scaling_granularity, axiswise_dim=axis,
            round_scales_to_power_of_2=c.round_scales_to_power_of_2)
        return (w._data, torch.zeros_like(rows._scale)), (w._scale, axis)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        data, row_scales = all_gather_outputs
        scale, axis = metadata
        if scale is None:  # forward: one scale per row
            scale, axis = row_scales, -1
        if out is not None:
            out._scale, out._axiswise_dim = scale, axis
            return None
        return GatheredFloat8Weight(data, scale, param_dtype, self._linear_mm_config,
                                    GemmInputRole.WEIGHT, axis), (data, row_scales)


class _Ctx:
    """What torchao's ``matmul_with_hp_or_float8_args`` reads from its autograd ctx."""

    def __init__(self, module, saved=()):
        self.linear_mm_config, self.config, self.saved_tensors = module.linear_mm_config, module.config, saved

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class GatheredRowwiseMatmul(torch.autograd.Function):
    """torchao's ``matmul_with_hp_or_float8_args`` (forward and backward unchanged) on
    the weight as FSDP2 gathered it for each pass: row-scaled fp8 in forward, cast for
    ``grad_input`` in backward (``module.weight`` is re-gathered before this backward)."""

    @staticmethod
    def forward(ctx, input_hp, weight, module):
        _expect(weight, forward=True)
        ctx.module = module
        ctx.save_for_backward(input_hp)
        return matmul_with_hp_or_float8_args.forward(_Ctx(module), input_hp, weight.t(),
                                                     module.linear_mm_config, module.config)

    @staticmethod
    def backward(ctx, grad_output):
        (input_hp,) = ctx.saved_tensors
        weight = ctx.module.weight
        _expect(weight, forward=False)
        grad_input, grad_weight_t, *_ = matmul_with_hp_or_float8_args.backward(
            _Ctx(ctx.module, (input_hp, weight.t())), grad_output)
        return grad_input, grad_weight_t.t(), None


def _expect(weight, forward: bool) -> None:
    if (weight._axiswise_dim == -1) != forward:
        raise RuntimeError(
            "fusedpar float8 (rowwise fp8 all-gather): the weight holds the cast for the "
            f"{'backward' if forward else 'forward'} pass in the {'forward' if forward else 'backward'}"
            " pass: FSDP2 must re-gather it between them (reshard_after_forward=True, "
            "reshard_after_backward=True); with other settings use float8_all_gather=False")


class Float8LinearGatheredRowwise(Float8Linear):
    """torchao's ``Float8Linear`` whose weight FSDP2 gathers in fp8 (rowwise recipes)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a traced backward cannot take the re-gathered weight
            raise RuntimeError(
                "fusedpar float8: the rowwise fp8 all-gather does not compile (its backward "
                "re-gathers the weight as FSDP2 casts it for that pass); with torch.compile set "
                "float8_all_gather=False (torchao's rowwise: weights all-gathered in param_dtype)")
        if not isinstance(self.weight, GatheredFloat8Weight):  # not gathered by FSDP2
            return super().forward(input)
        output = GatheredRowwiseMatmul.apply(input, self.weight, self)
        return output if self.bias is None else output + self.bias.to(output.dtype)


# DCP loads with weights_only=True: the optimizer state of a rowwise weight has its class
torch.serialization.add_safe_globals([RowwiseFloat8Weight])
