import pytest
import torch
import torch.distributed as dist

import fusedpar
from tests.ops.collective_cases import (capture_errors, cpu_backends, interpreter_cast_slack,
                                        poisoned_allocations, rank_data, requires_cuda,
                                        stalled_peer_error, subgroup)

pytestmark = [pytest.mark.timeout(300)]

BACKENDS = cpu_backends("all_gather_matmul")
# (A_shard shape, gather_dim, N of each B): 2-D and 3-D, both gather dims, odd sizes
CASES = [((5, 7), 0, [3]), ((5, 7), 0, [3, 1, 4]), ((2, 3, 6), 0, [5]), ((2, 3, 6), 1, [5, 2]),
         ((1, 1), 0, [1])]


def _gather(x, dim, group=None):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _check_exact(backend):
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, (shape, dim, ns) in enumerate(CASES):
        a = rank_data(shape, torch.float32, rank, salt=i) - 20  # small integers, sign-mixed
        bs = [rank_data((shape[-1], n), torch.float32, 0, salt=i + j) / 8 for j, n in enumerate(ns)]
        expected_a = _gather(a, dim)
        for return_a in (True, False):
            with poisoned_allocations(), fusedpar.comm.count_bytes() as counter:
                gathered, outs = fusedpar.ops.all_gather_matmul(a, bs, dim, return_A=return_a,
                                                                backend=backend)
            assert (gathered is None) != return_a
            if return_a:
                assert torch.equal(gathered, expected_a), (shape, dim)
            for out, b in zip(outs, bs):
                assert torch.equal(out, (expected_a.double() @ b.double()).float()), (shape, dim)
            assert counter.total() == (world - 1) * a.numel() * 4
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torch_exactly_on_integer_data(pools, world, backend):
    assert pools(world).run(_check_exact, backend) == [True] * world


def _check_low_precision(backend):
    rank = dist.get_rank()
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(rank)
        a = torch.randn(6, 2, 40).to(dtype)
        torch.manual_seed(100)
        b = torch.randn(40, 24).to(dtype)
        exact = _gather(a.double(), 1) @ b.double()
        torch_err = ((_gather(a, 1) @ b).double() - exact).abs().max()
        _, (out,) = fusedpar.ops.all_gather_matmul(a, [b], 1, backend=backend)
        err = (out.double() - exact).abs().max()
        assert err <= 2 * torch_err + interpreter_cast_slack(exact, dtype, backend), (dtype, err)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_error_within_twice_torch(pools, backend):
    assert pools(2).run(_check_low_precision, backend) == [True, True]


def _check_gradients(backend):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full_a = torch.randn(3, 4 * world, 6, dtype=torch.float64)
    bs = [torch.randn(6, n, dtype=torch.float64, requires_grad=True) for n in (5, 3)]
    weights = [torch.randn(3, 4 * world, n, dtype=torch.float64) for n in (5, 3)]
    # single process: gathered A, every rank's loss summed
    ref_a = full_a.clone().requires_grad_()
    ref_bs = [b.detach().clone().requires_grad_() for b in bs]
    (sum((ref_a @ b * w).sum() for b, w in zip(ref_bs, weights)) * world).backward()
    a = full_a.chunk(world, 1)[rank].float().clone().requires_grad_()
    bs32 = [b.detach().float().requires_grad_() for b in bs]
    gathered, outs = fusedpar.ops.all_gather_matmul(a, bs32, 1, return_A=True, backend=backend)
    loss = sum((o * w.float()).sum() for o, w in zip(outs, weights)) + (gathered * 0.5).sum()
    loss.backward()
    grad_gathered_term = 0.5 * world  # d/dA_shard of sum_ranks sum(0.5 * gathered)
    assert torch.allclose(a.grad.double(), ref_a.grad.chunk(world, 1)[rank] + grad_gathered_term,
                          atol=1e-4)
    for b, ref in zip(bs32, ref_bs):
        total = b.grad.clone()
        dist.all_reduce(total)  # each rank holds its own loss's dB
        assert torch.allclose(total.double(), ref.grad, atol=1e-4)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_single_process(pools, backend):
    assert pools(2).run(_check_gradients, backend) == [True, True]


def _compiled():
    name = dist.group.WORLD.group_name

    def block(x, w1, w2):
        _, (h,) = fusedpar.ops.all_gather_matmul(x, [w1], 0, name, return_A=False)
        return fusedpar.ops.matmul_reduce_scatter(torch.relu(h), w2, "sum", 0, name)

    x = rank_data((4, 6), torch.float32, dist.get_rank())
    w1, w2 = rank_data((6, 5), torch.float32, 0) / 16, rank_data((5, 3), torch.float32, 1) / 16
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, w1, w2), block(x, w1, w2))
    # with grads: the traced op's registered autograd and eager's autograd.Function agree
    grads = []
    for fn in (compiled, block):
        params = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
        fn(*params).square().sum().backward()
        grads.append([p.grad for p in params])
    assert all(torch.equal(c, e) for c, e in zip(*grads))
    return True


def test_torch_compile_fullgraph(pools):
    assert pools(2).run(_compiled) == [True, True]


def _bad_inputs():
    a, b = torch.ones(4, 6), torch.ones(6, 3)
    errors = capture_errors({
        "k": lambda: fusedpar.ops.all_gather_matmul(a, [torch.ones(5, 3)], 0),
        "dtype": lambda: fusedpar.ops.all_gather_matmul(a, [b.half()], 0),
        "last_dim": lambda: fusedpar.ops.all_gather_matmul(a, [b], 1),  # K-sharded: B needs 2 * 6 rows
        "no_dim": lambda: fusedpar.ops.all_gather_matmul(a, [b], 2),
        "one_d": lambda: fusedpar.ops.all_gather_matmul(torch.ones(6), [b], 0),
        "empty": lambda: fusedpar.ops.all_gather_matmul(a, [], 0),
        "int": lambda: fusedpar.ops.all_gather_matmul(a.int(), [b.int()], 0),
        "minus_one": lambda: fusedpar.ops.all_gather_matmul(a, [b], -1),
        "fp64_triton": lambda: fusedpar.ops.all_gather_matmul(a.double(), [b.double()], 0,
                                                               backend="triton"),
    })
    for backend in ("pipelined", "triton"):  # shapes differ across ranks: detected, no hang
        group = subgroup()
        a_rank = torch.ones(4 + dist.get_rank(), 6)
        errors.update(capture_errors({f"mismatch_{backend}": lambda: fusedpar.ops.all_gather_matmul(
            a_rank, [b], 0, group, backend=backend)}))
    return errors


def test_bad_inputs_give_clear_errors(pools):
    errors = pools(2).run(_bad_inputs)[0]
    assert "K mismatch: A.shape[-1] = 6 but B.shape[0] = 5" in errors["k"][1]
    assert errors["dtype"][0] == "TypeError" and "float16" in errors["dtype"][1]
    assert "A gathered along K has 12 columns (6 per rank) but B.shape[0] = 6" in errors["last_dim"][1]
    assert "gather_dim=2 is not a dim of A" in errors["no_dim"][1]
    assert "2-D or 3-D" in errors["one_d"][1]
    assert "Bs is empty" in errors["empty"][1]
    assert errors["int"][0] == "TypeError" and "A has dtype torch.int32" in errors["int"][1]
    assert "A gathered along K has 12 columns" in errors["minus_one"][1]
    assert "float32, float16 or bfloat16" in errors["fp64_triton"][1]
    for backend in ("pipelined", "triton"):
        assert errors[f"mismatch_{backend}"][0] == "ValueError"
        message = errors[f"mismatch_{backend}"][1]
        # says what each rank passed
        assert "passed different inputs" in message and "(4, 6)" in message and "(5, 6)" in message


def _triton_matmul(x, group):
    return fusedpar.ops.all_gather_matmul(x, [torch.ones(3, 5)], 0, group, backend="triton")


def test_a_stalled_peer_times_out(pools):
    """Rank 1 never makes its second call: rank 0 waits for its READY flag before copying its
    shard, gives up at the timeout and raises naming it (no hang, no wrong result)."""
    assert "rank 1" in stalled_peer_error(pools, _triton_matmul)


def _torch_schema_and_fp64():
    """The op takes torch's ``symm_mem.fused_all_gather_matmul`` argument list unchanged, and
    the plain-torch backends take float64 (gradcheck)."""
    rank, group = dist.get_rank(), dist.group.WORLD
    a = rank_data((3, 4), torch.float64, rank)
    b = rank_data((4, 2), torch.float64, 0) / 4
    gathered, (out,) = torch.ops.fusedpar.all_gather_matmul(a, [b], 0, group.group_name)
    _, (no_a,) = torch.ops.fusedpar.all_gather_matmul(a, [b], 0, group.group_name, return_A=False)
    expected = _gather(a, 0)
    ok = torch.equal(gathered, expected) and torch.equal(out, expected @ b) and torch.equal(no_a, out)
    for backend in ("reference", "pipelined"):
        a_req = a.clone().requires_grad_()
        _, (y,) = fusedpar.ops.all_gather_matmul(a_req, [b], 0, backend=backend)
        y.sum().backward()
        ok = ok and y.dtype == torch.float64 and a_req.grad.dtype == torch.float64
    return ok


def test_torch_schema_drop_in_and_float64(pools):
    assert pools(2).run(_torch_schema_and_fp64) == [True, True]


def test_loopback_repeats_stage_no_description_and_poison_only_what_the_gemm_cannot(monkeypatch):
    """Host work per call (CPU loopback, W=2): a call of the shape of the last one copies no
    description words to the pads; the GEMM NaN-fills a failed call's product and gathered A
    itself, so only the products of further Bs off a gathered A that is not returned need a
    launch of their own. Results stay exact either way."""
    from fusedpar.comm import symmetric
    from fusedpar.kernels import signal

    staged, poisoned = [], []
    real_words, real_poison = symmetric.host_words, signal.poison_if_failed
    monkeypatch.setattr(symmetric, "host_words",
                        lambda words, device: staged.append(words) or real_words(words, device))
    monkeypatch.setattr(signal, "poison_if_failed",
                        lambda pad, t: poisoned.append(tuple(t.shape)) or real_poison(pad, t))
    shards = [rank_data((5, 7), torch.float32, r) - 20 for r in range(2)]
    bs = [rank_data((7, n), torch.float32, 0) / 8 for n in (3, 4)]
    expected_a = torch.cat(shards)
    for call, return_a in enumerate((True, True, False)):
        staged.clear(), poisoned.clear()
        results = fusedpar.ops.all_gather_matmul_loopback(shards, bs, return_A=return_a)
        for gathered, outs in results:
            assert torch.equal(gathered, expected_a) if return_a else gathered is None
            for out, b in zip(outs, bs):
                assert torch.equal(out, (expected_a.double() @ b.double()).float())
        assert poisoned == ([] if return_a else 2 * [(10, 4)])
        if call > 0:  # the first may follow other shapes on these cached buffers
            assert staged == []


@pytest.mark.parametrize("return_a", [True, False])
def test_a_failed_loopback_call_is_nan_where_it_failed_and_raises(monkeypatch, return_a):
    """Simulated rank 1 publishes another fingerprint: rank 0's wait for it fails, so rank
    0's outputs (and its gathered A) are NaN, filled by the GEMM's last program, and the
    call raises naming both inputs; the next call on fresh buffers is right."""
    from fusedpar.kernels import signal

    real_stage = signal.stage
    monkeypatch.setattr(signal, "stage", lambda x, dst, pad_table, rank, world, meta, *a, **k:
                        real_stage(x, dst, pad_table, rank, world, meta + rank, *a, **k))
    shards = [rank_data((5, 7), torch.float32, r) - 20 for r in range(2)]
    bs = [rank_data((7, 3), torch.float32, 0) / 8]
    outs = []
    real_launch = fusedpar.kernels.gemm_peers.GatherLaunch.__call__
    monkeypatch.setattr(fusedpar.kernels.gemm_peers.GatherLaunch, "__call__",
                        lambda self, a, b, c, *args, gathered=None: outs.append((c, gathered))
                        or real_launch(self, a, b, c, *args, gathered=gathered))
    with pytest.raises(ValueError, match="rank 0 and rank 1 .* passed different inputs"):
        fusedpar.ops.all_gather_matmul_loopback(shards, bs, return_A=return_a)
    (out, gathered), _ = outs
    assert out.isnan().all() and (gathered is None) != return_a
    assert not return_a or gathered.isnan().all()
    monkeypatch.undo()
    _, (out,) = fusedpar.ops.all_gather_matmul_loopback(shards, bs)[0]
    assert torch.equal(out, (torch.cat(shards).double() @ bs[0].double()).float())


# ---- GPU: skipped without CUDA ----------------------------------------------------------


@requires_cuda
def test_gpu_loopback_matches_torch():
    for world in (1, 4):
        for i, (shape, dim, ns) in enumerate(CASES):
            shards = [(rank_data(shape, torch.float32, r, salt=i) - 20).cuda() for r in range(world)]
            bs = [(rank_data((shape[-1], n), torch.float32, 0, salt=i) / 8).cuda() for n in ns]
            expected_a = torch.cat(shards, dim)
            for gathered, outs in fusedpar.ops.all_gather_matmul_loopback(shards, bs, dim):
                assert torch.equal(gathered, expected_a)
                for out, b in zip(outs, bs):
                    assert torch.equal(out, (expected_a.double() @ b.double()).float())


def _gpu_one_rank_copy_engine():
    """W=1 on the GPU: the copy-engine producer (stream_write_value32 flags) and the
    persistent GEMM waiting on them, in bf16 against torch."""
    torch.manual_seed(0)
    a = torch.randn(2, 300, 512, device="cuda").bfloat16()
    bs = [torch.randn(512, n, device="cuda").bfloat16() for n in (384, 130)]
    gathered, outs = fusedpar.ops.all_gather_matmul(a, bs, 1, backend="triton")
    torch.cuda.synchronize()
    ratios = []  # fused error / (2 x torch's bf16 error), against fp64
    for out, b in zip(outs, bs):
        exact = a.double() @ b.double()
        torch_err = ((a @ b).double() - exact).abs().max()
        ratios.append(float((out.double() - exact).abs().max() / (2 * torch_err)))
    return torch.equal(gathered, a), max(ratios)


@requires_cuda
def test_gpu_one_rank_copy_engine_producer(pools):
    ((same_a, worst),) = pools(1).run(_gpu_one_rank_copy_engine)
    assert same_a and worst <= 1.0, worst


def _check_any_gather_dim(backend):
    """Every dim of A, the last (a K-sharded A: B has W times its K) included: outputs equal
    the gathered A times B, contiguous and laid out as the fake implementation says;
    gradients equal one process's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rank, world = dist.get_rank(), dist.get_world_size()
    for i, (shape, dim) in enumerate((((5, 3), 1), ((2, 3, 5), 2), ((2, 3, 5), -1), ((2, 3, 5), 1))):
        last = dim % len(shape) == len(shape) - 1
        a = (rank_data(shape, torch.float32, rank, salt=i) - 20).requires_grad_()
        b = (rank_data((shape[-1] * (world if last else 1), 4), torch.float32, 0, salt=i) / 8).requires_grad_()
        gathered, (out,) = fusedpar.ops.all_gather_matmul(a, [b], dim, backend=backend)
        full = _gather(a.detach(), dim)
        assert torch.equal(gathered, full) and torch.equal(out, (full.double() @ b.double()).float())
        a0, b0 = a.detach(), b.detach()
        with FakeTensorMode() as mode:
            fakes = fusedpar.ops.all_gather_matmul(mode.from_tensor(a0), [mode.from_tensor(b0)], dim,
                                                   backend=backend)
        for t, f in ((gathered, fakes[0]), (out, fakes[1][0])):
            assert t.is_contiguous() and (t.shape, t.stride()) == (f.shape, f.stride()), (shape, dim)
        grad = rank_data(out.shape, torch.float32, rank, salt=i + 7) / 4  # each rank's own dY
        out.backward(grad)
        a1, b1 = full.clone().requires_grad_(), b.detach().clone().requires_grad_()
        grads = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(grads, grad)
        sum(((a1 @ b1) * g).sum() for g in grads).backward()
        assert torch.equal(a.grad, a1.grad.chunk(world, dim)[rank]), (shape, dim)
        expected_b = full.flatten(0, -2).t() @ grad.flatten(0, -2)
        assert torch.equal(b.grad, expected_b), (shape, dim)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_gather_dim_with_the_fake_layout_and_gradients(pools, backend):
    assert pools(2).run(_check_any_gather_dim, backend) == [True, True]
