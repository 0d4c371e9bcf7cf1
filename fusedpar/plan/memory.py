"""Closed-form memory per rank of one training step under one parallel config.

What fusedpar's ``parallelize`` builds, term by term (bytes, the most loaded rank):

- **parameters / gradients / optimizer state**: every parameter's local shard after TP
  (``tp`` splits attention, dense MLPs, embedding and head; norms, routers and, without
  ``ep``, whole MoE blocks stay replicated), EP (experts ``Shard(0)`` over ``ep``) and
  FSDP2 (``Shard(0)`` over ``dp_shard x cp``, experts over ``efsdp``; dim 0 padded to a
  multiple of the shard count, as FSDP2 allocates it). Gradients and optimizer states
  are in the parameters' dtype (FSDP2 keeps no master copy); AdamW holds two moments and a
  4-byte ``step`` per parameter.
- **activations**, per layer and micro-batch, counted from what autograd saves in
  fusedpar's Llama block (see :func:`layer_activations`); with activation checkpointing a
  layer keeps its input and one layer is recomputed at a time.
- **pipeline stages** hold the activations (and, on the last stage, the loss's) of the
  micro-batches in flight: GPipe all of them, 1F1B at most ``pp`` (the first stage ``pp``,
  the last one). torch's schedules defer FSDP's gradient reduce-scatter to the end of the
  last micro-batch, so a stage's whole unsharded gradients exist from its first backward
  on; the schedule keeps a receive buffer per micro-batch for the stage's input and its
  output's gradient, and the input gradients sent back until the next step.
- **FSDP2 unsharded parameters**: the root unit (embedding, head, final norm) stays
  unsharded from forward to the end of backward (``reshard_after_forward=False`` for the
  root), plus ``units_in_flight`` block units (the current one and the prefetched one), the
  all-gather output while it is copied out, and the unit's unsharded gradients.
- **transient**: the loss (logits, their fp32 copy, the softmax's gradient), a block's
  backward workspace, and the optimizer step's temporaries (``foreach`` AdamW: one
  parameter-sized list).
- **float8** (``Training.float8``): the unsharded weights FSDP gathers in fp8 take 1 byte an
  element (rowwise: and a float32 scale per row; :mod:`fusedpar.plan.float8` says which),
  and a converted linear's backward holds fp8 copies of its input, its output's gradient
  and its weight; master weights, gradients and optimizer state are unchanged.
- **symmetric memory** (fusedpar's fused backends): one buffer per group, as large as the
  largest call stages, rounded up to a power of two (``fusedpar.comm.symmetric``); it is
  outside torch's caching allocator, so not in ``max_memory_allocated``.
- **reserve**: the CUDA context and library workspaces plus allocator fragmentation, stated
  defaults (see :class:`Device`), not part of the peak torch reports.

The peak is the largest of four moments: the end of the forward (loss computed), the
loss's backward, the last block's backward, and the optimizer step.
"""

from __future__ import annotations

import dataclasses
import math

from ..parallel import config
from .float8 import converted, gather_form, gathered_bytes
from .model import ModelSpec, Tensor, parameter_shapes

__all__ = ["Candidate", "Memory", "Tensor", "Training", "estimate_memory", "parameter_shapes",
           "stage_memories"]

GiB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
#: The pipeline schedules the planner models: ParallelConfig's (``parallel.config.PP_SCHEDULES``)
#: that run one stage per rank.
PLANNED_SCHEDULES = tuple(sorted(set(config.PP_SCHEDULES.values()) - set(config.MULTI_STAGE_SCHEDULES)))


def dtype_bytes(name: str) -> int:
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype {name!r}: choose one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


@dataclasses.dataclass(frozen=True)
class Training:
    """What one step trains on and with.

    ``micro_batch``: sequences per data-parallel rank per forward (None: the whole
    ``global_batch / dp``, no accumulation; pipeline configs need at least ``pp``
    micro-batches, so they appear only with a ``micro_batch`` that gives them); ``param_dtype`` stores parameters, gradients
    and optimizer state; ``compute_dtype`` is FSDP2's ``MixedPrecisionPolicy.param_dtype``
    (activations), ``reduce_dtype`` its gradient reduction; ``foreach``: the optimizer's
    multi-tensor path (torch's default on GPUs); ``units_in_flight``: FSDP2 block units
    unsharded at once (2: the current and the prefetched one, on a GPU; 1 with synchronous
    collectives such as gloo's); ``fsdp_comm="fusedpar"``: FSDP2's collectives on fusedpar's
    ops (their results are copied into FSDP's buffers, and they use symmetric memory);
    ``capacity_factor``: MoE rows a rank receives, relative to balanced routing;
    ``pp_schedule``: torch's pipeline schedule with ``pp > 1`` (``"1F1B"`` or ``"GPipe"``);
    ``float8``: a torchao recipe (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``)
    or None, ``float8_all_gather``: FSDP gathers the converted weights in fp8 (see
    :mod:`fusedpar.plan.float8`).
    """

    seq_len: int
    global_batch: int
    micro_batch: int | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    optimizer: str = "adamw"
    foreach: bool = True
    units_in_flight: int = 2
    fsdp_comm: str = "fusedpar"
    capacity_factor: float = 1.0
    pp_schedule: str = "1F1B"
    float8: str | None = None
    float8_all_gather: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "reduce_dtype"):
            dtype_bytes(getattr(self, name))
        if self.optimizer not in _OPTIMIZER_STATES:
            raise ValueError(f"optimizer={self.optimizer!r}: choose one of {sorted(_OPTIMIZER_STATES)}")
        for name in ("seq_len", "global_batch", "units_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.pp_schedule not in PLANNED_SCHEDULES:
            raise ValueError(f"pp_schedule={self.pp_schedule!r}: the planner models {' and '.join(PLANNED_SCHEDULES)}")
        if self.float8 is not None and self.float8 not in config.FLOAT8_RECIPES:
            raise ValueError(f"float8={self.float8!r}: choose one of {', '.join(config.FLOAT8_RECIPES)} "
                             "(torchao's recipes) or None")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"micro_batch={self.micro_batch} must be at least 1 (or None)")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run: the degrees (``pp`` outermost; the rest multiply to ``world / pp``)
    and whether each block is activation-checkpointed."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    activation_checkpointing: bool = False

    @classmethod
    def from_config(cls, config, activation_checkpointing: bool = False) -> Candidate:
        """The candidate of a validated :class:`~fusedpar.parallel.ParallelConfig`."""
        return cls(dp_replicate=config.dp_replicate, dp_shard=config.dp_shard, cp=config.cp,
                   tp=config.tp, ep=config.ep, pp=config.pp,
                   activation_checkpointing=activation_checkpointing)

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """FSDP2's shard degree of dense parameters (``dp_shard x cp``)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """FSDP2's shard degree of experts (``dp_shard x cp x tp / ep``)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def name(self) -> str:
        """``"FSDP"``, ``"DDP"``, ``"HSDP"`` or the non-trivial degrees, e.g. ``"tp2 x fsdp4"``;
        ``" +AC"`` when checkpointed."""
        parts = [f"{axis}{getattr(self, axis)}" for axis in ("pp", "tp", "cp", "ep") if getattr(self, axis) > 1]
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts.append(f"hsdp{self.dp_replicate}x{self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"ddp{self.dp_replicate}")
        elif self.dp_shard > 1 or not parts:
            parts.append(f"fsdp{self.dp_shard}")
        return " x ".join(parts) + (" +AC" if self.activation_checkpointing else "")


def _shard(dim0: int, degree: int) -> int:
    """FSDP2's per-rank rows of a ``dim0``-row parameter over ``degree`` ranks (padded)."""
    return -(-dim0 // degree)


def _pow2_buffer(nbytes: float) -> int:
    """A symmetric buffer's size for calls of ``nbytes`` (power of two, at least 1 MiB)."""
    want = max(int(nbytes), 1 << 20)
    return 1 << (want - 1).bit_length()


@dataclasses.dataclass
class Memory:
    """Bytes per rank of one config (the most loaded rank / pipeline stage).

    ``peak`` is what torch's allocator would report as ``max_memory_allocated``: the
    largest sum, over the step's moments, of ``params + grads + optimizer + activations +
    unsharded + transient`` (the breakdown fields hold that moment's terms; ``phase`` names
    it). ``symmetric`` (fusedpar's buffers) and ``reserve`` come on top: ``total`` is what
    the GPU must hold.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    unsharded: int
    transient: int
    peak: int
    phase: str
    symmetric: int
    reserve: int
    phases: dict[str, int]
    stage: str = "all"

    @property
    def total(self) -> int:
        return self.peak + self.symmetric + self.reserve

    def breakdown(self) -> dict[str, int]:
        """The terms of ``total``, in the order of the plot's stacks."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "fsdp unsharded": self.unsharded,
                "transient": self.transient, "symmetric": self.symmetric, "reserve": self.reserve}


def layer_activations(spec: ModelSpec, tokens: int, cand: Candidate, c: int,
                      capacity_factor: float = 1.0) -> int:
    """Bytes autograd saves in one block's forward for ``tokens`` tokens of this rank (after
    CP), in compute dtype ``c`` bytes. Sequence-sharded parts (norms, MoE blocks under
    ``tp``) see ``tokens / tp``. Counted from fusedpar's Llama block:

    - RMSNorm: its fp32 input, the normalized input and the weighted output, the last one
      as the projections' input (gathered to the whole sequence under SP by
      ``all_gather_matmul``), plus the fp32 ``rsqrt`` per token;
    - attention: q after RoPE, K and V repeated to the query heads (a CP ring takes them
      unrepeated), the output, and the fp32 log-sum-exp per head;
    - SwiGLU MLP: gate, up, silu(gate) and their product (``tokens x intermediate / tp``
      each); GELU MLP: the fc output and its activation; an MoE block: per routed copy
      the row sent, gate/up, the activation (and silu(gate) in the per-expert loop used
      without ``ep``) and the output, and the router's fp32 logits and probabilities.
    """
    h, tp = spec.hidden, cand.tp
    seq_shard = tokens // tp if tp > 1 else tokens
    norm = (seq_shard * h * (4 + c) + seq_shard * 4) if spec.norm == "rms" else (seq_shard * h * c + 8 * seq_shard)
    proj_inputs = 2 * tokens * h * c
    kv = spec.kv_dim if cand.cp > 1 else spec.q_dim
    attention = tokens * (2 * spec.q_dim + 2 * kv) // tp * c + tokens * spec.heads // tp * 4
    if spec.moe:
        copies = int(seq_shard * spec.top_k * capacity_factor)
        # per routed copy: the row, gate/up, the activation and the output; the per-expert
        # loop without ep (experts_dense) also keeps silu(gate)
        per_copy = 2 * h + (3 if cand.ep > 1 else 4) * spec.expert_intermediate
        mlp = copies * per_copy * c + seq_shard * spec.experts * 8
        proj_inputs = tokens * h * c + seq_shard * h * c  # the MoE block reads its own shard
    elif spec.mlp == "swiglu":
        mlp = 4 * tokens * spec.intermediate // tp * c
    else:
        mlp = 2 * tokens * spec.intermediate // tp * c
    return 2 * norm + proj_inputs + attention + mlp


def estimate_memory(spec: ModelSpec, cand: Candidate, train: Training, device=None) -> Memory:
    """:class:`Memory` of ``cand`` training ``spec`` under ``train``; with ``pp > 1`` the
    worse of the first and the last pipeline stage. ``device`` (a :class:`~fusedpar.plan.Device`)
    sets the reserve; None: no reserve."""
    return max(stage_memories(spec, cand, train, device).values(), key=lambda m: m.total)


def stage_memories(spec: ModelSpec, cand: Candidate, train: Training, device=None) -> dict[str, Memory]:
    """:class:`Memory` of each pipeline stage the planner models: ``{"first": ..., "last": ...}``
    with ``pp > 1``, else ``{"all": ...}``."""
    stages = ("first", "last") if cand.pp > 1 else ("all",)
    return {stage: _stage_memory(spec, cand, train, device, stage) for stage in stages}


def micro_batches(cand: Candidate, train: Training) -> tuple[int, int]:
    """``(micro_batch, count)``: sequences per forward on a data-parallel rank (``micro_batch``
    None: the rank's whole share), and forwards per step. Raises ``ValueError`` when the
    batch does not split evenly."""
    if train.global_batch % cand.dp:
        raise ValueError(f"global_batch={train.global_batch} is not divisible by the "
                         f"data-parallel degree dp_replicate*dp_shard={cand.dp}")
    per_rank = train.global_batch // cand.dp
    micro = train.micro_batch or per_rank
    if per_rank % micro:
        raise ValueError(f"micro_batch={micro} does not divide the {per_rank} sequences per "
                         f"data-parallel rank (global_batch {train.global_batch} / dp {cand.dp})")
    return micro, per_rank // micro


def _stage_memory(spec: ModelSpec, cand: Candidate, train: Training, device, stage: str) -> Memory:
    p, c, r = (dtype_bytes(train.param_dtype), dtype_bytes(train.compute_dtype),
               dtype_bytes(train.reduce_dtype))
    micro, count = micro_batches(cand, train)
    tokens = micro * train.seq_len // cand.cp  # this rank's tokens per forward
    layers_here = math.ceil(spec.layers / cand.pp)
    first, last = stage in ("first", "all"), stage in ("last", "all")

    def held(t: Tensor) -> int:  # tensors of this stage (per-layer ones: its layers)
        if t.stage == "layer":
            return t.count * layers_here // spec.layers
        return t.count if (t.stage == "first" and first) or (t.stage == "last" and last) else 0

    shapes = parameter_shapes(spec, cand.tp, cand.ep)
    degree = {"root": cand.fsdp, "layer": cand.fsdp, "experts": cand.efsdp}
    local = sum(held(t) * _shard(t.dim0, degree[t.unit]) * t.rest for t in shapes)
    n_tensors = sum(held(t) for t in shapes)

    fp8 = converted(spec) if train.float8 else set()

    def unsharded(unit: str, per_layer: bool, elem: int, gathered: bool = False) -> int:
        """Bytes of one unit's unsharded parameters (padded) of ``elem`` bytes an element;
        ``gathered``: as FSDP all-gathers them (float8: fp8 weights, row scales)."""
        return sum((1 if per_layer else held(t)) * degree[t.unit] * gathered_bytes(
            _shard(t.dim0, degree[t.unit]), t.rest, gather_form(t, fp8, cand, train) if gathered else None, elem)
            for t in shapes if t.unit == unit and held(t))

    params, grads = local * p, local * p
    states = _OPTIMIZER_STATES[train.optimizer]
    optimizer = states * local * p + (n_tensors * 4 if states else 0)
    pipelined = cand.pp > 1
    # earlier micro-batches' gradients; under pp torch's schedules run every micro-batch's
    # backward without FSDP's gradient sync and reduce-scatter once after the last one
    # (PipelineStage.perform_reduce_grad): the stage's whole unsharded gradients, in the
    # reduce dtype FSDP2 accumulates them in, exist from the first backward on instead
    accumulated = grads if count > 1 and not pipelined else 0
    stage_grads = sum(unsharded(u, False, r) for u in ("root", "layer", "experts")) if pipelined else 0

    unit = unsharded("layer", True, c, True) + unsharded("experts", True, c, True)
    root = unsharded("root", False, c, True)
    # the root's gradients that exist during the blocks' backward: head and final norm
    root_grads = sum(_shard(t.dim0, cand.fsdp) * cand.fsdp * t.rest for t in shapes
                     if t.unit == "root" and t.stage == "last" and last) * c
    gather = unit * (2 if train.fsdp_comm == "fusedpar" and cand.fsdp > 1 else 1)

    # micro-batches whose activations a stage holds at once: GPipe runs every forward before
    # any backward; 1F1B starts backward once the first micro-batch has passed every stage
    # (the first stage holds pp of them, the last one)
    if not pipelined:
        in_flight = 1
    elif train.pp_schedule == "GPipe":
        in_flight = count
    else:
        in_flight = min(cand.pp, count) if first else 1
    per_layer = layer_activations(spec, tokens, cand, c, train.capacity_factor)
    h, V = spec.hidden, spec.vocab // cand.tp
    seq_shard = tokens // cand.tp if cand.tp > 1 else tokens
    rope = 2 * micro * (train.seq_len // cand.cp) * spec.head_dim * c if not spec.positions else 0
    logits_saved = tokens * V * 4 if last else 0  # log_softmax's fp32 output
    head_saved = (seq_shard * h * (4 + c) + tokens * h * c) if last else 0  # final norm, head input
    if cand.activation_checkpointing:
        kept = layers_here * seq_shard * h * c + rope  # each block's input
        recompute = per_layer
    else:
        kept = layers_here * per_layer + rope
        recompute = 0
    # pp: the schedule keeps each micro-batch's stage output (the last stage's logits) until
    # its backward is done
    stage_out = (tokens * V * c if last else seq_shard * h * c) if pipelined else 0
    kept += stage_out
    blocks = in_flight * kept
    loss_fwd = (tokens * V * c + (tokens * V * 4 if c != 4 else 0)) if last else 0
    loss_bwd = 2 * tokens * V * 4 + (tokens * V * c if c != 4 else 0) if last else 0
    # a block's backward: the incoming gradient and the larger of two moments of the MLP's:
    # the down projection's (its input gradients and weight gradient; under pp the weight
    # gradient accumulates into stage_grads, counted there) and, under SP, gate/up's (their
    # gradients and the two concatenated)
    if spec.moe:
        I = spec.expert_intermediate
        mlp_bwd = seq_shard * spec.top_k * (3 * I + h) * c
    else:
        I = spec.intermediate // cand.tp
        mlp_bwd = 3 * tokens * I * c + (h * I * c if cand.pp == 1 else 0)
        if cand.tp > 1:
            mlp_bwd = max(mlp_bwd, 4 * tokens * I * c)
    # the unit's gather comes before its recomputation (AC) and the MLP's gradients: the
    # larger of the two moments (``recompute``: the activations held at it)
    if gather > recompute + mlp_bwd:
        recompute, mlp_bwd = 0, gather
    # float8: a converted linear's backward also holds fp8 casts (1 byte an element) of its
    # input, its output's gradient and its weight: the largest linear's
    fp8_casts = max((tokens * (t.dim0 + t.rest) + t.dim0 * t.rest for t in shapes if t.name in fp8), default=0)
    block_bwd = seq_shard * h * c + mlp_bwd + fp8_casts
    # pp: the schedule's receive buffers, one per micro-batch for the stage's input (not the
    # first stage) and for its output's gradient (not the last), kept from step to step, and
    # the input gradients already sent back (.grad of the receive buffers, kept until the
    # next step starts)
    hop = seq_shard * h * c
    pp_buffers = count * hop * ((not first) + (not last)) if pipelined else 0
    sent = (count - 1) * hop if pipelined and not first else 0
    # a forward after a backward (1F1B's steady state) sees the gradients of the earlier ones
    late_forward = stage_grads + sent if in_flight < count else 0
    base = params + optimizer + accumulated + pp_buffers
    # a backward holds ``bwd_flight`` micro-batches' activations and ``bwd_grads``: the first
    # one under pp all in flight and none of the stage's gradients, a later one as many or
    # fewer (GPipe: one fewer) and all of them (the larger of the two)
    bwd_flight, bwd_grads = in_flight, 0
    if pipelined:
        root_grads = 0  # part of stage_grads
        later = count - 1 if train.pp_schedule == "GPipe" else min(in_flight, count - 1)
        if later * (kept + logits_saved + head_saved) + stage_grads + sent > blocks:
            bwd_flight, bwd_grads = later, stage_grads + sent
    bwd_blocks = bwd_flight * kept
    # the forward's end: the current micro-batch's logits are counted in loss_fwd
    fwd_held = in_flight * (kept + logits_saved + head_saved) - (stage_out if last else 0)
    # the loss's backward: the head's input and the final norm's saved tensors wait for theirs
    moments = {
        "forward": (base + late_forward + root + fwd_held + loss_fwd, loss_fwd),
        "loss backward": (base + bwd_grads + root + bwd_flight * (kept + logits_saved + head_saved)
                          + loss_bwd + root_grads, loss_bwd + root_grads),
        "block backward": (base + bwd_grads + root + root_grads + bwd_blocks + (bwd_flight - 1)
                           * (logits_saved + head_saved) + recompute
                           + train.units_in_flight * unit + block_bwd, root_grads + block_bwd),
    }
    step_temp = (local * p if train.foreach else 2 * max(_shard(t.dim0, degree[t.unit]) * t.rest
                                                         for t in shapes if held(t)) * p) if states else 0
    moments["optimizer step"] = (params + grads + optimizer + pp_buffers + (count * hop if sent else 0)
                                 + step_temp, step_temp)
    phase = max(moments, key=lambda k: moments[k][0])
    peak, transient = moments[phase]
    if phase == "optimizer step":
        acts, uns, g = pp_buffers + (count * hop if sent else 0), 0, grads
    else:
        forward = phase == "forward"
        acts = pp_buffers + (fwd_held if forward else bwd_flight * (kept + logits_saved + head_saved))
        if phase == "block backward":  # the current micro-batch's loss and head are done
            acts += recompute - logits_saved - head_saved
        uns = root + (train.units_in_flight * unit if phase == "block backward" else 0)
        g = accumulated + (late_forward if forward else bwd_grads)
    rs_unit = max(unsharded("layer", True, r) + unsharded("experts", True, r), unsharded("root", False, r))
    symmetric = _symmetric(spec, cand, train, tokens, seq_shard, c, rs_unit) if device is None or device.symmetric else 0
    reserve = device.reserve(peak) if device is not None else 0
    return Memory(params=params, grads=g, optimizer=optimizer, activations=acts, unsharded=uns,
                  transient=transient, peak=peak, phase=phase, symmetric=symmetric, reserve=reserve,
                  phases={k: v for k, (v, _) in moments.items()}, stage=stage)


def _symmetric(spec, cand, train, tokens, seq_shard, c, rs_unit) -> int:
    """fusedpar's symmetric buffers: one per group, sized by its largest staged call
    (``rs_unit``: the largest unit's gradients in the reduce dtype)."""
    sizes = []
    if cand.fsdp > 1 and train.fsdp_comm == "fusedpar":  # reduce-scatter stages the whole unit
        sizes.append(rs_unit)
    if cand.tp > 1:  # matmul_reduce_scatter stages the [tokens, hidden] product
        sizes.append(tokens * spec.hidden * c)
    if cand.cp > 1:  # the ring stages this rank's K and V
        sizes.append(2 * tokens * spec.kv_dim // cand.tp * c)
    if cand.ep > 1:  # the fused exchange: the rows a rank receives, twice
        sizes.append(2 * seq_shard * spec.top_k * train.capacity_factor * spec.hidden * c)
    return sum(_pow2_buffer(n) for n in sizes)
