import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.testing.cases import DTYPES
from fusedpar.testing.collectives import symmetric_backend_names
from tests.dist_pool import leftover_shm
from tests.ops.collective_cases import (capture_errors, check_exact, chosen_backend,
                                        cpu_backends, env, rank_data, requires_cuda, subgroup,
                                        timeout_case)

pytestmark = [pytest.mark.timeout(300)]

SHAPES_DIMS = [((3, 5), 0), ((3, 5), 1), ((5, 3, 7), 1), ((5, 3, 7), -1), ((1,), 0), ((2, 1, 3), 2)]


def _torch_all_gather(x, dim, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _check_exact(backend):
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    for dtype in DTYPES:
        for i, (shape, dim) in enumerate(SHAPES_DIMS):
            for transposed in (False, True):
                x = rank_data(shape, dtype, rank, salt=i, transposed=transposed)
                expected = _torch_all_gather(x, dim, group)
                check_exact(group, x, lambda: fusedpar.ops.all_gather(x, dim, group, backend=backend),
                            expected, (world - 1) * x.numel() * x.element_size(),
                            f"{dtype} {shape} dim={dim} transposed={transposed}")
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("backend", cpu_backends("all_gather"))
def test_matches_torch_distributed_exactly(pools, world, backend):
    assert pools(world).run(_check_exact, backend) == [True] * world


def _auto_choice():
    x = rank_data((4, 3), torch.float32, dist.get_rank())
    fusedpar.ops.all_gather(x, 0)
    with env(FUSEDPAR_BACKEND="reference"):
        forced = chosen_backend("all_gather", x, 0, dist.group.WORLD)
    return chosen_backend("all_gather", x, 0, dist.group.WORLD), forced


def test_every_rank_picks_the_same_backend(pools):
    results = pools(4).run(_auto_choice)
    assert results == [("triton", "reference")] * 4  # interpreter on: triton comes first


def _shape_mismatch(backend):
    group = subgroup()
    rank = dist.get_rank()
    x = torch.zeros((4, 6) if rank == 0 else (6, 4))  # same bytes, different shape
    try:
        fusedpar.ops.all_gather(x, 0, group, backend=backend)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("backend", cpu_backends("all_gather"))
def test_shapes_differing_across_ranks_raise(pools, backend):
    messages = pools(2).run(_shape_mismatch, backend)
    for message in messages:
        assert message is not None and "passed different inputs" in message


def _bad_inputs():
    x = torch.ones(4, 3)
    return capture_errors({
        "dim": lambda: fusedpar.ops.all_gather(x, 2),
        "dtype": lambda: fusedpar.ops.all_gather(x.to(torch.complex64), 0),
        "group_name": lambda: fusedpar.ops.all_gather(x, 0, "no-such-group"),
        "group_type": lambda: fusedpar.ops.all_gather(x, 0, 3),
        "backend_name": lambda: fusedpar.ops.all_gather(x, 0, backend="nccl"),
        "backend_forced": lambda: fusedpar.ops.all_gather(x, 0, backend="cuda"),
    })


def test_bad_inputs_give_clear_errors(pools):
    errors = pools(2).run(_bad_inputs)[0]
    assert errors["dim"][0] == "ValueError" and "dim=2" in errors["dim"][1]
    assert errors["dtype"][0] == "TypeError" and "complex64" in errors["dtype"][1]
    assert errors["group_name"][0] == "ValueError" and "no-such-group" in errors["group_name"][1]
    assert errors["group_type"][0] == "TypeError"
    assert "does not exist" in errors["backend_name"][1] and "triton" in errors["backend_name"][1]
    assert errors["backend_forced"][0] == "BackendNotSupportedError"
    assert "CUDA tensors" in errors["backend_forced"][1]


def _gradient():
    rank, world = dist.get_rank(), dist.get_world_size()
    x = rank_data((3, 5), torch.float32, rank).requires_grad_()
    weight = rank_data((3 * world, 5), torch.float32, rank + 10)  # differs per rank
    (fusedpar.ops.all_gather(x, 0, backend="triton") * weight).sum().backward()
    # d/dx_r sum_ranks sum(gathered * weight_rank) = sum_ranks weight_rank[r-th block]
    total = weight.clone()
    dist.all_reduce(total)
    assert torch.equal(x.grad, total.chunk(world, 0)[rank])
    return True


def test_gradient_is_reduce_scatter(pools):
    assert pools(2).run(_gradient) == [True, True]


def _compiled():
    name = dist.group.WORLD.group_name

    def step(x):
        return fusedpar.ops.reduce_scatter(fusedpar.ops.all_gather(x * 2, 1, name), "sum", 1, name)

    x = rank_data((4, 3), torch.float32, dist.get_rank())
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), step(x))
    return True


def test_torch_compile_fullgraph(pools):
    assert pools(2).run(_compiled) == [True, True]


def test_loopback_matches_cat():
    for world in (1, 4):
        xs = [rank_data((3, 5), torch.bfloat16, r) for r in range(world)]
        with fusedpar.comm.count_bytes() as counter:
            outs = fusedpar.ops.all_gather_loopback(xs, 1)
        for out in outs:
            assert torch.equal(out, torch.cat(xs, 1))
        assert counter.total() == world * (world - 1) * xs[0].numel() * 2


def _gather(x, group):
    return fusedpar.ops.all_gather(x, 0, group, backend="triton")


@pytest.mark.parametrize("mode", ["stall", "die"])
def test_a_missing_peer_times_out(pools, mode):
    results = pools(4).run(timeout_case, _gather, 2, mode, 2.0, tolerate_death=True)
    for rank, result in enumerate(results):
        if rank == 2:
            continue
        assert result["elapsed"] < 2.0 * 3, result
        assert "rank 2" in result["message"] and "READY[2]" in result["message"], result
    assert not leftover_shm()


# ---- GPU: skipped without CUDA ----------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("backend", symmetric_backend_names("all_gather"))
def test_gpu_loopback_matches_cat(backend):
    for world in (1, 4):
        for dtype in DTYPES:
            for i, (shape, dim) in enumerate(SHAPES_DIMS):
                xs = [rank_data(shape, dtype, r, salt=i).cuda() for r in range(world)]
                outs = fusedpar.ops.all_gather_loopback(xs, dim, backend=backend)
                for out in outs:
                    assert torch.equal(out, torch.cat(xs, dim)), (world, dtype, shape, dim)


@requires_cuda
@pytest.mark.parametrize("backend", symmetric_backend_names("all_gather"))
def test_gpu_calls_on_two_streams_take_turns(backend):
    """FSDP2 issues its all-gathers and reduce-scatters on two streams, on one group's
    symmetric buffer, and a call restages this rank's data region: a call on another stream
    waits (on the device) for the previous call to end. Stream ``a`` is held back by a sleep
    kernel; the call issued after it on stream ``b`` must not change what ``a`` gathers."""
    for world in (1, 2):
        xs = [[rank_data((64, 33), torch.float32, r, salt=salt).cuda() for r in range(world)]
              for salt in (1, 2)]
        fusedpar.ops.all_gather_loopback(xs[0], 0, backend=backend)  # compiled, buffers made
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(a):
            torch.cuda._sleep(200_000_000)  # ~0.1 s
            first = fusedpar.ops.all_gather_loopback(xs[0], 0, backend=backend)
        with torch.cuda.stream(b):
            second = fusedpar.ops.all_gather_loopback(xs[1], 0, backend=backend)
        torch.cuda.synchronize()
        assert all(torch.equal(out, torch.cat(xs[0])) for out in first), world
        assert all(torch.equal(out, torch.cat(xs[1])) for out in second), world


def _gpu_single_rank(backend):
    x = rank_data((5, 3, 7), torch.bfloat16, 0).cuda()
    out = fusedpar.ops.all_gather(x, 1, backend=backend)
    torch.cuda.synchronize()
    buf = fusedpar.comm.get_buffer(dist.group.WORLD, 1, x.device)
    return torch.equal(out, x), buf.backend


@requires_cuda
@pytest.mark.parametrize("backend", symmetric_backend_names("all_gather"))
def test_gpu_torch_symmetric_memory_one_rank(pools, backend):
    assert pools(1).run(_gpu_single_rank, backend) == [(True, "torch")]


def _outputs_are_not_views():
    x = torch.ones(4, 6)
    outs = [op(x, dim, backend=backend) for backend in cpu_backends("all_gather") for dim in (0, 1)
            for op in (lambda x, d, backend: fusedpar.ops.all_gather(x, d, backend=backend),
                       lambda x, d, backend: fusedpar.ops.reduce_scatter(x, "sum", d, backend=backend))]
    return [out._base is None for out in outs]


def test_outputs_are_not_views(pools):
    """FSDP2 and autograd warn about (and mishandle) views returned by a custom op."""
    assert all(pools(2).run(_outputs_are_not_views)[0])
