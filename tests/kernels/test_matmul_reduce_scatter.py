"""The fused matmul + reduce-scatter kernels, one process playing every rank over loopback
buffers: each rank's GEMM writes ``P_r = A_r @ B_r`` into its data region and raises the
chunks' READY flags; then each rank stages its peers' partials of its chunk (as the op's
copies do) and ``reduce_chunks`` sums them with its own and raises DONE, which the next
epoch's GEMMs wait for.

Rank r's inputs encode r, so a misrouted chunk cannot pass; the data regions start as NaN,
so a skipped tile cannot pass either.
"""

import pytest
import torch

from fusedpar.comm import layout
from fusedpar.kernels.matmul_reduce_scatter import matmul_reduce_scatter, reduce_chunks
from fusedpar.kernels.gemm import gemm_operands
from fusedpar.kernels.signal import wait_flags

META = 4242
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, NUM_PROGRAMS=3)


def int_activation(rank, m, k, dtype, strided):
    """Small integers offset by 8*(rank+1); ``strided``: a [M, K] view of a [K, M] tensor."""
    i = torch.arange(m * k)
    vals = (i * 7) % 13 - 6 + 8 * (rank + 1)
    if strided:
        return vals.reshape(k, m).to(dtype).t()
    return vals.reshape(m, k).to(dtype)


def int_weight(rank, k, n, dtype, transposed):
    """Values in {-1, 0, 1}, a different pattern per rank."""
    j = torch.arange(k * n) + rank
    vals = (j * 5) % 3 - 1
    if transposed:
        return vals.reshape(n, k).to(dtype).t()
    return vals.reshape(k, n).to(dtype)


def status(buf):
    return buf.pad()[layout.STATUS : layout.STATUS + 3].tolist()


def run_gemm(buf, a, b, epoch, config=None, scales=None):
    """One rank's producer: poison its data region, launch. Returns P (float32 with
    ``scales``: the fp8 GEMM's)."""
    world = buf.world_size
    m, n = a.shape[0], b.shape[1]
    p = buf.data(torch.float32 if scales else a.dtype, m * n).view(m, n)
    p.fill_(float("nan"))
    matmul_reduce_scatter(a, b, p, buf.pad_table, buf.rank, world, epoch, META, buf.timeout_ns,
                          config=config, scales=scales)
    return p


def run_reduce(buf, m_chunk, n, dtype, divisor=1.0, epoch=1, out_dtype=None):
    """One rank's consumer: each peer's partial of its chunk into a NaN-poisoned staging
    buffer, row j from rank (rank - 1 - j) % W (the order the op copies them in), then
    ``reduce_chunks`` (which raises DONE of ``epoch``) into ``out_dtype`` (default: the
    partials' ``dtype``)."""
    world, rank = buf.world_size, buf.rank
    partial = lambda src: buf.data(dtype, world * m_chunk * n, rank=src).view(world, -1)[rank]  # noqa: E731
    stage = torch.full((world - 1, m_chunk * n), float("nan"), dtype=dtype)
    for j in range(world - 1):
        stage[j] = partial((rank - 1 - j) % world)
    out = torch.full((m_chunk, n), float("nan"), dtype=out_dtype or dtype)
    reduce_chunks(out, partial(rank), stage, buf.pad_table, rank, world, epoch, divisor)
    return out


def ready_words(bufs, src):
    """READY[src] as seen in every rank's pad."""
    return [buf.pad()[layout.READY + src].item() for buf in bufs]


CASES = [  # world, m_chunk, N, K, dtype, strided A, transposed B, config; TMA loads where rows
    # of A and B (or Bᵀ) are 16-byte multiples and A's unit stride is along K (the last two)
    (1, 5, 7, 33, torch.float32, False, False, None),
    (2, 5, 7, 33, torch.float16, True, True, None),
    (2, 7, 33, 5, torch.float32, False, True, SMALL),
    (4, 17, 20, 40, torch.float32, True, False, SMALL),
    (4, 5, 7, 33, torch.float16, False, True, None),
    (2, 9, 24, 40, torch.float32, False, False, SMALL),
    (4, 17, 8, 16, torch.float16, False, True, None),
]
TMA_CASES = CASES[-2:]


@pytest.mark.parametrize("world,m,n,k,dtype,strided,transposed,config", CASES)
def test_gemm_then_reduce_scatter_exact(loopback, world, m, n, k, dtype, strided, transposed, config):
    bufs = loopback(world)
    epoch = 1
    a = [int_activation(r, world * m, k, dtype, strided) for r in range(world)]
    b = [int_weight(r, k, n, dtype, transposed) for r in range(world)]
    partial = [(a[r].double() @ b[r].double()) for r in range(world)]
    tma = (world, m, n, k, dtype, strided, transposed, config) in TMA_CASES
    assert gemm_operands(a[0], b[0].unsqueeze(0), config)[0]["TMA"] == tma
    for buf in bufs:
        r = buf.rank
        assert ready_words(bufs, r) == [0] * world
        p = run_gemm(buf, a[r], b[r], epoch, config)
        assert torch.equal(p, partial[r].to(dtype)), r
        # every chunk's owner (this rank included) now sees READY[r] = epoch; the tile that
        # completed each chunk set its counter back for the next launch
        assert ready_words(bufs, r) == [epoch] * world
        assert buf.pad()[layout.CHUNK_TILES : layout.CHUNK_TILES + world].tolist() == [0] * world
        assert buf.pad()[layout.META].item() == META
    for buf in bufs:
        r = buf.rank
        for divisor in (1.0, float(world)):
            out = run_reduce(buf, m, n, dtype, divisor)
            expected = sum(partial[s].to(dtype).double() for s in range(world))[r * m : (r + 1) * m]
            expected = (expected.float() / divisor).to(dtype)  # fp32 sum, one rounding
            assert torch.equal(out, expected), (r, divisor, (out.double() - expected.double()).abs().max())


def test_second_epoch_recounts_chunks(loopback):
    world, m, n, k = 2, 5, 7, 33
    bufs = loopback(world)
    a = [int_activation(r, world * m, k, torch.float32, False) for r in range(world)]
    b = [int_weight(r, k, n, torch.float32, False) for r in range(world)]
    for epoch in (1, 2):
        for buf in bufs:
            run_gemm(buf, a[buf.rank], b[buf.rank], epoch)
            assert ready_words(bufs, buf.rank) == [epoch] * world
            assert buf.pad()[layout.CHUNK_TILES : layout.CHUNK_TILES + world].tolist() == [0] * world
        for buf in bufs:
            out = run_reduce(buf, m, n, torch.float32, epoch=epoch)
            assert [b.pad()[layout.DONE + buf.rank].item() for b in bufs if b is not buf] == [epoch]
            expected = sum(a[s].double() @ b[s].double() for s in range(world))[buf.rank * m : (buf.rank + 1) * m]
            assert torch.equal(out, expected.float())


def test_random_bf16_within_twice_torch_error(loopback):
    world, m, n, k = 2, 9, 17, 40
    torch.manual_seed(0)
    bufs = loopback(world)
    a = [torch.randn(world * m, k).to(torch.bfloat16) * (r + 1) for r in range(world)]
    b = [torch.randn(n, k).to(torch.bfloat16).t() for r in range(world)]
    partial = [a[r] @ b[r] for r in range(world)]  # torch: bf16 GEMMs, then a bf16 sum
    torch_sum = partial[0].clone()
    for p in partial[1:]:
        torch_sum += p
    exact = sum(a[r].double() @ b[r].double() for r in range(world))
    torch_err = (torch_sum.double() - exact).abs().max()
    # the interpreter rounds fp32->bf16 by truncation (1 ulp more), once per partial (the GEMM
    # stores P in bf16) and once for the sum: a 1/128 slack on each
    slack = (sum(p.double().abs().max() for p in partial) + exact.abs().max()) / 128
    for buf in bufs:
        run_gemm(buf, a[buf.rank], b[buf.rank], 1)
    for buf in bufs:
        r = buf.rank
        out = run_reduce(buf, m, n, torch.bfloat16)
        ours_err = (out.double() - exact[r * m : (r + 1) * m]).abs().max()
        assert ours_err <= 2 * torch_err + slack, (ours_err, torch_err)


@pytest.mark.parametrize("tensorwise", [False, True])
def test_scaled_gemm_then_reduce_scatter_exact(loopback, tensorwise):
    """``SCALED``: fp8 operands (e4m3 A, e5m2 B), the GEMM multiplies each tile by A's row
    scales and B's column scales (stride 0: one tensorwise scale) and stores float32
    partials; ``reduce_chunks`` sums them in float32 into a bf16 output (the GPU group
    path's chunk sum), exact on small integers with power-of-2 scales. K = 40: pointer
    loads (no TMA: 40 bytes a row)."""
    world, m, n, k = 2, 5, 24, 40
    bufs = loopback(world)
    a = [int_activation(r, world * m, k, torch.float32, False).remainder(5).sub(2).to(torch.float8_e4m3fn)
         for r in range(world)]
    b = [int_weight(r, k, n, torch.float32, True).to(torch.float8_e5m2) for r in range(world)]
    sa = [torch.full((1,), 2.0 ** r) if tensorwise else torch.exp2(torch.arange(world * m) % 3 - 1.0 + r)
          for r in range(world)]
    sb = [torch.full((1,), 0.5) if tensorwise else torch.exp2(torch.arange(n) % 2 - r * 1.0) for r in range(world)]
    stride = 0 if tensorwise else 1
    partial = [(a[r].double() * sa[r].double()[:, None]) @ (b[r].double() * sb[r].double()[None, :])
               for r in range(world)]
    for buf in bufs:
        r = buf.rank
        p = run_gemm(buf, a[r], b[r], 1, scales=(sa[r], stride, sb[r], stride))
        assert p.dtype == torch.float32 and torch.equal(p, partial[r].float()), r
    for buf in bufs:
        r = buf.rank
        out = run_reduce(buf, m, n, torch.float32, out_dtype=torch.bfloat16)
        expected = sum(partial)[r * m:(r + 1) * m].to(torch.bfloat16)
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected), r


def test_reduce_chunks_rejects_a_misshaped_stage():
    out, own = torch.zeros(6), torch.zeros(6)
    with pytest.raises(ValueError, match=r"\[W - 1 = 2, n\]"):
        reduce_chunks(out, own, torch.zeros(3, 6), torch.zeros(3, dtype=torch.int64), 0, 3, 1)


def test_a_single_peer_wait_waits_for_that_peer_only(loopback):
    """The op's copies wait for one peer's chunk at a time (``wait_flags(only=src)``): rank
    2's flag is up, rank 1's is not; waiting for 2 succeeds, waiting for 1 gives up at the
    deadline naming it."""
    world, late = 4, 1
    bufs = loopback(world)
    buf = bufs[0]
    buf.pad()[layout.READY + 2] = 1
    wait_flags(buf.pad_table, layout.READY, 0, world, 1, buf.timeout_ns, layout.TIMEOUT_READY, only=2)
    assert status(buf) == [0, 0, 0]
    buf.pad()[layout.DEADLINE] = 1  # what the watchdog writes once the call's time is up
    wait_flags(buf.pad_table, layout.READY, 0, world, 1, buf.timeout_ns, layout.TIMEOUT_READY, only=late)
    assert status(buf) == [layout.TIMEOUT_READY, late, 1]
