"""The expert-parallel SwiGLU expert MLP (``moe_experts``): dispatch -> grouped GEMM ->
SwiGLU -> grouped GEMM -> combine.

Backends (priority order):
- ``pipelined``: the exchange split by source rank with async P2P (gloo on CPU, NCCL on
  GPU). Step ``s`` sends to ``rank + s`` and receives from ``rank - s`` (every pair is
  matched in the same step on both sides, so NCCL cannot deadlock); the expert GEMMs run on
  this rank's own tokens while the other sources' rows travel, then on each source's rows
  as they arrive, and each source's results go back as soon as they are done. The backward
  pass is the same pipeline over the output gradients.
- ``reference``: the unfused ops (``moe_dispatch`` -> ``grouped_mm`` -> ``swiglu`` ->
  ``grouped_mm`` -> ``moe_combine``).
Both move exactly the routed rows, there and back (no padding). ``moe_experts_loopback``
runs every rank's part in one process (the unfused ops over loopback symmetric buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import counters, resolve_group
from ..errors import BackendNotSupportedError
from .backend import Backend, Dispatcher
from .grouped_mm import grouped_mm
from .moe import (_DTYPE_CODES, _all_to_all, _check_same_everywhere, _Permute, _sort, _Unpermute,
                  check_routing, moe_combine, moe_dispatch, swiglu)

OP = "moe_experts"


def check_expert_weights(op: str, x, w13, w2) -> None:
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fusedpar.{op}: w13 must be [E_local, 2I, H] and w2 [E_local, H, I], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"fusedpar.{op}: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 "
                         f"{tuple(w2.shape)} do not fit: need w13 [E_local, 2I, H={x.shape[1]}] and "
                         "w2 [E_local, H, I]")
    if not x.dtype == w13.dtype == w2.dtype:
        raise TypeError(f"fusedpar.{op}: x is {x.dtype}, w13 {w13.dtype} and w2 {w2.dtype}; cast "
                        "them to one dtype")
    if not x.device == w13.device == w2.device:
        raise ValueError(f"fusedpar.{op}: x, w13 and w2 must be on one device, got {x.device}, "
                         f"{w13.device} and {w2.device}")


@dataclass
class ExpertsCall:
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    group: dist.ProcessGroup

    def cache_key(self) -> tuple:
        return (self.group.group_name, self.x.device.type, self.x.dtype)

    def describe(self) -> str:
        return (f"x {tuple(self.x.shape)} {self.x.dtype} on {self.x.device.type}, topk_idx "
                f"{tuple(self.topk_idx.shape)}, w13 {tuple(self.w13.shape)}")


class Reference(Backend):
    """The unfused ops of the docstring."""

    name = "reference"

    def run(self, call: ExpertsCall) -> torch.Tensor:
        num_experts = call.w13.shape[0] * dist.get_world_size(call.group)
        recv_x, tokens_per_expert, handle = moe_dispatch(call.x, call.topk_idx, call.topk_weights,
                                                         num_experts, call.group)
        offs = tokens_per_expert.cumsum(0).to(torch.int32)
        h = swiglu(grouped_mm(recv_x, call.w13.transpose(1, 2), offs))
        return moe_combine(grouped_mm(h, call.w2.transpose(1, 2), offs), handle)


@dataclass
class _Plan:
    """Who sends what to whom: ``send[d]`` rows to rank d, ``recv[s]`` rows from rank s (in
    (local expert, token) order), ``offs[s]`` the group ends of source s's rows."""

    group: dist.ProcessGroup
    rank: int
    world: int
    send: list
    recv: list
    offs: torch.Tensor  # int32 [W, E_local]

    def send_rows(self, dst: int) -> slice:
        start = sum(self.send[:dst])
        return slice(start, start + self.send[dst])

    def recv_rows(self, src: int) -> slice:
        start = sum(self.recv[:src])
        return slice(start, start + self.recv[src])

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> list:
        """Start sending ``send`` to ``dst`` and receiving ``recv`` from ``src`` (empty ones
        are skipped: both sides know the counts)."""
        ops = []
        if send.shape[0]:
            ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(self.group, dst), self.group))
        if recv.shape[0]:
            ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(self.group, src), self.group))
        return dist.batch_isend_irecv(ops) if ops else []


def _pipeline(plan: _Plan, outgoing: torch.Tensor, incoming: torch.Tensor, compute) -> torch.Tensor:
    """Send ``outgoing``'s rows for each rank there, run ``compute(src, rows)`` on the rows
    of each source (own rank first, then in arrival order) and send each result back;
    returns the results of ``outgoing``'s rows, in its order. ``incoming`` receives the
    sources' rows (kept for the backward pass)."""
    rank, world = plan.rank, plan.world
    incoming[plan.recv_rows(rank)] = outgoing[plan.send_rows(rank)]
    arrivals = [plan.exchange(outgoing[plan.send_rows((rank + s) % world)], (rank + s) % world,
                              incoming[plan.recv_rows((rank - s) % world)], (rank - s) % world)
                for s in range(1, world)]
    returned = outgoing.new_empty(outgoing.shape[0], outgoing.shape[1])
    returned[plan.send_rows(rank)] = compute(rank, incoming[plan.recv_rows(rank)])
    replies = []
    for s in range(1, world):
        src, dst = (rank - s) % world, (rank + s) % world
        for request in arrivals[s - 1]:
            request.wait()
        result = compute(src, incoming[plan.recv_rows(src)])
        # result goes back to src; dst returns ours at the same step
        replies.append((result, plan.exchange(result, src, returned[plan.send_rows(dst)], dst)))
    for _, requests in replies:
        for request in requests:
            request.wait()
    return returned


class _ExpertPipeline(torch.autograd.Function):
    """``sorted_x`` (this rank's copies, sorted by destination rank and expert) -> the expert
    MLP outputs of those copies, computed on the ranks owning the experts."""

    @staticmethod
    def forward(ctx, sorted_x, w13, w2, plan: _Plan):
        rows = sum(plan.recv)
        received = sorted_x.new_empty(rows, sorted_x.shape[1])
        h13 = sorted_x.new_empty(rows, w13.shape[1])

        def experts(src, x_rows):
            if x_rows.shape[0] == 0:
                return x_rows.new_empty(0, w2.shape[1])
            offs = plan.offs[src]
            h13[plan.recv_rows(src)] = grouped_mm(x_rows, w13.transpose(1, 2), offs)
            return grouped_mm(swiglu(h13[plan.recv_rows(src)]), w2.transpose(1, 2), offs)

        back = _pipeline(plan, sorted_x.contiguous(), received, experts)
        ctx.save_for_backward(received, h13, w13, w2)
        ctx.plan = plan
        return back

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_back):
        received, h13, w13, w2 = ctx.saved_tensors
        plan = ctx.plan
        need_w13, need_w2 = ctx.needs_input_grad[1:3]
        grad_w13 = torch.zeros_like(w13) if need_w13 else None
        grad_w2 = torch.zeros_like(w2) if need_w2 else None

        def experts_backward(src, dy):
            if dy.shape[0] == 0:
                return dy.new_empty(0, w13.shape[2])
            offs, rows = plan.offs[src], plan.recv_rows(src)
            act, swiglu_vjp = torch.func.vjp(swiglu, h13[rows])
            if need_w2:
                grad_w2.add_(grouped_mm(dy.t(), act, offs))
            (dh13,) = swiglu_vjp(grouped_mm(dy, w2, offs))
            if need_w13:
                grad_w13.add_(grouped_mm(dh13.t(), received[rows], offs))
            return grouped_mm(dh13, w13, offs)

        # every rank runs the exchange, whatever it needs, so the ranks stay in step
        grad_incoming = torch.empty_like(received)
        grad_sorted = _pipeline(plan, grad_back.contiguous(), grad_incoming, experts_backward)
        return grad_sorted, grad_w13, grad_w2, None


class Pipelined(Backend):
    """Split by source rank with async P2P (see the module docstring)."""

    name = "pipelined"

    def not_supported_reasons(self, call: ExpertsCall) -> list[str]:
        backend = str(dist.get_backend(call.group)).lower()
        if "gloo" not in backend and "nccl" not in backend:
            return [f"needs point-to-point sends (gloo or NCCL), the group's backend is {backend}"]
        return []

    def run(self, call: ExpertsCall) -> torch.Tensor:
        x, topk_idx, w13 = call.x, call.topk_idx, call.w13
        group = call.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local, k = w13.shape[0], topk_idx.shape[1]
        _check_same_everywhere(OP, group, [x.shape[1], k, local, w13.shape[1],
                                           _DTYPE_CODES.get(x.dtype, 9)],
                               "hidden size, k, experts per rank, 2 x intermediate size, dtype")
        pos, counts = _sort(topk_idx, local * world)
        recv_counts = _all_to_all(counts.view(world, local), [1] * world, [1] * world, group)
        plan = _Plan(group, rank, world, counts.view(world, local).sum(1).tolist(),
                     recv_counts.sum(1).tolist(), recv_counts.cumsum(1).to(torch.int32))
        sorted_x = _Permute.apply(x, pos, k, sum(plan.send))
        back = _ExpertPipeline.apply(sorted_x, w13, call.w2, plan)
        row_bytes = x.shape[1] * x.element_size()
        counters.record(OP, self.name, (sum(plan.recv) - plan.recv[rank]
                                        + sum(plan.send) - plan.send[rank]) * row_bytes)
        return _Unpermute.apply(back, call.topk_weights, pos, k)


BACKENDS = Dispatcher(OP, [Pipelined(), Reference()])


def moe_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, group=None, *, backend: str | None = None):
    """The expert-parallel SwiGLU expert MLP; with every rank's tokens and experts in one
    process it is ``experts_dense(x, topk_idx, topk_weights, cat(w13s), cat(w2s))``. Here::

        recv_x, tokens_per_expert, handle = moe_dispatch(x, topk_idx, topk_weights, E, group)
        offs = tokens_per_expert.cumsum(0).int()
        h = swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs))
        return moe_combine(grouped_mm(h, w2.transpose(1, 2), offs), handle)

    ``w13 [E_local, 2I, H]`` / ``w2 [E_local, H, I]``: this rank's experts (global expert
    ``rank * E_local + e``). Gradients for x, w13, w2 and topk_weights.
    Backends: ``pipelined`` (the exchange split by source rank, async P2P overlapping the
    expert GEMMs, own tokens first) and ``reference`` (the unfused ops above).
    """
    group = resolve_group(group)
    check_expert_weights(OP, x, w13, w2)
    world = dist.get_world_size(group)
    check_routing(OP, x, topk_idx, topk_weights, w13.shape[0] * world, world)
    call = ExpertsCall(x, topk_idx, topk_weights, w13, w2, group)
    return BACKENDS.select(call, backend or "").run(call)


def moe_experts_loopback(xs: list, topk_idxs: list, topk_weights: list, w13s: list, w2s: list, *,
                         backend: str | None = None) -> list:
    """Every rank's part of ``moe_experts`` in this process: rank r passes ``xs[r]``,
    ``topk_idxs[r]``, ``topk_weights[r]`` and holds experts ``w13s[r]`` / ``w2s[r]``; returns
    each rank's output, the same as ``experts_dense(xs[r], topk_idxs[r], topk_weights[r],
    cat(w13s), cat(w2s))``. Forward only; for single-device benchmarks and tests.
    Backend: ``reference``, the unfused ops over loopback symmetric buffers::

        dispatched = moe_dispatch_loopback(xs, topk_idxs, topk_weights, E)
        ys = [grouped_mm(swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs)),
                         w2.transpose(1, 2), offs)      # offs = tokens_per_expert.cumsum(0)
              for (recv_x, tokens_per_expert, _), w13, w2 in zip(dispatched, w13s, w2s)]
        return moe_combine_loopback(ys, [handle for _, _, handle in dispatched])
    """
    from .moe import moe_combine_loopback, moe_dispatch_loopback

    op = f"{OP}_loopback"
    world = len(xs)
    if world < 1 or not len(topk_idxs) == len(topk_weights) == len(w13s) == len(w2s) == world:
        raise ValueError(f"fusedpar.{op}: xs, topk_idxs, topk_weights, w13s and w2s must hold one "
                         f"entry per simulated rank; got {len(xs)}, {len(topk_idxs)}, "
                         f"{len(topk_weights)}, {len(w13s)}, {len(w2s)}")
    for r, (x, w13, w2) in enumerate(zip(xs, w13s, w2s)):
        check_expert_weights(op, x, w13, w2)
        if w13.shape != w13s[0].shape:
            raise ValueError(f"fusedpar.{op}: w13s[{r}] is {tuple(w13.shape)} but w13s[0] "
                             f"{tuple(w13s[0].shape)}; every rank holds as many experts of one size")
    if backend not in (None, "", "reference"):
        raise BackendNotSupportedError(f"fusedpar.{op}: backend={backend!r}; the loopback runs "
                                       "'reference' (the unfused ops)")
    dispatched = moe_dispatch_loopback(xs, topk_idxs, topk_weights, w13s[0].shape[0] * world)
    ys = []
    with torch.no_grad():
        for (recv_x, tokens_per_expert, _), w13, w2 in zip(dispatched, w13s, w2s):
            offs = tokens_per_expert.cumsum(0).to(torch.int32)
            h = swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs))
            ys.append(grouped_mm(h, w2.transpose(1, 2), offs))
    return moe_combine_loopback(ys, [handle for _, _, handle in dispatched])
