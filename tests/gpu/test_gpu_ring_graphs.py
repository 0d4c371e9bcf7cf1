"""The triton ``ring_attention`` forward captured in a CUDA graph (issue 43): after one eager
call of a signature, a call without packed documents is captured once and replayed with new
inputs; every replay equals an eager call on the same inputs bitwise (the same launches: the
kernels take the epoch from the device, the plan fixes every other argument), and both are
attention over the whole sequence. In loopback (W simulated ranks in this process) and on W
spawned ranks sharing cuda:0 (tests/gpu/conftest.py). A call with packed documents refuses
capture (its documents are baked into its launches). Skipped without a GPU."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedpar
from fusedpar.parallel import zigzag_shard
from tests.ops.collective_cases import captured, subgroup

NEEDS_GPU = "needs a CUDA GPU: CUDA graphs capture GPU launches"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_GPU)
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

B, S, H, H_KV, D = 2, 192, 4, 2, 64  # several query blocks per rank at W=4; GQA
REPLAYS = 3
BF16_TOL = 2e-2
# (layout, causal, window, softcap): the default causal zigzag; a two-sided window with softcap
# on contiguous chunks (rank 0 sees few of its peers' keys: copies that only check)
CASES = [("zigzag", True, (-1, -1), 0.0), ("contiguous", False, (40, 8), 30.0)]


def _shard(x, dim, layout, rank, world):
    return zigzag_shard(x, dim, rank, world) if layout == "zigzag" else x.chunk(world, dim)[rank]


def _full(seed):
    """q, k, v of the whole sequence (bf16, CPU), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g).bfloat16() for h in (H, H_KV, H_KV)]


def _reference(full, causal, window, softcap):
    """fp32 attention over the whole sequence (CPU), GQA by repeating the K/V heads."""
    q, k, v = (t.float().transpose(1, 2) for t in full)
    k, v = (t.repeat_interleave(H // H_KV, 1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * D ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    left, right = window[0], 0 if causal else window[1]
    visible = torch.ones(S, S, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return (F.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v).transpose(1, 2)


def _rel(out, ref) -> float:
    out = out.detach().float().cpu()
    return float((out - ref).norm() / ref.norm()) if torch.isfinite(out).all() else float("inf")


@requires_cuda
@pytest.mark.parametrize("layout,causal,window,softcap", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_loopback_ring_replays_equal_eager_bitwise(world, layout, causal, window, softcap):
    fusedpar.comm.release_buffers()
    dev = torch.device("cuda")
    full = _full(0)
    qs, ks, vs = ([_shard(t, 1, layout, r, world).to(dev) for r in range(world)] for t in full)
    mask = {"causal": causal, "window_size": window, "softcap": softcap, "layout": layout}

    def step():
        return fusedpar.ops.ring_attention_loopback(qs, ks, vs, **mask)

    step()  # eager: compiles, makes the buffers and the plan
    torch.cuda.synchronize()
    graph, outs = captured(step)
    for replay in range(1, REPLAYS + 1):
        full = _full(replay)
        for parts, t in zip((qs, ks, vs), full):
            for r, part in enumerate(parts):
                part.copy_(_shard(t, 1, layout, r, world))
        graph.replay()
        replayed = [(out.clone(), lse.clone()) for out, lse in outs]
        eager = step()
        torch.cuda.synchronize()
        expected = _reference(full, causal, window, softcap)
        for r, ((out, lse), (eager_out, eager_lse)) in enumerate(zip(replayed, eager)):
            where = (world, layout, replay, r)
            assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse), where
            assert _rel(out, _shard(expected, 1, layout, r, world)) <= BF16_TOL, where
    for view in fusedpar.comm.get_loopback_buffers(world, 1, dev):
        view.synchronize()  # raises what a replay recorded
    fusedpar.comm.release_buffers()


@requires_cuda
def test_gpu_packed_documents_refuse_capture():
    """A packed call (run eagerly first) raises FusedparError naming the fix when captured."""
    fusedpar.comm.release_buffers()
    world, dev = 2, torch.device("cuda")
    full = _full(0)
    cu = torch.tensor([0, 100, S], dtype=torch.int32, device=dev)  # one packed row, zigzag
    qs, ks, vs = ([zigzag_shard(t[:1], 1, r, world).to(dev) for r in range(world)] for t in full)

    def step():
        return fusedpar.ops.ring_attention_loopback(qs, ks, vs, causal=True, cu_seqlens=cu)

    step()
    torch.cuda.synchronize()
    with pytest.raises(Exception) as raised:
        captured(step)
    chain, error = [], raised.value
    while error is not None:  # the refusal, or what ending the capture raised over it
        chain.append(error)
        error = error.__context__
    assert any(isinstance(e, fusedpar.FusedparError) and "packed documents (cu_seqlens) cannot be "
               "captured" in str(e) for e in chain), chain
    torch.cuda.synchronize()
    fusedpar.comm.release_buffers()


def _group_replays(layout, causal, window, softcap):
    """This rank's ring, captured after one eager call (the warm-up of ``captured``: every rank
    makes it), replayed on new inputs: each replay equals the eager call that follows it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    group = subgroup()
    q, k, v = (_shard(t, 1, layout, rank, world).to(dev) for t in _full(0))
    mask = {"causal": causal, "window_size": window, "softcap": softcap, "layout": layout,
            "backend": "triton"}

    def step():
        return fusedpar.ops.ring_attention_with_lse(q, k, v, group, **mask)

    step()
    torch.cuda.synchronize()
    dist.barrier(group)
    graph, (out, lse) = captured(step)
    torch.cuda.synchronize()
    for replay in range(1, REPLAYS + 1):
        full = _full(replay)
        for part, t in zip((q, k, v), full):
            part.copy_(_shard(t, 1, layout, rank, world))
        dist.barrier(group)
        graph.replay()
        replayed = out.clone(), lse.clone()
        eager_out, eager_lse = step()
        torch.cuda.synchronize()
        where = (rank, layout, replay)
        assert torch.equal(replayed[0], eager_out) and torch.equal(replayed[1], eager_lse), where
        expected = _shard(_reference(full, causal, window, softcap), 1, layout, rank, world)
        assert _rel(replayed[0], expected) <= BF16_TOL, where
    fusedpar.comm.get_buffer(group, 1, dev).synchronize()  # raises what a replay recorded
    dist.barrier(group)
    return True


@pytest.mark.multirank
@pytest.mark.parametrize("layout,causal,window,softcap", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("world", [2])
def test_gpu_shared_ranks_ring_replays_equal_eager_bitwise(gpu_pools, world, layout, causal, window,
                                                           softcap):
    assert gpu_pools(world).run(_group_replays, layout, causal, window, softcap) == [True] * world
