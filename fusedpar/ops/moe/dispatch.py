"""``moe_dispatch`` / ``moe_combine``: send each token's copies to the ranks owning their
experts, and the expert outputs back, weighted and summed per token; their loopback
variants (every rank in one process). Backends: ``reference`` (``all_to_all_single``)
and ``triton`` (symmetric memory with per-source flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ...comm import counters, get_buffer, get_loopback_buffers, layout, resolve_group, symmetric
from ...comm.groups import host_collective_device
from ...errors import FusedparError
from ...kernels import moe_dispatch as dispatch_kernels
from .. import protocol
from ..backend import Backend, Dispatcher
from ..registry import register
from .exchange import (SCALE_BYTES, Permute, Unpermute, all_to_all_rows, check_routing, check_same_everywhere,
                       checked_counts, dequantize_float8, eager_under_compile, exchange_counts, float8_cast,
                       host_to_device, invalid_ids_error, permute_float8, sort_by_expert, unpack_float8, unpermute)
from .routing import topk_route

OP = "moe_dispatch"
EXCHANGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)  # uint8: fp8 rows + scales


@dataclass
class MoEHandle:
    """What ``moe_combine`` and the backward passes need to undo a ``moe_dispatch``."""

    group: object              # the ep ProcessGroup (None for a loopback rank)
    pos: torch.Tensor          # int32 [T*k]: each copy's row in the local sorted buffer, -1 dropped
    k: int
    tokens: int
    weights: torch.Tensor
    backend: str
    recv_rows: int             # rows of recv_x, flattened (E_local * W * M when padded)
    max_tokens_per_rank: int | None = None
    # reference backend
    send: list | None = None                  # rows sent to each rank
    recv: list | None = None                  # rows received from each rank
    expert_order: torch.Tensor | None = None  # compact recv_x = received[expert_order]
    source_order: torch.Tensor | None = None  # received = compact recv_x[source_order]
    padded_rows: torch.Tensor | None = None   # with max_tokens_per_rank: compact row -> padded row
    # triton backend
    routes: "SymmetricRoutes | None" = None


@dataclass
class RoutingCall:
    """One rank's dispatch call (``group`` None: a loopback of ``world_size`` ranks)."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_experts: int
    group: object
    world_size: int
    max_tokens_per_rank: int | None = None
    float8: str | None = None  # a recipe: rows travel as fp8 bytes + scale (``pack_float8``)

    @property
    def rows_dtype(self) -> torch.dtype:
        """The dtype of the exchanged rows: x's, or uint8 for float8 rows."""
        return self.x.dtype if self.float8 is None else torch.uint8

    @property
    def row_width(self) -> int:
        """Elements of an exchanged row: H, or H fp8 bytes + the scale's for float8 rows."""
        return self.x.shape[1] + (0 if self.float8 is None else SCALE_BYTES)

    def sorted_rows(self, pos: torch.Tensor, k: int, rows: int) -> torch.Tensor:
        """The copies in expert order, as they are staged: ``Permute`` (differentiable), or
        each copy cast to fp8 as it is gathered (``permute_float8``)."""
        if self.float8 is None:
            return Permute.apply(self.x, pos, k, rows)
        return permute_float8(self.x, pos, k, rows, self.float8)

    def cache_key(self):
        name = self.group.group_name if self.group is not None else f"loopback{self.world_size}"
        return (name, self.x.device.type, self.rows_dtype)

    def describe(self):
        return (f"x {tuple(self.x.shape)} {self.x.dtype} on {self.x.device.type}, topk_idx "
                f"{tuple(self.topk_idx.shape)}")


def _capacity_error(max_tokens: int, what: str) -> ValueError:
    return ValueError(f"fusedpar.moe_dispatch: max_tokens_per_rank={max_tokens} is too small: "
                      f"{what}; raise it (each (local expert, source) block of recv_x holds "
                      "max_tokens_per_rank rows, and no rank may pass more tokens)")


# ---- the reference backend: all_to_all_single ---------------------------------------------------


def _counted_all_to_all(x, send, recv, group, op):
    peer_rows = sum(recv) - recv[dist.get_rank(group)]
    counters.record(op, "reference", peer_rows * math.prod(x.shape[1:]) * x.element_size())
    return all_to_all_rows(x, send, recv, group)


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows with uneven splits, moving them in direction
    ``op`` (``"moe_dispatch"`` or ``"moe_combine"``); its adjoint swaps the splits and the
    direction (counted under the other op, as the triton backend's)."""

    @staticmethod
    def forward(ctx, x, send, recv, group, op):
        ctx.send, ctx.recv, ctx.group, ctx.op = send, recv, group, op
        return _counted_all_to_all(x, send, recv, group, op)

    @staticmethod
    def backward(ctx, grad):
        other = "moe_combine" if ctx.op == "moe_dispatch" else "moe_dispatch"
        return _counted_all_to_all(grad, ctx.recv, ctx.send, ctx.group, other), None, None, None, None


class ReferenceDispatch(Backend):
    """Sort copies by expert, exchange the per-expert counts and the expert-id flag
    (``all_to_all_single``, then one host read; see ``INVALID_IDS``), then the
    rows (``all_to_all_single`` with uneven splits, read on the host), then reorder the
    received rows from source-major to expert-major (and pad them, with max_tokens_per_rank)."""

    name = "reference"

    def run(self, call: RoutingCall):
        x, topk_idx, weights, num_experts, group = (call.x, call.topk_idx, call.topk_weights,
                                                    call.num_experts, call.group)
        M = call.max_tokens_per_rank
        world = dist.get_world_size(group)
        local = num_experts // world
        H = call.row_width
        check_same_everywhere(OP, group, [H, topk_idx.shape[1], num_experts,
                                          symmetric.dtype_code(call.rows_dtype), M or 0],
                              "hidden size, k, num_experts, dtype, max_tokens_per_rank")
        pos, header = sort_by_expert(topk_idx, num_experts)
        send_counts, recv_counts = exchange_counts(OP, topk_idx, header, group)
        if M is not None:  # agreed by every rank, so every rank raises
            worst = torch.tensor([x.shape[0], int(recv_counts.max()) if recv_counts.numel() else 0],
                                 device=host_collective_device(group))
            protocol.all_reduce(worst, group, dist.ReduceOp.MAX)
            if int(worst.max()) > M:
                raise _capacity_error(M, f"a rank passes {int(worst[0])} tokens and some expert "
                                         f"gets {int(worst[1])} copies from one rank")
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        sorted_x = call.sorted_rows(pos, topk_idx.shape[1], sum(send))
        received = _AllToAll.apply(sorted_x, send, recv, group, OP)
        expert_order, source_order = _expert_major(recv_counts, x.device)
        per_expert = recv_counts.sum(0)
        recv_x, padded_rows = received[expert_order], None
        if M is not None:
            padded_rows = host_to_device(_padded_rows(per_expert, world * M), x.device)
            recv_x = recv_x.new_zeros(local * world * M, H).index_put((padded_rows,), recv_x)
        handle = MoEHandle(group, pos, topk_idx.shape[1], x.shape[0], weights, self.name,
                           recv_x.shape[0], M, send, recv, expert_order, source_order, padded_rows)
        if M is not None:
            recv_x = recv_x.view(local, world * M, -1)
        return recv_x, host_to_device(per_expert.to(torch.int32), x.device), handle

    @staticmethod
    def combine(y: torch.Tensor, handle: MoEHandle) -> torch.Tensor:
        if handle.padded_rows is not None:
            y = y[handle.padded_rows]
        received = y[handle.source_order]
        back = _AllToAll.apply(received, handle.recv, handle.send, handle.group, "moe_combine")
        return Unpermute.apply(back, handle.weights, handle.pos, handle.k)


def _padded_rows(per_expert: torch.Tensor, block: int) -> torch.Tensor:
    """Row of each compact (expert-major) row in the padded ``[E_local * block]`` layout."""
    per_expert = per_expert.long()
    expert = torch.repeat_interleave(torch.arange(per_expert.numel()), per_expert)
    starts = per_expert.cumsum(0) - per_expert
    return expert * block + torch.arange(expert.numel()) - starts[expert]


def _expert_major(recv_counts: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows come grouped by (source, local expert); the grouped GEMM wants them by
    (local expert, source). Returns both gather orders between the two layouts."""
    counts = recv_counts.long()  # [W, E_local]
    seg = torch.repeat_interleave(torch.arange(counts.numel()), counts.reshape(-1))
    source_starts = counts.reshape(-1).cumsum(0) - counts.reshape(-1)
    expert_starts = (counts.t().reshape(-1).cumsum(0) - counts.t().reshape(-1)).view(counts.t().shape).t()
    dest = expert_starts.reshape(-1)[seg] + torch.arange(seg.numel()) - source_starts[seg]
    expert_order = torch.empty_like(dest)
    expert_order[dest] = torch.arange(dest.numel())
    return host_to_device(expert_order, device), host_to_device(dest, device)


# ---- the triton backend: symmetric memory, per-source flags -----------------------------------


@dataclass
class SymmetricRoutes:
    """One rank's routes of one dispatch over symmetric memory (the triton backend)."""

    views: object              # nbytes -> the symmetric buffer views of the call's ranks
    index: int                 # this rank's position in views(...)
    table: torch.Tensor        # int32 [W, E + 1]: every rank's per-expert counts, then its T
    recv_src: torch.Tensor     # int32 [2, recv_rows]
    send_src: torch.Tensor     # int32 [2, send_rows]
    send_cap: int              # sorted rows any rank stages (the same on every rank)
    recv_cap: int              # recv_x rows any rank holds (the same on every rank)
    k: int
    max_tokens: int | None

    @property
    def num_experts(self) -> int:
        return self.table.shape[1] - 1

    @property
    def recv_rows(self) -> int:
        return self.recv_src.shape[1]

    @property
    def send_rows(self) -> int:
        return self.send_src.shape[1]


def _group_views(group, device):
    return lambda nbytes: [get_buffer(group, nbytes, device)]


def _describe(dtype, H, E, k, M) -> list[int]:
    return symmetric.describe_words(0, dtype, (H, E, k, M or 0), 0)


def _run_round(op, bufs, xs, meta, desc, pull) -> list:
    """``protocol.run_staged``, saying what the fingerprinted "shape" is on a mismatch."""
    try:
        return protocol.run_staged(op, protocol.TRITON_LAUNCHERS, bufs, xs, meta, desc, pull, graphable=True)
    except ValueError as e:
        raise ValueError(f"{e} (here: shape = (hidden size, num_experts, k, max_tokens_per_rank))") from None


def _gather_counts(views, headers: list, meta: int, desc: list[int]) -> list:
    """Every rank's header (int32 ``[E + 1]``: per-expert counts, then T) on every rank, as
    ``[W, E + 1]``: one staged round of the all-gather pull kernel (whose waits check the
    fingerprint ``meta`` of hidden size, E, k, dtype and max_tokens_per_rank). Metadata: its
    bytes are not counted as moved rows."""
    n = headers[0].numel()

    def pull(buf, staged, epoch):
        out = staged.new_empty(buf.world_size, n)
        protocol.TRITON_LAUNCHERS.all_gather_pull(out, staged, buf.pad_table, buf.rank, buf.world_size,
                                                  epoch, meta, 1, n, buf.timeout_ns,
                                                  protocol.stats_tensor(out.device))
        return out

    return _run_round(OP, views(n * 4), headers, meta, desc, pull)


def _capacity_error_from(table: torch.Tensor, max_tokens: int):
    """The error of a call whose capacity check failed (reads the table: error path only;
    the routes do not keep topk_idx, so a flagged rank is named without its ids)."""
    E = table.shape[1] - 1
    error = invalid_ids_error(OP, table[:, E], E, {})
    over = (table > max_tokens).nonzero().tolist()
    if error is not None or not over:
        return error
    src, expert = over[0]
    count = int(table[src, expert])
    return _capacity_error(max_tokens, f"rank {src} passed {count} tokens" if expert == E
                           else f"rank {src} routes {count} copies to expert {expert}")


def _pull(routes: list, rows: list, op: str, check_capacity: bool = False) -> list:
    """One staged round moving rows in direction ``op``: ``"moe_dispatch"`` stages sorted
    copies and pulls recv_x rows, ``"moe_combine"`` stages recv_x-shaped rows and pulls each
    copy's row back. One entry per rank view."""
    first = routes[0]
    dispatching = op == "moe_dispatch"
    cap = first.send_cap if dispatching else first.recv_cap
    H, dtype = rows[0].shape[1], rows[0].dtype
    bufs = first.views(max(cap, 1) * H * rows[0].element_size())
    staged = [r[:cap].contiguous() for r in rows]  # more rows only in a call its capacity check fails
    meta = symmetric.fingerprint(op, dtype, H, first.num_experts, first.k, first.max_tokens)
    by_rank = {buf.rank: r for buf, r in zip(bufs, routes)}

    def pull(buf, _staged, epoch):
        mine = by_rank[buf.rank]
        protocol.TRITON_LAUNCHERS.wait_flags(buf.pad_table, layout.READY, buf.rank, buf.world_size, epoch,
                                             buf.timeout_ns, layout.TIMEOUT_READY, meta)
        if check_capacity:
            dispatch_kernels.check_capacity(mine.table, mine.max_tokens, buf.pad_table, buf.rank, epoch)
        src = mine.recv_src if dispatching else mine.send_src
        out = rows[0].new_empty(src.shape[1], H)
        stats = protocol.stats_tensor(out.device)
        dispatch_kernels.pull_rows(out, src[0], src[1], buf.pad_table, buf.rank, stats)
        counters.record(op, "triton", stats)
        return out

    try:
        return _run_round(op, bufs, staged, meta, _describe(dtype, H, first.num_experts, first.k,
                                                            first.max_tokens), pull)
    except ValueError:  # a capacity failure: say which rank and expert
        error = _capacity_error_from(first.table, first.max_tokens) if check_capacity else None
        if error is None:
            raise
        raise error from None


@torch.library.custom_op("fusedpar::moe_pull_rows", mutates_args=())
def _moe_pull_rows_op(rows: torch.Tensor, recv_src: torch.Tensor, send_src: torch.Tensor,
                      table: torch.Tensor, group_name: str, send_cap: int, recv_cap: int, k: int,
                      max_tokens: int, op: str, check_capacity: bool) -> torch.Tensor:
    """The exchange primitive of the triton backend (one ``_pull`` round of this rank);
    ``max_tokens`` 0 = unpadded."""
    routes = SymmetricRoutes(_group_views(resolve_group(group_name), rows.device), 0, table, recv_src,
                             send_src, send_cap, recv_cap, k, max_tokens or None)
    return _pull([routes], [rows], op, check_capacity)[0]


@_moe_pull_rows_op.register_fake
def _(rows, recv_src, send_src, table, group_name, send_cap, recv_cap, k, max_tokens, op, check_capacity):
    routes = recv_src if op == "moe_dispatch" else send_src
    return rows.new_empty(routes.shape[1], rows.shape[1])


def _pull_rows_setup(ctx, inputs, output):
    _, recv_src, send_src, table, *ctx.args = inputs
    ctx.save_for_backward(recv_src, send_src, table)


def _pull_rows_backward(ctx, grad):
    """The routes are a partial permutation of rows: the adjoint is the other direction."""
    group_name, send_cap, recv_cap, k, max_tokens, op, _ = ctx.args
    other = "moe_combine" if op == "moe_dispatch" else "moe_dispatch"
    grad_rows = _moe_pull_rows_op(grad.contiguous(), *ctx.saved_tensors, group_name, send_cap, recv_cap,
                                  k, max_tokens, other, False)
    return (grad_rows,) + (None,) * 10


_moe_pull_rows_op.register_autograd(_pull_rows_backward, setup_context=_pull_rows_setup)


def _pull_op(rows, routes: SymmetricRoutes, group, op: str, check_capacity: bool = False):
    return _moe_pull_rows_op(rows, routes.recv_src, routes.send_src, routes.table, group.group_name,
                             routes.send_cap, routes.recv_cap, routes.k, routes.max_tokens or 0, op,
                             check_capacity)


class TritonDispatch(Backend):
    """Symmetric memory with per-source flags (``protocol.run_staged`` rounds):

    1. counts: every rank stages its per-expert counts (and T); one all-gather pull kernel
       waits for each source's READY flag (bounded, fingerprint of hidden size / E / k /
       dtype / max_tokens_per_rank checked: no extra collective), so every rank holds the
       whole ``[W, E + 1]`` table on the device;
    2. rows: every rank stages its expert-sorted copies; after every source's READY flag one
       kernel pulls exactly this rank's rows from the sources' buffers into recv_x, by routes
       computed on the device from the table (``kernels.moe_dispatch.routes``, one launch;
       the exchange is the custom op ``torch.ops.fusedpar.moe_pull_rows``).

    ``moe_combine`` is one round the other way (owners stage their outputs; every rank pulls
    its copies' rows back), then the weighted sum of the permutation kernels; each direction's
    backward is the other direction. Only routed rows cross ranks; the pull kernel counts
    them. Without ``max_tokens_per_rank`` the sizes of recv_x and of the staging buffers are
    read on the host from the table (one small device-to-host copy); with it nothing is read
    on the host: expert ids and capacity are checked on the device, and a violation fails the
    call on every rank when it finishes."""

    name = "triton"

    def not_supported_reasons(self, call: RoutingCall) -> list[str]:
        reasons = protocol.triton_reasons(call)
        if call.rows_dtype not in EXCHANGE_DTYPES:
            reasons.append(f"dtype {call.rows_dtype} (the exchange kernel takes float32, float16, bfloat16 "
                           "and uint8, the bytes of float8 rows)")
        return reasons

    def run(self, call: RoutingCall):
        (recv_x, per_expert, handle), = self.run_views(_group_views(call.group, call.x.device),
                                                       [dist.get_rank(call.group)], [call], call.group)
        return recv_x, per_expert, handle

    def run_views(self, views, ranks, calls, group=None):
        """``(recv_x, tokens_per_expert, handle)`` for each rank in ``ranks`` (rank r's call
        ``calls[i]``); ``views(nbytes)`` gives their symmetric buffers. With a ``group`` (one
        rank) the rows move by the differentiable custom op, else (loopback) directly."""
        first = calls[0]
        W, E, M = first.world_size, first.num_experts, first.max_tokens_per_rank
        L, k, H = E // W, first.topk_idx.shape[1], first.row_width
        sorts = [sort_by_expert(c.topk_idx, E, c.x.shape[0]) for c in calls]  # T, or the id flag
        meta = symmetric.fingerprint(OP, first.rows_dtype, H, E, k, M)
        tables = _gather_counts(views, [header for _, header in sorts], meta,
                                _describe(first.rows_dtype, H, E, k, M))
        if M is not None:
            send_rows = [c.x.shape[0] * k for c in calls]
            recv_rows = [L * W * M] * len(calls)
            send_cap, recv_cap = M * k, L * W * M
        else:  # the one host read of this backend; every rank reads the same table
            host = checked_counts(OP, tables[0].cpu(), E, {r: c.topk_idx for r, c in zip(ranks, calls)})
            per_owner = host.view(W, W, L).sum((0, 2))
            send_rows = [int(host[r].sum()) for r in ranks]
            recv_rows = [int(per_owner[r]) for r in ranks]
            send_cap, recv_cap = int(host.sum(1).max()), int(per_owner.max())
        route_tables = [dispatch_kernels.routes(table[:, :E], r, W, M, recv_rows[i], send_rows[i])
                 for i, (r, table) in enumerate(zip(ranks, tables))]
        routes = [SymmetricRoutes(views, i, table, recv_src, send_src, send_cap, recv_cap, k, M)
                  for i, (table, (recv_src, send_src, _)) in enumerate(zip(tables, route_tables))]
        if group is not None:
            (pos, _), mine = sorts[0], routes[0]
            recvs = [_pull_op(first.sorted_rows(pos, k, mine.send_rows), mine, group, OP, M is not None)]
        else:
            sorted_rows = [c.sorted_rows(pos, k, r.send_rows) for c, (pos, _), r in zip(calls, sorts, routes)]
            recvs = _pull(routes, sorted_rows, OP, M is not None)
        out = []
        for c, (pos, _), r, (*_, per_expert), recv in zip(calls, sorts, routes, route_tables, recvs):
            if M is not None:
                recv = recv.view(L, W * M, H)
            handle = MoEHandle(group, pos, k, c.x.shape[0], c.topk_weights, self.name, r.recv_rows, M,
                               routes=r)
            out.append((recv, per_expert, handle))
        return out

    @staticmethod
    def combine(y: torch.Tensor, handle: MoEHandle) -> torch.Tensor:
        back = _pull_op(y, handle.routes, handle.group, "moe_combine")
        return Unpermute.apply(back, handle.weights, handle.pos, handle.k)


# ---- float8 rows: differentiable through the exchange --------------------------------------------


class _Float8Dispatch(torch.autograd.Function):
    """``moe_dispatch(x, ..., float8=recipe)`` for a layer that trains: the fp8 rows and their
    scales travel, the output is also their dequantised values in x's dtype (exact: fp8
    times a power of 2), through which the gradient flows back as the dispatch's adjoint
    does, in x's dtype (the combine direction, unweighted)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, num_experts, group, recipe, backend):
        (data, scale), per_expert, handle = moe_dispatch(x, topk_idx, topk_weights, num_experts, group,
                                                         float8=recipe, backend=backend)
        ctx.adjoint = replace(handle, weights=torch.ones_like(topk_weights))
        ctx.mark_non_differentiable(data, scale, per_expert)
        return dequantize_float8(data, scale, x.dtype), data, scale, per_expert, handle

    @staticmethod
    def backward(ctx, grad, *_):
        return moe_combine(grad, ctx.adjoint), None, None, None, None, None, None


def float8_dispatch(x, topk_idx, topk_weights, num_experts: int, group, recipe: str, backend: str = ""):
    """``(recv, (data, scale), tokens_per_expert, handle)``: ``moe_dispatch(..., float8=recipe)``
    (unpadded) differentiable in ``x`` and, through ``moe_combine(y, handle)``, in
    ``topk_weights``: ``recv`` holds the received rows' values in x's dtype (``data * scale``),
    the gradient of ``recv`` goes back to ``x`` unquantised (as an fp8 dispatch's backward
    does in DeepEP: combine in high precision)."""
    recv, data, scale, per_expert, handle = _Float8Dispatch.apply(
        x, topk_idx, topk_weights.detach(), num_experts, group, recipe, backend)
    return recv, (data, scale), per_expert, replace(handle, weights=topk_weights)


# ---- the public functions ------------------------------------------------------------------------

TRITON = TritonDispatch()
DISPATCHER = Dispatcher(OP, [ReferenceDispatch(), TRITON])


def _default_backend(call: RoutingCall) -> str:
    """``max_tokens_per_rank`` asks for no host read: then triton, where it runs, unless
    ``FUSEDPAR_BACKEND`` forces a backend (its reasons are the same on every rank)."""
    if call.max_tokens_per_rank is None or DISPATCHER.forced_name(""):
        return ""
    return "" if TRITON.not_supported_reasons(call) else "triton"


def _check_capturable(x: torch.Tensor, max_tokens_per_rank: int | None, backend: str | None) -> None:
    """Only the triton backend with ``max_tokens_per_rank`` reads nothing on the host
    (``backend`` None: not chosen yet)."""
    reads_host = backend not in (None, "triton") or max_tokens_per_rank is None
    if isinstance(x, torch.Tensor) and symmetric.capturing(x.device) and reads_host:
        raise FusedparError(
            f"fusedpar.moe_dispatch: a CUDA graph can capture only the triton backend with "
            f"max_tokens_per_rank (got backend {backend!r}, max_tokens_per_rank="
            f"{max_tokens_per_rank}): the others read the routing counts on the host")


@eager_under_compile
def moe_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, group=None, *, max_tokens_per_rank: int | None = None,
                 float8: str | None = None, backend: str | None = None):
    """Send each token's copies to the ranks owning their experts; the same as::

        copies = [(t, e) for t in range(T) for e in topk_idx[t] if e >= 0]   # on every rank
        recv_x = rows x[t] of every rank's copies whose expert e lives here (e // E_local ==
                 rank), ordered by (local expert, source rank, token)
        tokens_per_expert[e_l] = number of those rows for local expert e_l

    ``x [T, H]``, ``topk_idx [T, k]`` (int, ``-1`` = dropped), ``topk_weights [T, k]`` (kept for
    ``moe_combine``). Returns ``(recv_x, tokens_per_expert int32 [E_local], handle)``; feed
    ``recv_x`` to a grouped GEMM with ``offs = tokens_per_expert.cumsum(0)`` and give its
    output and the handle to ``moe_combine``. Differentiable in ``x``. Only the routed
    rows cross ranks (no padding).

    ``max_tokens_per_rank=M`` (DeepEP's low-latency layout): ``recv_x`` is ``[E_local, W*M, H]``;
    expert e_l's ``tokens_per_expert[e_l]`` rows come first in ``recv_x[e_l]`` (same order as
    above), the rest are zero (a grouped GEMM over ``recv_x.view(-1, H)`` may use
    ``offs = (arange(E_local) + 1) * W * M``). Every rank must pass at most M tokens and send at
    most M copies to one expert, else every rank raises ``ValueError`` (nothing is dropped).
    On the triton backend nothing is read on the host then (sizes are fixed, expert ids and
    capacity are checked on the device, the error surfaces when the call's flags finish), so
    dispatch and combine can be captured in a CUDA graph (after one eager call, which makes
    the symmetric buffer): the buffer then keeps its epochs on the device, and a failure in
    a replay NaN-fills that replay's outputs and raises at the buffer's ``synchronize()`` or
    its next eager call. Capturing any other dispatch raises ``FusedparError``.

    ``float8="rowwise"`` (a recipe of ``fusedpar.ops.float8_scales``; its input cast must be
    rowwise): each token is cast to fp8 with its own scale (``float8_scales.quantize(x, e4m3,
    -1, round_pow2=True)``, torchao's cast of a grouped GEMM's input) and its bytes travel with
    the scale's (``H + 4`` bytes a row instead of ``2H`` in bf16; as uint8, which gloo moves);
    ``recv_x`` is then the pair ``(data fp8 [rows, H], scale fp32 [rows])`` (padded: ``[E_local,
    W*M, H]`` and ``[E_local, W*M]``, the padding's scales 0), what ``scaled_grouped_mm`` takes,
    and ``moe_combine`` sends the expert outputs back in their own dtype (bf16). The fp8 rows
    carry no gradient: ``moe_experts(..., float8=)`` is the differentiable layer. Where the
    permutation kernels run (CUDA, the interpreter) each copy is cast as it is gathered into
    the staged rows (``gather_rows_float8``: no pass of its own over x).

    Backends: ``reference`` (counts and rows by ``all_to_all_single``; the splits are read on
    the host), ``triton`` (symmetric memory with per-source flags, see ``TritonDispatch``).
    By default ``triton`` runs the calls with ``max_tokens_per_rank`` (where it can: they
    read nothing on the host) and ``reference`` the others; ``backend=`` or
    ``FUSEDPAR_BACKEND`` choose.
    Every rank passes the same hidden size, k, num_experts, dtype and max_tokens_per_rank
    (T may differ); a difference raises ``ValueError``. An expert id outside ``[-1, E)``
    raises ``ValueError`` on every rank, naming the rank that passed it: every backend checks
    the ids on the device and flags them in the exchanged counts (topk_idx is never read on
    the host), so the error comes at the host read of the counts, or (triton with M) when
    the call finishes.
    """
    _check_capturable(x, max_tokens_per_rank, backend)
    group = resolve_group(group)
    world = dist.get_world_size(group)
    check_routing(OP, x, topk_idx, topk_weights, num_experts, world, max_tokens_per_rank)
    if float8 is not None:
        float8_cast(float8)  # a recipe whose input cast can travel per token
    call = RoutingCall(x, topk_idx, topk_weights, num_experts, group, world, max_tokens_per_rank, float8)
    chosen = DISPATCHER.select(call, backend or _default_backend(call))
    _check_capturable(x, max_tokens_per_rank, chosen.name)
    recv_x, per_expert, handle = chosen.run(call)
    return (recv_x if float8 is None else unpack_float8(recv_x, float8)), per_expert, handle


@eager_under_compile
def moe_combine(y: torch.Tensor, handle: MoEHandle) -> torch.Tensor:
    """The adjoint of ``moe_dispatch``: send the expert outputs back and sum each token's
    copies weighted by its routing weights; the same as::

        out[t] = sum over j with topk_idx[t, j] >= 0 of topk_weights[t, j] * y_row(t, j)

    ``y``: one row per row of recv_x (``[rows, H']``, or recv_x's padded shape). Differentiable
    in ``y`` and ``topk_weights`` (fp32 sums). Uses the dispatch's backend.
    """
    if not isinstance(handle, MoEHandle):
        raise TypeError("fusedpar.moe_combine: handle must be the third output of moe_dispatch")
    if y.dim() not in (2, 3) or y.numel() != handle.recv_rows * y.shape[-1] or (
            y.dim() == 2 and y.shape[0] != handle.recv_rows):
        raise ValueError(f"fusedpar.moe_combine: y must be [{handle.recv_rows}, hidden] (one row "
                         f"per row of recv_x), got {tuple(y.shape)}")
    return DISPATCHER.backends[handle.backend].combine(y.reshape(handle.recv_rows, y.shape[-1]), handle)


def moe_dispatch_loopback(xs: list, topk_idxs: list, topk_weights: list, num_experts: int, *,
                          max_tokens_per_rank: int | None = None, float8: str | None = None) -> list:
    """Every rank's part of ``moe_dispatch`` in this process (rank r passes ``xs[r]``,
    ``topk_idxs[r]``, ``topk_weights[r]``) over loopback symmetric buffers with the ``triton``
    backend; returns each rank's ``(recv_x, tokens_per_expert, handle)`` (``float8``: recv_x
    the pair of fp8 rows and scales, as ``moe_dispatch``'s). Forward only: for single-device
    benchmarks and tests of the protocol; ``moe_combine_loopback`` undoes it."""
    world = len(xs)
    op = "moe_dispatch_loopback"
    if world < 1 or len(topk_idxs) != world or len(topk_weights) != world:
        raise ValueError(f"fusedpar.{op}: xs, topk_idxs and topk_weights must hold one tensor per "
                         f"simulated rank; got {len(xs)}, {len(topk_idxs)}, {len(topk_weights)}")
    first = xs[0]
    _check_capturable(first, max_tokens_per_rank, "triton")
    for r, (x, idx, w) in enumerate(zip(xs, topk_idxs, topk_weights)):
        check_routing(op, x, idx, w, num_experts, world, max_tokens_per_rank)
        if (x.shape[1], x.dtype, x.device, idx.shape[1]) != (first.shape[1], first.dtype, first.device,
                                                             topk_idxs[0].shape[1]):
            raise ValueError(f"fusedpar.{op}: rank {r} passes x {tuple(x.shape)} {x.dtype} on "
                             f"{x.device} with k={idx.shape[1]}, rank 0 x {tuple(first.shape)} "
                             f"{first.dtype} on {first.device} with k={topk_idxs[0].shape[1]}; the "
                             "hidden size, dtype, device and k must match (T may differ)")
    if float8 is not None:
        float8_cast(float8)
    calls = [RoutingCall(x, idx, w, num_experts, None, world, max_tokens_per_rank, float8)
             for x, idx, w in zip(xs, topk_idxs, topk_weights)]
    backend = DISPATCHER.select(calls[0], "triton")
    device = first.device
    with torch.no_grad():
        out = backend.run_views(lambda nbytes: get_loopback_buffers(world, nbytes, device),
                                list(range(world)), calls)
    if float8 is None:
        return out
    return [(unpack_float8(recv, float8), per_expert, handle) for recv, per_expert, handle in out]


def moe_combine_loopback(ys: list, handles: list) -> list:
    """Every rank's part of ``moe_combine`` in this process: ``ys[r]`` holds one row per row
    of rank r's recv_x, ``handles`` come from ``moe_dispatch_loopback``. Forward only."""
    if not handles or len(ys) != len(handles) or any(
            not isinstance(h, MoEHandle) or h.routes is None or h.group is not None
            or h.routes.index != r or h.routes.table.shape[0] != len(handles)
            for r, h in enumerate(handles)):
        raise ValueError("fusedpar.moe_combine_loopback: give one y per simulated rank and the "
                         "handles moe_dispatch_loopback returned, in rank order")
    for r, (y, h) in enumerate(zip(ys, handles)):
        if y.numel() != h.recv_rows * y.shape[-1] or y.shape[-1] != ys[0].shape[-1]:
            raise ValueError(f"fusedpar.moe_combine_loopback: ys[{r}] must be [{h.recv_rows}, "
                             f"{ys[0].shape[-1]}] (one row per row of recv_x), got {tuple(y.shape)}")
    with torch.no_grad():
        backs = _pull([h.routes for h in handles], [y.reshape(h.recv_rows, y.shape[-1]) for y, h in zip(ys, handles)],
                      "moe_combine")
        return [unpermute(b, h.pos, h.k, h.tokens, h.weights) for b, h in zip(backs, handles)]


# no example call for ``fusedpar info``: a dispatch exchanges routing counts over a group
register(DISPATCHER, (moe_dispatch, moe_combine, moe_dispatch_loopback, moe_combine_loopback, topk_route), checks="fusedpar.testing.moe_cases")
