"""``fusedpar.ops.ring_attention``: attention over a sequence split across the ranks of a
context-parallel group, with the K/V exchange hidden behind the blockwise attention.

Layouts (``layout=``): ``"zigzag"`` (default): the global sequence is cut into ``2W``
chunks and rank ``r`` holds chunks ``r`` and ``2W-1-r`` (``fusedpar.parallel.zigzag_shard``),
so causal work is equal on every rank; ``"contiguous"``: rank ``r`` holds chunk ``r`` of W;
``"zigzag_docs"`` (packed documents, ``cu_seqlens``): each document is cut into ``2W``
chunks and rank ``r`` holds chunks ``r`` and ``2W-1-r`` of every document, in document
order (``fusedpar.parallel.sequence_shard``; ring-flash-attn's varlen zigzag), so causal
work is equal on every rank within each document, not only over the whole row.

Backends: ``triton`` (per ring step, a copy kernel pulls the visible rows of a peer's K/V
from symmetric memory once its flag flips, while an attention kernel folds the previous
step's block into fp32 state), ``pipelined`` (K/V around the ring by async P2P),
``pipelined_sdpa`` (the same ring, each step torch's attention kernel with its lse),
``ulysses`` (all-to-all heads <-> sequence), ``allgather_kv`` (gather K/V).

Ring blocks (``blocks``): rank ``r`` attends its queries to the K/V of every source rank
``src``, one flash-attention block per (query chunk, key chunk) pair with that pair's
diagonal offset, cut to the keys its window reaches (packed documents cut further), or none.
Without a window, most causal blocks are fully visible, fully masked (skipped) or the own
block (causal in local indices). Partial results merge in fp32 with the stable
log-sum-exp update. Every backward recomputes the blocks from the saved (global) lse: a
block's ``P = exp(S - lse)`` is its share of the whole softmax, so its dQ/dK/dV are exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm import get_loopback_buffers, group_name, resolve_group, symmetric
from ...errors import FusedparError
from ..backend import Dispatcher, Plans, autocast_inputs, autocast_off
from ..registry import EXAMPLE_WORLD, register
from ..flash_attention import backward_backend, check_mask_args, default_scale, host_list
from .call import OP, RingCall, check_ring_inputs, nbytes
from .gathered import AllGatherKV, Ulysses
from .pipelined import Pipelined, PipelinedSdpa
from .triton_ring import RingPlan, TritonRing

MASK_SCHEMA = ("str group_name, bool causal, float softmax_scale, int window_left, int window_right, "
               "float softcap, str layout, Tensor? cu_seqlens, str backend")
SCHEMA = f"(Tensor q, Tensor k, Tensor v, {MASK_SCHEMA}) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, Tensor? dlse, "
                   f"{MASK_SCHEMA}) -> (Tensor, Tensor, Tensor)")


# pipelined_sdpa first: it is plain torch's way (torch's context_parallel: a ring with SDPA's
# kernels as its steps), and the other rings' step kernel measured slower than SDPA on the
# H100 (benchmarks/results); the rings are not tuned (no shape bucket), so this order is
# the choice wherever it can run (no window, softcap, packing or lse gradient)
DISPATCHER = Dispatcher(OP, [PipelinedSdpa(), TritonRing(), Pipelined(), Ulysses(), AllGatherKV()])


PLANS = Plans(OP)
CU_SEQLENS_ARG = 7  # cu_seqlens' index among the arguments after q, k, v (MASK_SCHEMA)


def _call(q, k, v, group_name_, causal, softmax_scale, window_left, window_right, softcap, layout,
          cu_seqlens, lse_grad=False) -> RingCall:
    group = resolve_group(group_name_)
    check_ring_inputs(OP, q, k, v, layout, dist.get_world_size(group), cu_seqlens)
    return RingCall(q, k, v, group, causal, softmax_scale, layout, cu_seqlens=cu_seqlens,
                    lse_grad=lse_grad, window=(window_left, window_right), softcap=softcap)


def _documents_key(op: str, q: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple:
    """A packed call's documents as part of its plan's key (their values shape the plan).
    Refuses CUDA-graph capture first: the values are read on the host (no read while
    capturing) and baked into the call's launches, which a replay would repeat whatever the
    documents of its step."""
    if symmetric.capturing(q.device):
        raise FusedparError(
            f"fusedpar.{op}: a call with packed documents (cu_seqlens) cannot be captured in a "
            "CUDA graph: the documents are read on the host and baked into the call, so every "
            "replay would attend within the documents of the capture. Run packed calls eagerly "
            "(capture the layers around them), or capture calls without cu_seqlens (rows of one "
            "sequence each, fixed shapes)")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        return None, type(cu_seqlens)  # no plan: its checks say what is wrong
    return tuple(host_list(cu_seqlens)), cu_seqlens.dtype, cu_seqlens.device


@torch.library.custom_op("fusedpar::ring_attention", mutates_args=(), schema=SCHEMA)
def _ring_attention_op(q, k, v, *args):
    cu_seqlens = args[CU_SEQLENS_ARG]
    documents = None if cu_seqlens is None else _documents_key(OP, q, cu_seqlens)
    key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
           v.shape, v.stride(), v.dtype, v.device, documents, args[:CU_SEQLENS_ARG],
           args[CU_SEQLENS_ARG + 1])
    plan = PLANS.get(key)
    # a ring's launches hold its buffer's addresses: once the group's buffer grew, a new plan
    # (unlike the fused matmuls', which follow it; so a step whose later call grows the
    # buffer needs a second eager step before a capture takes its ring)
    if plan is None or isinstance(plan, RingPlan) and not plan.buf.live:
        plan = PLANS.make(key, q.device, lambda: _plan(q, k, v, *args))
    return plan(q, k, v, cu_seqlens)  # out and lse contiguous: the fake's layout


def _plan(q, k, v, *args):
    """Every call of this signature: checked, its backend chosen, then the backend's plan
    (the triton ring's ``RingPlan``; a plain-torch ring's ``Backend.plan``)."""
    call = _call(q, k, v, *args[:-1])
    return DISPATCHER.select(call, args[-1]).plan(call)


@_ring_attention_op.register_fake
def _(q, k, v, *args):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("fusedpar::ring_attention_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _ring_attention_backward_op(q, k, v, out, lse, dout, dlse, *args):
    call = _call(q, k, v, *args[:-1], lse_grad=dlse is not None)
    grads = backward_backend(DISPATCHER, call, args[-1]).backward(call, out, lse, dout, dlse)
    return tuple(g.contiguous() for g in grads)


@_ring_attention_backward_op.register_fake
def _(q, k, v, out, lse, dout, dlse, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *ctx.args = inputs  # MASK_SCHEMA's arguments
    cu_seqlens = ctx.args[CU_SEQLENS_ARG]
    ctx.args[CU_SEQLENS_ARG] = None  # saved as a tensor
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    args = list(ctx.args)
    args[CU_SEQLENS_ARG] = cu_seqlens
    dq, dk, dv = _ring_attention_backward_op(q, k, v, out, lse, dout, dlse, *args)
    return (dq, dk, dv) + (None,) * len(args)


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def ring_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                            causal: bool = False, softmax_scale: float | None = None,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            mask_align: str = "top_left", layout: str = "zigzag",
                            cu_seqlens: torch.Tensor | None = None, backend: str | None = None):
    """``(out, lse)`` of attention over the sequence split across ``group``; the same as::

        unshard = partial(sequence_unshard, dim=1, layout=layout, cu_seqlens=cu_seqlens)
        out, lse = flash_attention(q, unshard(k), unshard(v), causal=causal, return_lse=True,
                                   ...)  # q at its global positions, per document if packed
        # = rows of flash_attention(unshard(q), unshard(k), unshard(v)) that this rank holds

    q: ``[B, S_local, H, D]``, k/v: ``[B, S_local, H_kv, D]``: this rank's part of the
    sequence in ``layout`` (``"zigzag"``: chunks ``r`` and ``2W-1-r`` of ``2W``, see
    ``fusedpar.parallel.zigzag_shard``; ``"contiguous"``: chunk ``r`` of ``W``;
    ``"zigzag_docs"``: chunks ``r`` and ``2W-1-r`` of each document of ``cu_seqlens``, every
    document a multiple of ``2W`` long, see ``fusedpar.parallel.sequence_shard``). ``lse`` is
    fp32 ``[B, H, S_local]``; both outputs are differentiable. The mask is
    ``flash_attention``'s by global position: ``window_size=(left, right)`` (query ``i``
    sees keys ``i - left .. i + right``; -1 unbounded; ``causal``: ``right = 0``), ``softcap``
    (Gemma 2's ``softcap * tanh(s / softcap)``); ``mask_align`` is accepted for
    flash-attn's signature, and both alignments are one here (q and k/v are the same
    sequence). Key blocks a rank's queries cannot see are neither moved (``triton``) nor
    computed. Backends: ``pipelined``
    (K/V around the ring by async P2P, overlapped with the blocks), ``pipelined_sdpa`` (that
    ring with torch's attention kernel and its lse per step, as torch's ``context_parallel``;
    flash_attention's ``sdpa`` limits: no window or softcap; the default where it runs),
    ``ulysses`` (all-to-all
    heads <-> sequence; needs ``H % W == 0``), ``allgather_kv`` (gather K/V, attend
    locally), ``triton`` (pulls each peer's K/V rows that this rank's queries see from
    symmetric memory once, overlapped with the blocks; its backward is the pipelined one).
    The local blocks run the flash-attention kernel on GPU. Packed documents:
    ``cu_seqlens`` (int32 cumulative ends over the *global* sequence, in global order,
    identical on every rank; B = 1; the sequence sharded as ``layout`` says: each document
    zigzag with ``"zigzag_docs"``, which balances each document's causal work, or the whole
    row) confines attention to each document, also across ranks (``triton``, ``pipelined``,
    ``allgather_kv``). Every rank must pass the same shapes; a difference raises
    ``ValueError`` before any K/V moves. Under ``torch.autocast``, q, k and v are cast to
    its dtype first, as SDPA's inputs are. The first call of a signature (shapes, strides,
    dtypes, arguments, documents) checks and plans; later ones only run. The ``triton``
    forward may be captured in a CUDA graph after one eager call of its signature, except
    with ``cu_seqlens`` (the documents are baked into the call: capture raises
    ``FusedparError``).
    """
    window, softcap, _ = check_mask_args(OP, window_size, softcap, mask_align)
    q, k, v = autocast_inputs(q, k, v)
    with autocast_off(q):
        return _ring_attention_op(q, k, v, group_name(group), bool(causal),
                                  default_scale(q, softmax_scale), *window, softcap, layout,
                                  cu_seqlens, backend or "")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                   causal: bool = False, softmax_scale: float | None = None,
                   window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   mask_align: str = "top_left", layout: str = "zigzag",
                   cu_seqlens: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """The output of ``ring_attention_with_lse`` (same arguments)."""
    return ring_attention_with_lse(q, k, v, group, causal=causal, softmax_scale=softmax_scale,
                                   window_size=window_size, softcap=softcap, mask_align=mask_align,
                                   layout=layout, cu_seqlens=cu_seqlens, backend=backend)[0]


def ring_attention_loopback(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], *,
                            causal: bool = False, softmax_scale: float | None = None,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            layout: str = "zigzag", cu_seqlens: torch.Tensor | None = None):
    """Every rank's part of ``ring_attention_with_lse`` in this process (rank r holds
    ``qs[r]``, ``ks[r]``, ``vs[r]``) over loopback symmetric buffers with the ``triton``
    kernel; returns each rank's ``(out, lse)``. Forward only: for single-device benchmarks
    and tests of the protocol. Calls of one signature (shapes, dtypes, mask, documents) reuse
    one plan; without ``cu_seqlens`` a call may be captured in a CUDA graph after an eager
    one."""
    world = len(qs)
    if world < 1 or len(ks) != world or len(vs) != world:
        raise ValueError(f"fusedpar.{OP}_loopback: qs, ks, vs must hold one tensor per simulated "
                         f"rank; got {len(qs)}, {len(ks)}, {len(vs)}")
    for r in range(world):
        for name, got, first in (("qs", qs[r], qs[0]), ("ks", ks[r], ks[0]), ("vs", vs[r], vs[0])):
            if got.shape != first.shape or got.dtype != first.dtype or got.device != first.device:
                raise ValueError(f"fusedpar.{OP}_loopback: {name}[{r}] is {tuple(got.shape)} "
                                 f"{got.dtype} on {got.device}, {name}[0] is {tuple(first.shape)} "
                                 f"{first.dtype} on {first.device}; they must match")
    window, softcap, _ = check_mask_args(f"{OP}_loopback", window_size, softcap, "top_left")
    q, k, v = qs[0], ks[0], vs[0]
    scale = default_scale(q, softmax_scale)
    documents = None if cu_seqlens is None else _documents_key(f"{OP}_loopback", q, cu_seqlens)
    bufs = get_loopback_buffers(world, 2 * nbytes(k), q.device)  # remade after a failure
    key = (world, q.shape, q.dtype, q.device, k.shape, k.dtype, v.shape, v.dtype, bool(causal), scale,
           window, softcap, layout, documents)
    ring = LOOPBACK_PLANS.get(key)
    if ring is None or ring.buf is not bufs[0]:
        def build():
            check_ring_inputs(f"{OP}_loopback", q, k, v, layout, world, cu_seqlens)
            call = RingCall(q.contiguous(), k, v, None, bool(causal), scale, layout, world_size=world,
                            cu_seqlens=cu_seqlens, window=window, softcap=softcap)
            DISPATCHER.select(call, "triton")  # raises where the triton kernels cannot run
            return RingPlan(call, bufs, any_strides=True)

        ring = LOOPBACK_PLANS.make(key, q.device, build)
    return ring.run_views(qs, ks, vs)


LOOPBACK_PLANS = Plans(f"{OP}_loopback")


# no reference backend: the tests' oracle is plain-torch attention over the whole sequence
register(DISPATCHER, (ring_attention, ring_attention_with_lse, ring_attention_loopback), oracle=None, checks="fusedpar.testing.flash_attention_cases",
         example=lambda device: RingCall(
             *[torch.zeros(1, 2 * EXAMPLE_WORLD, 2, 16, device=device)] * 3, None, True, 0.25,
             "zigzag", world_size=EXAMPLE_WORLD))
