"""Rank-side helpers shared by the all_gather and reduce_scatter tests (run inside workers)."""

import contextlib
import os

import torch
import torch.distributed as dist

import fusedpar
from fusedpar.comm import get_buffer, settings
from fusedpar.ops import registry
from fusedpar.ops.float8_scales import CPU_SCALED_MM_TAKES_ROWS
from fusedpar.testing.collectives import demo_input

import pytest

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
#: torchao's rowwise recipes and torch's rowwise ``_scaled_mm`` (an oracle) on CPU
cpu_row_scales = pytest.mark.skipif(not CPU_SCALED_MM_TAKES_ROWS, reason=f"torch {torch.__version__}'s CPU "
                                    "_scaled_mm takes no rowwise scales (2.14's does)")


def rank_data(shape, dtype, rank, salt=0, transposed=False):
    """Small integers (exact in every dtype, sums too) that encode the rank and position:
    ``fusedpar check``'s all_gather input. ``transposed``: a non-contiguous input of the same
    shape (the transpose of ``shape[::-1]``'s data) where it has two dims or more."""
    if transposed and len(shape) > 1:
        return rank_data(shape[::-1], dtype, rank, salt).transpose(0, -1)
    return demo_input("all_gather", shape, dtype, rank, 0, salt, "cpu")  # world: unused here


def cpu_backends(op: str) -> list[str]:
    """``op``'s backends (the registry's, in priority order) but the CUDA extension's, which
    needs CUDA tensors, and torch's own kernels as backends (``torch``: it refuses the odd
    shapes these tests use; ``symm_mem``: CUDA only; each has tests of its own)."""
    return [name for name in registry.get(op).backends if name not in ("cuda", "torch", "symm_mem")]


def capture_errors(calls: dict) -> dict:
    """``{name: (exception type name, message) or None}`` for each zero-argument call."""
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - the tests inspect type and message
            errors[name] = (type(e).__name__, str(e))
    return errors


def interpreter_cast_slack(exact: torch.Tensor, dtype: torch.dtype, backend: str) -> float:
    """The Triton interpreter rounds fp32 -> bf16 by truncation (up to 1 ulp = 2^-7 of the
    value, where a GPU rounds to nearest): the extra error a triton result may carry here."""
    from fusedpar.kernels.interpreter import interpreting

    if backend == "triton" and dtype == torch.bfloat16 and interpreting():
        return float(exact.abs().max()) / 128
    return 0.0


def poison_symmetric(group, nbytes, device="cpu"):
    """Fill this rank's symmetric data region with NaN bytes so stale data cannot pass. The
    barrier first: a peer may still be reading the region for the previous call (the fill
    bypasses the protocol's wait before restaging; on a GPU, once every rank's kernels ended)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=group)
    buf = get_buffer(group, nbytes, torch.device(device))
    buf.data(torch.uint8, buf.capacity).fill_(0xFF)


def check_exact(group, x, call, expected, moved, case):
    """``call()`` (a collective of ``x`` over ``group``), with this rank's symmetric region
    and new allocations poisoned, returns exactly ``expected`` (dtype, shape and values:
    ``case`` names the case) and counts ``moved`` bytes sent."""
    poison_symmetric(group, 4 * x.numel() * x.element_size())
    with poisoned_allocations(), fusedpar.comm.count_bytes() as counter:
        out = call()
    assert out.dtype == expected.dtype and out.shape == expected.shape, (out.shape, expected.shape)
    assert torch.equal(out, expected), case
    assert counter.total() == moved


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty returns NaN / INT_MAX-filled memory: outputs a kernel skips cannot pass."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@contextlib.contextmanager
def env(**values):
    """Environment variables set for the block, and fusedpar's settings read again (they are
    read once: ``fusedpar.comm.settings``) on entering and leaving it."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    settings.refresh()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        settings.refresh()


@contextlib.contextmanager
def debug_level(level=dist.DebugLevel.DETAIL):
    """torch.distributed's debug level (what ``TORCH_DISTRIBUTED_DEBUG`` sets when torch is
    imported) at ``level``; at DETAIL the reference and pipelined backends check every call's
    inputs across ranks (``protocol.raise_on_mismatch``)."""
    old = dist.get_debug_level()
    dist.set_debug_level(level)
    try:
        yield
    finally:
        dist.set_debug_level(old)


def chosen_backend(op, x, dim, group, **extra):
    """The backend op ``op``'s dispatcher picks for this call."""
    from fusedpar.ops.calls import CollectiveCall

    call = CollectiveCall(op, x, dim % x.dim(), dist.get_world_size(group), group, **extra)
    return fusedpar.ops.registry.get(op).dispatcher.select(call).name


def subgroup():
    """A fresh group over all ranks: its symmetric buffer starts clean."""
    return dist.new_group(list(range(dist.get_world_size())))


def timeout_case(op, stall_rank, mode, timeout_s):
    """``stall_rank`` sleeps (``mode="stall"``) or exits (``mode="die"``) instead of calling
    ``op``; every other rank must fail with FusedparTimeoutError within the timeout."""
    import time

    group = subgroup()
    x = torch.ones(4 * dist.get_world_size(), 3)
    op(x, group)  # a healthy call first (default timeout): the buffer exists on every rank
    dist.barrier()  # ... and every rank has finished it
    with env(FUSEDPAR_TIMEOUT=timeout_s):
        rank = dist.get_rank()
        if rank == stall_rank:
            if mode == "die":
                os._exit(3)
            # away past the others' deadline (it never makes the call either way; longer
            # only made the test wait for it)
            time.sleep(timeout_s * 1.2)
            return None
        start = time.monotonic()
        try:
            op(x, group)
        except fusedpar.FusedparTimeoutError as e:
            return {"elapsed": time.monotonic() - start, "message": str(e)}
        raise AssertionError("the op returned although a peer never called it")


def stalled_peer_error(pools, op, timeout_s=2.0) -> str:
    """Rank 1 of two never makes its second ``op`` call (``timeout_case``): rank 0 must give
    up within 3x the timeout and raise naming READY[1] (no hang, no wrong result). Returns
    rank 0's message."""
    results = pools(2).run(timeout_case, op, 1, "stall", timeout_s)
    assert results[1] is None
    assert results[0]["elapsed"] < 3 * timeout_s, results[0]
    assert "READY[1]" in results[0]["message"], results[0]
    return results[0]["message"]


def _frozen(value):
    """What a launch freezes of a non-tensor argument: a TMA descriptor's layout (its base
    address is frozen as a tensor's is), any other value itself."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, TensorDescriptor):
        return ("TensorDescriptor", tuple(value.shape), tuple(value.strides), tuple(value.block_shape),
                value.padding)
    return value


@contextlib.contextmanager
def scalar_arguments(launchers=None):
    """Record the non-tensor arguments of launches, in order: what a CUDA graph freezes at
    capture (tensors are frozen as addresses, which a graph's memory pool keeps).

    ``launchers``: ``[(owner, name)]``, launcher functions to patch; each record is the tuple
    of one call's non-tensor arguments. None: every Triton kernel launch (in the interpreter,
    so CPU only); each record is ``(kernel name, grid, ((argument, value), ...))``, constexprs
    and launch options (``num_warps``) included, a TMA descriptor as its layout (``_frozen``)."""
    launches = []
    if launchers is None:
        from triton.runtime.interpreter import InterpretedFunction

        from fusedpar.kernels.interpreter import interpreting

        assert interpreting(), "scalar_arguments() records Triton launches in the interpreter only"
        run = InterpretedFunction.run

        def run_and_record(self, *args, grid, warmup, **kwargs):
            named = [*zip(self.arg_names, args), *kwargs.items()]
            if callable(grid):
                grid = grid(dict(named))
            launches.append((self.fn.__name__, tuple(grid),
                             tuple((k, _frozen(v)) for k, v in named if not isinstance(v, torch.Tensor))))
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

        saved = [(InterpretedFunction, "run", run)]
        InterpretedFunction.run = run_and_record
    else:
        def recording(launch):
            def launch_and_record(*args, **kwargs):
                launches.append(tuple(a for a in [*args, *kwargs.values()]
                                      if not isinstance(a, torch.Tensor)))
                return launch(*args, **kwargs)
            return launch_and_record

        saved = [(owner, name, getattr(owner, name)) for owner, name in launchers]
        for owner, name, launch in saved:
            setattr(owner, name, recording(launch))
    try:
        yield launches
    finally:
        for owner, name, launch in saved:
            setattr(owner, name, launch)


def captured(step):
    """``(graph, outputs)``: ``step()`` captured in a CUDA graph after a warm-up call on a side
    stream (as torch advises); replaying the graph refills the captured outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
