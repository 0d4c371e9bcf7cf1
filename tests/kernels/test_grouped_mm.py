"""The grouped GEMM kernels against a loop of fp64 matmuls, exact on small integers; the
fused expert MLP's and all_gather_matmul's gather GEMM (its plain, SwiGLU and SwiGLU-backward
epilogues, and a source whose rows never arrive)."""

import time

import pytest
import torch

from fusedpar.comm import layout
from fusedpar.kernels.gemm import gemm_operands
from fusedpar.kernels.gemm_peers import block_runs, grouped_mm_peers
from fusedpar.kernels.grouped_mm import grouped_mm_k, grouped_mm_rows
from fusedpar.ops.moe import swiglu


def _ints(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).float()


# (group sizes, K, N, tail rows): ragged, empty groups first / middle / last, a trailing tail
# of rows. fp32 rows of K (N) elements are 16-byte aligned when K (N) is a multiple of 4: the
# first cases take the TMA path, the others the pointer loads
TMA_CASES = [([5, 0, 37, 1], 44, 36, 3), ([0, 70, 0], 100, 8, 0)]
POINTER_CASES = [([5, 0, 37, 1], 45, 33, 0), ([0, 0, 9], 7, 70, 4), ([64], 3, 5, 0),
                 ([0, 3, 0], 66, 1, 9)]


@pytest.mark.parametrize("b_kmajor", [False, True], ids=["b_unit_n", "b_unit_k"])
@pytest.mark.parametrize("sizes, K, N, tail", TMA_CASES + POINTER_CASES)
def test_rows_grouped(sizes, K, N, tail, b_kmajor):
    T = sum(sizes) + tail
    a = _ints(T, K, seed=1)
    b = _ints(len(sizes), N, K, seed=2).transpose(1, 2) if b_kmajor else _ints(len(sizes), K, N, seed=2)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    c = torch.full((T, N), float("nan"))
    assert gemm_operands(a, b)[0]["TMA"] == ((sizes, K, N, tail) in TMA_CASES)
    grouped_mm_rows(a, b, offs, c)
    # rows past offs[-1] are zeros, not left unwritten
    assert torch.equal(c.double(), grouped_product(a, b, offs))


def grouped_product(a, b, offs):
    """The grouped product in fp64, zeros past ``offs[-1]``."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end].double() @ b[g].double()
        start = end
    return out


def _epilogue_b(groups, K, N, b_kmajor, epilogue):
    """b of an epilogue test, ``[groups, K, 2N]`` (``[gate | up]``) or, for the VJP and the
    plain product, ``[groups, K, N]``; unit stride along K or along N."""
    cols = N if epilogue in ("swiglu_vjp", "product") else 2 * N
    b = _ints(groups, cols, K, seed=6).transpose(1, 2) if b_kmajor else _ints(groups, K, cols, seed=6)
    return b / 8


def _epilogue_outputs(epilogue, rows, N, product):
    """``(the kernels' epilogue, c, h, expected c)`` for a test epilogue with ``product``
    the fp64 P: NaN-poisoned c (and h, kept products) or, for the VJP, h the forward's
    products. ``"product"``: no epilogue, c = P."""
    if epilogue == "product":
        return None, torch.full((rows, N), float("nan")), None, product
    if epilogue == "swiglu_vjp":
        h = _ints(rows, 2 * N, seed=7) / 4
        expected = torch.func.vjp(swiglu, h.double())[1](product)[0]
        return epilogue, torch.full((rows, 2 * N), float("nan")), h, expected
    h = torch.full((rows, 2 * N), float("nan")) if epilogue == "swiglu_keep_h" else None
    return "swiglu", torch.full((rows, N), float("nan")), h, swiglu(product)


# (group sizes, K, N, tail rows, b with unit stride along K, TMA): the expert MLP's layouts
# (w13ᵀ in the forward, w2 in the backward); N below, across and not a multiple of the block
EPILOGUE_CASES = [([5, 0, 37, 1], 44, 20, 3, True, True), ([0, 40, 0], 36, 12, 0, False, True),
                  ([5, 0, 37, 1], 45, 7, 2, True, False), ([9, 30], 33, 40, 0, False, False)]


@pytest.mark.parametrize("epilogue", ["swiglu", "swiglu_keep_h", "swiglu_vjp"])
@pytest.mark.parametrize("sizes, K, N, tail, b_kmajor, tma", EPILOGUE_CASES)
def test_rows_epilogues(sizes, K, N, tail, b_kmajor, tma, epilogue):
    """The SwiGLU epilogues of the peers kernel on the rows kernel (the pipelined expert
    MLP's): c = swiglu(P) (+ h = P), or c = vjp(swiglu, h)(P), with P the grouped product;
    the rows past offs[-1] get zeros. NaN-poisoned outputs."""
    T = sum(sizes) + tail
    a, b = _ints(T, K, seed=5) / 8, _epilogue_b(len(sizes), K, N, b_kmajor, epilogue)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    product = grouped_product(a, b, offs)
    kind, c, h, expected = _epilogue_outputs(epilogue, T, N, product)
    assert gemm_operands(a, b, epilogue=kind)[0]["TMA"] == tma
    grouped_mm_rows(a, b, offs, c, epilogue=kind, h=h)
    torch.testing.assert_close(c.double(), expected, rtol=1e-5, atol=1e-5)
    if epilogue == "swiglu_keep_h":
        assert torch.equal(h.double(), product)  # small multiples of 1/64: exact in fp32


def test_an_expanded_operand_takes_pointer_loads():
    """A TMA descriptor takes no zero stride: b expanded from one expert's weights (stride 0
    over experts) goes to the pointer loads, and the product is still every group's."""
    a, offs = _ints(11, 36, seed=30), torch.tensor([4, 4, 11], dtype=torch.int32)
    b = _ints(1, 36, 8, seed=31).expand(3, 36, 8)
    assert gemm_operands(a, b.contiguous())[0]["TMA"] and not gemm_operands(a, b)[0]["TMA"]
    c = torch.full((11, 8), float("nan"))
    grouped_mm_rows(a, b, offs, c)
    assert torch.equal(c.double(), grouped_product(a, b, offs))


def test_rows_epilogue_needs_offs_and_contiguous_outputs():
    a, b, offs = torch.zeros(4, 8), torch.zeros(2, 8, 8), torch.tensor([2, 4], dtype=torch.int32)
    for kwargs in (dict(epilogue="gelu"), dict(epilogue="swiglu", pad_rows=2),
                   dict(epilogue="swiglu_vjp", h=torch.zeros(8, 4).t())):
        with pytest.raises(ValueError, match="epilogue"):
            grouped_mm_rows(a, b, offs, torch.zeros(4, 8), **kwargs)


@pytest.mark.parametrize("sizes, M, N", [([5, 0, 37, 1], 33, 9), ([0, 70], 2, 65)])
def test_k_grouped_on_transposed_operand(sizes, M, N):
    Ktot = sum(sizes)
    x, dy = _ints(Ktot, M, seed=3), _ints(Ktot, N, seed=4)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    c = torch.full((len(sizes), M, N), float("nan"))
    grouped_mm_k(x.t(), dy, offs, c)  # the weight gradient's layout: a = x.t(), strides (1, M)
    start = 0
    for g, end in enumerate(offs.tolist()):
        assert torch.equal(c[g].double(), x[start:end].double().t() @ dy[start:end].double())
        start = end


def test_k_grouped_sums_each_groups_segments_over_sources():
    """``sources=S``: K holds S source-major runs of E segments (the expert MLP's received
    rows: per source, its rows of each expert), and c[g] sums g's S segments; a group empty
    in every source gives zeros, a source with no rows at all adds nothing."""
    rows = [[3, 0, 40], [0, 0, 0], [7, 0, 1]]  # [source][group]
    M, N = 33, 9
    segments = torch.tensor(rows).flatten()
    x, dy = _ints(int(segments.sum()), M, seed=13), _ints(int(segments.sum()), N, seed=14)
    c = torch.full((3, M, N), float("nan"))
    grouped_mm_k(x.t(), dy, segments.cumsum(0).to(torch.int32), c, sources=3)
    expected = torch.zeros(3, M, N, dtype=torch.float64)
    ends = segments.cumsum(0).tolist()
    for seg, end in enumerate(ends):
        start = end - int(segments[seg])
        expected[seg % 3] += x[start:end].double().t() @ dy[start:end].double()
    assert torch.equal(c.double(), expected)
    with pytest.raises(ValueError, match="sources"):
        grouped_mm_k(x.t(), dy, segments.cumsum(0).to(torch.int32), c, sources=2)


# (counts, pad_rows, K, N): empty, partial, full and over-full groups (a count past the pad
# is clamped); K, N multiples of 4 take the TMA path
MASKED_CASES = [([0, 3, 9, 9], 9, 44, 36), ([70, 1], 70, 100, 8), ([2, 0, 5], 5, 45, 33),
                ([12, 1], 7, 7, 70)]


@pytest.mark.parametrize("b_kmajor", [False, True], ids=["b_unit_n", "b_unit_k"])
@pytest.mark.parametrize("counts, P, K, N", MASKED_CASES)
def test_rows_masked(counts, P, K, N, b_kmajor):
    E = len(counts)
    a = _ints(E * P, K, seed=5)
    b = _ints(E, N, K, seed=6).transpose(1, 2) if b_kmajor else _ints(E, K, N, seed=6)
    c = torch.full((E * P, N), float("nan"))
    assert gemm_operands(a, b)[0]["TMA"] == (K % 4 == 0 and N % 4 == 0)
    grouped_mm_rows(a, b, torch.tensor(counts, dtype=torch.int32), c, pad_rows=P)
    expected = torch.zeros(E * P, N, dtype=torch.float64)
    for g, n in enumerate(counts):
        rows = slice(g * P, g * P + min(n, P))
        expected[rows] = a[rows].double() @ b[g].double()
    assert torch.equal(c.double(), expected)  # the padding past each count is zeros


@pytest.mark.parametrize("counts, P, M, N", [([0, 3, 9], 9, 33, 9), ([5, 1], 5, 2, 65)])
def test_k_masked(counts, P, M, N):
    E = len(counts)
    x, dy = _ints(E * P, M, seed=7), _ints(E * P, N, seed=8)
    c = torch.full((E, M, N), float("nan"))
    grouped_mm_k(x.t(), dy, torch.tensor(counts, dtype=torch.int32), c, pad_rows=P)
    for g, n in enumerate(counts):
        rows = slice(g * P, g * P + n)
        assert torch.equal(c[g].double(), x[rows].double().t() @ dy[rows].double())


def test_fp16_within_torch_error():
    torch.manual_seed(0)
    a, b = torch.randn(40, 48).half(), torch.randn(3, 48, 24).half()
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    c = torch.empty(40, 24, dtype=torch.half)
    grouped_mm_rows(a, b, offs, c)
    exact = torch.cat([a[:10].double() @ b[0].double(), a[10:].double() @ b[2].double()])
    torch_out = torch.cat([a[:10].float() @ b[0].float(), a[10:].float() @ b[2].float()]).half()
    torch_err = (torch_out.double() - exact).abs().max()
    assert (c.double() - exact).abs().max() <= 2 * torch_err


def _peers(a, b, c, table, buf, rank, world, **kwargs):
    """``grouped_mm_peers`` at epoch 1 over the blocks of ``table`` and their runs."""
    runs = block_runs(table)
    grouped_mm_peers(a, b, c, table, torch.from_numpy(runs).int(), runs[:, 2].tolist(), buf.pad_table,
                     rank, world, 1, buf.timeout_ns, **kwargs)


@pytest.mark.parametrize("K", [33, 36], ids=["pointer", "tma"])
def test_peers_gather_skips_a_source_whose_rows_never_landed(loopback, K):
    """Rank 1 of 3 multiplies its received blocks in source order 1 (own), 2, 0, each
    source's tiles after its GATHERED flag; source 2's copy never lands: its tiles are
    skipped (its rows keep their NaN), the timeout names source 2, and the kernel returns.
    Rows encode their source, so a block read from the wrong place cannot pass. (The SwiGLU
    epilogue, as the expert MLP's forward launches it.)"""
    world, me, late, N = 3, 1, 2, 20
    buf = loopback(world)[me]
    sizes = {1: [3, 0], 2: [5, 2], 0: [1, 4]}  # rows per (source, expert), empty group included
    groups, at = [], 0
    for src in (1, 2, 0):
        for expert, rows in enumerate(sizes[src]):
            groups.append([src, expert, 0, at, rows])
            at += rows
    table = torch.tensor(groups, dtype=torch.int32)
    source = torch.repeat_interleave(table[:, 0], table[:, 4]).float()
    a = _ints(at, K, seed=3) / 8 + source[:, None]
    b = _ints(2, K, 2 * N, seed=4) / 8
    assert gemm_operands(a, b, epilogue="swiglu")[0]["TMA"] == (K % 4 == 0)  # rows of 16-byte multiples
    c = torch.full((at, N), float("nan"))
    pad = buf.pad()
    pad[layout.GATHERED:layout.GATHERED + world] = 1
    pad[layout.GATHERED + late] = 0
    pad[layout.DEADLINE] = 1  # this call's deadline has passed: a missing flag fails at once
    start = time.monotonic()
    _peers(a, b, c, table, buf, me, world, push=False, epilogue="swiglu")
    assert time.monotonic() - start < 20
    assert pad[layout.STATUS:layout.STATUS + 3].tolist() == [layout.TIMEOUT_READY, late, 1]
    expert = torch.repeat_interleave(table[:, 1], table[:, 4]).long()
    expected = swiglu(torch.einsum("rk,rkn->rn", a.double(), b.double()[expert]))
    own, late_rows = source == me, source == late
    torch.testing.assert_close(c[own].double(), expected[own], rtol=1e-5, atol=1e-5)
    assert c[late_rows].isnan().all()


@pytest.mark.parametrize("epilogue", ["product", "swiglu", "swiglu_keep_h", "swiglu_vjp"])
@pytest.mark.parametrize("K, N, b_kmajor, tma", [(36, 7, True, True), (36, 40, True, True),
                                                  (36, 8, False, True), (36, 10, False, False),
                                                  (33, 40, True, False)],
                         ids=["tma_unit_k", "tma_two_n_tiles", "tma_unit_n", "pointer_unaligned_up",
                              "pointer_two_n_tiles"])
def test_peers_gather_epilogues(loopback, K, N, b_kmajor, tma, epilogue):
    """The gather's epilogues per row block, with P = a @ b[expert]: c = P
    (all_gather_matmul's), c = swiglu(P) (b's
    columns [gate | up]; h = P when given), or c = [d gate | d up] = vjp(swiglu, h)(P) at
    the forward's products h. N below, across and not a multiple of the block, so a gate
    tile's columns past N read up's columns and must not reach c or h. With unit stride
    along N the up half must start 16-byte aligned for TMA (N=10 fp32 does not). Rows
    encode their source; NaN-poisoned outputs."""
    world, me = 2, 1
    buf = loopback(world)[me]
    groups = [[1, 0, 0, 0, 4], [1, 1, 0, 4, 0], [0, 1, 0, 4, 11], [0, 0, 0, 15, 3]]
    table = torch.tensor(groups, dtype=torch.int32)
    rows = int(table[:, 4].sum())
    source = torch.repeat_interleave(table[:, 0], table[:, 4]).float()
    a, b = _ints(rows, K, seed=9) / 8 + source[:, None], _epilogue_b(2, K, N, b_kmajor, epilogue)
    expert = torch.repeat_interleave(table[:, 1], table[:, 4]).long()
    product = torch.einsum("rk,rkn->rn", a.double(), b.double()[expert])
    kind, c, h, expected = _epilogue_outputs(epilogue, rows, N, product)
    assert gemm_operands(a, b, epilogue=kind)[0]["TMA"] == tma
    buf.pad()[layout.GATHERED:layout.GATHERED + world] = 1
    _peers(a, b, c, table, buf, me, world, push=False, epilogue=kind, h=h)
    torch.testing.assert_close(c.double(), expected, rtol=1e-5, atol=1e-5)
    if epilogue == "swiglu_keep_h":
        assert torch.equal(h.double(), product)  # small multiples of 1/64: exact in fp32


def test_block_runs_join_contiguous_blocks_of_one_expert():
    """A run is a stretch of consecutive blocks of one expert whose rows follow each other:
    an expert change, a gap or a block named in ``firsts`` starts a new one; an empty block
    joins the run it sits in."""
    # src, expert, peer_row, local_row, rows
    table = torch.tensor([[1, 0, 0, 0, 4], [2, 0, 7, 4, 3], [0, 0, 9, 7, 0], [0, 0, 9, 7, 5],
                          [1, 1, 4, 12, 2], [2, 1, 0, 20, 1], [0, 1, 3, 21, 6]])
    assert block_runs(table).tolist() == [[0, 4, 12], [4, 1, 2], [5, 2, 7]]
    assert block_runs(table[:1]).tolist() == [[0, 1, 4]]
    # another launch's table starts at block 1 (its view's rows may follow on)
    assert block_runs(table, [1]).tolist() == [[0, 1, 4], [1, 3, 8], [4, 1, 2], [5, 2, 7]]


# rows per source of one expert, in the order the view processes them (own rank 1 first)
SPANNING = {1: 40, 2: 30, 0: 40}


def _spanning_case(K):
    """One expert's rows from three sources, contiguous in ``a`` (the received rows of a rank
    holding one expert), so the interpreter's 32-row tiles hold the rows of two sources.
    Rows encode their source."""
    groups, at = [], 0
    for src, rows in SPANNING.items():
        groups.append([src, 0, 3 * src, at, rows])  # peer_row: where src wants its results
        at += rows
    table = torch.tensor(groups, dtype=torch.int32)
    source = torch.repeat_interleave(table[:, 0], table[:, 4])
    return table, source, _ints(at, K, seed=11) / 8 + source[:, None].float()


@pytest.mark.parametrize("K", [33, 36], ids=["pointer", "tma"])
def test_peers_gather_tiles_span_the_sources_of_a_run(loopback, K):
    """A tile holding two sources' rows waits for both flags: with every flag up, every row
    is right; with source 2's copy never landing (rows 40-69), the tiles holding any of its
    rows are skipped (rows 32-95 with 32-row tiles, own rows 32-39 included) and the
    timeout names source 2."""
    world, me, late, N = 3, 1, 2, 12
    table, _, a = _spanning_case(K)
    b = _epilogue_b(1, K, N, True, "swiglu")
    expected = swiglu(a.double() @ b[0].double())
    assert block_runs(table).tolist() == [[0, 3, 110]]
    buf = loopback(world)[me]
    pad = buf.pad()
    pad[layout.GATHERED:layout.GATHERED + world] = 1
    c = torch.full((110, N), float("nan"))
    _peers(a, b, c, table, buf, me, world, push=False, epilogue="swiglu")
    torch.testing.assert_close(c.double(), expected, rtol=1e-5, atol=1e-5)

    pad[layout.GATHERED + late] = 0
    pad[layout.DEADLINE] = 1  # this call's deadline has passed: a missing flag fails at once
    c = torch.full((110, N), float("nan"))
    _peers(a, b, c, table, buf, me, world, push=False, epilogue="swiglu")
    assert pad[layout.STATUS:layout.STATUS + 3].tolist() == [layout.TIMEOUT_READY, late, 1]
    # the first program's tile (own rows only) ran before the failure; later waits give up
    # once a failure is recorded, so rows 96-109 may be either
    torch.testing.assert_close(c[:32].double(), expected[:32], rtol=1e-5, atol=1e-5)
    assert c[32:96].isnan().all()


@pytest.mark.parametrize("K", [33, 36], ids=["pointer", "tma"])
def test_peers_push_writes_each_row_of_a_spanning_tile_to_its_source(loopback, K):
    """The push over one run of three sources' rows: row i of source s's block lands at row
    ``c_row + peer_row + i`` of s's region, tiles holding two sources' rows
    included; nothing else in any region is written (NaN-poisoned)."""
    world, me, N, c_row = 3, 1, 12, 5
    c_offset = c_row * N
    table, source, a = _spanning_case(K)
    b = _ints(1, N, K, seed=12).transpose(1, 2) / 8  # w2ᵀ of row-major weights, as the MLP
    product = a.double() @ b[0].double()
    bufs = loopback(world)
    regions = [bufs[0].data(torch.float32, 1024, rank=r) for r in range(world)]
    for region in regions:
        region.fill_(float("nan"))
    _peers(a, b, a.new_empty(0), table, bufs[me], me, world, push=True, c_row=c_row)
    for src, rows in SPANNING.items():
        region = regions[src][c_offset:c_offset + 60 * N].view(60, N)
        peer_row = 3 * src
        torch.testing.assert_close(region[peer_row:peer_row + rows].double(), product[source == src],
                                   rtol=1e-5, atol=1e-5)
        written = torch.zeros(regions[src].numel(), dtype=torch.bool)
        written[c_offset + peer_row * N:c_offset + (peer_row + rows) * N] = True
        assert regions[src][~written].isnan().all()


def test_peers_epilogue_must_match_the_mode(loopback):
    buf = loopback(1)[0]
    a, b, c = torch.zeros(2, 4), torch.zeros(1, 4, 4), torch.zeros(2, 4)
    table = torch.tensor([[0, 0, 0, 0, 2]], dtype=torch.int32)
    for push, epilogue in ((True, "swiglu"), (True, "swiglu_vjp"), (False, "gelu")):
        with pytest.raises(ValueError, match="epilogue"):
            _peers(a, b, c, table, buf, 0, 1, push=push, epilogue=epilogue)
