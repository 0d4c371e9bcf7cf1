"""CUDA-graph capture and replay of the symmetric-memory ops, triton backend (issue 43): the
fused matmuls and the collectives, in loopback (every rank in this process) and in process
groups (one rank in the pytest process; ranks spawned onto the one GPU, tests/gpu/conftest.py),
forward and backward, and ``torch.compile(mode="reduce-overhead")`` of a tensor-parallel block.

Each capture follows one eager warm-up (``captured``: on a side stream, as torch advises); each
replay gets new rank-encoded inputs copied into the captured ones, its outputs and the
symmetric buffers poisoned first, and must equal bitwise an eager call on the same inputs
(which an oracle checks where it is cheap). What cannot be captured raises before the capture
does anything: a signature's first call, a buffer that must grow. Skipped without a GPU; the
capture logic is also checked on CPU with the capture faked (tests/ops/test_graphs.py)."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fusedpar
from fusedpar.comm import get_buffer, get_loopback_buffers
from fusedpar.errors import FusedparError
from fusedpar.testing.collectives import demo_input, symmetric_backend_names
from tests.gpu.conftest import NEEDS_GPU
from tests.ops.collective_cases import (
    captured,
    poison_symmetric,
    rank_data,
    requires_cuda,
    subgroup,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

OPS = ["all_gather", "reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter"]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _flat(nest) -> list[torch.Tensor]:
    """The tensors of a nest of tuples / lists (None left out), in order."""
    if isinstance(nest, torch.Tensor):
        return [nest]
    if isinstance(nest, (tuple, list)):
        return [t for item in nest for t in _flat(item)]
    return []


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} outputs, eager {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: output {i} {g.shape} vs {w.shape}"
        assert torch.equal(_bits(g), _bits(w)), (
            f"{what}: output {i} differs from the eager call's in "
            f"{int((g.float() != w.float()).sum())} of {g.numel()} elements")


def replays_match_eager(step, fill, poison, replays: int = 3) -> list[torch.Tensor]:
    """Capture ``step()`` after one eager warm-up (inputs ``fill(0)``), then ``replays`` times:
    ``fill(salt)`` (new values in the captured inputs), ``poison()`` the symmetric buffers and
    NaN-fill the graph's outputs, replay, and compare bitwise with an eager ``step()`` on the
    same inputs (buffers poisoned again before it). Returns the last replay's outputs."""
    fill(0)
    graph, outs = captured(step)
    outs = _flat(outs)
    assert outs, "the step returned no tensor"
    for salt in range(1, replays + 1):
        fill(salt)
        poison()
        for t in outs:
            if t.is_floating_point():
                t.detach().fill_(float("nan"))
        graph.replay()
        got = [t.detach().clone() for t in outs]
        poison()
        _assert_bitwise(got, [t.detach() for t in _flat(step())], f"replay {salt}")
    return got


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    got, want = got.detach().double(), want.detach().double()
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert torch.isfinite(got).all() and err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


# ---- loopback: every simulated rank in this process -----------------------------------------------


def _poison_loopback(world: int, device) -> None:
    torch.cuda.synchronize()
    for view in get_loopback_buffers(world, 1, device):
        view.data(torch.uint8, view.capacity).fill_(0xFF)


# (world, dtype, copy engine: the fused matmuls' copies on the side stream, as a group on a GPU)
LOOPBACK_CASES = [(1, torch.bfloat16, False), (1, torch.float32, False), (2, torch.bfloat16, True),
                  (2, torch.float32, False), (8, torch.bfloat16, False), (8, torch.float32, True)]


@requires_cuda
@pytest.mark.parametrize("world, dtype, engine", LOOPBACK_CASES,
                         ids=[f"W{w}-{str(d)[6:]}{'-engine' if e else ''}" for w, d, e in LOOPBACK_CASES])
def test_gpu_loopback_replays_match_eager(world, dtype, engine):
    """The four loopback ops in one graph, odd shapes: each replay equals an eager call bitwise
    and is right for its own inputs."""
    dev = _device()
    m, k, ns, n2 = 13, 40, (56, 24), 48
    shards = [torch.empty(2, m, k, dtype=dtype, device=dev) for _ in range(world)]  # gathered along dim 1
    bs = [torch.empty(k, n, dtype=dtype, device=dev) for n in ns]
    As = [torch.empty(world * 7, k, dtype=dtype, device=dev) for _ in range(world)]
    Bs = [torch.empty(k, n2, dtype=dtype, device=dev) for _ in range(world)]
    xs = [torch.empty(5, 3, 7, dtype=dtype, device=dev) for _ in range(world)]
    ys = [torch.empty(3, 2 * world, 5, dtype=dtype, device=dev) for _ in range(world)]

    def small(shape, salt):  # in [-1, 1]: exact products and sums
        return ((torch.arange(math.prod(shape)).view(shape) * 5 + salt) % 3 - 1).to(dtype)

    def fill(salt):
        for r in range(world):
            shards[r].copy_(rank_data(shards[r].shape, dtype, r, salt))
            As[r].copy_(rank_data(As[r].shape, dtype, r, salt + 1))
            Bs[r].copy_(small(Bs[r].shape, salt + r))
            xs[r].copy_(rank_data(xs[r].shape, dtype, r, salt + 2))
            ys[r].copy_(demo_input("reduce_scatter", ys[r].shape, dtype, r, world, salt, dev))
        for j, b in enumerate(bs):
            b.copy_(small(b.shape, salt + 7 * j))

    def step():
        return (fusedpar.ops.all_gather_matmul_loopback(shards, bs, 1, return_A=True, copy_engine=engine),
                fusedpar.ops.matmul_reduce_scatter_loopback(As, Bs, "sum", 0, side_stream=engine),
                fusedpar.ops.all_gather_loopback(xs, 1),
                fusedpar.ops.reduce_scatter_loopback(ys, "sum", 1))

    replays_match_eager(step, fill, lambda: _poison_loopback(world, dev))
    gathered_mm, scattered, gathered, reduced = step()  # eager on the last inputs: the oracle
    a = torch.cat(shards, 1)
    total = sum(x.float() @ y.float() for x, y in zip(As, Bs))
    for r in range(world):
        g, outs = gathered_mm[r]
        assert torch.equal(g, a), f"rank {r} A_gathered"
        for j, (out, b) in enumerate(zip(outs, bs)):
            _close(out, a.float() @ b.float(), TOL[dtype], f"rank {r} out[{j}]")
        _close(scattered[r], total.chunk(world, 0)[r], TOL[dtype], f"rank {r} matmul_reduce_scatter")
        assert torch.equal(gathered[r], torch.cat(xs, 1)), f"rank {r} all_gather"
        assert torch.equal(reduced[r], torch.stack(ys).sum(0).chunk(world, 1)[r]), f"rank {r} reduce_scatter"
    for view in get_loopback_buffers(world, 1, dev):
        view.synchronize()  # raises what a replay recorded


@requires_cuda
@pytest.mark.parametrize("backend", symmetric_backend_names("all_gather"))
def test_gpu_collectives_replay_from_a_cuda_graph(backend):
    """The all_gather and reduce_scatter kernels of either backend and the triton
    matmul_reduce_scatter take epoch offsets: one capture of all three, replayed with new
    inputs, gives the right outputs each time."""
    world = 4
    xs = [torch.empty(8, 5, device="cuda") for _ in range(world)]
    eye = [torch.eye(5, device="cuda")] * world

    def fill(salt):
        for r, x in enumerate(xs):
            x.copy_(rank_data((8, 5), torch.float32, r, salt))

    def step():
        return (fusedpar.ops.all_gather_loopback(xs, 1, backend=backend),
                fusedpar.ops.reduce_scatter_loopback(xs, "sum", 0, backend=backend),
                fusedpar.ops.matmul_reduce_scatter_loopback(xs, eye))

    fill(0)
    graph, (gathered, reduced, scattered) = captured(step)
    for salt in range(1, 4):
        fill(salt)
        graph.replay()
        total = sum(xs)
        assert all(torch.equal(out, torch.cat(xs, 1)) for out in gathered), salt
        assert all(torch.equal(out, total[2 * r:2 * r + 2]) for r, out in enumerate(reduced)), salt
        assert all(torch.equal(out, total[2 * r:2 * r + 2]) for r, out in enumerate(scattered)), salt


@requires_cuda
def test_gpu_loopback_buffers_cannot_grow_under_capture_and_a_captured_one_outlives_growth():
    """A loopback call needing bigger buffers raises under capture, naming the fix; an eager
    call that grows them replaces them, but a graph captured on the old ones still replays
    right (they stay allocated until ``release_buffers``)."""
    world, dev = 2, _device()
    xs = [torch.empty(6, 5, device=dev) for _ in range(world)]

    def fill(salt):
        for r, x in enumerate(xs):
            x.copy_(rank_data((6, 5), torch.float32, r, salt))

    fill(0)
    graph, outs = captured(lambda: fusedpar.ops.all_gather_loopback(xs, 0))
    old = get_loopback_buffers(world, 1, dev)
    big = [torch.ones(old[0].capacity // 4 + 1, device=dev) for _ in range(world)]
    with pytest.raises(FusedparError, match="during CUDA-graph capture; run one eager call first"), \
            torch.cuda.graph(torch.cuda.CUDAGraph()):
        fusedpar.ops.all_gather_loopback(big, 0)
    assert get_loopback_buffers(world, 1, dev)[0] is old[0]
    assert all(torch.equal(out, torch.ones(2 * big[0].numel(), device=dev))
               for out in fusedpar.ops.all_gather_loopback(big, 0))  # eager: grows them
    assert get_loopback_buffers(world, 1, dev)[0] is not old[0]
    for salt in (1, 2):
        fill(salt)
        graph.replay()
        assert all(torch.equal(out, torch.cat(xs)) for out in outs), salt
    for view in old:
        view.synchronize()


# ---- a process group: forward and backward ------------------------------------------------------


def _group_case(op: str, group):
    """``(step, fill)`` for ``op`` (triton) on this rank: static leaves and output weights
    (rank-encoded by ``fill(salt)``), and a step returning the outputs and the leaves' gradients
    of ``(out * weight).sum()``."""
    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), _device()

    def leaf(shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=dev, requires_grad=True)

    if op == "all_gather":
        x = leaf((5, 3, 7), torch.float32)
        leaves, bs = [x], []

        def forward():
            return [fusedpar.ops.all_gather(x, 1, group, backend="triton")]
    elif op == "reduce_scatter":
        x = leaf((3, 4 * world, 5), torch.float32)
        leaves, bs = [x], []

        def forward():
            return [fusedpar.ops.reduce_scatter(x, "sum", 1, group, backend="triton")]
    elif op == "all_gather_matmul":
        a = leaf((2, 7, 40), torch.bfloat16)  # gathered along dim 1
        b1, b2 = leaf((40, 56), torch.bfloat16), leaf((40, 24), torch.bfloat16)
        leaves, bs = [a, b1, b2], [b1, b2]

        def forward():
            gathered, outs = fusedpar.ops.all_gather_matmul(a, [b1, b2], 1, group, backend="triton")
            return [gathered, *outs]
    else:
        a, b = leaf((13 * world, 40), torch.bfloat16), leaf((40, 56), torch.bfloat16)
        leaves, bs = [a, b], [b]

        def forward():
            return [fusedpar.ops.matmul_reduce_scatter(a, b, "sum", 0, group, backend="triton")]

    with torch.no_grad():
        shapes = [t.shape for t in forward()]  # eager: the outputs' shapes (a first call, not captured)
    weights = [torch.empty(s, dtype=leaves[0].dtype, device=dev) for s in shapes]

    def fill(salt):
        with torch.no_grad():
            for i, t in enumerate(leaves + weights):
                if any(t is b for b in bs):  # small values, this rank's columns
                    t.copy_((torch.arange(t.numel()).view(t.shape) * (rank + 2) + salt + i) % 5 - 2)
                else:
                    t.copy_(rank_data(t.shape, t.dtype, rank, salt + 3 * i))

    def step():
        outs = forward()
        loss = sum((out * w).sum() for out, w in zip(outs, weights))
        return [*outs, *torch.autograd.grad(loss, leaves)]

    return step, fill


def _group_replays(op: str, group=None) -> bool:
    """Forward + backward of ``op`` captured after one eager warm-up, replayed on new inputs,
    each replay bitwise the eager result (the group's buffer poisoned before each)."""
    group = subgroup() if group is None else group
    dev = _device()
    step, fill = _group_case(op, group)
    replays_match_eager(step, fill, lambda: poison_symmetric(group, 1, dev))
    torch.cuda.synchronize()
    get_buffer(group, 1, dev).synchronize()  # raises what a replay recorded
    return True


def _forget_group(name: str) -> None:
    """Drop what fusedpar keeps per group name, for a group this process destroys."""
    from fusedpar.comm import symmetric
    from fusedpar.nn import linear

    symmetric._placement.pop(name, None)
    symmetric._peer_access.pop(name, None)
    for key in [key for key in linear._MESHES if key[0] == name]:
        del linear._MESHES[key]


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo world in the pytest process (its symmetric memory: torch's, on this GPU),
    destroyed after the module's tests."""
    if not torch.cuda.is_available():
        pytest.skip(NEEDS_GPU)
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    name = dist.group.WORLD.group_name
    try:
        yield dist.group.WORLD
    finally:
        torch.cuda.synchronize()
        fusedpar.comm.release_buffers()
        dist.destroy_process_group()
        _forget_group(name)


@pytest.mark.parametrize("op", OPS)
def test_gpu_one_rank_group_replays_forward_and_backward(one_rank_group, op):
    assert _group_replays(op, one_rank_group)


@pytest.mark.multirank
@pytest.mark.parametrize("op", OPS)
def test_gpu_shared_ranks_replay_forward_and_backward(gpu_pools, op):
    assert gpu_pools(2).run(_group_replays, op) == [True, True]


def test_gpu_what_cannot_be_captured_raises_naming_the_fix(one_rank_group):
    """A signature's first call under capture raises (its plan would check, agree and
    allocate) before launching anything; a warmed-up one then captures; a group buffer
    cannot grow under capture."""
    group, dev = one_rank_group, _device()
    b = torch.ones(8, 4, device=dev)
    calls = {
        "all_gather": lambda x: fusedpar.ops.all_gather(x, 0, group, backend="triton"),
        "reduce_scatter": lambda x: fusedpar.ops.reduce_scatter(x, "sum", 0, group, backend="triton"),
        "all_gather_matmul": lambda x: fusedpar.ops.all_gather_matmul(x, [b], 0, group, backend="triton"),
        "matmul_reduce_scatter": lambda x: fusedpar.ops.matmul_reduce_scatter(x, b, "sum", 0, group,
                                                                              backend="triton"),
    }
    x = torch.ones(6, 8, device=dev)
    for op, call in calls.items():
        new = torch.ones(11, 8, device=dev)  # a signature no test called
        with pytest.raises(FusedparError, match=rf"fusedpar\.{op}: the first call of this signature"
                                                r".*run one eager call of it before capturing"), \
                torch.cuda.graph(torch.cuda.CUDAGraph()):
            call(new)
        call(x)  # eager
        graph, out = captured(lambda call=call: call(x))
        graph.replay()
        _assert_bitwise(_flat(out), _flat(call(x)), op)
    buf = get_buffer(group, 1, dev)
    with pytest.raises(FusedparError, match="must grow to .* during CUDA-graph capture; run one eager"), \
            torch.cuda.graph(torch.cuda.CUDAGraph()):
        get_buffer(group, buf.capacity + 1, dev)
    assert get_buffer(group, 1, dev) is buf
    buf.synchronize()


# ---- torch.compile(mode="reduce-overhead") of a tensor-parallel block ---------------------------


def _compiled_tp_block(group=None) -> int:
    """A sequence-parallel column -> SiLU -> row MLP (fusedpar.nn, triton backend, bf16, no
    bias: only the fused ops cross ranks) under ``torch.compile(mode="reduce-overhead")``:
    four training steps (warm-up, recording, replays) match the eager block's output and
    gradients on the same inputs, and inductor skipped no CUDA graph. Returns the skips."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fusedpar.nn import ColumnParallelLinear, RowParallelLinear
    from fusedpar.nn.linear import local

    group = subgroup() if group is None else group
    rank, dev = dist.get_rank(group), _device()
    torch.manual_seed(0)
    up = nn.Linear(64, 96, bias=False).to(dev, torch.bfloat16)
    down = nn.Linear(96, 64, bias=False).to(dev, torch.bfloat16)

    def block():
        return nn.Sequential(
            ColumnParallelLinear.from_linear(up, group, sequence_parallel=True, backend="triton"),
            nn.SiLU(),
            RowParallelLinear.from_linear(down, group, sequence_parallel=True, backend="triton"))

    eager, compiled_block = block(), block()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_block, mode="reduce-overhead")
    for it in range(4):
        g = torch.Generator().manual_seed(100 * it + rank)
        x = (torch.randn(2, 8, 64, generator=g) + rank).to(dev, torch.bfloat16)  # this rank's shard
        dy = torch.randn(2, 8, 64, generator=g).to(dev, torch.bfloat16)
        results = []
        for module, run in ((eager, eager), (compiled_block, compiled)):
            torch.compiler.cudagraph_mark_step_begin()
            xi = x.clone().requires_grad_()
            out = run(xi)
            (out * dy).sum().backward()
            results.append([out.detach().clone(), xi.grad.clone()]
                           + [local(p.grad).clone() for p in module.parameters()])
            module.zero_grad(set_to_none=True)
        for i, (got, want) in enumerate(zip(results[1], results[0])):
            _close(got, want, 2e-2, f"step {it}: compiled vs eager, result {i}")
    torch.cuda.synchronize()
    return counters["inductor"]["cudagraph_skips"]


def test_gpu_reduce_overhead_compile_of_a_tp_block_on_one_rank(one_rank_group):
    assert _compiled_tp_block(one_rank_group) == 0


@pytest.mark.multirank
def test_gpu_shared_ranks_reduce_overhead_compile_of_a_tp_block(gpu_pools):
    assert gpu_pools(2).run(_compiled_tp_block) == [0, 0]
