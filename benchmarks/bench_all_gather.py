"""all_gather: fusedpar backends next to what a user would pick instead (DESIGN.md §6).

* ``test_loopback`` (one GPU, no torchrun): every rank of a W=8 all_gather in one process
  over a loopback symmetric buffer, against ``torch.cat`` of the W shards once per simulated
  rank (the same W outputs): the fused protocol's overhead over a plain device copy.
* ``test_torchrun`` (``torchrun --nproc-per-node N -m pytest benchmarks``): each backend
  against raw NCCL ``all_gather_into_tensor`` and torch ``symm_mem`` all-gathers.
* ``test_loopback_volume_is_the_lower_bound``: not a timing; runs on CPU too.

``shape`` is the per-rank shard; the gather is along dim 0. Each case checks its result
once before it is timed; do_bench quantiles go to ``results/all_gather.csv``.
"""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.errors import BackendNotSupportedError

OP = "all_gather"
W_LOOPBACK = 8
DTYPE = torch.bfloat16
SHAPES = [(4096, 8192), (1024, 8192), (1000, 4104)]  # per-rank shard
PEDANTIC = dict(rounds=10, warmup_rounds=2, iterations=1)  # fixed: identical on every rank

# torch 2.13+ names it all_gather_single; older ones all_gather_into_tensor
_nccl_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _name(shape) -> str:
    return "x".join(map(str, shape))


def _shard(shape, rank, device, dtype=DTYPE, seed=0) -> torch.Tensor:
    """Rank ``rank``'s input, reproducible on any rank; offset by the rank (provenance)."""
    g = torch.Generator(device=device)
    g.manual_seed(7919 * seed + rank)
    return (torch.randn(shape, generator=g, device=device) + rank).to(dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


# ---- single GPU: loopback --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "cuda", "torch.cat"])
@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_loopback(benchmark, gpu, gpu_times, record_row, synced, shape, backend):
    world = W_LOOPBACK
    benchmark.group = f"{OP} {_name(shape)} bf16 loopback W={world}"
    xs = [_shard(shape, r, gpu) for r in range(world)]
    expected = torch.cat(xs, 0)
    bytes_moved = None
    if backend == "torch.cat":
        def fn():
            return [torch.cat(xs, 0) for _ in range(world)]  # one output per simulated rank
        outs = fn()
    else:
        def fn():
            return fusedpar.ops.all_gather_loopback(xs, 0, backend=backend)
        try:
            with fusedpar.comm.count_bytes() as counter:
                outs = fn()
        except BackendNotSupportedError as e:
            pytest.skip(str(e))
        bytes_moved = counter.total()
    assert len(outs) == world
    for rank, out in enumerate(outs):
        assert torch.equal(out, expected), f"simulated rank {rank}: wrong gathered tensor"
    del outs

    median, p20, p80 = gpu_times(fn)
    record_row(OP, backend, shape, DTYPE, world, median, p20, p80,
               algo_bytes=world * _nbytes(expected), bytes_moved=bytes_moved,
               lower_bound=world * (world - 1) * _nbytes(xs[0]), mode="loopback")
    benchmark.extra_info.update(do_bench_median_ms=median, p20_ms=p20, p80_ms=p80)
    benchmark.pedantic(synced(fn), **PEDANTIC)


# ---- several GPUs: torchrun ------------------------------------------------------------------


def _case(backend, x, group):
    """``(fn, note)`` for one case; raises ``_Unavailable`` with the reason it cannot run."""
    world = dist.get_world_size(group)
    if backend in ("reference", "triton", "cuda"):
        return (lambda: fusedpar.ops.all_gather(x, 0, group, backend=backend)), "fusedpar"
    out_shape = (world * x.shape[0], *x.shape[1:])
    if backend == "nccl":
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)

        def nccl():
            _nccl_all_gather(out, x, group=group)
            return out
        return nccl, f"dist.{_nccl_all_gather.__name__}"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        raise _Unavailable(f"torch.distributed._symmetric_memory: {e}") from e
    op_name = backend.removeprefix("symm_mem.")
    if not hasattr(torch.ops.symm_mem, op_name):
        raise _Unavailable(f"torch {torch.__version__} has no torch.ops.symm_mem.{op_name}")
    op = getattr(torch.ops.symm_mem, op_name)
    if op_name == "multimem_all_gather_out":  # NVLS multicast; the output lives in symm memory
        out = symm_mem.empty(out_shape, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(out, group.group_name)
        return (lambda: op(x, group.group_name, out)), "output in symm_mem; needs multicast"
    # copy engine pull from a symm_mem workspace; the result is ready after wait_tensor
    return (lambda: torch.ops._c10d_functional.wait_tensor(op(x, group.group_name))), \
        "copy-engine pull"


class _Unavailable(Exception):
    pass


DIST_BACKENDS = ["reference", "triton", "cuda", "nccl", "symm_mem.multimem_all_gather_out",
                 "symm_mem._low_contention_all_gather"]


@pytest.mark.parametrize("backend", DIST_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_torchrun(benchmark, dist_gpu, gpu_times, record_row, agree, synced, shape, backend):
    group, device = dist_gpu
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    benchmark.group = f"{OP} {_name(shape)} bf16 W={world}"
    x = _shard(shape, rank, device)
    expected = torch.cat([_shard(shape, r, device) for r in range(world)], 0)
    reason, out, bytes_moved = None, None, None
    try:
        fn, note = _case(backend, x, group)
        with fusedpar.comm.count_bytes() as counter:
            out = fn()
        torch.cuda.synchronize()
        if note == "fusedpar":
            bytes_moved = counter.total()
    except (_Unavailable, BackendNotSupportedError) as e:
        reason = f"{backend}: {_first_line(e)}"
    except RuntimeError as e:  # torch's symm_mem ops refuse what the machine lacks (multicast)
        if not backend.startswith("symm_mem."):
            raise
        reason = f"{backend}: {_first_line(e)}"
    if not agree(reason is None):
        pytest.skip(reason or f"{backend} cannot run on another rank")
    assert agree(torch.equal(out, expected)), f"{backend}: wrong gathered tensor on some rank"

    median, p20, p80 = gpu_times(fn)
    record_row(OP, backend, shape, DTYPE, world, median, p20, p80,
               algo_bytes=_nbytes(expected), bytes_moved=bytes_moved,
               lower_bound=(world - 1) * _nbytes(x), mode="torchrun", impl=note)
    benchmark.extra_info.update(do_bench_median_ms=median, p20_ms=p20, p80_ms=p80)
    benchmark.pedantic(synced(fn), **PEDANTIC)


# ---- communication volume (no timing; CPU too) -----------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("shape,dim,dtype", [((5, 7), 0, torch.bfloat16),
                                             ((3, 5, 2), 1, torch.float32),
                                             ((1, 9), -1, torch.int32)],
                         ids=["5x7-dim0-bf16", "3x5x2-dim1-fp32", "1x9-dim-1-int32"])
def test_loopback_volume_is_the_lower_bound(local_device, shape, dim, dtype, backend):
    """Each of the W simulated ranks receives (W-1)/W of the gathered tensor: nothing more."""
    world = W_LOOPBACK
    xs = [_shard(shape, r, local_device, torch.float32, seed=1).mul(4).round().to(dtype)
          for r in range(world)]
    try:
        with fusedpar.comm.count_bytes() as counter:
            outs = fusedpar.ops.all_gather_loopback(xs, dim, backend=backend)
    except BackendNotSupportedError as e:
        pytest.skip(str(e))
    expected = torch.cat(xs, dim)
    for out in outs:
        assert torch.equal(out, expected)
    assert counter.total() == world * (world - 1) * _nbytes(xs[0])
