"""What float8 training (``ParallelConfig(float8=RECIPE)``, :mod:`fusedpar.parallel.float8`)
changes in the plan: which weights compute in fp8, what FSDP2 all-gathers them as, and the
bytes one rank receives through FSDP's all-gathers in a step.

What ``parallelize`` does, as the planner counts it:

- converted: the linear layers' weights (``nn.Linear``: attention and MLP projections, the
  MoE router, shared experts) whose dims are multiples of 16, not the output head; the
  embedding, norms, biases, GPT-2's ``Conv1D`` and the 3-D expert weights stay in
  ``compute_dtype``.
- FSDP all-gathers a converted weight (``float8_all_gather``, the default; never under tp,
  where the TP ops move fp8 inputs and FSDP gathers ``param_dtype``):
  tensorwise in fp8, 1 byte per element (its scale is all-reduced beforehand, not
  gathered); rowwise recipes (``rowwise``, ``rowwise_with_gw_hp``) in fp8 with a float32
  scale per row, in forward and again in backward, for the decoder layers' weights whose
  rows divide the shard degree, with more than one shard and without activation
  checkpointing; anything else in ``compute_dtype``.

Plain-PyTorch equivalent: the sum, over ``fully_shard``'s all-gathers of one step, of
``(shards - 1) * shard.numel() * shard.element_size()``.
"""

from __future__ import annotations

from .model import ModelSpec, Tensor, parameter_shapes

__all__ = ["FP8_LINEARS", "converted", "fsdp_all_gather_bytes", "gather_form", "gathered_bytes"]

#: The :func:`parameter_shapes` entries that are ``nn.Linear`` weights (what
#: ``convert_to_float8_training`` converts).
FP8_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                         "router", "shared_gate_up", "shared_down", "shared_expert_gate", "q_a_proj",
                         "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})
#: Bytes of one row's scale in a rowwise fp8 all-gather.
SCALE_BYTES = 4


def gathered_bytes(rows: int, cols: int, form: str | None, elem: int) -> int:
    """Bytes of a ``[rows, cols]`` shard in FSDP's all-gather: ``form`` ``"tensorwise"`` (fp8),
    ``"rowwise"`` (fp8 and a float32 scale per row) or None (``elem`` bytes an element)."""
    if form == "tensorwise":
        return rows * cols
    if form == "rowwise":
        return rows * (cols + SCALE_BYTES)
    return rows * cols * elem


def converted(spec: ModelSpec) -> set[str]:
    """The names of :func:`parameter_shapes` entries that compute in fp8 (module docstring)."""
    return {t.name for t in parameter_shapes(spec, tp=1, ep=1)
            if t.name in FP8_LINEARS and not t.dim0 % 16 and not t.rest % 16}


def gather_form(t: Tensor, fp8: set[str], cand, train) -> str | None:
    """How FSDP all-gathers ``t`` under ``train.float8``: ``"tensorwise"``, ``"rowwise"`` or
    None (``compute_dtype``). ``fp8``: :func:`converted`; ``cand``: a
    :class:`~fusedpar.plan.Candidate`."""
    if not train.float8 or t.name not in fp8 or not train.float8_all_gather or cand.tp > 1:
        return None
    if train.float8 == "tensorwise":
        return "tensorwise"
    degree = cand.efsdp if t.unit == "experts" else cand.fsdp
    if t.unit == "root" or cand.activation_checkpointing or degree == 1 or t.dim0 % degree:
        return None
    return "rowwise"


def fsdp_all_gather_bytes(spec: ModelSpec, cand, train, compute_bytes: int, layers: int | None = None) -> int:
    """Bytes one rank receives through FSDP's all-gathers in one forward and backward of
    ``layers`` decoder layers (default all; the root unit's tensors with them): each shard
    of the ``shards - 1`` others (padded to ``ceil(dim0 / shards)`` rows, as FSDP2 pads),
    the decoder layers' units twice (re-gathered for backward), the root once (FSDP2 keeps
    it)."""
    layers = spec.layers if layers is None else layers
    fp8 = converted(spec) if train.float8 else set()
    total = 0
    for t in parameter_shapes(spec, cand.tp, cand.ep):
        degree = cand.efsdp if t.unit == "experts" else cand.fsdp
        if degree == 1:
            continue
        count = t.count * layers // spec.layers if t.stage == "layer" else t.count
        shard = gathered_bytes(-(-t.dim0 // degree), t.rest, gather_form(t, fp8, cand, train), compute_bytes)
        total += (1 if t.unit == "root" else 2) * count * (degree - 1) * shard
    return total
