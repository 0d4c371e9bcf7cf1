"""The triton backend of moe_dispatch / moe_combine: no host reads with max_tokens_per_rank,
and the loopback variants (every rank in one process). The routing cases of every backend
are in test_moe.py."""

import contextlib
import sys

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.comm import get_buffer, get_loopback_buffers, layout
from fusedpar.kernels import moe_dispatch as dispatch_kernels
from fusedpar.kernels import moe_permute as permute_kernels
from fusedpar.ops import float8_scales
from fusedpar.ops import protocol
from fusedpar.ops.moe import moe_combine, moe_combine_loopback, moe_dispatch, moe_dispatch_loopback
from tests.ops.collective_cases import (captured, poison_symmetric, requires_cuda, scalar_arguments,
                                        stalled_peer_error, subgroup)
from tests.ops.test_moe import _check_provenance, _compact, _routing, _tokens

pytestmark = [pytest.mark.timeout(300)]

# every way Python code reads a tensor's values on the host (a device-to-host sync on CUDA)
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
MOE_FILES = tuple(f"fusedpar/ops/moe/{name}.py" for name in ("routing", "exchange", "dispatch")) + (
    "fusedpar/kernels/moe_dispatch.py", "fusedpar/kernels/moe_permute.py")


@contextlib.contextmanager
def no_host_reads(files=MOE_FILES):
    """Make every host read of a tensor called from ``files`` raise (CPU tensors have no
    sync to detect, so this catches the calls that would be one on CUDA)."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}

    def guard(name, original):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.endswith(files):
                raise AssertionError(f"host read Tensor.{name} at {caller.f_code.co_filename}:"
                                     f"{caller.f_lineno}")
            return original(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def _padded_round_trip(T, H, k, E, M):
    rank = dist.get_rank()
    idx = _routing(rank, T, k, E, "random")
    x = _tokens(rank, T, H).requires_grad_()
    w = ((torch.arange(T * k, dtype=torch.float32).view(T, k) % 4 + 1) / 4).requires_grad_()
    with no_host_reads():
        recv_x, per_expert, handle = moe_dispatch(x, idx, w, E, max_tokens_per_rank=M)  # triton
        assert handle.backend == "triton"
        out = moe_combine(recv_x * 2, handle)
        out.sum().backward()
    assert torch.equal(out, 2 * x.detach() * w.detach().sum(1, keepdim=True))
    assert torch.equal(x.grad, 2 * w.detach().sum(1, keepdim=True).expand_as(x))
    assert torch.equal(w.grad, 2 * x.detach().sum(1, keepdim=True).expand(T, k))
    _check_provenance(recv_x.detach(), per_expert, rank, dist.get_world_size(), T, H, k, E, "random", M)
    # the guard does catch a host read: the unpadded path reads the counts table once
    try:
        with no_host_reads():
            moe_dispatch(x, idx, w, E, backend="triton")
    except AssertionError as e:
        return str(e)
    return None


@pytest.mark.timeout(200)
def test_padded_dispatch_combine_and_backward_read_nothing_on_the_host(pools):
    caught = pools(2).run(_padded_round_trip, 7, 3, 2, 4, 7)
    assert all(c and c.startswith("host read Tensor.") and "moe/dispatch.py" in c for c in caught)


def _loopback_case(world, T, k, E, M, dtype, device="cpu"):
    H = 3
    xs = [_tokens(r, T, H).to(dtype).to(device) for r in range(world)]  # small integers: exact in bf16
    idxs = [_routing(r, T, k, E, "random").to(device) for r in range(world)]
    ws = [((torch.arange(T * k, dtype=torch.float32).view(T, k) % 4 + 1) / 4).to(device) for _ in range(world)]
    with fusedpar.comm.count_bytes() as counter:
        results = moe_dispatch_loopback(xs, idxs, ws, E, max_tokens_per_rank=M)
        outs = moe_combine_loopback([recv_x for recv_x, _, _ in results], [h for _, _, h in results])
    routed_away = 0
    for r, ((recv_x, per_expert, _), out) in enumerate(zip(results, outs)):
        assert recv_x.dtype == out.dtype == dtype
        _check_provenance(recv_x.float().cpu(), per_expert.cpu(), r, world, T, H, k, E, "random", M)
        assert torch.equal(out, (xs[r] * ws[r].sum(1, keepdim=True)).to(dtype))
        routed_away += int((idxs[r] // (E // world) != r).sum())
    nbytes = routed_away * H * xs[0].element_size()
    assert counter.by_op() == {("moe_dispatch", "triton"): nbytes, ("moe_combine", "triton"): nbytes}


@pytest.mark.parametrize("world, T, k, E, M, dtype", [(2, 9, 2, 4, None, torch.float32),
                                                      (4, 6, 4, 8, 6, torch.float32),
                                                      (2, 0, 1, 4, 1, torch.float32),
                                                      (2, 7, 2, 8, 7, torch.bfloat16)])
def test_loopback_routes_every_copy(world, T, k, E, M, dtype):
    _loopback_case(world, T, k, E, M, dtype)


@requires_cuda
@pytest.mark.parametrize("M", [None, 40])
def test_loopback_on_gpu(M):
    _loopback_case(4, 40, 2, 16, M, torch.bfloat16, "cuda")


EPOCH_LAUNCHERS = [(protocol.TRITON_LAUNCHERS, name) for name in ("wait_flags", "signal_peers", "all_gather_pull")] + [
    (dispatch_kernels, "check_capacity")]


def _round_trip_loopback(world, T, k, E, M, salt):
    """One padded dispatch + combine of every rank (salted data); checks and returns outputs."""
    xs = [_tokens(r, T, 3) + 100 * salt for r in range(world)]
    idxs = [_routing(r + salt, T, k, E, "random") for r in range(world)]
    ws = [torch.full((T, k), 0.25 * (salt + 1)) for _ in range(world)]
    results = moe_dispatch_loopback(xs, idxs, ws, E, max_tokens_per_rank=M)
    outs = moe_combine_loopback([recv_x * 2 for recv_x, _, _ in results], [h for _, _, h in results])
    for r, out in enumerate(outs):
        assert torch.equal(out, 2 * xs[r] * ws[r].sum(1, keepdim=True))
    return results


@pytest.fixture
def fresh_loopback_buffers():
    """Loopback buffers no other test has touched, dropped afterwards (this test moves them to
    device-held epochs)."""
    fusedpar.comm.release_buffers()
    yield
    fusedpar.comm.release_buffers()


def test_loopback_launches_the_same_arguments_every_call(fresh_loopback_buffers):
    """What lets a CUDA graph replay dispatch + combine (GPU test below): epochs live on the
    device, so every scalar a kernel takes is the same in every call, while the rows stay
    right; an all_gather_matmul call in between changes nothing of it."""
    world, T, k, E, M = 2, 6, 2, 4, 6
    views = get_loopback_buffers(world, 1 << 16, torch.device("cpu"))
    per_call = []
    for salt in range(3):
        a = [torch.full((4, 8), float(r + salt)) for r in range(world)]
        (gathered, (out,)), _ = fusedpar.ops.all_gather_matmul_loopback(a, [torch.eye(8)])
        assert torch.equal(out, torch.cat(a))
        with scalar_arguments(EPOCH_LAUNCHERS) as launches:
            _round_trip_loopback(world, T, k, E, M, salt)
        per_call.append(launches)
    assert per_call[0] == per_call[1] == per_call[2] and per_call[0]
    assert get_loopback_buffers(world, 1 << 16, torch.device("cpu"))[0] is views[0]
    epochs = [int(v.pad()[layout.EPOCH]) for v in views]
    assert epochs == [v.epoch for v in views] and len(set(epochs)) == 1
    for v in views:  # the kernels raised the flags to the device-held epoch
        peer = 1 - v.rank
        assert [int(v.pad()[layout.READY + peer]), int(v.pad()[layout.DONE + peer])] == epochs


@requires_cuda
def test_gpu_cuda_graph_replays_padded_dispatch_and_combine():
    """Capture the loopback dispatch + combine with max_tokens_per_rank once and replay it with
    new routing each time: rows, counts and outputs are right after every replay, and an
    eager call between replays (same buffers, device-held epochs) agrees."""
    world, T, H, k, E = 4, 48, 16, 2, 8
    device = torch.device("cuda")
    xs = [_tokens(r, T, H).to(device) for r in range(world)]
    idxs = [torch.empty(T, k, dtype=torch.int64, device=device) for _ in range(world)]
    ws = [torch.empty(T, k, device=device) for _ in range(world)]

    def route(salt):
        routings = [(_routing(r, T, k, E, "random") + salt) % E for r in range(world)]
        for idx, w, routing in zip(idxs, ws, routings):
            idx.copy_(routing)
            w.fill_(0.25 * (salt + 1))
        return routings

    def step():
        results = moe_dispatch_loopback(xs, idxs, ws, E, max_tokens_per_rank=T)
        outs = moe_combine_loopback([recv_x * 2 for recv_x, _, _ in results], [h for _, _, h in results])
        return [(recv_x, per_expert) for recv_x, per_expert, _ in results], outs

    def check(routings, received, outs):
        for r, ((recv_x, per_expert), out) in enumerate(zip(received, outs)):
            _check_provenance(recv_x.cpu(), per_expert.cpu(), r, world, T, H, k, E, None, T, routings)
            assert torch.equal(out, 2 * xs[r] * ws[r].sum(1, keepdim=True))

    route(0)
    graph, (received, outs) = captured(step)
    views = get_loopback_buffers(world, 1, device)
    assert all(view.captured for view in views)
    host_epoch = views[0].epoch
    words = [int(views[0].pad()[layout.EPOCH])]
    for salt in range(1, 4):
        routings = route(salt)
        graph.replay()
        check(routings, received, outs)
        views[0].synchronize()  # raises what a replay recorded
        words.append(int(views[0].pad()[layout.EPOCH]))
        if salt == 2:
            check(routings, *step())
            words.append(int(views[0].pad()[layout.EPOCH]))
    # every replay and the eager step advance the device word by the same number of calls;
    # the host counts the eager calls only
    steps = [after - before for before, after in zip(words, words[1:])]
    assert steps[0] > 0 and steps == [steps[0]] * 4, words
    assert views[0].epoch == host_epoch + steps[0]


def _gpu_graph_one_rank(T, H, k, E):
    """One rank on torch symmetric memory: dispatch, combine and their backward (the custom
    op both directions use) captured in one CUDA graph and replayed with new routing."""
    x = _tokens(0, T, H).cuda().requires_grad_()
    idx = torch.empty(T, k, dtype=torch.int64, device="cuda")
    w = torch.empty(T, k, device="cuda")

    def step():
        recv_x, _, handle = moe_dispatch(x, idx, w, E, max_tokens_per_rank=T, backend="triton")
        out = moe_combine(recv_x * 3, handle)
        return out, torch.autograd.grad(out.sum(), x)[0]

    idx.copy_(_routing(0, T, k, E, "random"))
    w.fill_(0.5)
    graph, (out, grad) = captured(step)
    results = []
    for salt in range(1, 4):
        idx.copy_((_routing(0, T, k, E, "random") + salt) % E)
        w.fill_(0.25 * salt)
        graph.replay()
        results.append(torch.equal(out, 3 * x.detach() * 0.25 * salt * k)
                       and torch.equal(grad, torch.full_like(x, 3 * 0.25 * salt * k)))
    buf = fusedpar.comm.get_buffer(dist.group.WORLD, 1, x.device)
    buf.synchronize()
    return results, buf.backend, buf.captured


@requires_cuda
def test_gpu_cuda_graph_captures_dispatch_combine_and_backward_on_one_rank(pools):
    assert pools(1).run(_gpu_graph_one_rank, 16, 8, 2, 4) == [([True] * 3, "torch", True)]


@requires_cuda
def test_gpu_capturing_a_dispatch_that_reads_the_host_raises():
    x = torch.ones(4, 8, device="cuda")
    idx, w = torch.zeros(4, 1, dtype=torch.int64, device="cuda"), torch.ones(4, 1, device="cuda")
    moe_dispatch_loopback([x, x], [idx, idx], [w, w], 4)  # eager: fine
    with pytest.raises(fusedpar.FusedparError, match="only the triton backend with max_tokens_per_rank"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            moe_dispatch_loopback([x, x], [idx, idx], [w, w], 4)


@pytest.mark.parametrize("M", [None, 5])
def test_loopback_ranks_with_different_token_counts(M):
    Ts, k, E = [5, 0, 3], 2, 6
    xs = [_tokens(r, T, 4) for r, T in enumerate(Ts)]
    idxs = [_routing(r, T, k, E, "random") for r, T in enumerate(Ts)]
    ws = [torch.full((T, k), 0.5) for T in Ts]
    results = moe_dispatch_loopback(xs, idxs, ws, E, max_tokens_per_rank=M)
    outs = moe_combine_loopback([recv_x for recv_x, _, _ in results], [h for _, _, h in results])
    for r, ((_, per_expert, _), out) in enumerate(zip(results, outs)):
        assert torch.equal(out, xs[r])  # two copies of weight 1/2
        mine = range(2 * r, 2 * r + 2)
        assert per_expert.tolist() == [sum(int((i == e).sum()) for i in idxs) for e in mine]


def test_loopback_rejects_mismatched_ranks():
    x, idx, w = torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2)
    with pytest.raises(ValueError, match="the hidden size, dtype, device and k must match"):
        moe_dispatch_loopback([x, torch.zeros(4, 5)], [idx, idx], [w, w], 4)
    with pytest.raises(ValueError, match="one tensor per simulated rank; got 2, 1, 2"):
        moe_dispatch_loopback([x, x], [idx], [w, w], 4)
    (recv, _, handle), _ = moe_dispatch_loopback([x, x], [idx, idx], [w, w], 4)
    with pytest.raises(ValueError, match="one y per simulated rank"):
        moe_combine_loopback([recv], [handle])


def test_the_exchange_is_a_custom_op_with_a_fake():
    """``torch.ops.fusedpar.moe_pull_rows`` (the rows round both directions use) has a fake
    impl: its output shape follows the routes, without a process group."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        rows = torch.empty(5, 3)
        recv_src, send_src = torch.empty(2, 8, dtype=torch.int32), torch.empty(2, 5, dtype=torch.int32)
        table = torch.empty(2, 5, dtype=torch.int32)
        args = (recv_src, send_src, table, "no-such-group", 5, 8, 2, 0)
        recv = torch.ops.fusedpar.moe_pull_rows(rows, *args, "moe_dispatch", False)
        back = torch.ops.fusedpar.moe_pull_rows(recv, *args, "moe_combine", False)
    assert recv.shape == (8, 3) and back.shape == (5, 3)


def _dispatch_padded(x, group):
    E = 2 * dist.get_world_size(group)
    idx = (torch.arange(x.shape[0]) % E).view(-1, 1)
    return moe_dispatch(x, idx, torch.ones(x.shape[0], 1), E, group, max_tokens_per_rank=x.shape[0],
                        backend="triton")


@pytest.mark.timeout(120)
def test_a_stalled_peer_times_out_instead_of_hanging(pools):
    message = stalled_peer_error(pools, _dispatch_padded)
    assert "fusedpar.moe_dispatch: rank 0" in message and "READY[1] (rank 1)" in message, message


def _device_epoch_rounds(T, H, k, E, M):
    """Padded dispatch + combine, the triton all_gather and all_gather_matmul share the
    group's buffer and its device-held epochs: each call advances the EPOCH word once."""
    group, rank, world = subgroup(), dist.get_rank(), dist.get_world_size()
    buf = get_buffer(group, 1, torch.device("cpu"))
    for salt in range(4):
        x = _tokens(rank, T, H) + 100 * salt
        w = torch.full((T, k), 0.25 * (salt + 1))
        recv_x, per_expert, handle = moe_dispatch(x, _routing(rank + salt, T, k, E, "random"), w, E, group,
                                                  max_tokens_per_rank=M, backend="triton")
        assert torch.equal(moe_combine(recv_x * 2, handle), 2 * x * w.sum(1, keepdim=True))
        expected = torch.cat([_tokens(r, T, H) + 100 * salt for r in range(world)])
        assert torch.equal(fusedpar.ops.all_gather(x, 0, group, backend="triton"), expected)
        _, (out,) = fusedpar.ops.all_gather_matmul(x, [torch.eye(H)], 0, group, backend="triton")
        assert torch.equal(out, expected)
    return buf.epoch, int(buf.pad()[layout.EPOCH])


@pytest.mark.timeout(200)
def test_ranks_on_device_held_epochs_exchange_the_right_rows(pools):
    # per round: dispatch and combine (2 calls each: counts and rows; combine 1), all_gather, all_gather_matmul
    assert pools(2).run(_device_epoch_rounds, 5, 3, 2, 4, 5) == [(4 * 5, 4 * 5)] * 2


@pytest.mark.timeout(120)
def test_a_stalled_peer_times_out_on_device_held_epochs(pools):
    """Relative epochs are waited for, not passed: the wait of a call a peer never makes
    times out and names the device-held epoch."""
    message = stalled_peer_error(pools, _dispatch_padded)
    assert "READY[1] (rank 1) to reach epoch 3" in message, message


# ---- float8 dispatch: fp8 rows and their scales, half the bytes -------------------------------------


def _check_float8_rows(data, scale, per_expert, rank, world, T, H, k, E, M):
    """The fp8 rows are ``float8_scales.quantize``'s per-token cast of each source's tokens
    (torchao's cast of a grouped GEMM's input), in recv_x's order; returns the dequantised
    rows (the tokens: small integers are exact in e4m3 with power-of-2 scales)."""
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == data.shape[:-1]
    rows = data.float() * scale[..., None]
    expected = _check_provenance(rows, per_expert, rank, world, T, H, k, E, "random", M)
    compact_data = _compact(data.view(torch.uint8), per_expert, world, M)
    compact_scale = _compact(scale[..., None], per_expert, world, M)[:, 0]
    casts = [float8_scales.quantize(_tokens(src, T, H).bfloat16(), torch.float8_e4m3fn, -1, True)
             for src in range(world)]
    assert torch.equal(compact_data, torch.stack([casts[s][0][t].view(torch.uint8) for s, t in expected])
                       if expected else compact_data)
    assert torch.equal(compact_scale, torch.stack([casts[s][1][t, 0] for s, t in expected])
                       if expected else compact_scale)
    return rows, expected


def _float8_dispatch(cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    for T, H, k, E, M, backend in cases:
        idx = _routing(rank, T, k, E, "random")
        w = (torch.arange(T * k, dtype=torch.float32).view(T, k) % 4 + 1) / 4
        x = _tokens(rank, T, H).bfloat16()  # row t of rank r: [r, t, small integers]
        if backend == "triton":
            poison_symmetric(dist.group.WORLD, 1 << 16)
        with fusedpar.comm.count_bytes() as fp8_bytes:
            (data, scale), per_expert, handle = moe_dispatch(x, idx, w, E, max_tokens_per_rank=M,
                                                             float8="rowwise", backend=backend)
        rows, expected = _check_float8_rows(data, scale, per_expert, rank, world, T, H, k, E, M)
        out = moe_combine(rows.bfloat16(), handle)  # identity experts; combine in bf16
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, (x.float() * w.sum(1, keepdim=True)).bfloat16())
        with fusedpar.comm.count_bytes() as bf16_bytes:
            moe_dispatch(x, idx, w, E, max_tokens_per_rank=M, backend=backend)
        from_peers = sum(1 for src, _ in expected if src != rank)
        fp8, bf16 = fp8_bytes.by_op()[("moe_dispatch", backend)], bf16_bytes.by_op()[("moe_dispatch", backend)]
        # the lower bound: each row from a peer once, its H fp8 bytes and one fp32 scale
        assert fp8 == from_peers * (H + 4) and bf16 == from_peers * H * 2, (fp8, bf16, from_peers)
        assert fp8 <= 0.55 * bf16 or from_peers == 0
    return True


# (T, H, k, E, max_tokens_per_rank, backend): H = 64, so an fp8 row is 68 / 128 = 0.53 of bf16's
FLOAT8_CASES = {2: [(9, 64, 2, 8, None, "reference"), (7, 64, 3, 4, 7, "triton"), (0, 64, 2, 4, None, "reference")],
                4: [(6, 64, 2, 8, 6, "reference"), (9, 64, 1, 4, None, "triton")]}


@pytest.mark.parametrize("world", [2, 4])
def test_float8_dispatch_sends_fp8_rows_and_scales(pools, world):
    assert pools(world).run(_float8_dispatch, FLOAT8_CASES[world]) == [True] * world


@pytest.mark.parametrize("world, M", [(2, None), (4, 5)])
def test_float8_dispatch_loopback(world, M):
    T, H, k, E = 5, 64, 2, 8
    xs = [_tokens(r, T, H).bfloat16() for r in range(world)]
    idxs = [_routing(r, T, k, E, "random") for r in range(world)]
    ws = [torch.ones(T, k) for _ in range(world)]
    results = moe_dispatch_loopback(xs, idxs, ws, E, max_tokens_per_rank=M, float8="rowwise")
    ys = []
    for r, ((data, scale), per_expert, _) in enumerate(results):
        rows, _ = _check_float8_rows(data, scale, per_expert, r, world, T, H, k, E, M)
        ys.append(rows.bfloat16())
    outs = moe_combine_loopback(ys, [h for *_, h in results])
    assert all(torch.equal(out, (x.float() * k).bfloat16()) for out, x in zip(outs, xs))


def test_float8_dispatch_refuses_a_tensorwise_cast():
    with pytest.raises(ValueError, match=r"float8='tensorwise' casts the input with one scale per tensor.*'rowwise'"):
        moe_dispatch_loopback([torch.zeros(2, 16)] * 2, [torch.zeros(2, 1, dtype=torch.long)] * 2,
                              [torch.ones(2, 1)] * 2, 2, float8="tensorwise")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_gather_casts_each_copy_as_torchao(dtype):
    """The permutation kernel that casts each copy as it gathers it (the staged rows of an
    fp8 dispatch) gives ``float8_scales.quantize``'s bytes and scales (torchao's cast) bit for
    bit: rows over six decades, a zero row, bf16 and fp32 x, power-of-2 scales or not;
    rows no copy lands on stay zero."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 100, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    x[3] = 0
    pos = torch.tensor([4, -1, 0, 7, 2, 5, 1, 3, 6, 8, 9, -1, 11, 10, 12, 13, 14, 15], dtype=torch.int32)
    for x in (x, x.bfloat16()):
        for pow2 in (True, False):
            out = permute_kernels.gather_rows_float8(x, pos, 2, 17, dtype, pow2)
            data, scale = float8_scales.quantize(x, dtype, -1, pow2)
            want = torch.cat([data.view(torch.uint8), scale.view(torch.uint8)], 1)
            for i, p in enumerate(pos.tolist()):
                if p >= 0:
                    assert torch.equal(out[p], want[i // 2]), (x.dtype, pow2, i)
            assert not out[16].any()
