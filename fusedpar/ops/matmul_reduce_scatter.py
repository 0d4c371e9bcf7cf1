"""``fusedpar.ops.matmul_reduce_scatter``: A @ B reduce-scattered over ranks along a leading
dim, the reduction hidden behind the GEMM (torch ``symm_mem.fused_matmul_reduce_scatter``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import counters, get_buffer, get_loopback_buffers, group_name, layout, resolve_group
from ..kernels import matmul_reduce_scatter as kernels
from ..kernels import signal as signal_kernels
from ..kernels.signal import sm_count
from . import protocol as C
from .all_gather_matmul import DISPATCHER as ALL_GATHER_MATMUL
from .all_gather_matmul import all_gather_matmul, symm_mem_reasons
from .calls import MatmulCall, check_matmul_inputs, check_scatter
from .backend import Backend, Dispatcher, autocast_inputs, autocast_off
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
    shape = _out_shape(call)
    lead = [shape[call.dim]] + [s for i, s in enumerate(shape[:-1]) if i != call.dim]
    return rows.view(*lead, shape[-1]).movedim(0, call.dim).contiguous()


class Reference(Backend):
    """One matmul, then ``dist.reduce_scatter_single`` of the product."""

    name = "reference"

    def run(self, call: MatmulCall):
        world = call.world_size
        C.raise_on_mismatch(call)
        product = call.rows() @ call.bs[0]  # [W * m_chunk, N]: rank r's chunk is block r
        out = torch.empty(product.numel() // world, dtype=product.dtype, device=product.device)
        C.reduce_scatter_single(out, product.view(-1), group=call.group)
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
        rank, left, right = C.ring_neighbours(group)
        C.raise_on_mismatch(call)
        chunks = call.rows().unflatten(0, (world, -1))
        b = call.bs[0]
        divisor = world if call.reduce_op == "avg" else 1
        acc = chunks[(rank - 1) % world] @ b
        if world == 1:
            acc = acc / divisor
        incoming = torch.empty_like(acc)
        for step in range(1, world):
            requests = C.exchange(acc, incoming, left, right, group)
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
    that chunk owner's pad. Meanwhile each peer's partial of this rank's chunk is copied
    into a local staging buffer as soon as its flag is up, in the order the peers finish
    them (``_fetch_partials``: on a GPU in a group, a side stream, one single-program flag
    wait and a copy-engine copy per peer, while the GEMM leaves ``REDUCER_SMS`` SMs free;
    on CPU and in a loopback, in stream order after the GEMMs). Once the own GEMM is done
    one pass sums the W partials in fp32, in rank order, rounding once. The partials are
    kept in the output dtype, so the W-1 chunks a rank copies are the lower bound of the
    traffic; the staging buffer costs (W-1)/W of the product's size."""

    name = "triton"

    def not_supported_reasons(self, call):
        return C.fused_dtype_reasons(call) + C.triton_reasons(call)

    def run(self, call: MatmulCall):
        a = call.rows()
        nbytes = a.shape[0] * call.bs[0].shape[1] * a.element_size()
        buf = get_buffer(call.group, nbytes, a.device)
        side_stream = a.is_cuda and call.world_size > 1  # a group of one copies nothing
        return _chunk_out(call, self.run_views([buf], [a], call.bs, call, side_stream)[0])

    def run_views(self, bufs, a_rows, bs, call: MatmulCall, side_stream: bool) -> list[torch.Tensor]:
        """Each rank view's ``[rows / W, N]`` chunk of the reduced product; ``side_stream``
        (CUDA): the copies on the side stream, overlapping the GEMMs."""
        world, meta = call.world_size, call.fingerprint()
        m, n = a_rows[0].shape[0], bs[0].shape[1]
        m_chunk = m // world
        divisor = float(world) if call.reduce_op == "avg" else 1.0
        dtype, device = a_rows[0].dtype, a_rows[0].device
        if m_chunk == 0 or n == 0:  # an empty result (every rank's: shapes agree), no exchange
            return [torch.empty(m_chunk, n, dtype=dtype, device=device) for _ in bufs]
        main = torch.cuda.current_stream(device) if side_stream else None
        side = C.side_stream(device) if side_stream else None
        # the GEMM leaves the side stream's flag waits an SM (DESIGN: grid <= SMs - k)
        config = ({"NUM_PROGRAMS": sm_count(device) - kernels.REDUCER_SMS}
                  if side_stream else None)
        epochs = [buf.next_epoch() for buf in bufs]
        partials, stages = [], []
        for buf, a, b, epoch in zip(bufs, a_rows, bs, epochs):
            C.wait_peers_done(C.TRITON_LAUNCHERS, buf, epoch)  # nobody reads our last partials
            kernels.reset_chunk_counters(buf.pad(), world)
            buf.publish(call.description(), meta)
            partials.append(buf.data(dtype, m * n).view(world, m_chunk * n))
            stages.append(torch.empty(world - 1, m_chunk * n, dtype=dtype, device=device))
            if side is not None:
                side.wait_stream(main)  # before the GEMM launch: the copies overlap it
            kernels.matmul_reduce_scatter(a, b, partials[-1].view(m, n), buf.pad_table, buf.rank, world,
                                    epoch, config=config)
            if side is not None:
                with torch.cuda.stream(side):
                    _fetch_partials(buf, stages[-1], epoch, meta, m * n)
        if side is not None:
            main.wait_stream(side)
        outs = []
        for buf, own, stage, epoch in zip(bufs, partials, stages, epochs):
            if side is None:
                _fetch_partials(buf, stage, epoch, meta, m * n)
            out = torch.empty(m_chunk, n, dtype=dtype, device=device)
            kernels.reduce_chunks(out, own[buf.rank], stage, buf.rank, world, divisor)
            counters.record(OP, self.name, stage.numel() * stage.element_size())
            outs.append(out)
        C.release(C.TRITON_LAUNCHERS, bufs, epochs, OP, outs)
        return outs


def _fetch_partials(buf, stage: torch.Tensor, epoch: int, meta: int, numel: int) -> None:
    """Copy each peer's partial of this rank's chunk (in its data region of ``numel``
    elements) into ``stage`` row ``j`` for peer ``(rank - 1 - j) % W``: the order in which
    the peers' GEMMs finish it. Each copy waits for the peer's READY flag and checks its
    fingerprint first (a one-program kernel). A copy cannot be made conditional on a
    device value, so after a failed wait it brings unsynchronised rows: ``release``
    NaN-fills the output."""
    rank, world = buf.rank, buf.world_size
    for j in range(world - 1):
        src = (rank - 1 - j) % world
        signal_kernels.wait_flags(buf.pad_table, layout.READY, rank, world, epoch, buf.timeout_ns,
                                  layout.TIMEOUT_READY, meta, only=src)
        stage[j].copy_(buf.data(stage.dtype, numel, rank=src).view(world, -1)[rank])


class SymmMem(Backend):
    """torch's async-TP op ``torch.ops.symm_mem.fused_matmul_reduce_scatter`` (same schema)."""

    name = "symm_mem"

    def not_supported_reasons(self, call):
        return symm_mem_reasons(call, "fused_matmul_reduce_scatter")

    def run(self, call: MatmulCall):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(
            call.x, call.bs[0], call.reduce_op, call.dim, call.group.group_name).contiguous()


DISPATCHER = Dispatcher(OP, [Triton(), Pipelined(), Reference(), SymmMem()])  # vendor's last


@torch.library.custom_op("fusedpar::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int,
                              group_name: str, backend: str) -> torch.Tensor:
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    dim = _check(A, B, reduce_op, scatter_dim, world)
    call = MatmulCall(OP, A, dim, world, group, [B], reduce_op=reduce_op)
    if call.last_dim:
        return _scatter_columns(call, backend)
    return DISPATCHER.select(call, backend).run(call)


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
