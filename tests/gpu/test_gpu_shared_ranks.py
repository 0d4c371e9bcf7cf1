"""The group path of every GPU backend on one GPU: W processes share cuda:0 (gloo world,
tests/gpu/conftest.py), forward and backward against a CPU oracle in higher precision.
Every rank builds every rank's inputs from (rank, seed), so each computes the whole oracle
itself and compares its own part; rank r's data encodes r. Skipped without a GPU."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedpar
from fusedpar.parallel import zigzag_shard
from tests.ops.collective_cases import captured, env, poison_symmetric, rank_data, subgroup

pytestmark = [pytest.mark.gpu, pytest.mark.multirank, pytest.mark.timeout(600)]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _randn(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of ``out`` (any device and dtype) against the fp64 CPU ``ref``."""
    out = out.detach().cpu().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _assert_close(out, ref, tol, what):
    err = _rel(out, ref)
    assert err <= tol, f"rank {dist.get_rank()}: {what}: relative error {err:.2e} > {tol:.0e}"


# ---- all_gather / reduce_scatter: exact (small integers), forward and backward ----------


def _poison(group, nbytes):
    """NaN-fill this rank's symmetric data region, once every peer is done with it: a call
    returns before its peers have pulled its staged data (the next call waits for them), so
    poisoning right after a call would race their pulls."""
    torch.cuda.synchronize()
    dist.barrier(group)
    poison_symmetric(group, nbytes, _device())

GATHER_CASES = [((3, 5), 0), ((5, 3, 7), 1), ((64, 33), 1)]


def _collectives(backend):
    rank, world, dev = dist.get_rank(), dist.get_world_size(), _device()
    group = subgroup()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for i, (shape, dim) in enumerate(GATHER_CASES):
            xs = [rank_data(shape, dtype, r, salt=i) for r in range(world)]
            x = xs[rank].to(dev).requires_grad_(dtype == torch.float32)
            _poison(group, 4 * world * x.numel() * x.element_size())
            out = fusedpar.ops.all_gather(x, dim, group, backend=backend)
            assert torch.equal(out.detach().cpu(), torch.cat(xs, dim)), (backend, dtype, shape, dim)
            if dtype == torch.float32:  # the adjoint: reduce-scatter of every rank's gradient
                douts = [rank_data(out.shape, dtype, r, salt=100 + i) for r in range(world)]
                out.backward(douts[rank].to(dev))
                want = torch.stack(douts).sum(0).chunk(world, dim)[rank]
                assert torch.equal(x.grad.cpu(), want), (backend, "all_gather backward", shape)
        for i, (shape, dim) in enumerate(GATHER_CASES):
            if dtype == torch.bfloat16:  # sums of these integers are not exact in bf16
                continue
            full = list(shape)
            full[dim] *= world
            xs = [rank_data(full, dtype, r, salt=i) for r in range(world)]
            x = xs[rank].to(dev).requires_grad_(dtype == torch.float32)
            _poison(group, 4 * x.numel() * x.element_size())
            out = fusedpar.ops.reduce_scatter(x, "sum", dim, group, backend=backend)
            want = torch.stack(xs).sum(0).chunk(world, dim)[rank]
            assert torch.equal(out.detach().cpu(), want), (backend, dtype, shape, dim)
            if dtype == torch.float32:  # the adjoint: all-gather of every rank's gradient
                douts = [rank_data(out.shape, dtype, r, salt=200 + i) for r in range(world)]
                out.backward(douts[rank].to(dev))
                assert torch.equal(x.grad.cpu(), torch.cat(douts, dim)), (backend, "rs backward", shape)
    torch.cuda.synchronize()
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_shared_collectives_match_exactly(gpu_pools, backend, world):
    assert gpu_pools(world).run(_collectives, backend) == [True] * world


# ---- all_gather_matmul / matmul_reduce_scatter ----------------------------------------------

BF16_TOL = 2e-2  # bf16 operands, fp32 accumulation, against fp64


def _all_gather_matmul(backend):
    rank, world, dev = dist.get_rank(), dist.get_world_size(), _device()
    group = subgroup()
    m, k, ns = 24, 40, (24, 56)  # odd-ish sizes; two Bs share the gather (q/k/v-like)
    shards = [_randn((m, k), seed=r) + r for r in range(world)]  # rank r's rows encode r
    bs = [_randn((k, n), seed=1000 + j, scale=k ** -0.5) for j, n in enumerate(ns)]
    a = shards[rank].to(dev, torch.bfloat16).requires_grad_()
    b_dev = [b.to(dev, torch.bfloat16).requires_grad_() for b in bs]
    gathered, outs = fusedpar.ops.all_gather_matmul(a, b_dev, 0, group, backend=backend)
    # the oracle, from the bf16-rounded operands every rank used
    a_all = torch.cat([s.to(torch.bfloat16).double() for s in shards])
    b64 = [b.to(torch.bfloat16).double() for b in bs]
    assert torch.equal(gathered.detach().cpu().double(), a_all), "A_gathered"
    for j, out in enumerate(outs):
        _assert_close(out, a_all @ b64[j], BF16_TOL, f"{backend} out[{j}]")
    dys = [[_randn((m * world, n), seed=10 * r + j) for j, n in enumerate(ns)] for r in range(world)]
    torch.autograd.backward(outs, [dy.to(dev, torch.bfloat16) for dy in dys[rank]])
    dys = [[dy.to(torch.bfloat16).double() for dy in per_rank] for per_rank in dys]
    da = sum(dy @ b.T for per_rank in dys for dy, b in zip(per_rank, b64))
    _assert_close(a.grad, da[rank * m:(rank + 1) * m], BF16_TOL, f"{backend} dA_shard")
    for j, b in enumerate(b_dev):
        _assert_close(b.grad, a_all.T @ dys[rank][j], BF16_TOL, f"{backend} dB[{j}]")
    torch.cuda.synchronize()
    return True


def _matmul_reduce_scatter(backend):
    rank, world, dev = dist.get_rank(), dist.get_world_size(), _device()
    group = subgroup()
    m, k, n = 24 * world, 40, 56
    As = [_randn((m, k), seed=r) * (r + 1) for r in range(world)]  # scaled by the rank
    Bs = [_randn((k, n), seed=100 + r, scale=k ** -0.5) for r in range(world)]
    a = As[rank].to(dev, torch.bfloat16).requires_grad_()
    b = Bs[rank].to(dev, torch.bfloat16).requires_grad_()
    out = fusedpar.ops.matmul_reduce_scatter(a, b, "sum", 0, group, backend=backend)
    A64 = [x.to(torch.bfloat16).double() for x in As]
    B64 = [x.to(torch.bfloat16).double() for x in Bs]
    total = sum(x @ y for x, y in zip(A64, B64))
    _assert_close(out, total.chunk(world, 0)[rank], BF16_TOL, f"{backend} out")
    dys = [_randn((m // world, n), seed=500 + r) for r in range(world)]
    out.backward(dys[rank].to(dev, torch.bfloat16))
    g = torch.cat([dy.to(torch.bfloat16).double() for dy in dys])  # all_gather of dY
    _assert_close(a.grad, g @ B64[rank].T, BF16_TOL, f"{backend} dA")
    _assert_close(b.grad, A64[rank].T @ g, BF16_TOL, f"{backend} dB")
    torch.cuda.synchronize()
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", ["triton", "pipelined"])
@pytest.mark.parametrize("case", [_all_gather_matmul, _matmul_reduce_scatter],
                         ids=["all_gather_matmul", "matmul_reduce_scatter"])
def test_gpu_shared_fused_matmuls_forward_and_backward(gpu_pools, case, backend, world):
    assert gpu_pools(world).run(case, backend) == [True] * world


# ---- ring_attention: four backends, zigzag and contiguous, causal or not, GQA ----------------

B, S, H, H_KV, D = 2, 128, 4, 2, 64  # S divisible by 2W (zigzag); H and H_KV by W (ulysses)


def _shard(x, layout, rank, world):
    return zigzag_shard(x, 1, rank, world) if layout == "zigzag" else x.chunk(world, 1)[rank]


def _ring(backend, layout, causal):
    rank, world, dev = dist.get_rank(), dist.get_world_size(), _device()
    group = subgroup()
    q, k, v, dout = (_randn((B, S, h, D), seed=s) for s, h in enumerate((H, H_KV, H_KV, H)))
    q, k, v, dout = (t.to(torch.bfloat16).double() for t in (q, k, v, dout))
    # the oracle: attention over the whole sequence, GQA by repeating the K/V heads
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    rep = H // H_KV
    ref = F.scaled_dot_product_attention(
        full[0].transpose(1, 2), full[1].repeat_interleave(rep, 2).transpose(1, 2),
        full[2].repeat_interleave(rep, 2).transpose(1, 2), is_causal=causal).transpose(1, 2)
    ref.backward(dout)
    mine = [_shard(t, layout, rank, world).to(dev, torch.bfloat16).requires_grad_()
            for t in (q, k, v)]
    out = fusedpar.ops.ring_attention(*mine, group, causal=causal, layout=layout, backend=backend)
    what = f"{backend} {layout} causal={causal}"
    _assert_close(out, _shard(ref.detach(), layout, rank, world), BF16_TOL, f"{what} out")
    out.backward(_shard(dout, layout, rank, world).to(dev, torch.bfloat16))
    for name, t, r in zip("qkv", mine, full):
        _assert_close(t.grad, _shard(r.grad, layout, rank, world), 3e-2, f"{what} d{name}")
    torch.cuda.synchronize()
    return True


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("backend", ["pipelined", "ulysses", "allgather_kv", "triton"])
def test_gpu_shared_ring_attention_forward_and_backward(gpu_pools, backend, layout, causal):
    assert gpu_pools(2).run(_ring, backend, layout, causal) == [True, True]


# ---- moe_dispatch / moe_combine (triton) ------------------------------------------------------

TOKENS, HIDDEN, EXPERTS, TOP_K = 13, 40, 8, 2


def _routing(rank):
    """Rank ``rank``'s tokens (encoding the rank) and routing, a dropped copy included."""
    x = _randn((TOKENS, HIDDEN), seed=rank) + 10 * rank
    g = torch.Generator().manual_seed(50 + rank)
    idx, weights, _ = fusedpar.ops.topk_route(torch.randn(TOKENS, EXPERTS, generator=g), TOP_K)
    idx[0, 1] = -1
    weights[0, 1] = 0.0
    return x.float(), idx, weights


def _received(routing, rank, world):
    """The oracle of rank ``rank``'s recv_x and tokens_per_expert: the rows of every copy
    routed to its experts, ordered by (local expert, source rank, token)."""
    local = EXPERTS // world
    rows, counts = [], []
    for e in range(rank * local, (rank + 1) * local):
        n = 0
        for x, idx, _ in routing:
            for t in range(TOKENS):
                if (idx[t] == e).any():
                    rows.append(x[t])
                    n += 1
        counts.append(n)
    return torch.stack(rows), counts


def _moe_round_trip(max_tokens):
    rank, world, dev = dist.get_rank(), dist.get_world_size(), _device()
    group = subgroup()
    routing = [_routing(r) for r in range(world)]
    x_cpu, idx_cpu, w_cpu = routing[rank]
    x = x_cpu.to(dev).requires_grad_()
    w = w_cpu.to(dev).requires_grad_()
    recv_x, per_expert, handle = fusedpar.ops.moe_dispatch(
        x, idx_cpu.to(dev), w, EXPERTS, group, max_tokens_per_rank=max_tokens, backend="triton")
    rows, counts = _received(routing, rank, world)
    assert per_expert.cpu().tolist() == counts, (per_expert, counts)
    if max_tokens is None:
        assert torch.equal(recv_x.detach().cpu(), rows), "recv_x"
    else:  # [E_local, W*M, H]: each expert's rows first, zeros after
        assert recv_x.shape == (EXPERTS // world, world * max_tokens, HIDDEN)
        start = 0
        for e, n in enumerate(counts):
            assert torch.equal(recv_x[e, :n].detach().cpu(), rows[start:start + n]), f"expert {e}"
            assert not recv_x[e, n:].any(), f"expert {e} padding"
            start += n
    out = fusedpar.ops.moe_combine(recv_x, handle)  # identity experts
    kept = w_cpu.double() * (idx_cpu >= 0)
    torch.testing.assert_close(out.detach().cpu().double(), x_cpu.double() * kept.sum(1, keepdim=True),
                               rtol=1e-5, atol=1e-5)
    dout = _randn((TOKENS, HIDDEN), seed=900 + rank)
    out.backward(dout.float().to(dev))
    torch.testing.assert_close(x.grad.cpu().double(), dout * kept.sum(1, keepdim=True),
                               rtol=1e-5, atol=1e-5)
    dw = (dout * x_cpu.double()).sum(1, keepdim=True) * (idx_cpu >= 0)  # <dout_t, x_t> per copy
    torch.testing.assert_close(w.grad.cpu().double(), dw, rtol=1e-5, atol=1e-4)
    torch.cuda.synchronize()
    return True


@pytest.mark.parametrize("max_tokens", [None, TOKENS + 3], ids=["unpadded", "padded"])
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_shared_moe_dispatch_combine(gpu_pools, world, max_tokens):
    assert gpu_pools(world).run(_moe_round_trip, max_tokens) == [True] * world


def _moe_graph_replay():
    """The padded round trip captured in a CUDA graph after one eager call, replayed on new
    tokens (the buffer keeps its epochs on the device): each replay's output is right."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), _device()
    group = subgroup()
    x_cpu, idx_cpu, w_cpu = _routing(rank)
    x, idx, w = x_cpu.to(dev), idx_cpu.to(dev), w_cpu.to(dev)

    def step():
        recv_x, _, handle = fusedpar.ops.moe_dispatch(x, idx, w, EXPERTS, group,
                                                      max_tokens_per_rank=TOKENS, backend="triton")
        return fusedpar.ops.moe_combine(recv_x, handle)

    step()  # eager: compiles the kernels and makes the symmetric buffer
    torch.cuda.synchronize()
    dist.barrier(group)
    graph, out = captured(step)
    kept = (w_cpu.double() * (idx_cpu >= 0)).sum(1, keepdim=True)
    for salt in range(1, 4):
        new = _randn((TOKENS, HIDDEN), seed=100 * salt + rank) + 10 * rank
        x.copy_(new.float().to(dev))
        dist.barrier(group)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu().double(), new.float().double() * kept, rtol=1e-5,
                                   atol=1e-5, msg=lambda m, salt=salt: f"replay {salt}: {m}")
    fusedpar.comm.get_buffer(group, 1, dev).synchronize()  # raises what a replay recorded
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_gpu_shared_moe_padded_round_trip_replays_from_a_cuda_graph(gpu_pools, world):
    assert gpu_pools(world).run(_moe_graph_replay) == [True] * world


# ---- moe_experts (pipelined, fused) against the reference backend on CPU copies -------------

INTER = 48


def _moe_experts(backend):
    rank, world, dev = dist.get_rank(), dist.get_world_size(), _device()
    group = subgroup()
    local = EXPERTS // world
    x, idx, w = _routing(rank)
    w13 = _randn((local, 2 * INTER, HIDDEN), seed=700 + rank, scale=HIDDEN ** -0.5).float()
    w2 = _randn((local, HIDDEN, INTER), seed=800 + rank, scale=INTER ** -0.5).float()
    dout = _randn((TOKENS, HIDDEN), seed=900 + rank).float()
    results = {}
    for name, device, chosen in (("oracle", torch.device("cpu"), "reference"), (backend, dev, backend)):
        leaves = [t.to(device).requires_grad_() for t in (x, w, w13, w2)]
        out = fusedpar.ops.moe_experts(leaves[0], idx.to(device), leaves[1], leaves[2], leaves[3],
                                       group, backend=chosen)
        out.backward(dout.to(device))
        results[name] = [out.detach()] + [t.grad for t in leaves]
    for what, got, want in zip(("out", "dx", "dweights", "dw13", "dw2"), results[backend],
                               results["oracle"]):
        _assert_close(got, want.double(), 1e-2, f"{backend} {what}")  # tf32 GEMMs on the GPU
    torch.cuda.synchronize()
    return True


@pytest.mark.parametrize("backend", ["pipelined", "fused"])
def test_gpu_shared_moe_experts_forward_and_backward(gpu_pools, backend):
    assert gpu_pools(2).run(_moe_experts, backend) == [True, True]


# ---- a stalled rank ---------------------------------------------------------------------------

TIMEOUT_S = 3.0


def _stalled(backend):
    """Rank 1 never makes the second call: rank 0's output is NaN and its buffer raises
    FusedparTimeoutError naming rank 1 within the timeout; then a new group works."""
    rank, dev = dist.get_rank(), _device()
    group = subgroup()
    x = torch.full((4, 3), float(rank + 1), device=dev)
    fusedpar.ops.all_gather(x, 0, group, backend=backend)  # healthy: the buffer exists
    torch.cuda.synchronize()
    dist.barrier()
    seen = {}
    with env(FUSEDPAR_TIMEOUT=TIMEOUT_S):
        if rank == 1:
            time.sleep(TIMEOUT_S * 1.5)
        else:
            start = time.monotonic()
            try:  # the GPU path returns NaN and raises at the buffer's next sync or call
                out = fusedpar.ops.all_gather(x, 0, group, backend=backend)
                torch.cuda.synchronize()
                seen["nan"] = bool(out.isnan().all())
                fusedpar.comm.get_buffer(group, 1, dev).synchronize()
            except fusedpar.FusedparTimeoutError as e:
                seen["error"] = str(e)
            seen["elapsed"] = time.monotonic() - start
    dist.barrier()
    fresh = subgroup()  # the group is usable again once re-created
    again = fusedpar.ops.all_gather(x, 0, fresh, backend=backend)
    seen["fresh"] = torch.equal(again.cpu(), torch.cat([torch.full((4, 3), float(r + 1))
                                                        for r in range(dist.get_world_size())]))
    return seen


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_shared_stalled_rank_times_out_and_a_new_group_works(gpu_pools, backend):
    first, second = gpu_pools(2).run(_stalled, backend)
    assert first.get("nan") and "rank 1" in first.get("error", ""), first
    assert first["elapsed"] < 3 * TIMEOUT_S, first
    assert first["fresh"] and second["fresh"]
