"""``fusedpar.ops.matmul_reduce_scatter``: A @ B reduce-scattered over ranks along a leading
dim, the reduction hidden behind the GEMM (torch ``symm_mem.fused_matmul_reduce_scatter``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import counters, get_buffer, get_loopback_buffers, group_name, layout, resolve_group, symmetric
from ..kernels import matmul_reduce_scatter as kernels
from ..kernels import reduce_scatter as reduce_scatter_kernels
from ..kernels import signal as signal_kernels
from ..kernels.signal import sm_count
from . import protocol
from .all_gather_matmul import DISPATCHER as ALL_GATHER_MATMUL
from .all_gather_matmul import all_gather_matmul, symm_mem_reasons
from .calls import MatmulCall, check_matmul_inputs, check_scatter
from .backend import Backend, Dispatcher, Plans, autocast_inputs, autocast_off
from .registry import EXAMPLE_WORLD, register

OP = "matmul_reduce_scatter"


def _check(a, b, reduce_op, dim, world) -> int:
    dim = check_matmul_inputs(OP, a, [b], dim, "scatter_dim")
    if dim == a.dim() - 1:  # the output's columns
        check_scatter(OP, reduce_op, "reduce_op", "A @ B", b.shape[1], dim, "scatter_dim", world)
    else:
        check_scatter(OP, reduce_op, "reduce_op", "A", a.shape[dim], dim, "scatter_dim", world)
    return dim


def _scatter_columns(call: MatmulCall, backend: str) -> torch.Tensor:
    """Scattering the output's columns: ``A @ B`` scattered along its last dim is the
    transpose of ``Bᵀ @ Aᵀ`` scattered along its rows, which the backend runs (on row-major
    copies, the layouts its kernels are built for)."""
    a = call.x.flatten(0, -2)
    t = MatmulCall(OP, call.bs[0].t().contiguous(), 0, call.world_size, call.group,
                   [a.t().contiguous()], reduce_op=call.reduce_op)
    return DISPATCHER.select(t, backend).run(t).t().contiguous().view(*call.x.shape[:-1], -1)


def _out_shape(call: MatmulCall) -> list[int]:
    shape = list(call.x.shape[:-1]) + [call.bs[0].shape[1]]
    shape[call.dim] //= call.world_size
    return shape


def _chunk_out(call: MatmulCall, rows: torch.Tensor) -> torch.Tensor:
    """This rank's ``[rows, N]`` block (scattered dim first) in the caller's layout."""
    return chunk_layout(call)(rows)


def chunk_layout(call: MatmulCall):
    """``_chunk_out`` for every call of ``call``'s signature (keeping none of its tensors):
    the identity for a 2-D A scattered along dim 0."""
    if call.dim == 0 and call.x.dim() == 2:
        return lambda rows: rows
    shape, dim = _out_shape(call), call.dim
    lead = [shape[dim]] + [s for i, s in enumerate(shape[:-1]) if i != dim]
    return lambda rows: rows.view(*lead, shape[-1]).movedim(0, dim).contiguous()


class Reference(Backend):
    """One matmul, then ``dist.reduce_scatter_single`` of the product."""

    name = "reference"

    def run(self, call: MatmulCall):
        world = call.world_size
        protocol.raise_on_mismatch(call)
        product = call.rows() @ call.bs[0]  # [W * m_chunk, N]: rank r's chunk is block r
        out = torch.empty(product.numel() // world, dtype=product.dtype, device=product.device)
        protocol.reduce_scatter_single(out, product.view(-1), group=call.group)
        if call.reduce_op == "avg":  # gloo has no AVG
            out.div_(world)
        counters.record(OP, self.name, (world - 1) * out.numel() * out.element_size())
        return _chunk_out(call, out.view(product.shape[0] // world, product.shape[1]))


class Pipelined(Backend):
    """A ring reduce-scatter of the W row chunks of A @ B: at step s a rank computes the
    partial product of chunk ``(rank - s - 1) % W`` while the running sum of the previous
    chunk travels to its right neighbour; the last step leaves its own chunk. Partial sums
    add in fp32 (fp64 for fp64) and are rounded to the output dtype once per hop (as a ring collective)."""

    name = "pipelined"

    def run(self, call: MatmulCall):
        group, world = call.group, call.world_size
        rank, left, right = protocol.ring_neighbours(group)
        protocol.raise_on_mismatch(call)
        chunks = call.rows().unflatten(0, (world, -1))
        b = call.bs[0]
        divisor = world if call.reduce_op == "avg" else 1
        acc = chunks[(rank - 1) % world] @ b
        if world == 1:
            acc = acc / divisor
        incoming = torch.empty_like(acc)
        for step in range(1, world):
            requests = protocol.exchange(acc, incoming, left, right, group)
            partial = chunks[(rank - step - 1) % world] @ b
            for request in requests:
                request.wait()
            wide = torch.promote_types(partial.dtype, torch.float32)  # fp32, or fp64 for fp64
            total = partial.to(wide) + incoming.to(wide)
            if step == world - 1:
                total /= divisor
            acc = total.to(partial.dtype)
        counters.record(OP, self.name, (world - 1) * acc.numel() * acc.element_size())
        return _chunk_out(call, acc)


class Triton(Backend):
    """One persistent Triton GEMM writes A @ B into this rank's symmetric buffer, chunks in
    rank-rotated order (own chunk last); the tile that completes a chunk raises READY in
    that chunk owner's pad. Then each rank sums the W partials of its chunk in fp32, in
    rank order, rounding once, and the kernel that does closes the call (DONE to every peer,
    NaNs for a failed call): in a group on a GPU, each peer's partial is first copied into
    a local staging buffer as soon as its flag is up, in the order the peers finish them
    (``_fetch_partials``: a side stream, one single-program flag wait and a copy-engine copy
    per peer, while the GEMM leaves ``REDUCER_SMS`` SMs free), and ``reduce_chunks`` sums
    them once the own GEMM is done; on CPU and in a loopback, ``reduce_scatter_pull`` reads
    the partials where they are, after the GEMMs. Two launches per rank there. The partials
    are kept in the output dtype, so the W-1 chunks a rank reads are the lower bound of the
    traffic; the staging buffer costs (W-1)/W of the product's size. Nothing a call does
    depends on a host value a replay would freeze: it can be captured in a CUDA graph."""

    name = "triton"

    def not_supported_reasons(self, call):
        return protocol.fused_dtype_reasons(call) + protocol.triton_reasons(call)

    def run(self, call: MatmulCall):
        return self.plan(call)(call.x, call.bs)

    def plan(self, call: MatmulCall):
        """Every call of ``call``'s signature: the buffer, its views, the fingerprint and (a
        group on a GPU) the staging buffer made once."""
        a, b = call.rows(), call.bs[0]
        views = ScatterViews(call, a, b, [get_buffer(call.group, _nbytes(a, b), a.device)],
                             side_stream=a.is_cuda and call.world_size > 1)  # a group of one copies nothing
        dim, chunk_out = call.dim, chunk_layout(call)

        def run(A, Bs):
            return chunk_out(views.run([_rows(A, dim)], Bs)[0])

        return run

    def run_views(self, bufs, a_rows, bs, call: MatmulCall, side_stream: bool) -> list[torch.Tensor]:
        """Each rank view's ``[rows / W, N]`` chunk of the reduced product; ``side_stream``
        (CUDA): the copies on the side stream, overlapping the GEMMs."""
        return ScatterViews(call, a_rows[0], bs[0], bufs, side_stream).run(a_rows, bs)


def _nbytes(a_rows: torch.Tensor, b: torch.Tensor) -> int:
    return a_rows.shape[0] * b.shape[1] * a_rows.element_size()


def _rows(a: torch.Tensor, dim: int) -> torch.Tensor:
    """``MatmulCall.rows`` of ``a``: the rows with ``dim`` first, as ``[rows, K]``."""
    return a if dim == 0 and a.dim() == 2 else a.movedim(dim, 0).flatten(0, -2)


class ScatterViews:
    """The triton backend's calls of one signature on one set of rank views (one, or W in a
    loopback): the views of each rank's partials, the fingerprint, the GEMM's config and, with
    a side stream, the staging buffers, made once. ``a`` ``[rows, K]`` and ``b`` ``[K, N]``:
    a call's GEMM operands (rows in chunk order), which ``run`` takes per rank view.

    ``scaled`` (scaled_matmul_reduce_scatter): fp8 operands whose scales the GEMM applies in
    its epilogue (``run``'s ``scales``), float32 partials (the lower bound of what moves is
    then W-1 float32 chunks) summed in float32 and rounded once to ``out_dtype``: by
    ``reduce_chunks`` itself, or after the pull (which reads and writes the partials'
    dtype) by one cast."""

    def __init__(self, call: MatmulCall, a: torch.Tensor, b: torch.Tensor, bufs, side_stream: bool, *,
                 scaled: bool = False, out_dtype: torch.dtype | None = None):
        n, world = b.shape[1], call.world_size
        self.op, self.world, self.n = call.op, world, n
        self.m_chunk = a.shape[0] // world
        self.dtype = torch.float32 if scaled else a.dtype  # the partials'
        self.out_dtype = out_dtype or self.dtype
        self.device = a.device
        self.meta, self.desc = call.fingerprint(), call.description()
        self.divisor = float(world) if call.reduce_op == "avg" else 1.0
        self.rows = a.shape[0]
        self.bind(bufs)
        self.side = protocol.side_stream(a.device) if side_stream else None
        # the GEMM leaves the side stream's flag waits an SM (DESIGN: grid <= SMs - k)
        sms = sm_count(a.device) - kernels.REDUCER_SMS if side_stream else None
        self.stages = [torch.empty(world - 1, self.m_chunk * n, dtype=self.dtype, device=a.device)
                       for _ in bufs] if side_stream else None
        self.gemm = kernels.ScatterLaunch(a, b, world, sms, scaled)
        self.timeout_ns = bufs[0].timeout_ns  # a plan lives until the settings change

    def bind(self, bufs) -> None:
        """Use ``bufs``: each rank's partials are its data region's first rows x N."""
        self.bufs = bufs
        self.partials = [buf.data(self.dtype, self.rows * self.n).view(self.rows, self.n) for buf in bufs]

    def run(self, a_rows, bs, scales=None) -> list[torch.Tensor]:
        """Each rank view's ``[rows / W, N]`` chunk of the reduced product, in ``out_dtype``;
        ``scales``: per rank view, the GEMM's ``(sa, stride_sa, sb, stride_sb)`` (scaled)."""
        world, n, m_chunk = self.world, self.n, self.m_chunk
        if m_chunk == 0 or n == 0:  # an empty result (every rank's: shapes agree), no exchange
            return [torch.empty(m_chunk, n, dtype=self.out_dtype, device=self.device) for _ in self.bufs]
        if not self.bufs[0].live:  # a group's buffer grown since: its successor
            self.bind([symmetric.follow(self.bufs[0])])
        side = self.side
        main = torch.cuda.current_stream(self.device) if side is not None else None
        epochs = [buf.next_epoch(graphable=True) for buf in self.bufs]
        for i, (buf, a, b, epoch) in enumerate(zip(self.bufs, a_rows, bs, epochs)):
            buf.publish(self.desc)  # the GEMM publishes the fingerprint
            if side is not None:
                side.wait_stream(main)  # before the GEMM launch: the copies overlap it
            self.gemm(a, b, self.partials[i], buf.pad_table, buf.rank, epoch, self.meta, self.timeout_ns,
                      None if scales is None else scales[i])
            if side is not None:
                with torch.cuda.stream(side):
                    _fetch_partials(buf, self.stages[i], epoch, self.meta, self.partials[i])
        if side is not None:
            main.wait_stream(side)
        outs = []
        for i, (buf, epoch) in enumerate(zip(self.bufs, epochs)):
            if side is not None:
                out = torch.empty(m_chunk, n, dtype=self.out_dtype, device=self.device)
                own = self.partials[i].view(world, -1)[buf.rank]
                kernels.reduce_chunks(out, own, self.stages[i], buf.pad_table, buf.rank, world,
                                      epoch, self.divisor)
                counters.record(self.op, "triton", (world - 1) * own.numel() * own.element_size())
            else:
                out = torch.empty(m_chunk, n, dtype=self.dtype, device=self.device)
                stats = protocol.stats_tensor(self.device)
                reduce_scatter_kernels.reduce_scatter_pull(
                    out, buf.pad_table, buf.rank, world, epoch, self.meta, 1, m_chunk * n,
                    self.timeout_ns, stats, self.divisor, ends_call=True)
                counters.record(self.op, "triton", stats)
                if self.out_dtype != self.dtype:  # the float32 sums, rounded once
                    out = out.to(self.out_dtype)
            outs.append(out)
        for buf in self.bufs:
            buf.finish(self.op)
        return outs


def _fetch_partials(buf, stage: torch.Tensor, epoch: int, meta: int, partials: torch.Tensor) -> None:
    """Copy each peer's partial of this rank's chunk (in its data region, laid out as our
    ``partials``) into ``stage`` row ``j`` for peer ``(rank - 1 - j) % W``: the order in
    which the peers' GEMMs finish it. Each copy waits for the peer's READY flag and checks
    its fingerprint first (a one-program kernel). A copy cannot be made conditional on a
    device value, so after a failed wait it brings unsynchronised rows: ``reduce_chunks``
    NaN-fills the output."""
    rank, world = buf.rank, buf.world_size
    for j in range(world - 1):
        src = (rank - 1 - j) % world
        signal_kernels.wait_flags(buf.pad_table, layout.READY, rank, world, epoch, buf.timeout_ns,
                                  layout.TIMEOUT_READY, meta, only=src)
        stage[j].copy_(buf.data(stage.dtype, partials.numel(), rank=src).view(world, -1)[rank])


class SymmMem(Backend):
    """torch's async-TP op ``torch.ops.symm_mem.fused_matmul_reduce_scatter`` (same schema)."""

    name = "symm_mem"

    def not_supported_reasons(self, call):
        return symm_mem_reasons(call, "fused_matmul_reduce_scatter")

    def run(self, call: MatmulCall):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(
            call.x, call.bs[0], call.reduce_op, call.dim, call.group.group_name).contiguous()


DISPATCHER = Dispatcher(OP, [Triton(), Pipelined(), Reference(), SymmMem()])  # vendor's last
PLANS = Plans(OP)


@torch.library.custom_op("fusedpar::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int,
                              group_name: str, backend: str) -> torch.Tensor:
    key = (A.shape, A.stride(), A.dtype, A.device, B.shape, B.stride(), B.dtype, reduce_op,
           scatter_dim, group_name, backend)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.make(key, A.device, lambda: _plan(A, B, reduce_op, scatter_dim, group_name, backend))
    return plan(A, [B])


def _plan(A, B, reduce_op, scatter_dim, group_name, backend):
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    call = MatmulCall(OP, A, _check(A, B, reduce_op, scatter_dim, world), world, group, [B],
                      reduce_op=reduce_op)
    if not call.last_dim:
        return DISPATCHER.select(call, backend).plan(call)
    make = call.maker()
    return lambda A, Bs: _scatter_columns(make(A, Bs), backend)


@_matmul_reduce_scatter_op.register_fake
def _(A, B, reduce_op, scatter_dim, group_name, backend):
    world = dist.get_world_size(resolve_group(group_name))
    dim = _check(A, B, reduce_op, scatter_dim, world)
    return A.new_empty(_out_shape(MatmulCall(OP, A, dim, world, None, [B])))


def _setup_context(ctx, inputs, output):
    a, b, ctx.reduce_op, ctx.dim, ctx.group_name, ctx.backend = inputs
    ctx.save_for_backward(a, b)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    if ctx.reduce_op == "avg":
        grad = grad / dist.get_world_size(resolve_group(ctx.group_name))
    grad_gathered, (grad_a,) = all_gather_matmul(
        grad, [b.t()], ctx.dim, ctx.group_name, return_A=True,
        backend=ALL_GATHER_MATMUL.carry(ctx.backend))
    grad_b = a.flatten(0, -2).t() @ grad_gathered.flatten(0, -2)
    return grad_a, grad_b, None, None, None, None


_matmul_reduce_scatter_op.register_autograd(_backward, setup_context=_setup_context)


def matmul_reduce_scatter_loopback(As: list[torch.Tensor], Bs: list[torch.Tensor],
                                   reduce_op: str = "sum", scatter_dim: int = 0, *,
                                   side_stream: bool = False) -> list[torch.Tensor]:
    """Every rank's part of ``matmul_reduce_scatter`` in this process (rank r multiplies
    ``As[r]`` by ``Bs[r]``) over a loopback buffer with the ``triton`` backend; returns each
    rank's output. For single-device benchmarks and tests of the protocol.

    The peers' partials are copied in stream order after every rank's GEMM, or with
    ``side_stream`` (CUDA) as a group call copies them: on the side stream while the GEMMs
    run (a rank's copies wait there for the GEMMs of the ranks after it, which never wait)."""
    if not As or len(As) != len(Bs):
        raise ValueError(f"fusedpar.{OP}_loopback: As and Bs must hold one tensor per simulated rank")
    if side_stream and not As[0].is_cuda:
        raise ValueError(f"fusedpar.{OP}_loopback: side_stream=True needs CUDA tensors (the copy "
                         f"engine); As are on {As[0].device}")
    world = len(As)
    for r, (a, b) in enumerate(zip(As, Bs)):
        if (a.shape, b.shape, a.dtype, a.device) != (As[0].shape, Bs[0].shape, As[0].dtype, As[0].device):
            raise ValueError(f"fusedpar.{OP}_loopback: As[{r}] / Bs[{r}] differ from As[0] / Bs[0]")
    dim = _check(As[0], Bs[0], reduce_op, scatter_dim, world)
    call = MatmulCall(OP, As[0], dim, world, None, [Bs[0]], reduce_op=reduce_op)
    if call.last_dim:
        raise ValueError(f"fusedpar.{OP}_loopback: scatter_dim={scatter_dim} is the output's "
                         "last dim; the loopback runs the fused row scatter only (scatter a leading dim)")
    backend = DISPATCHER.select(call, "triton")
    rows = [MatmulCall(OP, a, dim, world, None, [b]).rows() for a, b in zip(As, Bs)]
    nbytes = rows[0].shape[0] * Bs[0].shape[1] * rows[0].element_size()
    bufs = get_loopback_buffers(world, nbytes, As[0].device)
    return [_chunk_out(call, out) for out in backend.run_views(bufs, rows, Bs, call, side_stream)]


def matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str = "sum",
                          scatter_dim: int = 0, group=None, *, backend: str | None = None):
    """Multiply ``A`` by ``B`` and reduce-scatter the product along ``scatter_dim``; the
    same as::

        fusedpar.ops.reduce_scatter(A @ B, reduce_op, scatter_dim, group)
        # = (sum over ranks of A_r @ B_r).chunk(W, scatter_dim)[rank]   ("avg": / W)

    ``A``: 2-D or 3-D ``[..., K]`` (K is this rank's shard of the contraction); ``B``:
    ``[K, N]``; the output's ``scatter_dim`` (a leading dim of A, or the last: N's columns)
    divisible by the world size. The output is contiguous, as torch's. fp32, fp16 or
    bf16. Backends: ``triton``, ``pipelined``, ``reference``, ``symm_mem`` (torch's
    ``fused_matmul_reduce_scatter`` itself, CUDA groups only). Differentiable:
    ``dA = all_gather_matmul(dY, Bᵀ)`` and ``dB = Aᵀ all_gather(dY)``. Under
    ``torch.autocast``, A and B are cast to its dtype first, as ``torch.matmul``'s inputs are.
    """
    A, B = autocast_inputs(A, B)
    with autocast_off(A):
        return _matmul_reduce_scatter_op(A, B, reduce_op, scatter_dim, group_name(group),
                                         backend or "")


register(DISPATCHER, (matmul_reduce_scatter, matmul_reduce_scatter_loopback),
         checks="fusedpar.testing.matmul",
         example=lambda device: MatmulCall(
             OP, torch.zeros(2 * EXAMPLE_WORLD, 8, device=device), 0, EXAMPLE_WORLD, None,
             [torch.zeros(8, 4, device=device)], reduce_op="sum"))
