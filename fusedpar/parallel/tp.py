"""``apply_tp``: tensor (+ sequence) parallelism for a Llama-style decoder block, with the
q/k/v and gate/up projections sharing one fused all-gather-matmul each.

Plain-PyTorch (DTensor) equivalent of ``apply_tp(block, tp_mesh, sequence_parallel=True)``::

    parallelize_module(block, tp_mesh, {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),)),
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    })
    block.self_attn.num_heads //= W; block.self_attn.num_key_value_heads //= W   # if present

and with ``sequence_parallel=False``: ColwiseParallel / RowwiseParallel on the projections
only (input and output replicated); with ``split_mlp=False`` (an MoE block) the "mlp"
entries are left out and the block's mlp runs on the sequence shards as it is. Unlike
DTensor, every tensor stays a plain tensor except the projections' parameters (DTensors on
the TP axis, as there) and each gather runs fused with its matmuls.
"""

from __future__ import annotations

from torch import nn

from ..comm import resolve_group
from ..nn import ColumnParallelLinear, RowParallelLinear, SharedGather, sync_replicated_grads

__all__ = ["apply_tp"]

ATTENTION_COLUMNS = ("q_proj", "k_proj", "v_proj")
ATTENTION_ROW = "o_proj"
MLP_COLUMNS = ("gate_proj", "up_proj")
MLP_ROW = "down_proj"
NORMS = ("input_layernorm", "post_attention_layernorm")

#: Integer attributes of the attention module that count heads; divided by the TP size.
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_heads", "n_kv_heads")


def _tp_axis(tp_mesh):
    """A DeviceMesh with a "tp" axis means that axis (the layers' DTensors then live on
    ``mesh["tp"]``, which FSDP2 composes with); anything else as ``resolve_group``."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(tp_mesh, DeviceMesh) and tp_mesh.ndim > 1:
        if "tp" not in (tp_mesh.mesh_dim_names or ()):
            raise ValueError(f"apply_tp: tp_mesh has axes {tp_mesh.mesh_dim_names} and none is "
                             "named 'tp'; pass mesh['tp'] (a 1-D mesh) or (mesh, axis_name)")
        tp_mesh = tp_mesh["tp"]
    return tp_mesh, resolve_group(tp_mesh)


def _expect(block: nn.Module, split_mlp: bool) -> tuple[nn.Module, nn.Module, list[tuple]]:
    """``(attn, mlp, parts)``: ``parts`` the modules apply_tp splits, as ``(module, name,
    column layers, row layer)``."""
    problems = []
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    parts = [(attn, "self_attn", ATTENTION_COLUMNS, ATTENTION_ROW)]
    if split_mlp:
        parts.append((mlp, "mlp", MLP_COLUMNS, MLP_ROW))
    elif not isinstance(mlp, nn.Module):
        problems.append("no submodule 'mlp'")
    for owner, owner_name, columns, row in parts:
        if owner is None:
            problems.append(f"no submodule {owner_name!r}")
            continue
        for name in (*columns, row):
            layer = getattr(owner, name, None)
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                raise ValueError(f"apply_tp: {owner_name}.{name} is already a "
                                 f"{type(layer).__name__}; apply_tp was applied to this block")
            weight = getattr(layer, "weight", None)
            if layer is None or weight is None or weight.dim() != 2:
                problems.append(f"{owner_name}.{name} is not a linear layer with a [out, in] weight")
    for name in NORMS:
        if not isinstance(getattr(block, name, None), nn.Module):
            problems.append(f"no submodule {name!r}")
    if problems:
        raise TypeError(
            f"apply_tp expects a Llama-style decoder block (Hugging Face LlamaDecoderLayer "
            f"names): self_attn.{{q,k,v,o}}_proj, mlp.{{gate,up,down}}_proj, {NORMS[0]}, "
            f"{NORMS[1]}; {type(block).__name__} has: " + "; ".join(problems)
        )
    return attn, mlp, parts


def _check_divisible(attn: nn.Module, parts: list[tuple], world: int) -> dict[str, int]:
    """Every size apply_tp splits (``parts``, from ``_expect``) must divide by ``world``;
    returns the head counts."""
    problems = []
    heads = {name: getattr(attn, name) for name in HEAD_COUNT_ATTRS
             if isinstance(getattr(attn, name, None), int) and not isinstance(getattr(attn, name), bool)}
    problems += [f"self_attn.{name}={value}" for name, value in heads.items() if value % world]
    for owner, owner_name, columns, row in parts:
        for name in columns:
            out = getattr(owner, name).weight.shape[0]
            if out % world:
                problems.append(f"{owner_name}.{name} out_features={out}")
        in_ = getattr(owner, row).weight.shape[1]
        if in_ % world:
            problems.append(f"{owner_name}.{row} in_features={in_}")
    head_dim = getattr(attn, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and not problems:
        for name in ATTENTION_COLUMNS:
            local = getattr(attn, name).weight.shape[0] // world
            if local % head_dim:
                problems.append(f"self_attn.{name}: {local} local output features is not a "
                                f"whole number of heads of head_dim={head_dim}")
    if problems:
        raise ValueError(f"apply_tp: these sizes are not divisible by the tensor-parallel size "
                         f"{world} (heads must split evenly over the ranks): " + ", ".join(problems))
    return heads


def _is_attention_width(attn: nn.Module, heads: dict[str, int]) -> bool:
    """Whether ``attn.hidden_size`` is the attention's own width ``num_heads * head_dim``."""
    hidden, head_dim = getattr(attn, "hidden_size", None), getattr(attn, "head_dim", None)
    num_heads = heads.get("num_heads", heads.get("num_attention_heads"))
    return (isinstance(hidden, int) and isinstance(head_dim, int) and num_heads is not None
            and hidden == num_heads * head_dim)


def apply_tp(block: nn.Module, tp_mesh=None, sequence_parallel: bool = True, *,
             backend: str | None = None, split_mlp: bool = True, float8=None) -> nn.Module:
    """Shard a Llama-style decoder block over the tensor-parallel group, in place; returns it.

    What it expects (duck typing; Hugging Face ``LlamaDecoderLayer`` names, also Mistral /
    Qwen2 / Qwen3 layers):

    - ``block.self_attn`` with linear ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj``
      (any module with a ``weight`` ``[out, in]`` and optional ``bias``). Its forward takes
      the hidden states as the first positional argument or the ``hidden_states`` keyword,
      passes them unchanged to q/k/v, infers head counts from the projections' outputs
      (``view(..., -1, head_dim)``) or from the attributes in :data:`HEAD_COUNT_ATTRS`, and
      feeds its whole result through ``o_proj``.
    - ``block.mlp`` with linear ``gate_proj``, ``up_proj``, ``down_proj``, its input passed
      unchanged to gate/up (e.g. ``down(act(gate(x)) * up(x))``).
    - ``block.input_layernorm`` and ``block.post_attention_layernorm`` (any modules).
    - ``split_mlp=False`` (sequence parallelism only): ``block.mlp`` may be any module
      (an MoE block); it is left whole and runs on this rank's sequence shard. Its
      parameters' gradients are not summed over the group: the caller's part (an
      expert-parallel exchange, or :func:`~fusedpar.nn.sync_replicated_grads`).

    What it does (W = size of the group, heads must divide by W):

    - q/k/v and gate/up become :class:`~fusedpar.nn.ColumnParallelLinear` (``from_linear``),
      o/down :class:`~fusedpar.nn.RowParallelLinear`. Attention heads are split: rank r
      keeps q heads ``[r*H/W, (r+1)*H/W)`` and the matching kv heads; head-count attributes
      present on ``self_attn`` (:data:`HEAD_COUNT_ATTRS`) are divided by W, and so is
      ``self_attn.hidden_size`` where it equals ``num_heads * head_dim`` (older HF code
      reshapes the attention output to it).
    - q/k/v share one gather, gate/up another (:class:`~fusedpar.nn.SharedGather`): a
      forward pre-hook on ``self_attn`` / ``mlp`` runs one ``all_gather_matmul`` and hands
      the forward the gathered hidden states (full sequence, so shape reads stay right);
      the projections return the precomputed outputs.
    - ``sequence_parallel=True``: the block takes and returns sequence shards
      ``[B, S/W, H]`` (sequence dim 1); the norms and residual adds run on the shards;
      o/down reduce-scatter along the sequence fused with their matmul.
      ``sequence_parallel=False``: input and output are replicated ``[B, S, H]``; o/down
      all-reduce.
    - The projections' parameters become DTensors on the TP axis (``Shard``/``Replicate``,
      as torch's plan leaves them). Every other parameter stays replicated (a plain tensor, same on every rank). Where
      it only sees part of the data, its gradient is summed over the group in backward by
      :func:`~fusedpar.nn.sync_replicated_grads`: with SP, all of them (the norms run on
      sequence shards); without SP, those inside ``self_attn`` / ``mlp`` (e.g. Qwen3's
      ``q_norm``/``k_norm`` act on this rank's heads). So after ``backward()`` every
      rank holds the complete gradient of the replicated parameters and the shard of the
      full gradient of the sharded ones; DDP/FSDP over other axes need do nothing for TP.

    ``tp_mesh``: a 1-D DeviceMesh, a mesh with a ``"tp"`` axis, ``(mesh, axis_name)``, a
    ProcessGroup, a group name or None (world). ``backend`` goes to the fused ops.
    ``float8``: a torchao recipe name for every projection, or a function of a projection
    returning its recipe or None; those layers compute in fp8 through the fused fp8 ops and
    their gathers move fp8 (``ColumnParallelLinear`` / ``RowParallelLinear``'s ``float8``;
    needs ``sequence_parallel=True``).
    Whole models: apply it to each layer; sharding the sequence of the embeddings'
    output and gathering before the head are the caller's (``fusedpar.parallelize``'s) part.
    """
    if not split_mlp and not sequence_parallel:
        raise ValueError("apply_tp: split_mlp=False needs sequence_parallel=True (the unsplit "
                         "mlp runs on this rank's sequence shard; with replicated input every "
                         "rank would repeat it on the same tokens)")
    axis, group = _tp_axis(tp_mesh)
    world = group.size()
    attn, mlp, parts = _expect(block, split_mlp)
    heads = _check_divisible(attn, parts, world)

    def recipe(layer):
        return float8(layer) if callable(float8) else float8

    def column(layer):
        return ColumnParallelLinear.from_linear(layer, axis, sequence_parallel=sequence_parallel,
                                                backend=backend, float8=recipe(layer))

    def row(layer):
        return RowParallelLinear.from_linear(layer, axis, sequence_parallel=sequence_parallel,
                                             backend=backend, float8=recipe(layer))

    for owner, _, columns, row_name in parts:
        for name in columns:
            setattr(owner, name, column(getattr(owner, name)))
        setattr(owner, row_name, row(getattr(owner, row_name)))
        recipes = {name: getattr(owner, name).float8 for name in columns}
        if len(set(recipes.values())) > 1:
            raise ValueError(f"apply_tp: float8 {recipes}: {', '.join(columns)} share one gather of "
                             "their input, so they compute in float8 all or none; convert or exclude "
                             "them together")
        shared = SharedGather(*(getattr(owner, name) for name in columns))
        shared.register_input_hook(owner)
    for name, value in heads.items():
        setattr(attn, name, value // world)
    if _is_attention_width(attn, heads):  # older HF reshapes the output to self.hidden_size
        attn.hidden_size //= world
    if sequence_parallel:
        sync_replicated_grads(block, group, skip=() if split_mlp else (mlp,))
    else:
        sync_replicated_grads(attn, group)
        sync_replicated_grads(mlp, group)
    return block
