"""The vendor attention backends on CUDA: flash_attention's ``sdpa`` with each of torch's
kernels (flash, cuDNN, memory-efficient: forced with ``torch.nn.attention.sdpa_kernel``)
against fp32 attention by the peers' rule, and the ``pipelined_sdpa`` ring on shared-GPU
ranks (tests/gpu/conftest.py) against fp64 attention of the whole sequence. Skipped without a
GPU (on CPU, tests/ops test the same backends with torch's CPU flash kernel)."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedpar
from fusedpar.ops.flash_attention import AttentionCall, sdpa_choice
from fusedpar.parallel import zigzag_shard
from tests.ops.attention_cases import assert_peers_rule, attention_ref, reference_results
from tests.ops.collective_cases import subgroup

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: torch's CUDA attention kernels (flash, cuDNN, memory-efficient)")
KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


@requires_cuda
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name.lower())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_gpu_sdpa_kernels_within_twice_the_bf16_error(kernel, causal, kv_heads):
    """out, lse and the gradients of bf16 inputs (odd S) within 2x (3x for the gradients)
    the error of the same math in bf16 against fp32; GQA through the op's own GQA or
    repeated heads, whichever torch's choice allows."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1001, n, 128, generator=g, device="cuda").to(torch.bfloat16)
               for n in (8, kv_heads, kv_heads))
    dout = torch.randn(q.shape, generator=g, device="cuda")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([kernel]):
        picked = sdpa_choice(AttentionCall(q, k, v, causal, 128 ** -0.5))[0]
        if picked != kernel:
            pytest.skip(f"torch runs {picked.name}, not {kernel.name}, for this call on this GPU")
        out, lse = fusedpar.ops.flash_attention(*leaves, causal=causal, return_lse=True, backend="sdpa")
        out.backward(dout.to(out.dtype))
    douts = (dout, torch.zeros(lse.shape, device="cuda"))
    low, exact = (reference_results((q, k, v), dtype, *douts, scale=128 ** -0.5, causal=causal)
                  for dtype in (torch.bfloat16, torch.float32))
    got = [out, lse] + [t.grad for t in leaves]
    for name, x, lo, ex in zip(["out", "lse", "dq", "dk", "dv"], got, low, exact):
        assert_peers_rule(f"{kernel.name} {name}", x, lo, ex, 2 if name in ("out", "lse") else 3)


@requires_cuda
def test_gpu_sdpa_with_an_lse_gradient_runs_the_next_backend():
    """The lse's gradient: torch's backward ops take none, so the backward runs on the next
    backend that takes it and still equals the reference."""
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 257, n, 64, generator=g, device="cuda").to(torch.bfloat16) for n in (4, 2, 2))
    douts = (torch.randn(q.shape, generator=g, device="cuda"),
             torch.randn(1, 4, 257, generator=g, device="cuda"))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = fusedpar.ops.flash_attention(*leaves, causal=True, return_lse=True, backend="sdpa")
    torch.autograd.backward((out, lse), (douts[0].to(out.dtype), douts[1]))
    low, exact = (reference_results((q, k, v), dtype, *douts, scale=64 ** -0.5, causal=True)
                  for dtype in (torch.bfloat16, torch.float32))
    for name, x, lo, ex in zip(["dq", "dk", "dv"], [t.grad for t in leaves], low[2:], exact[2:]):
        assert_peers_rule(name, x, lo, ex, 3)


def _sdpa_ring(layout, causal):
    """pipelined_sdpa on cuda:0 shared by the ranks: out and grads (no lse gradient: torch's
    backward per step) against fp64 attention of the whole sequence, GQA."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(2)
    full = [torch.randn(2, 128, n, 64, generator=g, dtype=torch.float64) for n in (4, 2, 2)]
    full = [t.to(torch.bfloat16).double().requires_grad_() for t in full]
    dout = torch.randn(2, 128, 4, 64, generator=g, dtype=torch.float64).to(torch.bfloat16)
    ref_out, _ = attention_ref(*full, scale=64 ** -0.5, causal=causal)
    ref_out.backward(dout.double())

    def shard(x):
        return zigzag_shard(x, 1, rank, world) if layout == "zigzag" else x.chunk(world, 1)[rank]

    mine = [shard(t.detach()).to(dev, torch.bfloat16).requires_grad_() for t in full]
    out = fusedpar.ops.ring_attention(*mine, subgroup(), causal=causal, layout=layout,
                                      backend="pipelined_sdpa")
    out.backward(shard(dout).to(dev))
    errors = {}
    for name, x, ref in zip(["out", "dq", "dk", "dv"], [out] + [t.grad for t in mine],
                            [ref_out.detach()] + [t.grad for t in full]):
        ref = shard(ref)
        errors[name] = ((x.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    torch.cuda.synchronize()
    return errors


@pytest.mark.multirank
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_gpu_pipelined_sdpa_ring_forward_and_backward(gpu_pools, layout, causal):
    for errors in gpu_pools(2).run(_sdpa_ring, layout, causal):
        assert all(err < 3e-2 for err in errors.values()), errors
