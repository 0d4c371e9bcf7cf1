"""``ParallelConfig``: the parallel degrees of a run, validated on CPU, and the named
``DeviceMesh`` built from them.

Plain-PyTorch equivalent of ``ParallelConfig(dp_replicate=R, dp_shard=S, cp=C, tp=T).build_mesh("cuda")``::

    mesh = init_device_mesh("cuda", (R, S, C, T),
                            mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")          # FSDP shards over dp_shard x cp
    mesh["dp_replicate", "dp_shard"]._flatten("dp")         # data loading / batch
    mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")  # loss / grad-norm reductions

Rank layout (torchtitan's): ``tp`` is innermost (consecutive ranks), then ``cp``, then
``dp_shard``, and ``dp_replicate`` is outermost, i.e. ``rank = ((r * S + s) * C + c) * T + t``.
Keep ``tp`` inside a node.

Pipeline parallelism (``pp > 1``) adds the outermost axis ``"pp"``: the mesh is then
``(pp, dp_replicate, dp_shard, cp, tp)`` and every other axis (and the flattened ones) lives
inside one pipeline stage's ranks; with ``pp == 1`` the mesh has no ``pp`` axis.

Expert parallelism does not multiply the world size: ``ep`` borrows its ranks from
``dp_shard x cp x tp`` (torchtitan convention), and the experts are FSDP-sharded over the
remaining ``efsdp = dp_shard * cp * tp // ep`` ranks. :meth:`ParallelConfig.build_ep_mesh`
builds that "sparse" mesh ``("dp_replicate", "efsdp", "ep")``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fusedpar.errors import ParallelConfigError

if TYPE_CHECKING:  # torch.distributed is imported lazily: validation needs no process group
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "EP_MESH_AXES",
    "FLATTENED_AXES",
    "FLOAT8_RECIPES",
    "MESH_AXES",
    "ParallelConfig",
    "ParallelConfigError",
    "get_submesh",
]

#: Axes of the dense mesh that :meth:`ParallelConfig.build_mesh` returns, outermost first.
MESH_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "tp")

#: Flattened axes registered on the dense mesh, and the mesh axes each one spans.
FLATTENED_AXES: dict[str, tuple[str, ...]] = {
    "dp_shard_cp": ("dp_shard", "cp"),  # FSDP's shard axis (kept even at size 1)
    "dp": ("dp_replicate", "dp_shard"),  # data parallel: batch / data loading
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # loss and grad-norm reductions
}

#: Axes of the expert ("sparse") mesh that :meth:`ParallelConfig.build_ep_mesh` returns.
EP_MESH_AXES: tuple[str, ...] = ("dp_replicate", "efsdp", "ep")

_FIELDS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "tp", "cp", "ep")
# Degrees that may be -1 ("the remaining ranks"). tp/cp/ep change how the model is cut, so
# they are never guessed.
_AUTO_FIELDS: tuple[str, ...] = ("dp_replicate", "dp_shard")
# Training options next to the degrees (FSDP2's mixed precision and collectives).
_OPTION_FIELDS: tuple[str, ...] = ("param_dtype", "reduce_dtype", "fsdp_comm", "pp_schedule",
                                   "pp_microbatches", "pp_stages_per_rank", "pp_split_points",
                                   "float8", "float8_all_gather", "float8_exclude", "float8_include")
_DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
FSDP_COMMS: tuple[str, ...] = ("fusedpar", "torch")

#: torchao's float8 training recipes (``torchao.float8.Float8LinearRecipeName`` values).
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: torchtitan's ``[quantize.linear.float8]`` keys -> ours (``precompute_...``: fusedpar always
#: precomputes the tensorwise scales once per optimizer step).
_TORCHTITAN_FLOAT8: dict[str, str | None] = {
    "recipe_name": "float8", "filter_fqns": "float8_exclude",
    "enable_fsdp_float8_all_gather": "float8_all_gather",
    "precompute_float8_dynamic_scale_for_fsdp": None,
}

#: Pipeline schedules (any spelling, case-insensitive) -> torch.distributed.pipelining's
#: schedule name (``get_schedule_class``); the last two run several stages per rank.
PP_SCHEDULES: dict[str, str] = {
    "gpipe": "GPipe", "1f1b": "1F1B",
    "interleaved": "Interleaved1F1B", "interleaved1f1b": "Interleaved1F1B",
    "zbv": "ZBVZeroBubble", "zbvzerobubble": "ZBVZeroBubble",
    "interleavedzb": "InterleavedZeroBubble", "interleavedzerobubble": "InterleavedZeroBubble",
}
MULTI_STAGE_SCHEDULES: tuple[str, ...] = ("Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble")

# Every key from_dict accepts -> our field. Ours, Axolotl's (and Accelerate's
# ParallelismConfig), torchtitan's.
KEY_ALIASES: dict[str, str] = {
    # ours
    "pp": "pp",
    "dp_replicate": "dp_replicate",
    "dp_shard": "dp_shard",
    "tp": "tp",
    "cp": "cp",
    "ep": "ep",
    # Axolotl / Accelerate
    "dp_replicate_size": "dp_replicate",
    "dp_shard_size": "dp_shard",
    "tensor_parallel_size": "tp",
    "context_parallel_size": "cp",
    "sequence_parallel_degree": "cp",  # Axolotl's old name for context_parallel_size
    "expert_parallel_size": "ep",
    "pipeline_parallel_size": "pp",
    "tp_size": "tp",
    "cp_size": "cp",
    "ep_size": "ep",
    "pp_size": "pp",
    # torchtitan
    "data_parallel_replicate_degree": "dp_replicate",
    "data_parallel_shard_degree": "dp_shard",
    "tensor_parallel_degree": "tp",
    "context_parallel_degree": "cp",
    "expert_parallel_degree": "ep",
    "pipeline_parallel_degree": "pp",
    "pipeline_parallel_schedule": "pp_schedule",
    "pipeline_parallel_split_points": "pp_split_points",
    # options
    "param_dtype": "param_dtype",
    "reduce_dtype": "reduce_dtype",
    "fsdp_comm": "fsdp_comm",
    "pp_schedule": "pp_schedule",
    "pp_microbatches": "pp_microbatches",
    "pp_stages_per_rank": "pp_stages_per_rank",
    "pp_split_points": "pp_split_points",
    # float8 training: ours, Axolotl's, torchtitan's (a [quantize.linear.float8] table)
    "float8": "float8",
    "float8_all_gather": "float8_all_gather",
    "float8_exclude": "float8_exclude",
    "float8_include": "float8_include",
    "fp8": "float8",
    "fp8_enable_fsdp_float8_all_gather": "float8_all_gather",
    "quantize.linear.float8": "float8",
    "quantize": "float8",
}


def _dtype_name(name: str, value: Any, allow_none: bool) -> str | None:
    """A dtype option as its torch name (``"bf16"`` / ``torch.bfloat16`` → ``"bfloat16"``)."""
    if value is None and allow_none:
        return None
    text = str(value).removeprefix("torch.")
    if text not in _DTYPE_NAMES:
        raise ParallelConfigError(f"{name}={value!r}: choose one of float32, bfloat16, float16"
                                  + (" or None (keep the parameters' dtype)" if allow_none else ""))
    return _DTYPE_NAMES[text]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _product_str(values: Mapping[str, int]) -> str:
    return " * ".join(f"{name}({value})" for name, value in values.items())


def _as_degree(name: str, value: Any, field: str | None = None) -> int:
    """``value`` as an int degree: a positive int, or -1 where ``field`` allows it.

    ``name`` is how the user spelled it (for messages), ``field`` our field (default ``name``).
    """
    field = name if field is None else field
    if isinstance(value, bool):
        raise ParallelConfigError(f"{name}={value!r}: a degree must be an int, not a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise ParallelConfigError(
            f"{name}={value!r}: a degree must be an int, got {type(value).__name__}"
        ) from None
    if value == -1 and field not in _AUTO_FIELDS:
        raise ParallelConfigError(
            f"{name}=-1 is not allowed: only dp_shard and dp_replicate may be -1 (the "
            f"remaining ranks); give {name} an explicit size, e.g. {name}=1"
        )
    if value < 1 and value != -1:
        allowed = "a positive int or -1 (the remaining ranks)" if field in _AUTO_FIELDS else "a positive int"
        raise ParallelConfigError(f"{name}={value}: must be {allowed}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The degree of each parallel axis. ``-1`` means "the remaining ranks" (``dp_shard``
    by default, or ``dp_replicate``; at most one of the two).

    Plain-PyTorch equivalent: the ``(dp_replicate, dp_shard, cp, tp)`` shape given to
    ``init_device_mesh`` (see the module docstring), checked like torchtitan's ``ParallelDims``::

        assert dp_replicate * dp_shard * cp * tp == world_size
        assert (dp_shard * cp * tp) % ep == 0

    With ``pp > 1`` the product also holds ``pp`` (outermost): ``pp * dp_replicate *
    dp_shard * cp * tp == world_size``.

    ``ParallelConfig()`` is pure FSDP over every rank. Construction checks each degree on its
    own; :meth:`validate` checks them against a world size and fills in the ``-1``.
    Errors are :class:`~fusedpar.errors.ParallelConfigError` (a ``ValueError``).
    """

    pp: int = 1
    """Pipeline parallelism: the outermost axis; each of its ranks runs a pipeline stage
    (decoder layers cut by the model's adapter), on ``torch.distributed.pipelining``."""

    dp_replicate: int = 1
    """Replicated data parallelism: HSDP's outer axis (gradients all-reduced across it).
    ``-1`` = the remaining ranks (then ``dp_shard`` must be explicit)."""

    dp_shard: int = -1
    """Sharded data parallelism (FSDP2 / ZeRO-3). Parameters are sharded over
    ``dp_shard x cp``. ``-1`` (default) = the remaining ranks."""

    tp: int = 1
    """Tensor (+ sequence) parallelism; the innermost axis (consecutive ranks, keep it
    inside a node)."""

    cp: int = 1
    """Context parallelism (ring attention over the sequence dim)."""

    ep: int = 1
    """Expert parallelism. Borrows its ranks from ``dp_shard x cp x tp`` (so it must divide
    that product) instead of multiplying the world size; experts are FSDP-sharded over
    ``efsdp = dp_shard * cp * tp // ep``."""

    param_dtype: str | None = None
    """FSDP2's ``MixedPrecisionPolicy.param_dtype`` (the dtype of the all-gathered
    parameters the forward computes with): ``"bfloat16"``, ``"float16"``, ``"float32"`` or
    None (the parameters' own dtype)."""

    reduce_dtype: str = "float32"
    """FSDP2's ``MixedPrecisionPolicy.reduce_dtype`` (gradient reduce-scatter / all-reduce)."""

    fsdp_comm: str = "fusedpar"
    """``"fusedpar"``: FSDP2's all-gather / reduce-scatter run on ``fusedpar.ops``
    (``set_custom_all_gather`` / ``set_custom_reduce_scatter``); ``"torch"``: FSDP2's
    own NCCL/gloo collectives."""

    pp_schedule: str = "1F1B"
    """The pipeline schedule (pp > 1): ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``
    (several stages per rank), ``"ZBVZeroBubble"`` or ``"InterleavedZeroBubble"`` (refused
    where a fusedpar op would compute the weight gradient: see
    :mod:`fusedpar.parallel.pipeline`); any case, ``"interleaved"`` / ``"zbv"`` too."""

    pp_microbatches: int | None = None
    """Microbatches per step and data-parallel rank (pp > 1); None = the number of
    pipeline stages. The batch must divide by it."""

    pp_stages_per_rank: int | None = None
    """Pipeline stages each pp rank runs: 1 for GPipe / 1F1B, 2 (default) or more for the
    multi-stage schedules."""

    pp_split_points: tuple[int, ...] | None = None
    """The decoder layers that begin stages 1, 2, ... (``pp * stages_per_rank - 1``
    increasing indices); None = as many layers in every stage as can be (the first stages
    get one more where they do not divide)."""

    float8: str | None = None
    """float8 training (torchao): ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``
    (torchao's recipe names; ``True`` = ``"tensorwise"``, as Axolotl's ``fp8: true``), or
    None. Linear layers compute in fp8 and FSDP2 all-gathers their weights in fp8, with
    every other axis (dp_shard, dp_replicate, cp, tp, ep, pp); see
    :mod:`fusedpar.parallel.float8`. Needs ``pip install fusedpar[fp8]``."""

    float8_all_gather: bool = True
    """With ``float8``: FSDP2 all-gathers the converted weights in fp8 (else in
    ``param_dtype``)."""

    float8_exclude: tuple[str, ...] = ()
    """With ``float8``: linear layers whose module name contains one of these strings stay
    in high precision (torchtitan's ``filter_fqns``), besides the defaults (the output
    head, layers whose dims are not multiples of 16)."""

    float8_include: tuple[str, ...] = ()
    """With ``float8``: linear layers whose name contains one of these strings are converted
    even where the defaults leave them out (e.g. ``("lm_head",)``); their dims must still be
    multiples of 16."""

    def __post_init__(self) -> None:
        for name in _FIELDS:
            object.__setattr__(self, name, _as_degree(name, getattr(self, name)))
        schedule = PP_SCHEDULES.get(str(self.pp_schedule).lower().replace("_", "").replace("-", ""))
        if schedule is None:
            raise ParallelConfigError(f"pp_schedule={self.pp_schedule!r}: choose one of "
                                      f"{', '.join(sorted(set(PP_SCHEDULES.values())))}")
        object.__setattr__(self, "pp_schedule", schedule)
        for name in ("pp_microbatches", "pp_stages_per_rank"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _as_degree(name, getattr(self, name), "pp_option"))
        multi = schedule in MULTI_STAGE_SCHEDULES
        stages = self.pp_stages_per_rank
        if stages is None:
            object.__setattr__(self, "pp_stages_per_rank", 2 if multi else 1)
        elif multi and stages < 2 or not multi and stages != 1:
            raise ParallelConfigError(
                f"pp_stages_per_rank={stages} with pp_schedule={schedule}: "
                + ("a multi-stage schedule runs at least 2 stages per rank" if multi else
                   f"{schedule} runs one stage per rank; use Interleaved1F1B for more"))
        if schedule == "ZBVZeroBubble" and self.pp_stages_per_rank != 2:
            raise ParallelConfigError(f"pp_stages_per_rank={self.pp_stages_per_rank}: "
                                      "ZBVZeroBubble runs exactly 2 stages per rank (a V)")
        if self.pp_split_points is not None:
            points = self.pp_split_points
            if isinstance(points, (str, bytes)) or not all(
                    isinstance(p, int) and not isinstance(p, bool) for p in points):
                raise ParallelConfigError(f"pp_split_points={points!r}: give the decoder-layer "
                                          "indices that begin stages 1, 2, ... as ints")
            object.__setattr__(self, "pp_split_points", tuple(points))
        object.__setattr__(self, "param_dtype", _dtype_name("param_dtype", self.param_dtype, True))
        object.__setattr__(self, "reduce_dtype", _dtype_name("reduce_dtype", self.reduce_dtype, False))
        if self.fsdp_comm not in FSDP_COMMS:
            raise ParallelConfigError(f"fsdp_comm={self.fsdp_comm!r}: choose one of {FSDP_COMMS}")
        self._check_float8()
        if self.dp_replicate == -1 and self.dp_shard == -1:
            raise ParallelConfigError(
                "dp_replicate=-1 and dp_shard=-1: at most one of them may be -1 (the "
                "remaining ranks); e.g. set dp_replicate=1 for pure FSDP, or give dp_shard "
                "a size (e.g. the GPUs of one node) for HSDP"
            )

    def _check_float8(self) -> None:
        recipe = self.float8
        if isinstance(recipe, bool):
            recipe = "tensorwise" if recipe else None
        if recipe is not None and recipe not in FLOAT8_RECIPES:
            close = difflib.get_close_matches(str(recipe), FLOAT8_RECIPES, n=1)
            raise ParallelConfigError(
                f"float8={self.float8!r}: torchao has no such float8 recipe; choose one of "
                f"{', '.join(FLOAT8_RECIPES)}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        object.__setattr__(self, "float8", recipe)
        if not isinstance(self.float8_all_gather, bool):
            raise ParallelConfigError(f"float8_all_gather={self.float8_all_gather!r}: must be True or False")
        for name in ("float8_exclude", "float8_include"):
            names = getattr(self, name)
            names = (names,) if isinstance(names, str) else names
            if not all(isinstance(n, str) for n in names):
                raise ParallelConfigError(f"{name}={getattr(self, name)!r}: give module-name "
                                          "substrings, e.g. ('lm_head', 'mlp.down_proj')")
            object.__setattr__(self, name, tuple(names))

    # ------------------------------------------------------------------ derived sizes

    @property
    def is_resolved(self) -> bool:
        """True when no degree is -1 (as :meth:`validate` returns)."""
        return self.dp_replicate != -1 and self.dp_shard != -1

    @property
    def world_size(self) -> int | None:
        """``dp_replicate * dp_shard * cp * tp``, or None while a degree is -1."""
        if not self.is_resolved:
            return None
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The axes of the dense mesh: :data:`MESH_AXES`, after ``"pp"`` when pp > 1."""
        return (("pp",) if self.pp > 1 else ()) + MESH_AXES

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The shape of the dense mesh, in :attr:`mesh_axes` order (resolved configs only)."""
        self._require_resolved("mesh_shape")
        return (self.pp,) * (self.pp > 1) + (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: ``pp * pp_stages_per_rank`` (1 without pp)."""
        return self.pp * self.pp_stages_per_rank if self.pp > 1 else 1

    @property
    def dp(self) -> int:
        """Data-parallel degree ``dp_replicate * dp_shard`` (how many different batches)."""
        self._require_resolved("dp")
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """FSDP shard degree ``dp_shard * cp``."""
        self._require_resolved("dp_shard_cp")
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """FSDP shard degree of the experts: ``dp_shard * cp * tp // ep``."""
        self._require_resolved("efsdp")
        return self.dp_shard * self.cp * self.tp // self.ep

    def _require_resolved(self, what: str) -> None:
        if not self.is_resolved:
            raise ParallelConfigError(
                f"{what} is unknown for {self.describe()}: call .validate(world_size) first "
                "to fill in the -1"
            )

    # ------------------------------------------------------------------ validation

    def validate(self, world_size: int) -> ParallelConfig:
        """Check the degrees against ``world_size`` and return a copy with ``-1`` filled in.

        Rules: every degree a positive int (``-1`` only for ``dp_shard``/``dp_replicate``);
        ``dp_replicate * dp_shard * cp * tp == world_size``; ``ep`` divides
        ``dp_shard * cp * tp``. Raises :class:`ParallelConfigError` naming the numbers that
        disagree and how to fix them.
        """
        if isinstance(world_size, bool):
            raise ParallelConfigError(f"world_size={world_size!r} must be a positive int")
        try:
            world_size = operator.index(world_size)
        except TypeError:
            raise ParallelConfigError(
                f"world_size={world_size!r} must be a positive int, got {type(world_size).__name__}"
            ) from None
        if world_size < 1:
            raise ParallelConfigError(f"world_size={world_size} must be a positive int")

        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}
        if self.pp > 1:
            sizes = {"pp": self.pp, **sizes}
        auto = next((name for name in _AUTO_FIELDS if sizes[name] == -1), None)
        if auto is not None:
            known = {name: value for name, value in sizes.items() if name != auto}
            known_product = math.prod(known.values())
            if world_size % known_product != 0:
                raise ParallelConfigError(
                    self._indivisible_message(known, world_size)
                    + f", so {auto}=-1 (the remaining ranks) cannot be resolved"
                    + self._indivisible_fix(known, world_size)
                )
            sizes[auto] = world_size // known_product
        else:
            product = math.prod(sizes.values())
            if product != world_size:
                raise ParallelConfigError(self._mismatch_message(sizes, world_size))

        resolved = dataclasses.replace(self, dp_replicate=sizes["dp_replicate"], dp_shard=sizes["dp_shard"])
        borrowed = {"dp_shard": resolved.dp_shard, "cp": resolved.cp, "tp": resolved.tp}
        borrow_product = math.prod(borrowed.values())
        if borrow_product % self.ep != 0:
            raise ParallelConfigError(
                f"ep={self.ep} does not divide {_product_str(borrowed)} = {borrow_product} "
                f"(world_size={world_size}): expert parallelism borrows its ranks from "
                f"dp_shard x cp x tp instead of multiplying the world size; choose ep from "
                f"the divisors of {borrow_product}: {_divisors(borrow_product)}"
            )
        return resolved

    @staticmethod
    def _indivisible_message(known: dict[str, int], world_size: int) -> str:
        bad = [name for name, value in known.items() if world_size % value != 0]
        if len(bad) == 1:
            return f"{bad[0]}={known[bad[0]]} does not divide world_size={world_size}"
        return f"{_product_str(known)} = {math.prod(known.values())} does not divide world_size={world_size}"

    @staticmethod
    def _indivisible_fix(known: dict[str, int], world_size: int) -> str:
        bad = [name for name, value in known.items() if world_size % value != 0]
        if len(bad) == 1:
            return f": choose {bad[0]} from the divisors of {world_size}: {_divisors(world_size)}"
        return f": choose {', '.join(known)} whose product divides {world_size}"

    def _mismatch_message(self, sizes: dict[str, int], world_size: int) -> str:
        product = math.prod(sizes.values())
        msg = f"{_product_str(sizes)} = {product} but world_size is {world_size}"
        fixes = []
        for auto, verb in (("dp_shard", "shard over"), ("dp_replicate", "replicate over")):
            rest_product = math.prod(v for name, v in sizes.items() if name != auto)
            if world_size % rest_product == 0 and world_size // rest_product != sizes[auto]:
                fixes.append(f"{auto}=-1 to {verb} the remaining ranks ({auto}={world_size // rest_product})")
        if fixes:
            msg += f": make the product equal {world_size}, e.g. set " + ", or ".join(fixes)
        else:
            rest = {name: value for name, value in sizes.items() if name != "dp_shard"}
            msg += f", and {self._indivisible_message(rest, world_size)}" + self._indivisible_fix(rest, world_size)
        if self.ep > 1 and product * self.ep == world_size:
            msg += (
                f". Note that ep={self.ep} is not a factor of the world size: it borrows "
                "its ranks from dp_shard x cp x tp (torchtitan convention; Axolotl counts "
                "ep x dp_shard == world)"
            )
        return msg

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParallelConfig:
        """Build from a mapping with our keys, Axolotl's/Accelerate's or torchtitan's.

        Accepted keys (``None`` = unset, i.e. the field's default):

        - ``dp_replicate``: ``dp_replicate_size``, ``data_parallel_replicate_degree``
        - ``dp_shard``: ``dp_shard_size``, ``data_parallel_shard_degree``
        - ``tp``: ``tensor_parallel_size``, ``tp_size``, ``tensor_parallel_degree``
        - ``cp``: ``context_parallel_size``, ``sequence_parallel_degree`` (old Axolotl
          alias), ``cp_size``, ``context_parallel_degree``
        - ``ep``: ``expert_parallel_size``, ``ep_size``, ``expert_parallel_degree``
        - options: ``param_dtype``, ``reduce_dtype``, ``fsdp_comm``
        - ``float8``: ``fp8`` (Axolotl: ``true`` = ``"tensorwise"``), torchtitan's table
          ``quantize.linear.float8`` (``recipe_name``, ``filter_fqns``,
          ``enable_fsdp_float8_all_gather``), as a dotted key or nested under ``quantize``;
          ``float8_all_gather``: ``fp8_enable_fsdp_float8_all_gather``

        Unknown keys, and one field given under two names with different values, raise
        :class:`ParallelConfigError`. Unlike Axolotl, an unset ``dp_replicate`` is 1 (not
        "whatever ``dp_shard`` leaves"): pass ``dp_replicate_size=-1`` for that.

        Axolotl's ``expert_parallel_size`` with its ``dp_shard_size`` means what it means in
        Axolotl, where ``ep x dp_shard`` ranks make the FSDP group: ``dp_shard`` becomes
        ``dp_shard_size * expert_parallel_size`` (fusedpar's ep borrows its ranks from
        ``dp_shard x cp x tp``, torchtitan's convention, which its own keys keep).
        """
        if not isinstance(d, Mapping):
            raise ParallelConfigError(f"from_dict expects a mapping, got {type(d).__name__}")
        unknown = [key for key in d if key not in KEY_ALIASES]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(str(key), KEY_ALIASES, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            accepted = "; ".join(
                f"{field}: " + ", ".join(k for k, f in KEY_ALIASES.items() if f == field)
                for field in _FIELDS + _OPTION_FIELDS
            )
            raise ParallelConfigError(
                f"unknown parallel config key(s) {', '.join(hints)}; accepted keys are {accepted}"
            )
        values: dict[str, int] = {}
        source: dict[str, str] = {}
        for key, value in _expand_float8_tables(d):
            if value is None:
                continue
            field = KEY_ALIASES.get(key, key)
            if field == "float8" and isinstance(value, bool):
                if not value:
                    continue  # fp8: false = no float8
                value = "tensorwise"  # Axolotl's fp8: true (torchao's default recipe)
            if field not in _OPTION_FIELDS:
                value = _as_degree(key, value, field)
            if field in values and values[field] != value:
                raise ParallelConfigError(
                    f"{field} is given twice with different values: {source[field]}={values[field]} "
                    f"and {key}={value}; keep one of them"
                )
            values[field] = value
            source.setdefault(field, key)
        if (source.get("ep") == "expert_parallel_size" and source.get("dp_shard") == "dp_shard_size"
                and values["dp_shard"] > 0):
            values["dp_shard"] *= values["ep"]
        return cls(**values)

    # ------------------------------------------------------------------ text

    def describe(self) -> str:
        """One line, e.g. ``"dp_replicate=1 dp_shard=4 cp=1 tp=2 ep=1 (world 8)"`` (with
        ``pp=2 (1F1B, 4 microbatches) `` first when pp > 1, ``float8=RECIPE`` before the world)."""
        world = self.world_size
        suffix = f"(world {world})" if world is not None else "(world: not resolved)"
        pipeline = ""
        if self.pp > 1:
            micro = f", {self.pp_microbatches} microbatches" if self.pp_microbatches else ""
            pipeline = f"pp={self.pp} ({self.pp_schedule}{micro}) "
        return pipeline + (
            f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} "
            f"tp={self.tp} ep={self.ep} " + (f"float8={self.float8} " if self.float8 else "") + suffix
        )

    def __str__(self) -> str:
        return self.describe()

    # ------------------------------------------------------------------ meshes

    def _world_size_for_mesh(self, world_size: int | None) -> int:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            actual = dist.get_world_size()
            if world_size is not None and world_size != actual:
                raise ParallelConfigError(
                    f"world_size={world_size} was passed but the default process group has "
                    f"{actual} ranks: pass world_size={actual} or leave it unset"
                )
            return actual
        if world_size is not None:
            return world_size
        env = os.environ.get("WORLD_SIZE")
        if env is None:
            raise ParallelConfigError(
                "cannot tell the world size: torch.distributed is not initialized and "
                "WORLD_SIZE is not set; launch with torchrun, call "
                "torch.distributed.init_process_group first, or pass world_size="
            )
        return int(env)

    @staticmethod
    def _device_type(device_type: str | None) -> str:
        if device_type is not None:
            return device_type
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def build_mesh(self, device_type: str | None = None, world_size: int | None = None) -> DeviceMesh:
        """Validate against the world size and build the dense named ``DeviceMesh``.

        Plain-PyTorch equivalent::

            cfg = self.validate(dist.get_world_size())
            mesh = init_device_mesh(device_type, cfg.mesh_shape,
                                    mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
            mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")

        Every axis is kept even at size 1 (so FSDP's ``MixedPrecisionPolicy`` applies on one
        rank too). The flattened axes of :data:`FLATTENED_AXES` are registered on the root
        mesh, so ``mesh["dp_shard_cp"]`` works; torch >= 2.10 warns that slicing a flattened
        axis from the root mesh is deprecated, so prefer :func:`get_submesh`
        (``get_submesh(mesh, "dp_shard_cp")``), which never warns and works for plain axes
        too. ``DeviceMesh._flatten`` is private but present with the same signature
        ``_flatten(mesh_dim_name)`` in every torch fusedpar supports (2.11 .. 2.14).

        Args:
            device_type: ``"cuda"`` or ``"cpu"`` (gloo); None = ``"cuda"`` if available.
            world_size: checked against ``dist.get_world_size()`` when the default process
                group exists; otherwise ``init_device_mesh`` creates it from the environment
                (``WORLD_SIZE`` etc., as torchrun sets them).

        The expert mesh is separate: see :meth:`build_ep_mesh`.
        """
        from torch.distributed.device_mesh import init_device_mesh

        cfg = self.validate(self._world_size_for_mesh(world_size))
        mesh = init_device_mesh(self._device_type(device_type), cfg.mesh_shape, mesh_dim_names=cfg.mesh_axes)
        for name in FLATTENED_AXES:
            get_submesh(mesh, name)  # creates and registers the flattened axis
        return mesh

    def build_ep_mesh(self, device_type: str | None = None, world_size: int | None = None) -> DeviceMesh:
        """Build the expert ("sparse") mesh ``("dp_replicate", "efsdp", "ep")``.

        Plain-PyTorch equivalent::

            cfg = self.validate(dist.get_world_size())
            init_device_mesh(device_type, (cfg.dp_replicate, cfg.efsdp, cfg.ep),
                             mesh_dim_names=("dp_replicate", "efsdp", "ep"))

        ``ep`` borrows from ``dp_shard x cp x tp`` and is innermost, so an ``ep`` group is
        ``ep`` consecutive ranks inside one ``dp_replicate`` slice (with ``ep >= tp`` it holds
        whole ``tp`` groups); experts are sharded by FSDP over ``efsdp`` and replicated over
        ``dp_replicate`` (torchtitan's sparse mesh, without pp/etp). It is a second root mesh
        with its own process groups: build it only when ``ep > 1``.
        """
        from torch.distributed.device_mesh import init_device_mesh

        cfg = self.validate(self._world_size_for_mesh(world_size))
        pp = ("pp",) * (cfg.pp > 1)
        return init_device_mesh(
            self._device_type(device_type),
            (cfg.pp,) * (cfg.pp > 1) + (cfg.dp_replicate, cfg.efsdp, cfg.ep),
            mesh_dim_names=pp + EP_MESH_AXES,
        )


def _expand_float8_tables(d: Mapping[str, Any]):
    """``d``'s items, torchtitan's float8 table (``quantize.linear.float8 = {recipe_name,
    filter_fqns, ...}``, or nested as ``quantize: {linear: {float8: {...}}}``) replaced by
    our keys (a table without ``recipe_name`` is torchtitan's default, tensorwise)."""
    for key, value in d.items():
        if key not in ("quantize", "quantize.linear.float8"):
            yield key, value
            continue
        table = value
        if key == "quantize":
            inner = value.get("linear") if isinstance(value, Mapping) else None
            table = inner.get("float8") if isinstance(inner, Mapping) else None
            if not isinstance(table, Mapping) or set(value) != {"linear"} or set(inner) != {"float8"}:
                raise ParallelConfigError(
                    f"quantize={value!r}: fusedpar reads torchtitan's quantize.linear.float8 table "
                    "only (e.g. {'linear': {'float8': {'recipe_name': 'rowwise'}}})")
        if not isinstance(table, Mapping):
            raise ParallelConfigError(f"{key}={value!r}: give torchtitan's float8 table, e.g. "
                                      "{'recipe_name': 'rowwise', 'filter_fqns': ['output']}")
        unknown = set(table) - set(_TORCHTITAN_FLOAT8)
        if unknown:
            raise ParallelConfigError(f"quantize.linear.float8: unknown key(s) {sorted(unknown)}; "
                                      f"fusedpar reads {', '.join(_TORCHTITAN_FLOAT8)}")
        yield "float8", table.get("recipe_name") or "tensorwise"
        for name, field in _TORCHTITAN_FLOAT8.items():
            if field is not None and field != "float8" and name in table:
                yield field, table[name]


def get_submesh(mesh: DeviceMesh, name: str | tuple[str, ...]) -> DeviceMesh:
    """``mesh[name]``, without torch's deprecation warning for flattened axes.

    For a flattened axis of :data:`FLATTENED_AXES` (``"dp_shard_cp"``, ``"dp"``, ``"dp_cp"``)
    this is ``mesh[axes]._flatten(name)``, which creates the flattened mesh (and its process
    group) on first use and returns the cached one afterwards: call it on every rank.
    A tuple of names holding a flattened one (HSDP's ``("dp_replicate", "dp_shard_cp")``)
    is those axes' meshes concatenated: their process groups, no new ones. Anything else
    is ``mesh[name]``.
    """
    if not isinstance(name, str) and any(axis in FLATTENED_AXES for axis in name):
        return type(mesh)._concatenate([get_submesh(mesh, axis) for axis in name])
    if isinstance(name, str) and name in FLATTENED_AXES:
        axes = FLATTENED_AXES[name]
        dim_names = mesh.mesh_dim_names or ()
        if all(axis in dim_names for axis in axes):
            flatten = getattr(mesh[axes], "_flatten", None)
            if flatten is None:  # pragma: no cover - every supported torch has it
                import torch

                raise ParallelConfigError(
                    f"torch {torch.__version__} has no DeviceMesh._flatten, needed for the "
                    f"{name!r} axis; fusedpar needs torch >= 2.11"
                )
            return flatten(name)
    return mesh[name]
