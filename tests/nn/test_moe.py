"""fusedpar.nn.moe: MoEBlock (single process) and ExpertParallelMoE (ep ranks)."""

import pytest
import torch
import torch.nn.functional as F

from fusedpar.nn.moe import MoEBlock

pytestmark = [pytest.mark.timeout(300)]


def _hf_style_forward(block, x):
    """Hugging Face MixtralSparseMoeBlock's arithmetic, written out independently."""
    h = x.reshape(-1, x.shape[-1])
    logits = F.linear(h, block.router.weight)
    probs = logits.float().softmax(-1)
    top, idx = probs.topk(block.top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    y = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(block.top_k):
            e = idx[t, j]
            gate, up = (block.w13[e] @ h[t]).chunk(2)
            y[t] += (block.w2[e] @ (F.silu(gate) * up)) * top[t, j]
    counts = torch.bincount(idx.reshape(-1), minlength=block.num_experts).double()
    aux = block.num_experts * (counts / h.shape[0] * probs.double().mean(0)).sum()
    return y.view(x.shape), aux


def test_moe_block_matches_per_token_loop():
    torch.manual_seed(0)
    block = MoEBlock(12, 10, num_experts=4, top_k=2, dtype=torch.float64)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    y, aux = block(x)
    ref_y, ref_aux = _hf_style_forward(block, x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(aux.double(), ref_aux, rtol=1e-6, atol=1e-6)
    (y.sum() + aux).backward()
    assert all(p.grad is not None for p in (block.router.weight, block.w13, block.w2))


def test_moe_block_contract_and_errors():
    block = MoEBlock(8, 6, num_experts=4, top_k=1)
    assert tuple(block.w13.shape) == (4, 12, 8) and tuple(block.w2.shape) == (4, 8, 6)
    assert (block.num_experts, block.top_k) == (4, 1)
    assert tuple(block.router.weight.shape) == (4, 8) and block.router.bias is None
    with pytest.raises(ValueError, match="hidden size 7"):
        block(torch.randn(3, 7))
    with pytest.raises(ValueError, match="top_k=5"):
        MoEBlock(8, 6, num_experts=4, top_k=5)
