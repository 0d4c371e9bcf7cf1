"""The fused all-gather + matmul kernel, one process playing every rank over loopback buffers.

The protocol is simulated by hand: each rank stages its A shard in its data region and
raises READY in every peer's pad (PULL=True), or a "copy engine" fills ``ag`` and the
GATHERED flags (PULL=False); then each rank's kernel runs and is compared with torch.
Rank r's shard encodes r, so a misrouted shard cannot pass; outputs start as NaN, so a
skipped tile cannot pass either.
"""

import time

import pytest
import torch

from fusedpar.comm import layout
from fusedpar.kernels.ag_gemm import ag_gemm
from fusedpar.kernels.signal import signal_peers

META = 12345
# Small blocks: several m- and n-tiles per shard, several K steps, 3 persistent programs.
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, NUM_PROGRAMS=3)


def int_shard(rank, m, k, dtype):
    """Small integers offset by 8*(rank+1): exact in fp16/fp32 products and sums."""
    i = torch.arange(m * k).reshape(m, k)
    return ((i * 7) % 13 - 6 + 8 * (rank + 1)).to(dtype)


def int_weight(k, n, dtype, transposed):
    """Values in {-1, 0, 1}; ``transposed``: a [K, N] view of an [N, K] tensor."""
    j = torch.arange(k * n)
    if transposed:
        return ((j * 5) % 3 - 1).reshape(n, k).to(dtype).t()
    return ((j * 5) % 3 - 1).reshape(k, n).to(dtype)


def stage_and_signal(bufs, shards, epoch, meta=META, skip=()):
    """Each rank stages its shard in its data region, publishes ``meta`` and raises READY in
    every peer's pad (ranks in ``skip`` stage but never signal). Returns the staged views."""
    world = len(bufs)
    staged = []
    for buf, x in zip(bufs, shards):
        view = buf.data(x.dtype, x.numel()).view(x.shape)
        view.copy_(x)
        if buf.rank not in skip:
            published = meta if isinstance(meta, int) else meta[buf.rank]
            signal_peers(buf.pad_table, layout.READY, buf.rank, world, epoch, published)
        staged.append(view)
    return staged


def status(buf):
    return buf.pad()[layout.STATUS : layout.STATUS + 3].tolist()


def run_rank(buf, staged, b, m, world, epoch, *, pull, store_a, config=None, expired=False, ag=None):
    """``expired``: this call's deadline has already passed (as the watchdog of a real call
    writes after FUSEDPAR_TIMEOUT), so a flag that is not raised fails at once."""
    dtype = staged.dtype
    k, n = b.shape
    c = torch.full((world * m, n), float("nan"), dtype=dtype)
    if ag is None and store_a:
        ag = torch.full((world * m, k), float("nan"), dtype=dtype)
    if expired:
        buf.pad()[layout.DEADLINE] = epoch
    ag_gemm(staged, b, c, ag, buf.pad_table, buf.rank, world, epoch, META, buf.timeout_ns,
            pull=pull, store_a=store_a, config=config)
    return c, ag


CASES = [  # world, m_local, N, K, dtype, transposed B, config
    (1, 5, 7, 33, torch.float32, False, None),
    (2, 5, 7, 33, torch.float16, True, None),
    (2, 7, 33, 5, torch.float32, False, None),
    (4, 17, 20, 40, torch.float32, True, SMALL),
    (4, 7, 33, 5, torch.float16, False, SMALL),
]


@pytest.mark.parametrize("world,m,n,k,dtype,transposed,config", CASES)
def test_pull_store_a_exact(loopback, world, m, n, k, dtype, transposed, config):
    bufs = loopback(world)
    shards = [int_shard(r, m, k, dtype) for r in range(world)]
    b = int_weight(k, n, dtype, transposed)
    staged = stage_and_signal(bufs, shards, epoch=1)
    gathered = torch.cat(shards)
    expected = (gathered.double() @ b.double()).to(dtype)
    for buf, view in zip(bufs, staged):
        c, ag = run_rank(buf, view, b, m, world, 1, pull=True, store_a=True, config=config)
        assert status(buf) == [0, 0, 0]
        assert torch.equal(c, expected), (buf.rank, (c.double() - expected.double()).abs().max())
        assert torch.equal(ag, gathered), buf.rank


@pytest.mark.parametrize("world,m,n,k,dtype,transposed,config", [CASES[1], CASES[3]])
def test_pull_without_store_a(loopback, world, m, n, k, dtype, transposed, config):
    bufs = loopback(world)
    shards = [int_shard(r, m, k, dtype) for r in range(world)]
    b = int_weight(k, n, dtype, transposed)
    staged = stage_and_signal(bufs, shards, epoch=1)
    expected = (torch.cat(shards).double() @ b.double()).to(dtype)
    for buf, view in zip(bufs, staged):
        c, _ = run_rank(buf, view, b, m, world, 1, pull=True, store_a=False, config=config)
        assert torch.equal(c, expected), buf.rank


@pytest.mark.parametrize("world,m,n,k,dtype,transposed,config", [CASES[0], CASES[1], CASES[3], CASES[4]])
def test_copy_engine_mode_reads_ag_after_gathered_flags(loopback, world, m, n, k, dtype, transposed, config):
    bufs = loopback(world)
    shards = [int_shard(r, m, k, dtype) for r in range(world)]
    b = int_weight(k, n, dtype, transposed)
    expected = (torch.cat(shards).double() @ b.double()).to(dtype)
    for epoch in (1, 2):  # a second call: the flags only need to reach the new epoch
        for buf in bufs:
            ag = torch.cat(shards)  # what the copy engine would have gathered
            buf.pad()[layout.GATHERED : layout.GATHERED + world] = epoch
            c, _ = run_rank(buf, shards[buf.rank], b, m, world, epoch, pull=False, store_a=False,
                            config=config, ag=ag)
            assert status(buf) == [0, 0, 0]
            assert torch.equal(c, expected), (epoch, buf.rank)


def test_random_bf16_within_twice_torch_error(loopback):
    world, m, n, k = 2, 9, 17, 40
    torch.manual_seed(0)
    bufs = loopback(world)
    shards = [torch.randn(m, k).to(torch.bfloat16) * (r + 1) for r in range(world)]
    b = torch.randn(n, k).to(torch.bfloat16).t()
    staged = stage_and_signal(bufs, shards, epoch=1)
    gathered = torch.cat(shards)
    exact = gathered.double() @ b.double()
    torch_err = ((gathered @ b).double() - exact).abs().max()
    for buf, view in zip(bufs, staged):
        c, ag = run_rank(buf, view, b, m, world, 1, pull=True, store_a=True)
        assert torch.equal(ag, gathered)
        # the interpreter rounds fp32->bf16 by truncation (1 ulp more), hence the 1/128 slack
        ours_err = (c.double() - exact).abs().max()
        assert ours_err <= 2 * torch_err + exact.abs().max() / 128, (ours_err, torch_err)


@pytest.mark.parametrize("pull", [True, False])
def test_timeout_skips_the_missing_shard_and_returns(loopback, pull):
    """Rank 1 of 4 works in rotated order 1, 2, 3, 0; shard 3 never arrives."""
    world, m, n, k, me, late = 4, 5, 7, 33, 1, 3
    bufs = loopback(world)
    shards = [int_shard(r, m, k, torch.float32) for r in range(world)]
    b = int_weight(k, n, torch.float32, False)
    staged = stage_and_signal(bufs, shards, epoch=1, skip=(late,))
    buf = bufs[me]
    ag = None
    if not pull:
        ag = torch.cat(shards)
        buf.pad()[layout.GATHERED : layout.GATHERED + world] = 1
        buf.pad()[layout.GATHERED + late] = 0  # the copy of the late shard never lands
    start = time.monotonic()
    c, _ = run_rank(buf, staged[me], b, m, world, 1, pull=pull, store_a=False, expired=True, ag=ag)
    assert time.monotonic() - start < 20
    assert status(buf) == [layout.TIMEOUT_READY, late, 1]
    expected = (torch.cat(shards).double() @ b.double()).float()
    rows = lambda s: slice(s * m, (s + 1) * m)  # noqa: E731
    for src in (1, 2):  # before the late shard in rotated order: computed
        assert torch.equal(c[rows(src)], expected[rows(src)]), src
    for src in (late, 0):  # the late shard, and every later one (a failure is recorded)
        assert c[rows(src)].isnan().all(), src


def test_fingerprint_mismatch_is_recorded_and_skipped(loopback):
    world, m, n, k = 2, 5, 7, 33
    bufs = loopback(world)
    shards = [int_shard(r, m, k, torch.float32) for r in range(world)]
    b = int_weight(k, n, torch.float32, False)
    staged = stage_and_signal(bufs, shards, epoch=1, meta=[META, META + 1])
    c, ag = run_rank(bufs[0], staged[0], b, m, world, 1, pull=True, store_a=True, expired=True)
    assert status(bufs[0]) == [layout.META_MISMATCH, 1, 1]
    expected = (torch.cat(shards).double() @ b.double()).float()
    assert torch.equal(c[:m], expected[:m]) and c[m:].isnan().all()
    assert torch.equal(ag[:m], shards[0]) and ag[m:].isnan().all()
