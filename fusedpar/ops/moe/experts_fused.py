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

``float8`` (a rowwise recipe, ``float8_swiglu_mlp``'s numbers): each token copy is cast to
fp8 as the permute kernel gathers it (``permute_float8``: a row of H fp8 bytes and its fp32
scale, H + 4 bytes, staged and gathered as above); the gather GEMM multiplies those rows
by w13 cast per expert and column (``float8_grouped_mm``'s cast) in fp8, reading each row's
scale in place (a row stride of H + 4 bytes: pointer loads, H a multiple of 4), and applies
the row and column scales in its epilogue, rounds the products to x's dtype and SwiGLUs
them as torch does in that dtype (``grouped_mm_peers``' ``scales``). The push GEMM's rows
``act`` are cast per row first, in a separate pass (a row's amax spans all of I, which the
gather GEMM's tiles split), and multiplied by w2's cast in fp8, scales in the epilogue.
The backward exchanges the output gradients in x's dtype (the weight gradients need them
in high precision where the experts live): once they are in, the down GEMM's input
gradient runs as the recipe's (``float8_grad_input``, per source) and SwiGLU's
vector-Jacobian product in torch, then the push GEMM multiplies ``dh13``'s rowwise cast by
w13's cast for the input gradient, in fp8; the weight gradients are
``float8_weight_grads``, as the other backends'. Every result equals the reference
backend's bitwise where the arithmetic is the same: in fp32 the epilogue's SwiGLU (Triton's
sigmoid) may differ from torch's silu by ulps, which reach ``rowwise_with_gw_hp``'s
high-precision w2 gradient (and the casts only where a value sits on a rounding edge).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ...comm import counters, get_buffer, get_loopback_buffers, layout, symmetric
from ...kernels import gemm_peers
from .. import float8_scales, protocol
from ..backend import Backend
from ..calls import CollectiveCall, REDUCE_DTYPES
from ..scaled_grouped_mm import cast_operand, float8_grad_input
from .exchange import (SCALE_BYTES, Unpermute, checked_counts, dequantize_float8, host_to_device, permute,
                       permute_float8, sort_by_expert, unpack_float8, unpermute)
from .experts_call import OP, ExchangePlan, ExpertsCall, host_read_reasons
from .mlp import float8_weight_grads, swiglu, weight_grads


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


class Float8B(NamedTuple):
    """An expert GEMM's B in fp8, as the recipe casts it: ``b [E, K, N]`` fp8, ``sb [E, N]``
    fp32 its column scales per expert, and ``cast_rows``: how the recipe casts the GEMM's A
    rows (rows -> (fp8 rows, fp32 scales ``[rows]``): a separate pass), None where the rows
    come cast (``permute_float8``'s packed rows: H fp8 bytes, then the fp32 scale, read in
    place)."""

    b: torch.Tensor
    sb: torch.Tensor
    cast_rows: Callable | None = None


def _weights(b) -> torch.Tensor:
    return b.b if isinstance(b, Float8B) else b


def _gemm_operands(rows: torch.Tensor, b) -> tuple:
    """``(a, b, scales)`` of a peers GEMM of ``rows`` by ``b`` (x's dtype, or a ``Float8B``:
    the fp8 rows and their scales, ``grouped_mm_peers``' ``scales``)."""
    if not isinstance(b, Float8B):
        return rows, b, None
    if b.cast_rows is None:  # packed rows: each row's scale after its H bytes (H % 4 == 0)
        H = rows.shape[1] - SCALE_BYTES
        a, sa = rows[:, :H].view(b.b.dtype), rows[:, H:].view(torch.float32)[:, 0]
    else:
        a, sa = b.cast_rows(rows)
    return a, b.b, (sa, sa.stride(0), b.sb, b.sb.stride(1), b.sb.stride(0))


def _region2_rows(rows: int, staged_row_bytes: int, back_row_bytes: int) -> int:
    """Where region 2 (the results, rows of ``back_row_bytes``) starts in a data region whose
    first ``rows`` staged rows take ``staged_row_bytes`` each, in result rows."""
    return -(-rows * staged_row_bytes // back_row_bytes)


def _fused_exchange(bufs, outgoing, first_bs, second_bs, table: torch.Tensor, meta: int,
                    desc: list[int], keep_h: bool = False, h13s: list | None = None,
                    copy_back: bool = True, dtype: torch.dtype | None = None):
    """``outgoing`` rows (per rank view, sorted like its copies) go to the ranks owning
    their experts, which compute ``epilogue(rows @ first_b[e]) @ second_b[e]`` and write the
    results straight back; one view per process, or all W in a loopback. ``epilogue`` runs
    in the gather GEMM. The forward (no ``h13s``): ``first_b = w13ᵀ``, swiglu,
    ``second_b = w2ᵀ``, the ``[rows, 2I]`` product kept only with ``keep_h``. The backward:
    ``w2``, the SwiGLU vector-Jacobian product at the forward's products ``h13s`` (per
    view), ``w13``. fp8 (``Float8B`` b's, ``dtype`` the results'): the forward's rows are
    ``permute_float8``'s packed rows, multiplied with their scales in place
    (``grouped_mm_peers``' ``scales``) before the SwiGLU epilogue; the push casts its rows
    as the recipe does first. A first step that is a function (the fp8 backward) is not a
    GEMM: it runs in torch on the received rows once they are all in and returns the push's
    rows. Returns per view ``(back, received, first product (None when not kept), the
    epilogue's output, bytes from peers)``: the results of its own rows in their order (in
    ``dtype``, default outgoing's), the rows it received (source-major) and what the
    epilogue made of them. ``copy_back=False``: ``back`` is a view of this rank's region 2,
    valid until this rank's next exchange on the group's buffer (a peer writes there only
    after our next stage); for a caller that consumes it at once, not for one that autograd
    saves.

    Two epochs per call. Epoch 1: stage the rows (after DONE of the last call), READY;
    ``protocol.gathering`` copies each source's block of rows for this rank's experts (one
    contiguous block per source) into ``received`` and raises GATHERED per source (the copy
    engine on a GPU), while the gather GEMM multiplies each source's rows once its flag is
    up, own rank first; DONE. Epoch 2: the push GEMM writes each source's results into the
    source's region 2 (past every rank's staged rows; free, since the epoch-1 stage waited
    for every peer's DONE of the last call), READY; each rank waits for every owner's READY
    and reads its region 2; DONE. Each routed row crosses once each way.
    """
    world, local = table.shape[0], _weights(second_bs[0]).shape[0]
    hidden, dtype = outgoing[0].shape[1], dtype or outgoing[0].dtype
    staged_row_bytes = hidden * outgoing[0].element_size()
    width = _weights(second_bs[0]).shape[2]  # of the results
    counts, staged = _by_owner(table, local)
    # where region 2 starts in every rank's data, in result rows
    region2_rows = _region2_rows(int(counts.sum((1, 2)).max()), staged_row_bytes, width * dtype.itemsize)
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
        product = mid = None
        if not callable(first_b):
            n = _weights(first_b).shape[2]
            # forward: swiglu of the [gate | up] products; backward: their gradients
            product = x.new_empty(sum(rows), n, dtype=dtype) if h13 is None and keep_h else None
            mid = x.new_empty(sum(rows), n // 2 if h13 is None else 2 * n, dtype=dtype)
        blocks = []
        for src in ((rank + step) % world for step in range(world)):
            n, first = per_source[src], firsts[rank][src]
            at = sum(per_source[:src])
            staged = buf.data(x.dtype, (first + n) * hidden, rank=src)[first * hidden:]
            if n:
                blocks.append((src, received[at:at + n], staged.view(n, hidden)))
        with protocol.gathering(buf, blocks, epoch, meta, copy_engine=x.is_cuda):
            if mid is not None:
                a, b, scales = _gemm_operands(received, first_b)
                gemm_peers.grouped_mm_peers(a, b, mid, *group_table, rows, buf.pad_table, rank, world,
                                            epoch, buf.timeout_ns, push=False,
                                            epilogue="swiglu" if h13 is None else "swiglu_vjp",
                                            h=product if h13 is None else h13, scales=scales)
        if mid is None:  # every source's rows are in (in stream order)
            mid = first_b(received)
        peer_rows = sum(per_source) - per_source[rank]
        states.append((received, product, mid, group_table, rows, peer_rows))
    protocol.release(launchers, bufs, epochs, OP, [state[:3] for state in states])  # Nones skipped
    epochs = [buf.next_epoch() for buf in bufs]
    for buf, second_b, epoch, (_, _, mid, group_table, rows, _) in zip(bufs, second_bs, epochs, states):
        a, b, scales = _gemm_operands(mid, second_b)
        gemm_peers.grouped_mm_peers(a, b, mid, *group_table, rows, buf.pad_table, buf.rank, world,
                                    epoch, buf.timeout_ns, push=True, c_row=region2_rows, scales=scales)
        launchers.signal_peers(buf.pad_table, layout.READY, buf.rank, world, epoch, -1)
    outs = []
    for buf, x, epoch, (received, product, mid, *_, peer_rows) in zip(bufs, outgoing, epochs,
                                                                       states):
        launchers.wait_flags(buf.pad_table, layout.READY, buf.rank, world, epoch, buf.timeout_ns,
                             layout.TIMEOUT_READY, meta)
        back = buf.data(dtype, (region2_rows + x.shape[0]) * width)[region2_rows * width:]
        back = back.view(x.shape[0], width)
        back = back.clone() if copy_back else back
        pushed_here = x.shape[0] - per_sources[buf.rank][buf.rank]
        outs.append((back, received, product, mid,
                     peer_rows * staged_row_bytes + pushed_here * width * dtype.itemsize))
    protocol.release(launchers, bufs, epochs, OP, [out[0] for out in outs])  # NaN where a wait failed
    return outs


def _float8_forward_bs(w13: torch.Tensor, w2: torch.Tensor, recipe: str) -> tuple[Float8B, Float8B]:
    """The forward's B operands as ``float8_swiglu_mlp`` casts them (per expert and column:
    ``float8_grouped_mm``'s forward), the push's rows ``act`` cast per row (a separate pass:
    a row's amax spans all of I, which the gather GEMM's tiles split)."""
    r, E = float8_scales.recipe(recipe), w13.shape[0]
    w13q, s13 = cast_operand(w13, r.w, r.round_pow2, E, w13.shape[1])
    w2q, s2 = cast_operand(w2, r.w, r.round_pow2, E, w2.shape[1])
    return (Float8B(w13q.transpose(1, 2), s13),
            Float8B(w2q.transpose(1, 2), s2, lambda act: cast_operand(act, r.x, r.round_pow2, act.shape[0])))


def _float8_backward_bs(w13: torch.Tensor, w2: torch.Tensor, h13: torch.Tensor, plan: ExchangePlan,
                        recipe: str) -> tuple:
    """The backward's steps as ``float8_swiglu_mlp``'s autograd runs them: the first (in
    torch, on the received output gradients ``dy``): the down GEMM's input gradient
    (``float8_grad_input``, per source: its rows' expert groups) and SwiGLU's vector-Jacobian
    product at ``h13``; the push: the first GEMM's input gradient, ``dh13`` cast per row and
    w13 per expert and column of H (``float8_grad_input``'s casts, in the push GEMM)."""
    r, E, H = float8_scales.recipe(recipe), w13.shape[0], w13.shape[2]

    def first(dy):
        d_act = dy.new_empty(dy.shape[0], w2.shape[2])
        for src in range(plan.world):
            rows = plan.copy_rows(src)
            if rows.stop > rows.start:
                d_act[rows] = float8_grad_input(r, dy[rows], w2.transpose(1, 2), plan.offs[src], dy.dtype)
        return torch.func.vjp(swiglu, h13)[1](d_act)[0]

    bq, sbt = cast_operand(w13.transpose(1, 2), r.w_for_dx, r.round_pow2, E, H)
    # float8_grad_input writes x's dtype here (x, w13 and w2 share it, bf16 or fp32)
    return first, Float8B(bq.transpose(1, 2), sbt, lambda dh13: cast_operand(dh13, r.dy, r.round_pow2, dh13.shape[0]))


def _fused_forward(bufs, sorted_xs, w13s, w2s, table, meta, desc, keep_h: bool = False,
                   copy_back: bool = True, float8: str | None = None):
    """The forward exchange: ``swiglu(rows @ w13[e]ᵀ) @ w2[e]ᵀ`` of each view's rows
    (``float8``: ``permute_float8``'s packed rows, through the recipe's casts)."""
    if float8 is None:
        firsts, seconds = [w.transpose(1, 2) for w in w13s], [w.transpose(1, 2) for w in w2s]
    else:
        firsts, seconds = zip(*(_float8_forward_bs(w13, w2, float8) for w13, w2 in zip(w13s, w2s)))
    return _fused_exchange(bufs, sorted_xs, firsts, seconds, table, meta, desc, keep_h=keep_h,
                           copy_back=copy_back, dtype=w13s[0].dtype)


def _fused_meta(hidden: int, w13: torch.Tensor, num_experts: int, k: int, dtype,
                float8: str | None = None) -> tuple[int, list[int]]:
    """``(meta, desc)``: the fingerprint the ranks' flags compare and the ``layout.DESC``
    words that describe a mismatch."""
    return (symmetric.fingerprint(OP, dtype, hidden, tuple(w13.shape[1:]), num_experts, k, float8),
            symmetric.describe_words(0, dtype, (hidden, w13.shape[1], num_experts, k), 0))


def _fused_nbytes(table: torch.Tensor, staged_row_bytes: int, back_row_bytes: int) -> int:
    """Every rank's data region: its staged copies, then region 2 (its copies' results)."""
    rows = int(table.sum(1).max())
    return (_region2_rows(rows, staged_row_bytes, back_row_bytes) + rows) * back_row_bytes


def _fused_buffer(plan: ExchangePlan, rows: torch.Tensor, dtype: torch.dtype, hidden: int):
    """The group's symmetric buffer, large enough for an exchange of ``rows`` whose results
    are ``hidden`` wide in ``dtype``."""
    return get_buffer(plan.group, _fused_nbytes(plan.table, rows.shape[1] * rows.element_size(),
                                                hidden * dtype.itemsize), rows.device)


class _FusedExperts(torch.autograd.Function):
    """The fused expert MLP of x's copies (``pos``: each copy's row, sorted by owner and
    expert; ``permute_float8``'s packed rows with ``float8``); its backward is the same
    exchange over the output gradients (``_fused_exchange`` with w2, the SwiGLU
    vector-Jacobian product in the gather GEMM's epilogue, and w13; with ``float8``, the
    recipe's steps: ``_float8_backward_bs``), the weight gradients computed where the
    experts live."""

    @staticmethod
    def forward(ctx, x, w13, w2, plan: ExchangePlan, pos, float8):
        table, k, sent = plan.table, plan.k, sum(plan.send)
        rows = permute(x, pos, k, sent) if float8 is None else permute_float8(x, pos, k, sent, float8)
        buf = _fused_buffer(plan, rows, x.dtype, x.shape[1])
        meta, desc = _fused_meta(x.shape[1], w13, table.shape[1], k, x.dtype, float8)
        (back, received, h13, act, nbytes), = _fused_forward([buf], [rows], [w13], [w2], table, meta, desc,
                                                             keep_h=any(ctx.needs_input_grad[:3]),
                                                             copy_back=plan.keep_back, float8=float8)
        counters.record(OP, "fused", nbytes)
        # act (the push GEMM's input) for w2's gradient: kept, as autograd keeps silu's output
        ctx.save_for_backward(received, h13, act if ctx.needs_input_grad[2] else None, w13, w2, pos)
        ctx.plan, ctx.meta, ctx.desc, ctx.float8, ctx.tokens = plan, meta, desc, float8, x.shape[0]
        return back

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_back):
        received, h13, act, w13, w2, pos = ctx.saved_tensors
        plan, float8 = ctx.plan, ctx.float8
        # a fingerprint of its own: a rank still in the forward pass cannot pass for one here
        meta = symmetric.fingerprint("backward", ctx.meta)
        grad_back = grad_back.contiguous()
        buf = _fused_buffer(plan, grad_back, grad_back.dtype, grad_back.shape[1])
        first, second = (w2, w13) if float8 is None else _float8_backward_bs(w13, w2, h13, plan, float8)
        (grad_sorted, grad_received, _, dh13, nbytes), = _fused_exchange(
            [buf], [grad_back], [first], [second], plan.table, meta, ctx.desc, h13s=[h13])
        counters.record(OP, "fused", nbytes)
        needs = ctx.needs_input_grad
        if float8 is None:
            dws = weight_grads(needs[1:3], w13, w2, plan, received, act, grad_received, dh13)
        else:
            x_rows = dequantize_float8(*unpack_float8(received, float8), grad_back.dtype)
            dws = float8_weight_grads(needs[1:3], w13, w2, plan, x_rows, act, grad_received, dh13, float8)
        return (unpermute(grad_sorted, pos, plan.k, ctx.tokens) if needs[0] else None, *dws,
                None, None, None)


def _float8_reasons(call: ExpertsCall) -> list[str]:
    """What the fused fp8 path cannot take (the recipe's own checks come before:
    ``moe_experts``)."""
    reasons, H = [], call.x.shape[1]
    if H % 4:
        reasons.append(f"float8={call.float8!r}: the first GEMM reads each staged row's fp32 scale in "
                       f"place after its H fp8 bytes, which needs H a multiple of 4, got H={H}; use "
                       "backend='pipelined' or 'reference'")
    return reasons + [f"float8={call.float8!r}: {r}" for r in float8_scales.fp8_tensor_core_reasons(call.x)]


class Fused(Backend):
    """Symmetric memory, both grouped GEMMs fused with the exchange (module docstring)."""

    name = "fused"

    def not_supported_reasons(self, call: ExpertsCall) -> list[str]:
        world = dist.get_world_size(call.group)
        reasons = protocol.triton_reasons(CollectiveCall(OP, call.x, 0, world, call.group))
        if call.x.dtype not in REDUCE_DTYPES:
            reasons.append(f"the fused kernels take float32, float16 or bfloat16, not {call.x.dtype}")
        if call.float8 is not None:
            reasons += _float8_reasons(call)
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
        back = _FusedExperts.apply(x, w13, call.w2, plan, pos, call.float8)
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
    bufs = get_loopback_buffers(world, _fused_nbytes(table, hidden * dtype.itemsize, hidden * dtype.itemsize),
                                xs[0].device)
    meta, desc = _fused_meta(hidden, w13s[0], local * world, k, dtype)
    outs = _fused_forward(bufs, sorted_xs, w13s, w2s, table, meta, desc, copy_back=False)
    for *_, nbytes in outs:
        counters.record(OP, "fused", nbytes)
    return [unpermute(back, pos, k, x.shape[0], w)
            for (back, *_), (pos, _), x, w in zip(outs, sorts, xs, topk_weights)]

