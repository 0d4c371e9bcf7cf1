"""The triton backend of moe_dispatch / moe_combine: no host reads with max_tokens_per_rank,
and the loopback variants (every rank in one process). The routing cases of every backend
are in test_moe.py."""

import contextlib
import sys

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops.moe import moe_combine, moe_combine_loopback, moe_dispatch, moe_dispatch_loopback
from tests.ops.collective_cases import requires_cuda, timeout_case
from tests.ops.test_moe import _check_provenance, _routing, _tokens

pytestmark = [pytest.mark.timeout(300)]

# every way Python code reads a tensor's values on the host (a device-to-host sync on CUDA)
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
MOE_FILES = ("fusedpar/ops/moe.py", "fusedpar/kernels/moe_dispatch.py", "fusedpar/kernels/moe_permute.py")


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
    assert all(c and c.startswith("host read Tensor.") and "moe.py" in c for c in caught)


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
    results = pools(2).run(timeout_case, _dispatch_padded, 1, "stall", 2.0)
    assert results[1] is None
    assert results[0]["elapsed"] < 2.0 * 3, results[0]
    assert "fusedpar.moe_dispatch: rank 0" in results[0]["message"]
    assert "READY[1] (rank 1)" in results[0]["message"], results[0]
