"""ring_attention: the loopback ring (all W=8 ranks in one process, the triton backend
copying each simulated peer's visible K/V rows from its symmetric buffer once while the
previous ring step attends) next to monolithic attention
on the full sequence (fusedpar's flash_attention kernel, and SDPA flash for reference).

``test_loopback`` (one GPU): B=1, H=32, D=128, full S in {16k, 32k}, causal (zigzag) and
not, forward, bf16; checked once against monolithic attention, then timed; rows in
``results/ring_attention.csv`` with TFLOP/s and the ratio to monolithic. Target (recorded,
never asserted): >= 0.85x of the monolithic kernel's TFLOP/s. Each row also notes
``gpu_busy_ms`` (a median well above it: the GPU waited for the host, whose ``host_ms``
issues 8 simulated ranks' steps and copies) and writes ``results/profiles/`` (GPU time per
kernel and copy of one call). ``loopback_graph``: the same loopback ring captured once in a
CUDA graph and replayed (``common.graphed``: the kernels take the epoch from the device), so
no host work is left per call; its row notes ``x_eager`` (the eager loopback's median over
its own). Skips without a GPU.
``test_loopback_volume``: bytes read from peers = the K/V lower bound (CPU too). Causal
zigzag: a rank needs half of each earlier rank's K/V and all of each later one's, so the
bound is 3/4 of the non-causal (W-1) x K/V.
"""

import pytest
import torch

import fusedpar
from fusedpar.parallel import zigzag_shard

from common import (DTYPE, W_LOOPBACK, bench, counted, gpu_profile, graphed, host_ms, nbytes,
                    or_skip, rel_err)
from targets import BASELINES

OP = "ring_attention"
B, H, D = 1, 32, 128
SEQS = [16384, 32768]
TARGET = BASELINES[OP]["monolithic"]
BACKENDS = ["monolithic", "loopback", "loopback_graph"]  # the baseline first
_medians: dict = {}


def _shards(x, layout, world):
    if layout == "zigzag":
        return [zigzag_shard(x, 1, r, world) for r in range(world)]
    return list(x.chunk(world, 1))


def _measure(backend, s, causal, device, gpu_times):
    g = torch.Generator(device=device)
    g.manual_seed(s)
    q, k, v = (torch.randn(B, s, H, D, generator=g, device=device).to(DTYPE) for _ in range(3))
    def monolithic():
        return fusedpar.ops.flash_attention(q, k, v, causal=causal)
    whole = monolithic()
    if backend == "monolithic":
        return monolithic, gpu_times(monolithic), None
    layout = "zigzag"
    qs, ks, vs = (_shards(t, layout, W_LOOPBACK) for t in (q, k, v))

    def fn():
        return fusedpar.ops.ring_attention_loopback(qs, ks, vs, causal=causal, layout=layout)
    if backend == "loopback_graph":
        counted(fn)  # eager first: compiles the kernels, makes the buffers and the plan
        fn = graphed(fn)
    results, moved = counted(fn)
    if backend == "loopback_graph":
        moved = None  # a replay runs no Python to count
    expected = _shards(whole.float(), layout, W_LOOPBACK)
    for r, (out, _) in enumerate(results):
        assert rel_err(out, expected[r]) <= 2e-2, f"simulated rank {r}"
    return fn, gpu_times(fn), moved


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("s", SEQS)
def test_loopback(benchmark, gpu, gpu_times, record_row, record_profile, report_target, synced, s,
                  causal, backend):
    benchmark.group = f"{OP} B{B} H{H} S{s} D{D} {'causal' if causal else 'full'} loopback W={W_LOOPBACK} bf16"
    fn, times, moved = or_skip(_measure, backend, s, causal, gpu, gpu_times)
    key = (s, causal)
    _medians[(*key, backend)] = times[0]
    flops = 4 * B * H * s * s * D * (0.5 if causal else 1.0)
    busy, kernels = gpu_profile(fn)
    notes = dict(tflops=f"{flops / (times[0] * 1e-3) / 1e12:.1f}", causal=causal,
                 gpu_busy_ms=f"{busy:.2f}", host_ms=f"{host_ms(fn):.2f}")
    base = _medians.get((*key, "monolithic"))
    if backend == "loopback_graph" and (*key, "loopback") in _medians:
        notes["x_eager"] = f"{_medians[(*key, 'loopback')] / times[0]:.2f}"
    if backend != "monolithic" and base is not None:
        ratio = base / times[0]
        verdict = "met" if ratio >= TARGET else "MISSED"
        notes["vs_monolithic"] = f"{ratio:.3f}x (target >= {TARGET}x: {verdict})"
        if backend == "loopback":  # the target's row
            report_target(f"{benchmark.group}: {ratio:.3f}x monolithic ({verdict})")
    kv_bytes = 2 * B * s * H * D * DTYPE.itemsize
    bound = (W_LOOPBACK - 1) * kv_bytes * (0.75 if causal else 1)  # causal zigzag: see above
    record_row(OP, backend, (B, s, H, D), DTYPE, W_LOOPBACK, *times, algo_bytes=kv_bytes,
               bytes_moved=moved, lower_bound=int(bound), **notes)
    record_profile(f"{OP}_{'causal' if causal else 'full'}", backend, (B, s, H, D), times[0], busy,
                   kernels)
    bench(benchmark, synced, fn, times, **notes)


def test_loopback_volume(local_device):
    """Causal zigzag, GQA: each simulated rank copies the peers' K/V rows its queries see,
    once: 3/4 of W (W-1) x K/V bytes of a rank."""
    world = 4
    g = torch.Generator(device=local_device)
    g.manual_seed(0)
    qs, ks, vs = ([torch.randn(1, 8, n, 16, generator=g, device=local_device).to(DTYPE)
                   for _ in range(world)] for n in (2, 1, 1))
    _, moved = or_skip(counted, lambda: fusedpar.ops.ring_attention_loopback(qs, ks, vs, causal=True))
    assert moved == 3 * world * (world - 1) // 4 * (nbytes(ks[0]) + nbytes(vs[0]))
