import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.testing.cases import DTYPES
from fusedpar.testing.collectives import symmetric_backend_names
from tests.dist_pool import leftover_shm
from tests.ops.collective_cases import (capture_errors, check_exact, cpu_backends, rank_data,
                                        requires_cuda, stalled_peer_error, subgroup)

pytestmark = [pytest.mark.timeout(300)]


def _shapes_dims(world):
    """Odd sizes whose scattered dim is a multiple of the world size."""
    return [((3 * world, 5), 0), ((3, 5 * world), 1), ((5, world, 7), 1), ((5, 3, 7 * world), -1),
            ((world,), 0), ((2, 1, world), 2)]


def _torch_reduce_scatter(x, op, dim, group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    total = x.to(torch.float64).clone()
    dist.all_reduce(total, group=group)
    if op == "avg":
        total /= world
    return total.chunk(world, dim=dim)[rank].to(x.dtype)


def _check_exact(backend):
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    for dtype in DTYPES:
        for i, (shape, dim) in enumerate(_shapes_dims(world)):
            for op in ("sum", "avg"):
                x = rank_data(shape, dtype, rank, salt=i, transposed=i % 2 == 1)
                expected = _torch_reduce_scatter(x, op, dim, group)
                check_exact(group, x,
                            lambda: fusedpar.ops.reduce_scatter(x, op, dim, group, backend=backend),
                            expected, (world - 1) * expected.numel() * expected.element_size(),
                            f"{dtype} {shape} dim={dim} {op}")
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("backend", cpu_backends("reduce_scatter"))
def test_matches_torch_distributed_exactly(pools, world, backend):
    assert pools(world).run(_check_exact, backend) == [True] * world


def _random_bf16(backend):
    """Random data: the fp32 accumulation must be at least as accurate as torch's bf16 sum."""
    rank = dist.get_rank()
    torch.manual_seed(rank)
    x = torch.randn(8, 33).to(torch.bfloat16)
    exact = _torch_reduce_scatter(x.double(), "sum", 0, dist.group.WORLD)
    torch_bf16 = x.clone()
    dist.all_reduce(torch_bf16)
    torch_err = (torch_bf16.chunk(dist.get_world_size())[rank].double() - exact).abs().max()
    ours = fusedpar.ops.reduce_scatter(x, "sum", 0, backend=backend)
    # the interpreter rounds fp32->bf16 by truncation (1 ulp more), hence the 1/128 slack
    ours_err = (ours.double() - exact).abs().max()
    assert ours_err <= 2 * torch_err + exact.abs().max() / 128, (ours_err, torch_err)
    return True


def test_random_bf16_within_twice_torch_error(pools):
    assert pools(4).run(_random_bf16, "triton") == [True] * 4


def _rank_order(backends):
    """fp32 data over six orders of magnitude, where every order of the sum rounds otherwise:
    each backend's result equals the fp32 sum in rank order (gloo's own ring does not)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    xs = [torch.randn(world * 300, generator=torch.Generator().manual_seed(r)) * torch.logspace(-3, 3, world * 300)
          for r in range(world)]
    want = xs[0].clone()
    for x in xs[1:]:
        want += x
    want = want.chunk(world)[rank]
    for backend in backends:
        got = fusedpar.ops.reduce_scatter(xs[rank], "sum", 0, backend=backend)
        assert torch.equal(got, want), (backend, (got - want).abs().max())
    return True


def test_every_cpu_backend_sums_in_rank_order(pools):
    assert pools(4).run(_rank_order, cpu_backends("reduce_scatter")) == [True] * 4


def _bad_inputs():
    return capture_errors({
        "divisible": lambda: fusedpar.ops.reduce_scatter(torch.ones(5, 3), "sum", 0),
        "op": lambda: fusedpar.ops.reduce_scatter(torch.ones(4, 3), "max", 0),
        "dtype": lambda: fusedpar.ops.reduce_scatter(torch.ones(4, 3, dtype=torch.int32), "sum", 0),
    })


def test_bad_inputs_give_clear_errors(pools):
    errors = pools(2).run(_bad_inputs)[0]
    assert errors["divisible"][0] == "ValueError"
    assert "x.shape[0] = 5 is not divisible by the world size 2" in errors["divisible"][1]
    assert errors["op"][0] == "ValueError" and "'max'" in errors["op"][1]
    assert errors["dtype"][0] == "TypeError" and "int32" in errors["dtype"][1]


def _dtype_mismatch(backend):
    group = subgroup()
    dtype = torch.float32 if dist.get_rank() == 0 else torch.float16
    try:
        fusedpar.ops.reduce_scatter(torch.ones(4, 4, dtype=dtype), "sum", 0, group, backend=backend)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("backend", cpu_backends("reduce_scatter"))
def test_dtypes_differing_across_ranks_raise(pools, backend):
    for message in pools(2).run(_dtype_mismatch, backend):
        assert message is not None and "passed different inputs" in message


def _gradient(op):
    rank, world = dist.get_rank(), dist.get_world_size()
    x = rank_data((2 * world, 3), torch.float32, rank).requires_grad_()
    weight = rank_data((2, 3), torch.float32, rank + 5)
    (fusedpar.ops.reduce_scatter(x, op, 0, backend="triton") * weight).sum().backward()
    expected = torch.cat([torch.empty_like(weight)] * world)
    dist.all_gather_into_tensor(expected, weight)
    if op == "avg":
        expected /= world
    assert torch.equal(x.grad, expected)
    return True


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_gradient_is_all_gather(pools, op):
    assert pools(2).run(_gradient, op) == [True, True]


def test_loopback_matches_sum():
    world = 4
    xs = [rank_data((3, 4 * world), torch.float16, r) for r in range(world)]
    with fusedpar.comm.count_bytes() as counter:
        outs = fusedpar.ops.reduce_scatter_loopback(xs, "sum", 1)
    total = sum(x.double() for x in xs).to(torch.float16)
    for rank, out in enumerate(outs):
        assert torch.equal(out, total.chunk(world, 1)[rank])
    assert counter.total() == world * (world - 1) * outs[0].numel() * 2


def _scatter(x, group):
    return fusedpar.ops.reduce_scatter(x, "sum", 0, group, backend="triton")


def test_a_stalled_peer_times_out(pools):
    stalled_peer_error(pools, _scatter)
    assert not leftover_shm()


# ---- GPU: skipped without CUDA ----------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("backend", symmetric_backend_names("reduce_scatter"))
def test_gpu_loopback_matches_sum(backend):
    for world in (1, 4):
        for dtype in DTYPES:
            for i, (shape, dim) in enumerate(_shapes_dims(world)):
                xs = [rank_data(shape, dtype, r, salt=i).cuda() for r in range(world)]
                for op in ("sum", "avg"):
                    outs = fusedpar.ops.reduce_scatter_loopback(xs, op, dim, backend=backend)
                    total = sum(x.double() for x in xs) / (world if op == "avg" else 1)
                    for rank, out in enumerate(outs):
                        expected = total.chunk(world, dim)[rank].to(dtype)
                        assert torch.equal(out, expected), (world, dtype, shape, dim, op)


def _gpu_single_rank(backend):
    x = rank_data((5, 3, 7), torch.float16, 0).cuda()
    out = fusedpar.ops.reduce_scatter(x, "avg", 2, backend=backend)
    torch.cuda.synchronize()
    return torch.equal(out, x)


@requires_cuda
@pytest.mark.parametrize("backend", symmetric_backend_names("reduce_scatter"))
def test_gpu_torch_symmetric_memory_one_rank(pools, backend):
    assert pools(1).run(_gpu_single_rank, backend) == [True]
