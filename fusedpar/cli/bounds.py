"""The bytes one rank must receive per training step through each of fusedpar's ops, which
``fusedpar train`` prints next to what the ops measured (``fusedpar.comm.count_bytes``).

- FSDP (``all_gather``, ``reduce_scatter``): each parameter's shard from every other rank
  of its FSDP group (``dp_shard x cp``; ``efsdp`` for experts split by ep), gathered twice
  for a block (re-gathered for backward) and once for the root (FSDP2 keeps it), its
  gradient reduce-scattered once in ``reduce_dtype``. Per dtype: a float8 weight that FSDP2
  gathers in fp8 counts 1 byte an element (tensorwise: its scale is all-reduced before, not
  gathered; rowwise: plus a float32 scale per row), the rest ``param_dtype``
  (:func:`fusedpar.plan.float8.gathered_bytes`, the planner's rule).
- tp (``all_gather_matmul``, ``matmul_reduce_scatter``; the embedding's ``all_gather`` and
  ``reduce_scatter``): with ``x`` one rank's sequence shard of the hidden states, ``[B/dp,
  S/(cp tp), H]``, a shared gather per attention block (q/k/v) and per dense MLP (gate/up;
  MoE blocks stay whole) + the ``lm_head``'s in forward, and the adjoints of the
  reduce-scatters (o, down) in backward: ``(2 (L + L_dense) + 1) (tp-1) |x|`` each; the
  embedding's reduce-scatter to the sequence-parallel region and its adjoint ``(tp-1) |x|``.
  float8 projections (their ``float8`` recipe) move to the fp8 ops: ``all_gather_scaled_matmul``
  gathers ``x`` in fp8 once per shared gather in forward (rowwise recipes: with a float32
  scale per row) and ``dy`` in fp8 per row-parallel layer in backward (its row scales travel
  beside, through torch's collective); ``scaled_matmul_reduce_scatter``'s bound is one
  ``(tp-1) |x|`` in ``param_dtype`` per row-parallel layer in forward and per shared gather
  in backward (it moves float32 partials, and one per projection). ``rowwise_with_gw_hp``
  also gathers ``x`` and ``dy`` in high precision for the weight gradient (``all_gather``).
- ep (``moe_experts``, or ``moe_dispatch`` + ``moe_combine`` where it runs unfused): it
  depends on the routing, which :class:`RoutedRows` records. A token needs one row on each
  other rank holding one of its experts, there and back, in forward and again in backward
  (where the sum of its experts' outputs on that rank is one row): DeepEP's volume, and
  the ``pipelined`` backend's (plus each row's expert ids and weights). A row per routed
  copy is what the ``fused`` and unfused ones move.
- ``ring_attention`` has no bound here: it depends on the algorithm (``fusedpar check``
  prints each backend's volume).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fusedpar.comm import resolve_group
from fusedpar.comm.groups import host_collective_device
from fusedpar.nn.linear import local
from fusedpar.nn.moe import ExpertParallelMoE
from fusedpar.ops import topk_route
from fusedpar.ops.moe.routing import rows_received, rows_sent
from fusedpar.plan.float8 import SCALE_BYTES, gathered_bytes

#: Mesh axes over which FSDP2 shards a parameter (the dense blocks', the experts').
FSDP_SHARD_AXES = ("dp_shard_cp", "efsdp")


def _fsdp_ranks(p: torch.Tensor) -> int:
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return 1
    return math.prod(mesh.size(i) for i, name in enumerate(mesh.mesh_dim_names)
                     if name in FSDP_SHARD_AXES)


def _elem(dtype_name: str | None) -> int:
    return getattr(torch, dtype_name or "float32").itemsize


def _gather_form(t: torch.Tensor, float8: str | None) -> str | None:
    """How FSDP2 all-gathers the local shard ``t``: ``"tensorwise"`` / ``"rowwise"`` fp8
    (torchao's and fusedpar's fp8 all-gather weights) or None (``param_dtype``)."""
    if float8 is None:
        return None
    from fusedpar.parallel.float8 import RowwiseFloat8Weight, WeightWithDynamicFloat8CastTensor

    if isinstance(t, RowwiseFloat8Weight):
        return "rowwise"
    return "tensorwise" if isinstance(t, WeightWithDynamicFloat8CastTensor) else None


def static_bounds(model, pcfg, batch_size: int, seq_len: int) -> dict[str, int]:
    """FSDP's and tp's bounds (module docstring) for ``model`` after ``parallelize``."""
    act_elem, reduce_elem = _elem(pcfg.param_dtype), _elem(pcfg.reduce_dtype)
    block_ids = {id(p) for p in model.model.layers.parameters()}
    gather = reduce = 0
    for p in model.parameters():
        t = local(p)  # FSDP pads: rank 0's is the largest
        rows = t.shape[0] if t.dim() else 1
        others = _fsdp_ranks(p) - 1
        shard = gathered_bytes(rows, t.numel() // max(rows, 1), _gather_form(t, pcfg.float8), act_elem)
        gather += (2 if id(p) in block_ids else 1) * others * shard
        reduce += others * t.numel() * reduce_elem
    bounds = {"all_gather": gather, "reduce_scatter": reduce}
    tp = pcfg.tp
    if tp > 1:
        hidden = model.config.hidden_size
        x = batch_size // pcfg.dp * seq_len // (pcfg.cp * tp) * hidden  # elements
        columns, rows = [], []  # a shared gather's first projection; the row-parallel ones
        for layer in model.model.layers:
            columns.append(layer.self_attn.q_proj)
            rows.append(layer.self_attn.o_proj)
            if hasattr(layer.mlp, "down_proj"):
                columns.append(layer.mlp.gate_proj)
                rows.append(layer.mlp.down_proj)
        fp8_cols = sum(getattr(m, "float8", None) is not None for m in columns)
        fp8_rows = sum(getattr(m, "float8", None) is not None for m in rows)
        plain = len(columns) + len(rows) - fp8_cols - fp8_rows + 1  # + the head's gather
        shard = (tp - 1) * x * act_elem
        bounds["all_gather"] += shard
        bounds["reduce_scatter"] += shard
        bounds["all_gather_matmul"] = bounds["matmul_reduce_scatter"] = plain * shard
        if fp8_cols + fp8_rows:
            scales = x // hidden * SCALE_BYTES if pcfg.float8 != "tensorwise" else 0
            bounds["all_gather_scaled_matmul"] = (tp - 1) * (fp8_cols * (x + scales) + fp8_rows * x)
            bounds["scaled_matmul_reduce_scatter"] = (fp8_cols + fp8_rows) * shard
            if pcfg.float8 == "rowwise_with_gw_hp":  # x and dy for the weight gradient
                bounds["all_gather"] += (fp8_cols + fp8_rows) * shard
    return {op: b for op, b in bounds.items() if b}


class RoutedRows:
    """Records the routing of the expert-parallel MoE blocks of ``model`` (forward hooks on
    their routers; the ids ``fusedpar.ops.topk_route`` picks) between :meth:`start` and
    :meth:`bounds`, which returns, per MoE op that ran, ``(lower bound, a row per copy)``
    in bytes received by this rank (module docstring). Every rank of the ep groups calls
    :meth:`bounds` (it all-gathers the counts)."""

    def __init__(self, model, act_dtype: str | None):
        self.blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
        self.row_bytes = model.config.hidden_size * _elem(act_dtype)
        self.group = resolve_group(self.blocks[0].group_name) if self.blocks else None
        self.routes: list[tuple[torch.Tensor, int]] = []
        for block in self.blocks:
            block.router.register_forward_hook(self._hook(block))

    def _hook(self, block):
        def record(_router, _args, logits):
            idx = topk_route(logits.detach(), block.top_k, renormalize=block.renormalize)[0]
            self.routes.append((idx, block.num_local_experts))
        return record

    def start(self) -> None:
        self.routes.clear()

    def bounds(self, ops: set[str]) -> dict[str, tuple[int, int]]:
        if self.group is None:
            return {}
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        sent = sum((rows_sent(idx, local, world) for idx, local in self.routes),
                   torch.zeros(2, world, dtype=torch.int64))
        device = host_collective_device(self.group)
        every = [torch.empty_like(sent, device=device) for _ in range(world)]
        dist.all_gather(every, sent.to(device), group=self.group)
        incoming, outgoing = rows_received(torch.stack(every).cpu(), rank)
        # forward and backward
        totals = {"moe_experts": 2 * (incoming + outgoing) * self.row_bytes,
                  "moe_dispatch": 2 * incoming * self.row_bytes,
                  "moe_combine": 2 * outgoing * self.row_bytes}
        return {op: (int(t[0]), int(t[1])) for op, t in totals.items() if op in ops}
