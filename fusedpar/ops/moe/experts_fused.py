"""The ``fused`` backend of ``moe_experts``: symmetric memory, both grouped GEMMs fused
with the exchange.

Every rank stages its expert-sorted copies; each source's block of rows for this rank's
experts is copied once into a local buffer (the copy engine on a side stream on a GPU,
raising a per-source GATHERED flag), while the first grouped GEMM
(``kernels.gemm_peers.grouped_mm_peers_kernel``) multiplies each source's rows as soon as
its flag is up (own rank first) and applies SwiGLU to its fp32 gate and up tiles (the
``[rows, 2I]`` product is written only when autograd needs it); then the second grouped
GEMM writes its tiles straight into the source ranks' buffers, where each rank reads its
results back (no separate all-to-all). Both GEMMs tile runs of blocks: a tile may hold
several sources' rows of one expert where they lie back to back (one expert per rank), so
splitting the rows by source costs no partial tile per source. The backward pass is the
same exchange over the output gradients (gather GEMM with w2 whose epilogue applies the
SwiGLU vector-Jacobian product to its fp32 tiles, push GEMM with w13); the weight
gradients are computed where the experts live, one launch each over every source's rows.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ...comm import counters, get_buffer, get_loopback_buffers, layout, symmetric
from ...kernels import gemm_peers
from .. import protocol
from ..backend import Backend
from ..calls import CollectiveCall, REDUCE_DTYPES
from .exchange import (Permute, Unpermute, checked_counts, host_to_device, permute, sort_by_expert,
                       unpermute)
from .experts_call import OP, ExchangePlan, ExpertsCall, host_read_reasons
from .mlp import weight_grads


def _by_owner(table: torch.Tensor, local: int) -> tuple[np.ndarray, np.ndarray]:
    """``table`` (host ``[W, E]``, every rank's copies per expert) as ``[src, owner,
    expert]``: the copies, and where each (owner, expert) block starts in src's sorted copies."""
    world, host = table.shape[0], table.numpy().astype(np.int64)
    staged = host.cumsum(1) - host
    return host.reshape(world, world, local), staged.reshape(world, world, local)


def first_gemm_blocks(table: torch.Tensor, ranks: list[int], local: int) -> tuple:
    """The first GEMM's row blocks of each rank view in ``ranks``, own rank first: rows
    ``[src, expert, row in src's staged copies, row in the view's received rows, rows]``
    (int64 ``[G, 5]``, empty blocks left out, one view's blocks after another), their runs
    (``gemm_peers.block_runs``: ``[R, 3]``, first block counted from the view's first), and
    how many blocks and runs each view has. ``table``: host int ``[W, E]``, every rank's
    copies per expert (a rank's copies are sorted by destination, then expert; the received
    rows are source-major). Whole-table numpy ops for every view at once, not a loop over
    the blocks: the host issues the first GEMM only after this."""
    world = table.shape[0]
    counts, staged = _by_owner(table, local)
    by_owner = counts.transpose(1, 0, 2).reshape(world, -1)  # [owner, src * local + expert]
    local_starts = (by_owner.cumsum(1) - by_owner).reshape(world, world, local)  # [owner, src, expert]
    owner = np.asarray(ranks)[:, None]
    src = (owner + np.arange(world)) % world  # per view: its rank, rank + 1, ...
    shape = (len(ranks), world, local)
    blocks = np.stack([np.broadcast_to(src[..., None], shape), np.broadcast_to(np.arange(local), shape),
                       staged[src, owner], local_starts[owner, src], counts[src, owner]], axis=-1)
    kept = blocks[..., 4] > 0
    blocks, per_view = blocks[kept], kept.reshape(len(ranks), -1).sum(1)
    view_starts = per_view.cumsum() - per_view
    runs = gemm_peers.block_runs(blocks, view_starts[per_view > 0])  # no run crosses views
    view_of_run = np.repeat(np.arange(len(ranks)), per_view)[runs[:, 0]]
    runs[:, 0] -= view_starts[view_of_run]
    return (blocks, runs, per_view.tolist(),
            np.bincount(view_of_run, minlength=len(ranks)).tolist())


def _fused_exchange(bufs, outgoing, first_bs, second_bs, table: torch.Tensor, meta: int,
                    desc: list[int], keep_h: bool = False, h13s: list | None = None,
                    copy_back: bool = True):
    """``outgoing`` rows (per rank view, sorted like its copies) go to the ranks owning
    their experts, which compute ``epilogue(rows @ first_b[e]) @ second_b[e]`` and write the
    results straight back; one view per process, or all W in a loopback. ``epilogue`` runs
    in the gather GEMM. The forward (no ``h13s``): ``first_b = w13ᵀ``, swiglu,
    ``second_b = w2ᵀ``, the ``[rows, 2I]`` product kept only with ``keep_h``. The backward:
    ``w2``, the SwiGLU vector-Jacobian product at the forward's products ``h13s`` (per
    view), ``w13``. Returns per view ``(back, received, first product (None when not
    kept), the epilogue's output, bytes from peers)``: the results of its own rows in their
    order, the rows it received (source-major) and what the epilogue made of them.
    ``copy_back=False``: ``back`` is a view of this rank's region 2, valid until this rank's
    next exchange on the group's buffer (a peer writes there only after our next stage); for
    a caller that consumes it at once, not for one that autograd saves.

    Two epochs per call. Epoch 1: stage the rows (after DONE of the last call), READY;
    ``protocol.gathering`` copies each source's block of rows for this rank's experts (one
    contiguous block per source) into ``received`` and raises GATHERED per source (the copy
    engine on a GPU), while the gather GEMM multiplies each source's rows once its flag is
    up, own rank first; DONE. Epoch 2: the push GEMM writes each source's results into the
    source's region 2 (past every rank's staged rows; free, since the epoch-1 stage waited
    for every peer's DONE of the last call), READY; each rank waits for every owner's READY
    and reads its region 2; DONE. Each routed row crosses once each way.
    """
    world, local = table.shape[0], first_bs[0].shape[0]
    hidden, dtype = outgoing[0].shape[1], outgoing[0].dtype
    counts, staged = _by_owner(table, local)
    region2_rows = int(counts.sum((1, 2)).max())  # where region 2 starts in every rank's data
    region2 = region2_rows * hidden
    # per owner: the rows each source sends it, and where that block starts in the source's
    # sorted copies
    per_sources = counts.sum(2).T.tolist()
    firsts = staged[:, :, 0].T.tolist()
    launchers = protocol.TRITON_LAUNCHERS
    row_blocks, runs, blocks_per_view, runs_per_view = first_gemm_blocks(
        table, [buf.rank for buf in bufs], local)
    # one copy for both tables (a pageable .to("cuda") would make each view's host wait for
    # the last view's GEMM)
    tables = host_to_device(torch.from_numpy(np.concatenate([row_blocks.ravel(), runs.ravel()])
                                             .astype(np.int32)), outgoing[0].device)
    split = row_blocks.size
    group_tables = list(zip(tables[:split].view(-1, 5).split(blocks_per_view),
                            tables[split:].view(-1, 3).split(runs_per_view)))
    run_rows = np.split(runs[:, 2], np.cumsum(runs_per_view)[:-1])
    epochs = protocol.begin(bufs, launchers)
    for buf, x, epoch in zip(bufs, outgoing, epochs):
        protocol.stage(launchers, buf, x, epoch, meta, desc, gather=True)
    states = []
    for buf, x, first_b, epoch, rows, group_table, h13 in zip(
            bufs, outgoing, first_bs, epochs, run_rows, group_tables, h13s or [None] * len(bufs)):
        rank, rows = buf.rank, rows.tolist()
        per_source = per_sources[rank]
        received = x.new_empty(sum(rows), hidden)
        width = first_b.shape[2]
        # forward: swiglu of the [gate | up] products; backward: their gradients
        product = x.new_empty(sum(rows), width) if h13 is None and keep_h else None
        mid = x.new_empty(sum(rows), width // 2 if h13 is None else 2 * width)
        blocks = []
        for src in ((rank + step) % world for step in range(world)):
            n, first = per_source[src], firsts[rank][src]
            at = sum(per_source[:src])
            staged = buf.data(dtype, (first + n) * hidden, rank=src)[first * hidden:]
            if n:
                blocks.append((src, received[at:at + n], staged.view(n, hidden)))
        with protocol.gathering(buf, blocks, epoch, meta, copy_engine=x.is_cuda):
            gemm_peers.grouped_mm_peers(received, first_b, mid, *group_table, rows, buf.pad_table,
                                        rank, world, epoch, buf.timeout_ns, push=False,
                                        epilogue="swiglu" if h13 is None else "swiglu_vjp",
                                        h=product if h13 is None else h13)
        peer_rows = sum(per_source) - per_source[rank]
        states.append((received, product, mid, group_table, rows, peer_rows))
    protocol.release(launchers, bufs, epochs, OP, [state[:3] for state in states])  # Nones skipped
    epochs = [buf.next_epoch() for buf in bufs]
    for buf, x, second_b, epoch, (_, _, mid, group_table, rows, _) in zip(
            bufs, outgoing, second_bs, epochs, states):
        gemm_peers.grouped_mm_peers(mid, second_b, x, *group_table, rows, buf.pad_table, buf.rank,
                                    world, epoch, buf.timeout_ns, push=True, c_row=region2_rows)
        launchers.signal_peers(buf.pad_table, layout.READY, buf.rank, world, epoch, -1)
    outs = []
    for buf, x, epoch, (received, product, mid, *_, peer_rows) in zip(bufs, outgoing, epochs,
                                                                       states):
        launchers.wait_flags(buf.pad_table, layout.READY, buf.rank, world, epoch, buf.timeout_ns,
                             layout.TIMEOUT_READY, meta)
        back = buf.data(dtype, region2 + x.numel())[region2:].view(x.shape)
        back = back.clone() if copy_back else back
        pushed_here = x.shape[0] - per_sources[buf.rank][buf.rank]
        outs.append((back, received, product, mid,
                     (peer_rows + pushed_here) * hidden * x.element_size()))
    protocol.release(launchers, bufs, epochs, OP, [out[0] for out in outs])  # NaN where a wait failed
    return outs


def _fused_forward(bufs, sorted_xs, w13s, w2s, table, meta, desc, keep_h: bool = False,
                   copy_back: bool = True):
    """The forward exchange: ``swiglu(rows @ w13[e]ᵀ) @ w2[e]ᵀ`` of each view's rows."""
    return _fused_exchange(bufs, sorted_xs, [w.transpose(1, 2) for w in w13s],
                           [w.transpose(1, 2) for w in w2s], table, meta, desc, keep_h=keep_h,
                           copy_back=copy_back)


def _fused_meta(hidden: int, w13: torch.Tensor, num_experts: int, k: int, dtype) -> tuple[int, list[int]]:
    """``(meta, desc)``: the fingerprint the ranks' flags compare and the ``layout.DESC``
    words that describe a mismatch."""
    return (symmetric.fingerprint(OP, dtype, hidden, tuple(w13.shape[1:]), num_experts, k),
            symmetric.describe_words(0, dtype, (hidden, w13.shape[1], num_experts, k), 0))


def _fused_nbytes(table: torch.Tensor, hidden: int, dtype: torch.dtype) -> int:
    """Every rank's data region: its staged copies, then region 2 (the same size)."""
    return 2 * int(table.sum(1).max()) * hidden * dtype.itemsize


def _fused_buffer(plan: ExchangePlan, rows: torch.Tensor):
    """The group's symmetric buffer, large enough for an exchange of ``rows``."""
    return get_buffer(plan.group, _fused_nbytes(plan.table, rows.shape[1], rows.dtype), rows.device)


class _FusedExperts(torch.autograd.Function):
    """The fused expert MLP; its backward is the same exchange over the output gradients
    (``_fused_exchange`` with w2, the SwiGLU vector-Jacobian product in the gather GEMM's
    epilogue, and w13), the weight gradients computed where the experts live."""

    @staticmethod
    def forward(ctx, sorted_x, w13, w2, plan: ExchangePlan):
        table, k = plan.table, plan.k
        buf = _fused_buffer(plan, sorted_x)
        meta, desc = _fused_meta(sorted_x.shape[1], w13, table.shape[1], k, sorted_x.dtype)
        (back, received, h13, act, nbytes), = _fused_forward([buf], [sorted_x.contiguous()], [w13],
                                                             [w2], table, meta, desc,
                                                             keep_h=any(ctx.needs_input_grad[:3]),
                                                             copy_back=plan.keep_back)
        counters.record(OP, "fused", nbytes)
        # act (the push GEMM's input) for w2's gradient: kept, as autograd keeps silu's output
        ctx.save_for_backward(received, h13, act if ctx.needs_input_grad[2] else None, w13, w2)
        ctx.plan, ctx.meta, ctx.desc = plan, meta, desc
        return back

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_back):
        received, h13, act, w13, w2 = ctx.saved_tensors
        plan = ctx.plan
        # a fingerprint of its own: a rank still in the forward pass cannot pass for one here
        meta = symmetric.fingerprint("backward", ctx.meta)
        buf = _fused_buffer(plan, grad_back)
        (grad_sorted, grad_received, _, dh13, nbytes), = _fused_exchange(
            [buf], [grad_back.contiguous()], [w2], [w13], plan.table, meta, ctx.desc, h13s=[h13])
        counters.record(OP, "fused", nbytes)
        return (grad_sorted, *weight_grads(ctx.needs_input_grad[1:3], w13, w2, plan, received, act,
                                           grad_received, dh13),
                None)


class Fused(Backend):
    """Symmetric memory, both grouped GEMMs fused with the exchange (module docstring)."""

    name = "fused"

    def not_supported_reasons(self, call: ExpertsCall) -> list[str]:
        world = dist.get_world_size(call.group)
        reasons = protocol.triton_reasons(CollectiveCall(OP, call.x, 0, world, call.group))
        if call.x.dtype not in REDUCE_DTYPES:
            reasons.append(f"the fused kernels take float32, float16 or bfloat16, not {call.x.dtype}")
        if call.float8 is not None:
            reasons.append(f"float8={call.float8!r}: the fused kernels stage and multiply x's dtype (the "
                           "fp8 rows are to be cast in its dispatch kernel, and its first GEMM to read "
                           "fp8 rows with their scales: not written yet); use backend='pipelined' or "
                           "'reference'")
        return reasons + host_read_reasons(call)

    def run(self, call: ExpertsCall) -> torch.Tensor:
        x, topk_idx, w13, group = call.x, call.topk_idx, call.w13, call.group
        world, rank, local, k = call.agree()
        E = local * world
        pos, header = sort_by_expert(topk_idx, E)
        table = torch.empty(world * (E + 1), dtype=header.dtype, device=header.device)
        protocol.all_gather_single(table, header, group=group)
        table = checked_counts(OP, table.view(world, -1).cpu(), E, {rank: topk_idx})  # one host read
        plan = ExchangePlan.from_counts(group, rank, table[rank].view(world, local),
                                        table[:, rank * local:(rank + 1) * local], x.device)
        plan.table, plan.k = table, k
        # the results are weighted and summed at once; kept only for topk_weights' gradient
        plan.keep_back = torch.is_grad_enabled() and call.topk_weights.requires_grad
        sorted_x = Permute.apply(x, pos, k, sum(plan.send))
        back = _FusedExperts.apply(sorted_x, w13, call.w2, plan)
        return Unpermute.apply(back, call.topk_weights, pos, k)


def fused_loopback(xs, topk_idxs, topk_weights, w13s, w2s) -> list:
    """Every rank's part of the fused expert MLP in this process, over loopback symmetric
    buffers (forward only; ``moe_experts_loopback``'s checks come first)."""
    world, local, k = len(xs), w13s[0].shape[0], topk_idxs[0].shape[1]
    hidden, dtype, E = xs[0].shape[1], xs[0].dtype, local * world
    sorts = [sort_by_expert(idx, E) for idx in topk_idxs]
    table = checked_counts(f"{OP}_loopback", torch.stack([header for _, header in sorts]).cpu(), E,
                           dict(enumerate(topk_idxs)))  # one host read
    sorted_xs = [permute(x.contiguous(), pos, k, int(table[r].sum()))
                 for r, (x, (pos, _)) in enumerate(zip(xs, sorts))]
    bufs = get_loopback_buffers(world, _fused_nbytes(table, hidden, dtype), xs[0].device)
    meta, desc = _fused_meta(hidden, w13s[0], local * world, k, dtype)
    outs = _fused_forward(bufs, sorted_xs, w13s, w2s, table, meta, desc, copy_back=False)
    for *_, nbytes in outs:
        counters.record(OP, "fused", nbytes)
    return [unpermute(back, pos, k, x.shape[0], w)
            for (back, *_), (pos, _), x, w in zip(outs, sorts, xs, topk_weights)]

