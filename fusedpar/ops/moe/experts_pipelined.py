"""The ``pipelined`` backend of ``moe_experts``: the exchange split by source rank with
async P2P (gloo on CPU, NCCL on GPU), overlapping the expert GEMMs.

A token travels once to each rank holding any of its experts (DeepEP's layout), after its
expert ids and weights there (fp32, a few bytes a row); the receiver expands each row into
its copies, sorted by expert, and returns one row per token: its copies' outputs, weighted
and summed. Step ``s`` sends to ``rank + s`` and receives from ``rank - s`` (every pair is
matched in the same step on both sides, so NCCL cannot deadlock); the expert GEMMs run on
this rank's own tokens while the other sources' rows travel, then on each source's rows as
they arrive, and each source's results go back as soon as they are done. The backward pass
is the same pipeline over the output gradients (the weights' gradients are computed where
the experts' outputs are, and go back after), then the weight gradients in one launch
each. SwiGLU and its backward run in the grouped GEMMs' epilogues
(``kernels.grouped_mm.grouped_mm_rows``). Each source's rows are their own GEMM, so each
pays its partial tiles (more tiles than one GEMM over all rows, the more experts per rank).

``float8`` (a rowwise recipe): each row is cast to fp8 as it is gathered and travels as its
fp8 bytes and fp32 scale (``permute_float8``: H + 4 bytes, not 2H in bf16); each source's
rows go through ``float8_swiglu_mlp`` (torchao's recipe, the first GEMM on the rows as they
came), whose autograd graph the backward runs on that source's output gradients; the weight
gradients come after, over every source's rows in expert order (``float8_weight_grads``:
the recipe's per-expert casts over all of an expert's rows, as the reference backend's).
The results, the gradients and the routing travel in their own dtypes, as without float8.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm import counters
from ..backend import Backend
from ..grouped_mm import grouped_mm
from .exchange import (Unpermute, dequantize_float8, exchange_counts, permute, permute_float8, sort_by_expert,
                       unpack_float8, unpermute)
from .experts_call import OP, ExchangePlan, ExpertsCall, host_read_reasons
from .mlp import float8_swiglu_mlp, float8_weight_grads, grouped_swiglu, grouped_swiglu_vjp, weight_grads


def _pipeline(plan: ExchangePlan, outgoing: torch.Tensor, incoming: torch.Tensor, compute,
              returned: torch.Tensor) -> torch.Tensor:
    """Send ``outgoing``'s rows for each rank there, run ``compute(src, rows)`` on the rows
    of each source (own rank first, then in arrival order) and send each result back into
    ``returned`` (the results of ``outgoing``'s rows, in its order; their width and dtype may
    differ from ``outgoing``'s: fp8 rows there, x's dtype back), and return it. ``incoming``
    receives the sources' rows."""
    rank, world = plan.rank, plan.world
    incoming[plan.recv_rows(rank)] = outgoing[plan.send_rows(rank)]
    arrivals = [plan.exchange(outgoing[plan.send_rows((rank + s) % world)], (rank + s) % world,
                              incoming[plan.recv_rows((rank - s) % world)], (rank - s) % world)
                for s in range(1, world)]
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


def _swap(plan: ExchangePlan, outgoing: torch.Tensor, incoming: torch.Tensor, back: bool = False) -> None:
    """``outgoing``'s rows for each rank into ``incoming``, as ``_pipeline`` moves them
    (``back``: the other way, each source's rows returned to it); waits for them."""
    there, here = (plan.recv_rows, plan.send_rows) if back else (plan.send_rows, plan.recv_rows)
    rank, world = plan.rank, plan.world
    incoming[here(rank)] = outgoing[there(rank)]
    steps = [plan.exchange(outgoing[there((rank + s) % world)], (rank + s) % world,
                           incoming[here((rank - s) % world)], (rank - s) % world)
             for s in range(1, world)]
    for requests in steps:
        for request in requests:
            request.wait()


def _peer_bytes(plan: ExchangePlan, there: torch.Tensor, back: torch.Tensor) -> int:
    """Bytes one exchange brings this rank from its peers: ``there``'s rows (one per row
    received from another rank) and ``back``'s (one per row returned to this rank)."""
    return ((sum(plan.recv) - plan.recv[plan.rank]) * there.shape[1] * there.element_size()
            + (sum(plan.send) - plan.send[plan.rank]) * back.shape[1] * back.element_size())


class _Float8Experts:
    """The expert MLP of each source's fp8 rows (``float8_swiglu_mlp``, torchao's recipe):
    the forward records each source's autograd graph (the weights detached: their gradients
    come after, over every source's rows at once, ``float8_weight_grads``), the backward
    runs it on that source's output gradients."""

    def __init__(self, w13, w2, recipe: str, dtype: torch.dtype):
        self.w13, self.w2, self.recipe, self.dtype = w13.detach(), w2.detach(), recipe, dtype
        self.graphs = {}  # source -> (its rows' values, h13, y)

    def forward(self, src: int, packed: torch.Tensor, offs: torch.Tensor) -> tuple:
        """``(act, y)`` of the source's rows, ``pack_float8``'s layout ``packed``."""
        data, scale = unpack_float8(packed, self.recipe)
        with torch.enable_grad():
            a = dequantize_float8(data, scale, self.dtype).requires_grad_()
            h13, act, y = float8_swiglu_mlp(a, (data, scale), self.w13, self.w2, offs, self.recipe)
        self.graphs[src] = (a, h13, y)
        return act.detach(), y.detach()

    def backward(self, src: int, grad_copies: torch.Tensor) -> tuple:
        """``(d rows, d h13)`` of the source's rows at their outputs' gradients."""
        a, h13, y = self.graphs.pop(src)
        return torch.autograd.grad(y, (a, h13), grad_copies)


class _ExpertPipeline(torch.autograd.Function):
    """``x``'s tokens as rows, one per token and rank holding one of its experts, sorted by
    that rank (``pos``: each (token, rank)'s row, -1 where none), their experts there
    (``ids``: local ids, -1 where the expert is elsewhere) and ``weights`` (0 there) -> per
    row, the weighted sum of the expert MLP outputs of its copies, computed on the rank
    owning them. ``float8``: the rows travel as fp8 bytes and a scale each (``pack_float8``,
    cast as they are gathered) and the expert GEMMs run in fp8 (``_Float8Experts``); the
    results and every gradient travel in x's dtype."""

    @staticmethod
    def forward(ctx, x, pos, weights, w13, w2, ids, plan: ExchangePlan, float8):
        k, local, world = ids.shape[1], w13.shape[0], plan.world
        copies, sent = sum(plan.copies), sum(plan.send)
        rows = (permute(x, pos, world, sent) if float8 is None
                else permute_float8(x, pos, world, sent, float8))
        received = rows.new_empty(copies, rows.shape[1])  # every source's copies, expert-sorted
        needs = ctx.needs_input_grad
        keep_h = float8 is None and any(needs[i] for i in (0, 2, 3, 4))
        h13 = x.new_empty(copies, w13.shape[1]) if keep_h else None
        act = x.new_empty(copies, w13.shape[1] // 2)
        out = x.new_empty(copies, x.shape[1]) if needs[2] else None
        fp8 = None if float8 is None else _Float8Experts(w13, w2, float8, x.dtype)
        # each received row's expert ids, then weights (fp32, ids exact), before the rows
        row_routing = torch.empty(sum(plan.recv), 2 * k, device=x.device)
        _swap(plan, torch.cat([ids.float(), weights.float()], 1), row_routing)
        pos_copies = torch.empty(row_routing.shape[0] * k, dtype=torch.int32, device=x.device)

        def experts(src, x_rows):
            mine, r = plan.copy_rows(src), plan.recv_rows(src)
            if mine.stop == mine.start:
                return x.new_zeros(x_rows.shape[0], x.shape[1])
            src_pos = pos_copies[r.start * k:r.stop * k]  # kept for the backward pass
            src_pos.copy_(sort_by_expert(row_routing[r, :k].long(), local)[0])
            received[mine] = permute(x_rows, src_pos, k, mine.stop - mine.start)
            offs = plan.offs[src]
            if fp8 is not None:
                act[mine], y = fp8.forward(src, received[mine], offs)
            else:
                grouped_swiglu(received[mine], w13, offs, act[mine], None if h13 is None else h13[mine])
                y = grouped_mm(act[mine], w2.transpose(1, 2), offs)
            if out is not None:
                out[mine] = y
            return unpermute(y, src_pos, k, x_rows.shape[0], row_routing[r, k:])

        back = _pipeline(plan, rows, rows.new_empty(sum(plan.recv), rows.shape[1]), experts,
                         x.new_empty(sent, x.shape[1]))
        counters.record(OP, "pipelined", _peer_bytes(plan, rows, back)
                        + (sum(plan.recv) - plan.recv[plan.rank]) * 2 * k * row_routing.element_size())
        # act (the down GEMM's input) for w2's gradient: kept, as autograd keeps silu's output
        ctx.save_for_backward(received, h13, act if needs[4] else None, out, row_routing, pos_copies, pos,
                              w13, w2)
        ctx.plan, ctx.weights_dtype, ctx.tokens, ctx.fp8 = plan, weights.dtype, x.shape[0], fp8
        return back

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_back):
        received, h13, act, out, row_routing, pos_copies, pos, w13, w2 = ctx.saved_tensors
        plan, k, fp8 = ctx.plan, row_routing.shape[1] // 2, ctx.fp8
        dh13 = grad_back.new_empty(sum(plan.copies), w13.shape[1])
        # the down GEMMs' output gradients
        grad_copies = grad_back.new_empty(sum(plan.copies), grad_back.shape[1])
        grad_row_weights = row_routing.new_zeros(row_routing.shape[0], k)  # of each received row

        def experts_backward(src, dy):
            mine, r = plan.copy_rows(src), plan.recv_rows(src)
            if mine.stop == mine.start:
                return dy.new_zeros(dy.shape)
            src_pos, offs = pos_copies[r.start * k:r.stop * k], plan.offs[src]
            if out is not None:  # d weight = <dy of the row, its copy's output>
                dots = (out[mine][src_pos.clamp(min=0).long()].float()
                        * dy.float().repeat_interleave(k, 0)).sum(-1)
                grad_row_weights[r] = torch.where(src_pos >= 0, dots, 0.0).view(-1, k)
            grad_copies[mine] = permute(dy, src_pos, k, mine.stop - mine.start, row_routing[r, k:])
            if fp8 is not None:
                dx, dh13[mine] = fp8.backward(src, grad_copies[mine])
            else:
                dx = grouped_mm(grouped_swiglu_vjp(grad_copies[mine], w2, offs, h13[mine],
                                                   out=dh13[mine]), w13, offs)
            return unpermute(dx, src_pos, k, dy.shape[0])

        # every rank runs the exchanges, whatever it needs, so the ranks stay in step
        grad_back = grad_back.contiguous()
        grad_rows = _pipeline(plan, grad_back, grad_back.new_empty(sum(plan.recv), grad_back.shape[1]),
                              experts_backward, torch.empty_like(grad_back))
        grad_weights = row_routing.new_empty(sum(plan.send), k)
        _swap(plan, grad_row_weights, grad_weights, back=True)
        counters.record(OP, "pipelined", _peer_bytes(plan, grad_back, grad_rows)
                        + (sum(plan.send) - plan.send[plan.rank]) * k * grad_weights.element_size())
        needs = ctx.needs_input_grad
        # the weight gradients once every source's rows are in (one launch each)
        if fp8 is None:
            dws = weight_grads(needs[3:5], w13, w2, plan, received, act, grad_copies, dh13)
        else:
            x_rows = dequantize_float8(*unpack_float8(received, fp8.recipe), grad_back.dtype)
            dws = float8_weight_grads(needs[3:5], w13, w2, plan, x_rows, act, grad_copies, dh13, fp8.recipe)
        return (unpermute(grad_rows, pos, plan.world, ctx.tokens) if needs[0] else None, None,
                grad_weights.to(ctx.weights_dtype), *dws, None, None, None)


class Pipelined(Backend):
    """Split by source rank with async P2P (see the module docstring); ``float8``: fp8 rows
    and scales there, ``float8_grouped_mm`` experts."""

    name = "pipelined"

    def not_supported_reasons(self, call: ExpertsCall) -> list[str]:
        backend = str(dist.get_backend(call.group)).lower()
        if "gloo" not in backend and "nccl" not in backend:
            return [f"needs point-to-point sends (gloo or NCCL), the group's backend is {backend}"]
        return host_read_reasons(call)

    def run(self, call: ExpertsCall) -> torch.Tensor:
        x, topk_idx, w13, group = call.x, call.topk_idx, call.w13, call.group
        world, rank, local, k = call.agree()
        _, header = sort_by_expert(topk_idx, local * world)
        # a row per token and rank holding one of its experts (none for a dropped copy)
        owner = torch.where(topk_idx >= 0, topk_idx // local, world).long()
        held = x.new_zeros(x.shape[0], world + 1, dtype=torch.int32).scatter_(1, owner, 1)[:, :world]
        sent, received = exchange_counts(OP, topk_idx, header, group, rows=held.sum(0))
        plan = ExchangePlan.from_counts(group, rank, sent[:, :local], received[:, :local], x.device,
                                        rows=(sent[:, local].tolist(), received[:, local].tolist()))
        rows = sum(plan.send)
        dst, token = torch.nonzero_static(held.t(), size=rows).unbind(1)  # by rank, then token
        there = owner[token] == dst[:, None]
        ids = torch.where(there, topk_idx[token] % local, -1)
        weights = torch.where(there, call.topk_weights[token], 0)
        # row of each (token, rank), -1 where none: the permutation kernels move the rows
        # (and sum each token's rows back in fp32, in a fixed order)
        row_of = (held.t().flatten().cumsum(0) - 1).view(world, -1).t()
        pos = torch.where(held > 0, row_of, -1).to(torch.int32).flatten()
        back = _ExpertPipeline.apply(x, pos, weights, w13, call.w2, ids, plan, call.float8)
        return Unpermute.apply(back, held.new_ones(held.shape, dtype=torch.float32), pos, world)
