"""moe_experts (the expert-parallel SwiGLU MLP) against the single-process dense loop."""

import pytest
import torch
import torch.distributed as dist

from fusedpar.ops.moe import experts_dense, topk_route
from fusedpar.ops.moe_experts import moe_experts
from tests.ops.collective_cases import capture_errors

pytestmark = [pytest.mark.timeout(300)]


def _check_experts(T, H, I, k, E_local):
    rank, world = dist.get_rank(), dist.get_world_size()
    E = E_local * world
    torch.manual_seed(0)  # the same weights and every rank's tokens on every rank
    w13, w2 = torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4
    xs = [torch.randn(T, H) for _ in range(world)]
    logits = [torch.randn(T, E) for _ in range(world)]
    # single process: every rank's tokens through the dense loop; loss summed over ranks
    ref_w13, ref_w2 = w13.double().requires_grad_(), w2.double().requires_grad_()
    ref_xs = [x.double().requires_grad_() for x in xs]
    ref_logits = [lg.double().requires_grad_() for lg in logits]
    total = 0
    for x, lg in zip(ref_xs, ref_logits):
        idx, w, aux = topk_route(lg, k)
        total = total + (experts_dense(x, idx, w.double(), ref_w13, ref_w2) ** 2).sum() + aux
    total.backward()
    # this rank
    sl = slice(rank * E_local, (rank + 1) * E_local)
    my_w13, my_w2 = w13[sl].clone().requires_grad_(), w2[sl].clone().requires_grad_()
    x, lg = xs[rank].clone().requires_grad_(), logits[rank].clone().requires_grad_()
    idx, w, aux = topk_route(lg, k)
    y = moe_experts(x, idx, w, my_w13, my_w2)
    ((y ** 2).sum() + aux).backward()
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), ref_xs[rank].grad, **tol)
    torch.testing.assert_close(lg.grad.double(), ref_logits[rank].grad, **tol)
    torch.testing.assert_close(my_w13.grad.double(), ref_w13.grad[sl], **tol)
    torch.testing.assert_close(my_w2.grad.double(), ref_w2.grad[sl], **tol)
    ref_y = experts_dense(xs[rank].double(), idx, w.detach().double(), w13.double(), w2.double())
    torch.testing.assert_close(y.double(), ref_y, **tol)
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_experts_matches_dense_loop(pools, world):
    assert pools(world).run(_check_experts, 12, 8, 6, 2, 2) == [True] * world


def _errors():
    x, w = torch.zeros(4, 3), torch.ones(4, 2)
    idx = torch.zeros(4, 2, dtype=torch.long)
    return capture_errors({
        "weights_shape": lambda: moe_experts(x, idx, w, torch.zeros(1, 4, 5), torch.zeros(1, 3, 2)),
    })


def test_bad_weights_raise_clear_errors(pools):
    for rank_errors in pools(2).run(_errors):
        assert "do not fit" in rank_errors["weights_shape"][1]
