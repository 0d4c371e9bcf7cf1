"""CUDA-graph capture of the symmetric-memory ops, its logic checked on CPU with the capture
faked (``symmetric.capturing`` and ``backend.capturing`` say True, as tests/comm/test_symmetric.py
fakes it): what a graph replay freezes of each Triton launch (its non-tensor arguments) is the
same at every call of one signature, epochs are passed as offsets of the device-held EPOCH word,
the host reads nothing back, and what cannot be captured (a plan's first call, a buffer that
must grow) raises before any launch, naming the fix. The real captures and replays are
tests/gpu/test_gpu_graphs.py. Also: ``torch.compile(fullgraph=True)`` (inductor) of a
sequence-parallel column -> row block on the triton backend, on CPU ranks."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fusedpar
from fusedpar.comm import get_buffer, get_loopback_buffers, layout, symmetric
from fusedpar.errors import FusedparError
from fusedpar.ops import backend
from tests.ops.collective_cases import env, rank_data, scalar_arguments, subgroup
from tests.ops.test_moe_dispatch import no_host_reads

pytestmark = [pytest.mark.timeout(300)]

# where a host read would be a device-to-host sync (illegal while a CUDA graph is captured)
CAPTURED_FILES = tuple(f"fusedpar/ops/{name}.py" for name in (
    "all_gather", "reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter", "scaled_matmul",
    "protocol", "backend", "calls")) + tuple(f"fusedpar/kernels/{name}.py" for name in (
        "signal", "all_gather", "reduce_scatter", "gemm_peers", "matmul_reduce_scatter", "gemm")) + (
    "fusedpar/comm/symmetric.py",)

OPS = ["all_gather", "reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter"]


@contextlib.contextmanager
def faked_capture():
    """Every check of fusedpar's capture path says a CUDA graph is being captured (on CPU,
    where nothing is), and no host read happens in fusedpar's code of these ops."""
    saved = symmetric.capturing, backend.capturing
    symmetric.capturing = backend.capturing = lambda device: True
    try:
        with no_host_reads(CAPTURED_FILES):
            yield
    finally:
        symmetric.capturing, backend.capturing = saved


def epochs_of(launches) -> list:
    """Every epoch argument of recorded Triton launches (``scalar_arguments()`` records)."""
    return [value for _, _, args in launches for name, value in args if "epoch" in name]


def check_frozen(launches_per_call: list[list]) -> None:
    """Every call launched the same kernels with the same non-tensor arguments (what a
    replay would freeze), and its epochs are offsets (<= 0: the device's EPOCH word plus it)."""
    first = launches_per_call[0]
    assert first, "no Triton launch recorded"
    for i, launches in enumerate(launches_per_call[1:], 1):
        assert launches == first, f"call {i} launched other arguments than call 0:\n{launches}\n{first}"
    epochs = epochs_of(first)
    assert epochs and all(e <= 0 for e in epochs), epochs


# ---- loopback: every simulated rank in this process -------------------------------------------

W = 3  # odd: no rank arithmetic that happens to work for powers of two


def _b(k: int, n: int, salt: int, rank: int = 0) -> torch.Tensor:
    """Small integers in [-1, 1] (exact products and sums), rank- and salt-dependent."""
    return ((torch.arange(k * n).view(k, n) * (rank + 2) + salt) % 3 - 1).float()


def _loopback_call(op: str, salt: int) -> None:
    """One loopback call of ``op`` on W ranks' rank-encoded inputs (they change with ``salt``),
    its outputs checked exactly against torch."""
    if op == "all_gather":
        xs = [rank_data((3, 5), torch.float32, r, salt) for r in range(W)]
        for out in fusedpar.ops.all_gather_loopback(xs, 1):
            assert torch.equal(out, torch.cat(xs, 1)), salt
    elif op == "reduce_scatter":
        xs = [rank_data((2 * W, 5), torch.float32, r, salt) for r in range(W)]
        total = torch.stack(xs).sum(0)
        for r, out in enumerate(fusedpar.ops.reduce_scatter_loopback(xs, "sum", 0)):
            assert torch.equal(out, total.chunk(W, 0)[r]), salt
    elif op == "all_gather_matmul":
        shards = [rank_data((5, 8), torch.float32, r, salt) for r in range(W)]
        bs = [_b(8, 7, salt), _b(8, 3, salt + 1)]
        a = torch.cat(shards)
        for gathered, outs in fusedpar.ops.all_gather_matmul_loopback(shards, bs, 0, return_A=True):
            assert torch.equal(gathered, a), salt
            assert all(torch.equal(out, a @ b) for out, b in zip(outs, bs)), salt
    elif op == "all_gather_scaled_matmul":  # fp8, the shards' row scales travelling with their rows
        shards = [(rank_data((5, 8), torch.float32, r, salt) % 9 - 4).to(torch.float8_e4m3fn)
                  for r in range(W)]
        scales = [torch.full((5, 1), 2.0 ** (r - salt)) for r in range(W)]
        bs = [_b(8, 7, salt).to(torch.float8_e4m3fn), _b(8, 3, salt + 1).to(torch.float8_e4m3fn)]
        b_scales = [torch.full((1, 7), 0.5), torch.ones(())]
        a = torch.cat([s.float() * c for s, c in zip(shards, scales)])
        for gathered, outs in fusedpar.ops.all_gather_scaled_matmul_loopback(
                shards, bs, scales, b_scales, 0, out_dtypes=[torch.float32] * 2):
            assert torch.equal(gathered.float(), torch.cat(shards).float()), salt
            assert all(torch.equal(out, a @ (b.float() * c))
                       for out, b, c in zip(outs, bs, b_scales)), salt
    elif op == "scaled_matmul_reduce_scatter":  # fp8, A's row scales, B's column scales
        As = [(rank_data((W * 3, 8), torch.float32, r, salt) % 9 - 4).to(torch.float8_e4m3fn) for r in range(W)]
        scales = [torch.full((W * 3, 1), 2.0 ** (r - salt)) for r in range(W)]
        Bs = [_b(8, 6, salt, r).to(torch.float8_e4m3fn) for r in range(W)]
        b_scales = [torch.full((1, 6), 0.5 * (r + 1)) for r in range(W)]
        total = sum((a.float() * s) @ (b.float() * c) for a, s, b, c in zip(As, scales, Bs, b_scales))
        for r, out in enumerate(fusedpar.ops.scaled_matmul_reduce_scatter_loopback(
                As, Bs, scales, b_scales, "sum", 0, out_dtype=torch.float32)):
            assert torch.equal(out, total.chunk(W, 0)[r]), salt
    else:
        As = [rank_data((W * 3, 8), torch.float32, r, salt) for r in range(W)]
        Bs = [_b(8, 6, salt, r) for r in range(W)]
        total = sum(a @ b for a, b in zip(As, Bs))
        for r, out in enumerate(fusedpar.ops.matmul_reduce_scatter_loopback(As, Bs, "sum", 0)):
            assert torch.equal(out, total.chunk(W, 0)[r]), salt


@pytest.fixture
def fresh_loopback_buffers():
    fusedpar.comm.release_buffers()
    yield
    fusedpar.comm.release_buffers()


@pytest.mark.parametrize("op", OPS + ["all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"])
def test_loopback_launches_freeze_the_same_arguments_under_capture(fresh_loopback_buffers, op):
    """One eager call, then two under a faked capture with new inputs: every call launches the
    same kernels with the same non-tensor arguments, so a graph captured at the second would
    replay the third; each is right for its own inputs; the epochs are offsets; nothing is
    read back on the host; the buffer knows it was captured."""
    calls = []
    with scalar_arguments() as launches:
        _loopback_call(op, 0)
    calls.append(launches)
    for salt in (1, 2):
        with faked_capture(), scalar_arguments() as launches:
            _loopback_call(op, salt)
        calls.append(launches)
    check_frozen(calls)
    views = get_loopback_buffers(W, 1, torch.device("cpu"))
    assert all(v.captured and not v.in_call for v in views)
    assert all(int(v.pad()[layout.DESC]) == symmetric.UNRECORDED for v in views)
    epochs = [int(v.pad()[layout.EPOCH]) for v in views]
    assert epochs == [v.epoch for v in views] == [3] * W  # one device epoch per call
    _loopback_call(op, 3)  # eager again after the capture: still right


def test_loopback_buffers_cannot_grow_under_capture(fresh_loopback_buffers):
    """A loopback call that needs bigger buffers than the last eager call made raises under a
    capture, before it starts (the views stay usable), naming the fix."""
    xs = [torch.ones(8, 4) for _ in range(2)]
    fusedpar.ops.all_gather_loopback(xs, 0)
    capacity = get_loopback_buffers(2, 1, torch.device("cpu"))[0].capacity
    big = [torch.ones(capacity // 4 + 1) for _ in range(2)]
    with faked_capture(), pytest.raises(FusedparError, match="during CUDA-graph capture; run one "
                                        "eager call first or set FUSEDPAR_SYMM_BYTES"):
        fusedpar.ops.all_gather_loopback(big, 0)
    views = get_loopback_buffers(2, 1, torch.device("cpu"))
    assert views[0].capacity == capacity and not any(v.in_call or v.failure for v in views)
    assert all(torch.equal(out, torch.ones(16, 4)) for out in fusedpar.ops.all_gather_loopback(xs, 0))


def test_a_group_buffer_cannot_grow_under_capture():
    """``get_buffer`` never allocates while a graph is captured: a group without a buffer big
    enough raises naming the fix (no collective is started: a stand-in group suffices)."""
    group = type("Group", (), {"group_name": "never-used"})()
    with faked_capture(), pytest.raises(FusedparError, match="must grow to 64 bytes during CUDA-graph "
                                        "capture; run one eager step first or set FUSEDPAR_SYMM_BYTES"):
        get_buffer(group, 64, torch.device("cpu"))


def test_making_a_plan_under_capture_raises_naming_the_fix():
    """``Plans.make`` checks, may agree across ranks and allocates: under a capture it raises
    before building anything; outside one it builds and keeps the plan."""
    plans = backend.Plans("all_gather_matmul")
    built = []

    def build():
        built.append(1)

        def plan():
            return None

        return plan

    with faked_capture(), pytest.raises(FusedparError, match=r"fusedpar\.all_gather_matmul: the first call "
                                        r"of this signature .* run one eager call of it before capturing"):
        plans.make("key", torch.device("cpu"), build)
    assert not built and plans.get("key") is None
    plan = plans.make("key", torch.device("cpu"), build)
    assert built == [1] and plans.get("key") is plan
    with faked_capture():
        assert plans.get("key") is plan  # a plan made eagerly serves the capture


# ---- a process group: plans, forward and backward ------------------------------------------------


def _group_step(op: str, group, salt: int, scale: int = 1) -> list[torch.Tensor]:
    """``op`` (triton) forward and backward on this rank's rank-encoded inputs (changing with
    ``salt``; ``scale`` changes the signature): outputs and input gradients, the forward
    checked against torch."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if op == "all_gather":
        xs = [rank_data((3 * scale, 5), torch.float32, r, salt) for r in range(world)]
        x = xs[rank].clone().requires_grad_()
        out = fusedpar.ops.all_gather(x, 1, group, backend="triton")
        assert torch.equal(out, torch.cat(xs, 1))
        leaves = [x]
    elif op == "reduce_scatter":
        xs = [rank_data((2 * world * scale, 5), torch.float32, r, salt) for r in range(world)]
        x = xs[rank].clone().requires_grad_()
        out = fusedpar.ops.reduce_scatter(x, "sum", 0, group, backend="triton")
        assert torch.equal(out, torch.stack(xs).sum(0).chunk(world, 0)[rank])
        leaves = [x]
    elif op == "all_gather_matmul":
        shards = [rank_data((5 * scale, 8), torch.float32, r, salt) for r in range(world)]
        a = shards[rank].clone().requires_grad_()
        b = _b(8, 7, salt, rank).requires_grad_()  # this rank's columns
        gathered, (out,) = fusedpar.ops.all_gather_matmul(a, [b], 0, group, backend="triton")
        assert torch.equal(out, torch.cat(shards) @ b.detach())
        out = torch.cat([gathered, out], 1)
        leaves = [a, b]
    else:
        As = [rank_data((3 * world * scale, 8), torch.float32, r, salt) for r in range(world)]
        Bs = [_b(8, 6, salt, r) for r in range(world)]
        a, b = As[rank].clone().requires_grad_(), Bs[rank].clone().requires_grad_()
        out = fusedpar.ops.matmul_reduce_scatter(a, b, "sum", 0, group, backend="triton")
        total = sum(x @ y for x, y in zip(As, Bs))
        assert torch.equal(out, total.chunk(world, 0)[rank])
        leaves = [a, b]
    weight = rank_data(tuple(out.shape), torch.float32, rank, salt + 7)  # dY encodes the rank
    grads = torch.autograd.grad((out * weight).sum(), leaves)
    return [out.detach(), *grads]


def _group_under_capture(op: str):
    """Per rank: one eager forward + backward of ``op``, then two under a faked capture with
    new inputs (each bitwise equal to an eager one on the same inputs, launching what the
    first did); a new signature under the capture raises before launching anything."""
    group = subgroup()
    calls = []
    with scalar_arguments() as launches:
        _group_step(op, group, 0)
    calls.append(launches)
    for salt in (1, 2):
        with faked_capture(), scalar_arguments() as launches:
            got = _group_step(op, group, salt)
        calls.append(launches)
        want = _group_step(op, group, salt)  # eager, same inputs
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (op, salt)
    check_frozen(calls)
    buf = get_buffer(group, 1, torch.device("cpu"))
    with faked_capture(), scalar_arguments() as launches:
        try:
            _group_step(op, group, 3, scale=2)
            error = None
        except FusedparError as e:
            error = str(e)
    assert not launches and not buf.in_call and not buf.failure
    _group_step(op, group, 4)  # the group still works
    return error


@pytest.mark.parametrize("op", OPS)
def test_group_calls_warmed_up_once_run_under_capture_forward_and_backward(pools, op):
    errors = pools(2).run(_group_under_capture, op)
    for error in errors:
        assert error and f"fusedpar.{op}: the first call of this signature" in error, error
        assert "run one eager call of it before capturing" in error, error


def _warm_step_after_growth():
    """One eager step of calls on the group's symmetric buffer, the last growing it; then the
    same step under a faked capture (the fused matmuls' and all_gather's plans follow it)."""
    group = subgroup()
    small = torch.ones(16, 4)
    large = torch.ones(1024, 4)  # 16 KiB: more than FUSEDPAR_SYMM_BYTES
    world = dist.get_world_size(group)

    b = torch.eye(4)

    def step():  # the calls of small inputs first: their plans predate the growth
        _, (out,) = fusedpar.ops.all_gather_matmul(small, [b], 0, group, return_A=False, backend="triton")
        assert torch.equal(out, small.repeat(world, 1))
        reduced = fusedpar.ops.matmul_reduce_scatter(small, b, "sum", 0, group, backend="triton")
        assert torch.equal(reduced, world * small[: 16 // world])
        for x in (small, large):
            assert torch.equal(fusedpar.ops.all_gather(x, 0, group, backend="triton"), x.repeat(world, 1))

    with env(FUSEDPAR_SYMM_BYTES=4096):
        step()  # the warm-up: the large call grows the buffer made by the small one
        try:
            with faked_capture():
                step()
        except FusedparError as e:
            return str(e)
    return None


def test_a_step_warmed_up_once_can_be_captured_when_a_later_call_grew_the_buffer(pools):
    """DESIGN §3: one eager warm-up per shape, then capture. A warm-up step whose later call
    grows the group's buffer retires the plans of the calls before it; the capture of the
    same step must still find (or remake without allocating) their plans."""
    assert pools(2).run(_warm_step_after_growth) == [None, None]


# ---- torch.compile (inductor) of a tensor-parallel block on the triton backend -------------------


def _tp_block(group, seed=0, hidden=16, ffn=24):
    """A sequence-parallel column -> SiLU -> row MLP (no bias: nothing but the fused ops
    crosses ranks) from one seeded full MLP, on the triton backend."""
    torch.manual_seed(seed)
    up, down = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)
    col = fusedpar.nn.ColumnParallelLinear.from_linear(up, group, sequence_parallel=True, backend="triton")
    row = fusedpar.nn.RowParallelLinear.from_linear(down, group, sequence_parallel=True, backend="triton")
    return nn.Sequential(col, nn.SiLU(), row)


def _compiled_block():
    import torch._dynamo

    from fusedpar.nn.linear import local

    rank, world = dist.get_rank(), dist.get_world_size()
    group = subgroup()
    eager = _tp_block(group)
    compiled_block = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_block, fullgraph=True)  # inductor
    results = []
    for block, run in ((eager, eager), (compiled_block, compiled), (compiled_block, compiled)):
        x = (torch.randn(2, 4 * world, 16, generator=torch.Generator().manual_seed(rank)) + rank)
        x.requires_grad_()
        out = run(x)
        (out * (rank + 1)).sum().backward()
        results.append([out.detach(), x.grad] + [local(p.grad).clone() for p in block.parameters()])
        block.zero_grad()
    for got in results[1:]:
        for g, w in zip(got, results[0]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    return True


def test_torch_compile_fullgraph_inductor_of_a_tp_block(pools):
    assert pools(2).run(_compiled_block) == [True, True]
