"""``moe_experts``: the expert-parallel SwiGLU expert MLP, dispatch -> grouped GEMM ->
SwiGLU -> grouped GEMM -> combine, and ``moe_experts_loopback`` (every rank in one process).

Backends, in priority order (on a GPU the tuning tables choose among the ones that can take
a call, by ``ExpertsCall.bucket()``: ``fusedpar.ops.tuning``):
- ``pipelined`` (``experts_pipelined``): the exchange split by source rank with async P2P,
  overlapping the expert GEMMs; a row per token and rank holding its experts. Takes
  ``float8``: the rows travel as fp8 bytes and a scale each.
- ``fused`` (``experts_fused``): symmetric memory, both grouped GEMMs fused with the
  exchange. Takes ``float8``: each copy is cast as the permute kernel gathers it and
  travels as fp8 bytes and a scale; the GEMMs multiply in fp8 with the scales in their
  epilogues.
- ``reference`` (``Reference`` here): the unfused ops, ``moe_dispatch`` -> ``grouped_mm``
  -> ``swiglu`` -> ``grouped_mm`` -> ``moe_combine``. The only backend that takes
  ``max_tokens_per_rank``: the padded dispatch and ``grouped_mm(..., masked_m=)``, no host
  read.
Every backend moves only routed rows, once there and once back (no padding), in the
forward pass and again in the backward, and counts both: a row per token and rank holding
its experts (``pipelined``), or a row per routed copy (``fused``, ``reference``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm import resolve_group
from ...errors import BackendNotSupportedError
from ..backend import Backend, Dispatcher, autocast_inputs, autocast_off
from ..grouped_mm import grouped_mm
from ..registry import register
from .dispatch import float8_dispatch, moe_combine, moe_combine_loopback, moe_dispatch, moe_dispatch_loopback
from .exchange import check_routing, eager_under_compile, float8_cast
from .experts_call import OP, ExpertsCall, check_expert_weights
from .experts_fused import Fused, fused_loopback
from .experts_pipelined import Pipelined
from .mlp import float8_swiglu_mlp, swiglu


class Reference(Backend):
    """The unfused ops of ``moe_experts``'s docstring; with ``max_tokens_per_rank`` the
    padded dispatch and masked grouped GEMMs (``grouped_mm(..., masked_m=)``): no host read.
    With ``float8``: the fp8 dispatch and ``float8_grouped_mm`` (``_run_float8``)."""

    name = "reference"

    def not_supported_reasons(self, call: ExpertsCall) -> list[str]:
        if call.float8 is not None and call.max_tokens_per_rank is not None:
            return ["float8 experts take no max_tokens_per_rank (scaled_grouped_mm has no masked "
                    "layout yet)"]
        return []

    def run(self, call: ExpertsCall) -> torch.Tensor:
        if call.float8 is not None:
            return _run_float8(call)
        num_experts = call.w13.shape[0] * dist.get_world_size(call.group)
        recv_x, tokens_per_expert, handle = moe_dispatch(
            call.x, call.topk_idx, call.topk_weights, num_experts, call.group,
            max_tokens_per_rank=call.max_tokens_per_rank)
        if call.max_tokens_per_rank is None:
            groups = dict(offs=tokens_per_expert.cumsum(0).to(torch.int32))
        else:  # recv_x [E_local, W * M, H]: only each expert's first rows are multiplied
            groups = dict(masked_m=tokens_per_expert)
        h = swiglu(grouped_mm(recv_x, call.w13.transpose(1, 2), **groups))
        return moe_combine(grouped_mm(h, call.w2.transpose(1, 2), **groups), handle)


def _run_float8(call: ExpertsCall) -> torch.Tensor:
    """``moe_experts(..., float8=recipe)``: tokens travel as fp8 rows and scales, both expert
    GEMMs run as ``float8_grouped_mm`` (the first on the dispatched casts as they are), the
    outputs come back in x's dtype."""
    num_experts = call.w13.shape[0] * dist.get_world_size(call.group)
    recv, cast, tokens_per_expert, handle = float8_dispatch(call.x, call.topk_idx, call.topk_weights,
                                                            num_experts, call.group, call.float8)
    offs = tokens_per_expert.cumsum(0).to(torch.int32)
    *_, y = float8_swiglu_mlp(recv, cast, call.w13, call.w2, offs, call.float8)
    return moe_combine(y, handle)


DISPATCHER = Dispatcher(OP, [Pipelined(), Fused(), Reference()])


@eager_under_compile
def moe_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, group=None, *,
                max_tokens_per_rank: int | None = None, float8: str | None = None,
                backend: str | None = None):
    """The expert-parallel SwiGLU expert MLP; with every rank's tokens and experts in one
    process it is ``experts_dense(x, topk_idx, topk_weights, cat(w13s), cat(w2s))``. Here::

        recv_x, tokens_per_expert, handle = moe_dispatch(x, topk_idx, topk_weights, E, group)
        offs = tokens_per_expert.cumsum(0).int()
        h = swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs))
        return moe_combine(grouped_mm(h, w2.transpose(1, 2), offs), handle)

    ``w13 [E_local, 2I, H]`` / ``w2 [E_local, H, I]``: this rank's experts (global expert
    ``rank * E_local + e``). Gradients for x, w13, w2 and topk_weights.

    ``max_tokens_per_rank=M``: nothing is read on the host (``moe_dispatch``'s padded layout,
    then ``grouped_mm(recv_x, w, masked_m=tokens_per_expert)``), so the layer can be
    captured in a CUDA graph; the same limits and errors as ``moe_dispatch`` with M. Only
    the ``reference`` backend takes it (the others size their exchanges on the host).

    Backends: ``fused`` (symmetric memory: the first grouped GEMM multiplies each source's
    rows as soon as the copy engine has brought them, own rank first; the second writes
    straight into the source ranks' buffers; the backward the same over the gradients),
    ``pipelined`` (first in the priority order: the exchange split by source rank, async
    P2P overlapping the expert GEMMs, own tokens first) and ``reference`` (the unfused ops
    above; the only one with ``max_tokens_per_rank``). On a GPU the tuning tables choose
    (``fusedpar.ops.tuning``); ``backend=`` or ``FUSEDPAR_BACKEND`` force one.
    Under ``torch.autocast``, x, w13 and w2 are cast to its dtype first, as ``torch.matmul``'s
    inputs are (``topk_weights`` keep theirs).

    ``float8="rowwise"`` (a recipe of ``fusedpar.ops.float8_scales`` whose input cast is
    rowwise: ``"rowwise"``, torchao's float8 MoE training, or ``"rowwise_with_gw_hp"``): the
    expert GEMMs run in fp8, as ``float8_grouped_mm`` (torchao's recipe, forward and
    backward), and the tokens travel as fp8 rows with their scales (``moe_dispatch(...,
    float8=)``: the first GEMM multiplies them as they arrive, no second cast); the outputs
    come back, and the gradients go back to x, in x's dtype (bf16 or fp32). The same as::

        recv, (data, scale), tokens_per_expert, handle = float8_dispatch(x, ..., float8)
        h = swiglu(float8_grouped_mm(recv, w13.transpose(1, 2), offs, recipe=float8, a_cast=(data, scale)))
        return moe_combine(float8_grouped_mm(h, w2.transpose(1, 2), offs, recipe=float8), handle)

    Every backend takes it: the pipelined one sends each (token, rank) row as fp8 bytes
    and its scale (cast as the rows are gathered), runs the same ``float8_swiglu_mlp`` on
    each source's rows as they arrive, and the weights' gradients over every source's rows
    in expert order (the same numbers). The ``fused`` one casts each copy in its permute
    kernel and stages it as fp8 bytes and a scale (H + 4 bytes; H a multiple of 4), its
    first GEMM multiplies the gathered rows in fp8 with the scales and SwiGLU in its
    epilogue, its push GEMM the rowwise-cast activations (cast in a separate pass); its
    backward runs the recipe's steps on the exchanged output gradients (``experts_fused``);
    the same numbers, but for the epilogue's SwiGLU in fp32 (ulps from torch's silu).
    """
    x, w13, w2 = autocast_inputs(x, w13, w2)
    group = resolve_group(group)
    check_expert_weights(OP, x, w13, w2)
    world = dist.get_world_size(group)
    check_routing(OP, x, topk_idx, topk_weights, w13.shape[0] * world, world, max_tokens_per_rank)
    if float8 is not None:
        float8_cast(float8)  # a clear error for a recipe that cannot travel per token
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"fusedpar.{OP}: float8={float8!r} takes bf16 or fp32 x, w13, w2 (the "
                            f"scaled GEMMs' outputs), got {x.dtype}")
    call = ExpertsCall(x, topk_idx, topk_weights, w13, w2, group, max_tokens_per_rank, float8)
    with autocast_off(x):
        return DISPATCHER.select(call, backend or "").run(call)


def moe_experts_loopback(xs: list, topk_idxs: list, topk_weights: list, w13s: list, w2s: list, *,
                         backend: str | None = None) -> list:
    """Every rank's part of ``moe_experts`` in this process: rank r passes ``xs[r]``,
    ``topk_idxs[r]``, ``topk_weights[r]`` and holds experts ``w13s[r]`` / ``w2s[r]``; returns
    each rank's output, the same as ``experts_dense(xs[r], topk_idxs[r], topk_weights[r],
    cat(w13s), cat(w2s))``. Forward only; for single-device benchmarks and tests.
    Backends: ``fused`` (the default; loopback symmetric buffers, see ``moe_experts``) and
    ``reference``, the unfused ops over loopback symmetric buffers::

        dispatched = moe_dispatch_loopback(xs, topk_idxs, topk_weights, E)
        ys = [grouped_mm(swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs)),
                         w2.transpose(1, 2), offs)      # offs = tokens_per_expert.cumsum(0)
              for (recv_x, tokens_per_expert, _), w13, w2 in zip(dispatched, w13s, w2s)]
        return moe_combine_loopback(ys, [handle for _, _, handle in dispatched])
    """
    op = f"{OP}_loopback"
    world = len(xs)
    if world < 1 or not len(topk_idxs) == len(topk_weights) == len(w13s) == len(w2s) == world:
        raise ValueError(f"fusedpar.{op}: xs, topk_idxs, topk_weights, w13s and w2s must hold one "
                         f"entry per simulated rank; got {len(xs)}, {len(topk_idxs)}, "
                         f"{len(topk_weights)}, {len(w13s)}, {len(w2s)}")
    for r, (x, idx, w, w13, w2) in enumerate(zip(xs, topk_idxs, topk_weights, w13s, w2s)):
        check_expert_weights(op, x, w13, w2)
        check_routing(op, x, idx, w, w13.shape[0] * world, world)
        if w13.shape != w13s[0].shape:
            raise ValueError(f"fusedpar.{op}: w13s[{r}] is {tuple(w13.shape)} but w13s[0] "
                             f"{tuple(w13s[0].shape)}; every rank holds as many experts of one size")
    if backend not in (None, "", "fused", "reference"):
        raise BackendNotSupportedError(f"fusedpar.{op}: backend={backend!r}; choose 'fused' or "
                                       "'reference' (the unfused ops)")
    if backend in (None, "", "fused"):
        with torch.no_grad():
            return fused_loopback(xs, topk_idxs, topk_weights, w13s, w2s)
    dispatched = moe_dispatch_loopback(xs, topk_idxs, topk_weights, w13s[0].shape[0] * world)
    ys = []
    with torch.no_grad():
        for (recv_x, tokens_per_expert, _), w13, w2 in zip(dispatched, w13s, w2s):
            offs = tokens_per_expert.cumsum(0).to(torch.int32)
            h = swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs))
            ys.append(grouped_mm(h, w2.transpose(1, 2), offs))
    return moe_combine_loopback(ys, [handle for _, _, handle in dispatched])


# no example call for ``fusedpar info``: a call exchanges routing counts over a group
register(DISPATCHER, (moe_experts, moe_experts_loopback), checks="fusedpar.testing.moe_cases")
