import pytest
import torch
import torch.distributed as dist

import fusedpar
from tests.ops.collective_cases import (capture_errors, cpu_backends, interpreter_cast_slack,
                                        poisoned_allocations, rank_data, requires_cuda,
                                        stalled_peer_error, subgroup)

pytestmark = [pytest.mark.timeout(300)]

BACKENDS = cpu_backends("matmul_reduce_scatter")


def _cases(world):
    """(A shape, scatter_dim, N): 2-D and 3-D, both scatter dims, odd sizes."""
    return [((3 * world, 7), 0, 5), ((2 * world, 3, 6), 0, 1), ((2, 3 * world, 5), 1, 4),
            ((world, 1), 0, 3)]


def _reference(a, b, op, dim):
    """Every rank's A @ B summed in fp64 (B equal on every rank here), chunk of this rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    total = a.double() @ b.double()
    dist.all_reduce(total)
    if op == "avg":
        total /= world
    return total.chunk(world, dim)[rank]


def _check_exact(backend):
    world = dist.get_world_size()
    for i, (shape, dim, n) in enumerate(_cases(world)):
        a = rank_data(shape, torch.float32, dist.get_rank(), salt=i) - 20
        b = rank_data((shape[-1], n), torch.float32, 0, salt=i) / 8
        for op in ("sum", "avg"):
            expected = _reference(a, b, op, dim).float()
            with poisoned_allocations(), fusedpar.comm.count_bytes() as counter:
                out = fusedpar.ops.matmul_reduce_scatter(a, b, op, dim, backend=backend)
            assert out.shape == expected.shape and torch.equal(out, expected), (shape, dim, op)
            assert counter.total() == (world - 1) * out.numel() * 4
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torch_exactly_on_integer_data(pools, world, backend):
    assert pools(world).run(_check_exact, backend) == [True] * world


def _check_low_precision(backend):
    rank, world = dist.get_rank(), dist.get_world_size()
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(rank)
        a = torch.randn(4 * world, 48).to(dtype)
        b = torch.randn(48, 20).to(dtype)
        exact = a.double() @ b.double()
        dist.all_reduce(exact)
        exact = exact.chunk(world)[rank]
        torch_out = a @ b
        dist.all_reduce(torch_out)  # the unfused low-precision path
        torch_err = (torch_out.chunk(world)[rank].double() - exact).abs().max()
        err = (fusedpar.ops.matmul_reduce_scatter(a, b, "sum", 0, backend=backend).double()
               - exact).abs().max()
        assert err <= 2 * torch_err + interpreter_cast_slack(exact, dtype, backend), (dtype, err)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_error_within_twice_torch(pools, backend):
    assert pools(4).run(_check_low_precision, backend) == [True] * 4


def _check_gradients(backend, op):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full_a = torch.randn(2, 3 * world, 4 * world, dtype=torch.float64)  # K sharded over ranks
    full_b = torch.randn(4 * world, 5, dtype=torch.float64)
    weight = torch.randn(2, 3 * world, 5, dtype=torch.float64)
    ref_a, ref_b = full_a.clone().requires_grad_(), full_b.clone().requires_grad_()
    y = ref_a @ ref_b / (world if op == "avg" else 1)
    (y * weight).sum().backward()
    a = full_a.chunk(world, -1)[rank].float().requires_grad_()
    b = full_b.chunk(world, 0)[rank].float().requires_grad_()
    out = fusedpar.ops.matmul_reduce_scatter(a, b, op, 1, backend=backend)
    (out * weight.chunk(world, 1)[rank].float()).sum().backward()
    assert torch.allclose(a.grad.double(), ref_a.grad.chunk(world, -1)[rank], atol=1e-4)
    assert torch.allclose(b.grad.double(), ref_b.grad.chunk(world, 0)[rank], atol=1e-4)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_gradients_match_single_process(pools, backend, op):
    assert pools(2).run(_check_gradients, backend, op) == [True, True]


def _check_empty(backend):
    """Zero rows, zero columns or zero K give the empty (or zero) result on every backend,
    forward and backward, also through all_gather_matmul with a 0-row shard (its backward is
    this op); the triton backend then moves nothing, and the group's buffer still works."""
    world, group = dist.get_world_size(), subgroup()
    for m, k, n in ((0, 3, 5), (2 * world, 3, 0), (2 * world, 0, 5)):
        a, b = torch.randn(m, k, requires_grad=True), torch.randn(k, n, requires_grad=True)
        out = fusedpar.ops.matmul_reduce_scatter(a, b, "sum", 0, group, backend=backend)
        assert out.shape == (m // world, n) and not out.any(), (m, k, n)
        out.sum().backward()
        assert not a.grad.any() and not b.grad.any() and a.grad.shape == a.shape, (m, k, n)
        shard = torch.randn(0, k, requires_grad=True)
        _, (y,) = fusedpar.ops.all_gather_matmul(shard, [b], 0, group, backend=backend)
        y.sum().backward()
        assert y.shape == (0, n) and shard.grad.shape == (0, k), (m, k, n)
    full = fusedpar.ops.matmul_reduce_scatter(torch.ones(2 * world, 3), torch.ones(3, 5), "sum", 0,
                                              group, backend=backend)
    return torch.equal(full, torch.full((2, 5), 3.0 * world))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_shapes(pools, backend):
    assert pools(2).run(_check_empty, backend) == [True, True]


def _bad_inputs():
    errors = {}
    for backend in ("pipelined", "triton"):  # shapes differ across ranks: detected, no hang
        group = subgroup()
        a_rank = torch.ones(4, 4 + dist.get_rank())
        b_rank = torch.ones(4 + dist.get_rank(), 2)
        errors.update(capture_errors({f"mismatch_{backend}": lambda: fusedpar.ops.matmul_reduce_scatter(
            a_rank, b_rank, "sum", 0, group, backend=backend)}))
    return errors | capture_errors({
        "divisible": lambda: fusedpar.ops.matmul_reduce_scatter(torch.ones(3, 4), torch.ones(4, 2)),
        "op": lambda: fusedpar.ops.matmul_reduce_scatter(torch.ones(4, 4), torch.ones(4, 2), "max"),
        "k": lambda: fusedpar.ops.matmul_reduce_scatter(torch.ones(4, 4), torch.ones(3, 2)),
        "columns": lambda: fusedpar.ops.matmul_reduce_scatter(torch.ones(4, 4), torch.ones(4, 3), "sum", 1),
    })


def test_bad_inputs_give_clear_errors(pools):
    errors = pools(2).run(_bad_inputs)[0]
    assert "A.shape[0] = 3 is not divisible by the world size 2" in errors["divisible"][1]
    assert "'max'" in errors["op"][1]
    assert "K mismatch" in errors["k"][1]
    assert "A @ B.shape[1] = 3 is not divisible by the world size 2" in errors["columns"][1]
    for backend in ("pipelined", "triton"):
        assert errors[f"mismatch_{backend}"][0] == "ValueError"
        assert "passed different inputs" in errors[f"mismatch_{backend}"][1]


def _triton_matmul_rs(x, group):
    return fusedpar.ops.matmul_reduce_scatter(x, torch.ones(3, 5), "sum", 0, group, backend="triton")


def test_a_stalled_peer_times_out(pools):
    """Rank 1 never makes its second call: rank 0 waits for its READY flag before copying its
    partial, gives up at the timeout and raises naming it (no hang, no wrong result)."""
    assert "rank 1" in stalled_peer_error(pools, _triton_matmul_rs)


def _late_peer():
    """Rank 0 sleeps before its second call: every other rank waits for its partial at its
    place in the copy order (first on rank 1, last on rank 3), and the result is bit for bit
    that of the first call, where every rank started together (the partials are summed in
    rank order, whenever they arrived)."""
    import time

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    a = torch.randn(2 * world, 24) * (rank + 1)
    b = torch.randn(24, 9)
    together = fusedpar.ops.matmul_reduce_scatter(a, b, "sum", 0, backend="triton")
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)
    late = fusedpar.ops.matmul_reduce_scatter(a, b, "sum", 0, backend="triton")
    exact = a.double() @ b.double()
    dist.all_reduce(exact)
    close = torch.allclose(late.double(), exact.chunk(world)[rank], atol=1e-4)
    return torch.equal(late, together) and close


def test_a_late_peer_changes_nothing(pools):
    assert pools(4).run(_late_peer) == [True] * 4


# ---- GPU: skipped without CUDA ----------------------------------------------------------


@requires_cuda
def test_gpu_loopback_matches_torch():
    for world in (1, 4):
        for i, (shape, dim, n) in enumerate(_cases(world)):
            As = [(rank_data(shape, torch.float32, r, salt=i) - 20).cuda() for r in range(world)]
            Bs = [(rank_data((shape[-1], n), torch.float32, r, salt=i) / 8).cuda() for r in range(world)]
            total = sum(a.double() @ b.double() for a, b in zip(As, Bs))
            for op in ("sum", "avg"):
                outs = fusedpar.ops.matmul_reduce_scatter_loopback(As, Bs, op, dim)
                expected = (total / (world if op == "avg" else 1)).float().chunk(world, dim)
                for out, want in zip(outs, expected):
                    assert torch.equal(out, want), (world, shape, dim, op)


def _gpu_one_rank():
    torch.manual_seed(0)
    a = torch.randn(2, 300, 512, device="cuda").bfloat16()
    b = torch.randn(512, 384, device="cuda").bfloat16()
    out = fusedpar.ops.matmul_reduce_scatter(a, b, "sum", 1, backend="triton")
    exact = a.double() @ b.double()
    torch_err = ((a @ b).double() - exact).abs().max()
    return float((out.double() - exact).abs().max() / (2 * torch_err))  # <= 1: within 2x torch


@requires_cuda
def test_gpu_one_rank_symmetric_memory(pools):
    assert pools(1).run(_gpu_one_rank)[0] <= 1.0


@requires_cuda
def test_gpu_side_stream_copies_while_the_gemms_hold_all_but_one_sm():
    """A group call's path on one GPU: the peers' partials are copied on the side stream (a
    one-program flag wait, then a copy) while the GEMMs run on all SMs but ``REDUCER_SMS``.
    In a loopback the first rank's copies wait for GEMMs launched after them, and each copy
    is same-device: if a copy needed an SM the GEMMs held, this would stall into the
    timeout. Exact on integer data, for both paths."""
    world, m, k, n = 4, 4 * 1024, 512, 768
    As = [(rank_data((m, k), torch.float32, r) - 20).cuda() for r in range(world)]
    Bs = [(rank_data((k, n), torch.float32, r, salt=1) / 8).cuda() for r in range(world)]
    total = sum(a.double() @ b.double() for a, b in zip(As, Bs)).float()
    for side_stream in (True, False):
        outs = fusedpar.ops.matmul_reduce_scatter_loopback(As, Bs, side_stream=side_stream)
        torch.cuda.synchronize()
        for rank, (out, want) in enumerate(zip(outs, total.chunk(world))):
            assert torch.equal(out, want), (side_stream, rank)


def test_loopback_side_stream_needs_cuda():
    with pytest.raises(ValueError, match="side_stream=True needs CUDA tensors"):
        fusedpar.ops.matmul_reduce_scatter_loopback([torch.ones(2, 3)] * 2, [torch.ones(3, 4)] * 2,
                                                    side_stream=True)


def _check_columns(backend):
    """Scattering the output's last dim (its columns), 2-D and 3-D, sum and avg: exact, a
    contiguous output as torch's, and gradients equal one process's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, (shape, n) in enumerate((((5, 3), 2 * world), ((2, 3, 5), 3 * world))):
        for op in ("sum", "avg"):
            a = (rank_data(shape, torch.float32, rank, salt=i) - 20).requires_grad_()
            b = (rank_data((shape[-1], n), torch.float32, rank, salt=i) / 8).requires_grad_()
            with poisoned_allocations():
                out = fusedpar.ops.matmul_reduce_scatter(a, b, op, -1, backend=backend)
            total = a.detach().double() @ b.detach().double()
            dist.all_reduce(total)
            expected = (total / (world if op == "avg" else 1)).chunk(world, -1)[rank]
            assert out.is_contiguous() and torch.equal(out, expected.float()), (shape, op)
            grad = rank_data(out.shape, torch.float32, rank, salt=i + 3) / 4
            out.backward(grad)
            grads = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(grads, grad)
            d_full = torch.cat(grads, -1).double() / (world if op == "avg" else 1)
            assert torch.equal(a.grad.double(), d_full @ b.detach().double().t()), (shape, op)
            expected_b = a.detach().double().flatten(0, -2).t() @ d_full.flatten(0, -2)
            assert torch.equal(b.grad.double(), expected_b), (shape, op)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_along_the_output_columns(pools, backend):
    assert pools(2).run(_check_columns, backend) == [True, True]
