"""What the reference and pipelined backends share in ``protocol``.

Host staging (``protocol.host_staged``): on a group whose CUDA transfers are gloo's (the
shared-GPU test world: NCCL refuses ranks sharing a GPU), collectives and point-to-point
exchanges carry CUDA tensors through host copies, since gloo sends and gathers CPU tensors
only. CPU ranks have no CUDA tensor, so here staging is forced on: every backend built on
these transfers must give exactly its unstaged result, forward and backward.

The input check across ranks (``protocol.raise_on_mismatch``): one all-gather on the first
call of an op on a group, on every call at torch's DETAIL debug level."""

from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops import protocol
from fusedpar.ops.moe.routing import topk_route
from tests.ops.collective_cases import capture_errors, debug_level, subgroup


def _results(group) -> list[torch.Tensor]:
    """Outputs and input gradients of the backends whose transfers go through protocol's
    wrappers: the pipelined fused matmuls (P2P), the pipelined and Ulysses rings (P2P,
    all-to-all), the reference all_gather_matmul (all-gather) and the pipelined MoE experts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 + rank)  # rank-dependent data
    a = torch.randn(5, 12, generator=g).requires_grad_()
    b = torch.randn(12, 7, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = []
    for backend in ("pipelined", "reference"):
        gathered, (y,) = fusedpar.ops.all_gather_matmul(a, [b], 0, group, backend=backend)
        y.square().sum().backward()
        out += [gathered, y, a.grad, b.grad]
        a.grad = b.grad = None
        z = fusedpar.ops.matmul_reduce_scatter(a, b[:, :6], "sum", 1, group, backend=backend)
        z.square().sum().backward()
        out += [z, a.grad, b.grad]
        a.grad = b.grad = None
    q, k, v = (torch.randn(1, 6, 4, 8, generator=g).requires_grad_() for _ in range(3))
    for backend in ("pipelined", "ulysses"):
        o = fusedpar.ops.ring_attention(q, k, v, group, causal=True, backend=backend)
        o.square().sum().backward()
        out += [o, q.grad, k.grad, v.grad]
        q.grad = k.grad = v.grad = None
    torch.manual_seed(0)
    w13, w2 = torch.randn(2, 8, 6).requires_grad_(), torch.randn(2, 6, 4).requires_grad_()
    x = torch.randn(5, 6, generator=g).requires_grad_()
    idx, weights, _ = topk_route(torch.randn(5, 2 * world, generator=g), 2)
    y = fusedpar.ops.moe_experts(x, idx, weights, w13, w2, group, backend="pipelined")
    y.square().sum().backward()
    return out + [y, x.grad, w13.grad, w2.grad]


def _staged_equals_unstaged() -> bool:
    torch.set_num_threads(1)
    group = subgroup()
    plain = _results(group)
    with mock.patch.object(protocol, "host_staged", return_value=True) as staging:
        staged = _results(group)
    assert staging.call_count > 20  # every transfer asked, and went through host copies
    assert len(plain) == len(staged) == 26
    for i, (want, got) in enumerate(zip(plain, staged)):
        assert torch.equal(want, got), f"rank {dist.get_rank()}: result {i} differs when staged"
    return True


def test_staged_transfers_equal_unstaged(pools):
    assert pools(2).run(_staged_equals_unstaged, timeout=300) == [True, True]


def _which_are_staged() -> list[bool]:
    cuda = SimpleNamespace(is_cuda=True)  # a stand-in: these ranks have no GPU
    group = subgroup()
    found = [protocol.host_staged(group, cuda), protocol.host_staged(group, torch.ones(1))]
    for backend in ("cpu:gloo,cuda:nccl", "nccl", "cpu:gloo,cuda:gloo"):
        with mock.patch.object(dist, "get_backend", lambda group: backend):
            found.append(protocol.host_staged(group, cuda))
    return found


def test_only_cuda_tensors_on_gloo_are_staged(pools):
    assert pools(2).run(_which_are_staged) == [[True, False, False, False, True]] * 2


def _input_checks() -> tuple[dict, tuple | None]:
    """All-gathers (the check's collective) per op over 3 calls, at the OFF then the DETAIL
    debug level, on a fresh group; then a call whose shapes differ across ranks, at DETAIL.
    Neither op moves its data by all-gather (reduce-scatter, ring P2P)."""
    rank, group = dist.get_rank(), subgroup()
    a, b = torch.full((4, 3), rank + 1.0), torch.ones(3, 2)
    calls = {
        "reduce_scatter": lambda: fusedpar.ops.reduce_scatter(a, "sum", 0, group, backend="reference"),
        "all_gather_matmul": lambda: fusedpar.ops.all_gather_matmul(a, [b], 0, group,
                                                                    backend="pipelined"),
    }
    counts = {name: [] for name in calls}
    with mock.patch.object(protocol, "all_gather_single", wraps=protocol.all_gather_single) as gathers:
        for level in (dist.DebugLevel.OFF, dist.DebugLevel.DETAIL):
            with debug_level(level):
                for name, call in calls.items():
                    gathers.reset_mock()
                    for _ in range(3):
                        call()
                    counts[name].append(gathers.call_count)
    with debug_level(dist.DebugLevel.DETAIL):
        later = capture_errors({"later": lambda: fusedpar.ops.reduce_scatter(
            torch.ones(4 + 2 * rank, 3), "sum", 0, group, backend="reference")})["later"]
    return counts, later


def test_inputs_are_checked_on_the_first_call_and_every_call_at_detail(pools):
    for counts, later in pools(2).run(_input_checks):
        assert counts == {"reduce_scatter": [1, 3], "all_gather_matmul": [1, 3]}
        assert later[0] == "ValueError" and "passed different inputs" in later[1], later
        assert "(4, 3)" in later[1] and "(6, 3)" in later[1], later
