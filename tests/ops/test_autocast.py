"""Under ``torch.autocast`` the matmul and attention ops cast their floating inputs to its
dtype first, as ``torch.matmul`` and SDPA do: fp32 weights meet the bf16 activations of the
ops before them (a TP or MoE model trained under autocast) instead of raising a dtype
mismatch. Each op, given fp32 and bf16 leaves inside a CPU bf16 autocast region, returns
exactly what it returns on their bf16 casts outside one, and every leaf gets that gradient
in its own dtype."""

import pytest
import torch
import torch.distributed as dist

import fusedpar

BF16 = torch.bfloat16


def _matches_the_cast_call(fn, *tensors) -> bool:
    leaves = [t.detach().requires_grad_() for t in tensors]
    with torch.autocast("cpu", dtype=BF16):
        out = fn(*leaves)
    casts = [t.detach().to(BF16).requires_grad_() for t in tensors]
    ref = fn(*casts)
    assert out.dtype == BF16 and torch.equal(out, ref), fn
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(BF16)
    out.backward(grad)
    ref.backward(grad)
    for leaf, cast in zip(leaves, casts):
        assert leaf.grad.dtype == leaf.dtype and torch.equal(leaf.grad, cast.grad.to(leaf.dtype)), fn
    return True


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_grouped_mm(backend):
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)
    assert _matches_the_cast_call(lambda a, b: fusedpar.ops.grouped_mm(a, b, offs, backend=backend),
                                  _randn(10, 12, seed=0, dtype=BF16), _randn(3, 12, 5, seed=1))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_flash_attention(backend):
    q, k, v = (_randn(1, 9, h, 16, seed=h, dtype=dtype) for h, dtype in ((4, torch.float32),
                                                                         (2, BF16), (2, torch.float32)))
    assert _matches_the_cast_call(
        lambda q, k, v: fusedpar.ops.flash_attention(q, k, v, causal=True, backend=backend), q, k, v)


def _group_ops():
    """The group ops on a one-rank group: bf16 activations, fp32 weights."""
    x, w = _randn(6, 8, seed=2, dtype=BF16), _randn(8, 5, seed=3)
    assert _matches_the_cast_call(lambda x, w: fusedpar.ops.all_gather_matmul(x, [w], 0)[1][0], x, w)
    assert _matches_the_cast_call(lambda x, w: fusedpar.ops.matmul_reduce_scatter(x, w), x, w)
    q, kv = _randn(1, 8, 2, 16, seed=4, dtype=BF16), _randn(1, 8, 2, 16, seed=5)
    assert _matches_the_cast_call(lambda q, k, v: fusedpar.ops.ring_attention(q, k, v, causal=True),
                                  q, kv, kv)
    idx = torch.tensor([[0, 1], [1, 0], [1, 1], [0, 0], [1, 0]])
    weights = torch.full((5, 2), 0.5)
    w13, w2 = _randn(2, 6, 8, seed=6), _randn(2, 8, 3, seed=7)
    assert _matches_the_cast_call(
        lambda x, w13, w2: fusedpar.ops.moe_experts(x, idx, weights, w13, w2, dist.group.WORLD),
        _randn(5, 8, seed=8, dtype=BF16), w13, w2)
    return True


def test_group_ops(pools):
    assert pools(1).run(_group_ops) == [True]
