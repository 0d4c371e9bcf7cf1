"""``fusedpar.ops.ring_attention`` on spawned gloo ranks: every backend, both layouts,
causal or not, GQA, B > 1; out, lse and the gradients of q, k, v equal fp64 attention on
the full sequence (outputs compared after unsharding), and the bytes moved equal the
K/V (and dK/dV) volume. Sliding windows and softcap (bf16, the peers' rule), packed
documents, and the triton ring's bytes at the lower bound: the K/V rows its queries see."""

import contextlib
import gc
import importlib
import weakref

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops.flash_attention import host_list
from fusedpar.ops.ring_attention.call import packed_layout
from fusedpar.parallel import sequence_shard, sequence_unshard, zigzag_shard
from fusedpar.ops.ring_attention.blocks import rank_chunks
from tests.ops.attention_cases import assert_peers_rule, attention_ref, reference_results, visible_keys
from tests.ops.collective_cases import (capture_errors, cpu_backends, debug_level, scalar_arguments,
                                        stalled_peer_error, subgroup)
from tests.ops.test_flash_attention import sdpa64

pytestmark = [pytest.mark.timeout(300)]

BACKENDS = cpu_backends("ring_attention")
# (B, H, H_kv, D): GQA, MQA, odd head dim
SHAPES = [(2, 4, 2, 16), (1, 4, 1, 23)]


def _shard(x, dim, layout, rank, world, cu_seqlens=None):
    return sequence_shard(x, dim, rank, world, layout=layout, cu_seqlens=cu_seqlens)


def _unshard(x, dim, layout):
    return sequence_unshard(x, dim, layout=layout, backend="reference")


def visible_kv_bytes(kv: int, world: int, rank: int, causal: bool, layout: str) -> int:
    """The forward's lower bound for a rank that pulls K/V: the bytes of the peers' K/V rows
    its queries can see, once (``kv``: one rank's K/V bytes). Causal, contiguous: the ranks
    before it; zigzag: the first half of each rank before it and all of each rank after."""
    if not causal:
        return (world - 1) * kv
    if layout == "contiguous":
        return rank * kv
    return rank * kv // 2 + (world - 1 - rank) * kv


def seen_key_rows(world: int, rank: int, layout: str, seqlen: int, visible, documents=None) -> int:
    """The peers' K/V rows some query of ``rank`` sees (``visible [S, S]`` by global
    position): what a rank that pulls K/V must receive, once (``seqlen``: S_local;
    ``documents``: ``zigzag_docs``' ranges)."""
    def positions(r):
        return torch.cat([torch.arange(g, g + n)
                          for _, g, n in rank_chunks(layout, world, r, seqlen, documents)])

    mine = positions(rank)
    return sum(int(visible[mine][:, positions(src)].any(0).sum()) for src in range(world) if src != rank)


def _expected_bytes(backend, q, k, world, causal, layout):
    """``(forward, backward)`` bytes this rank receives, fp32 inputs."""
    kv = 2 * k.numel() * 4
    if backend == "triton":  # pulls what it needs; the backward is the pipelined ring's
        return visible_kv_bytes(kv, world, dist.get_rank(), causal, layout), 2 * (world - 1) * kv
    if backend in ("pipelined", "pipelined_sdpa", "allgather_kv"):  # K/V once around; dK/dV once back
        return (world - 1) * kv, 2 * (world - 1) * kv
    kv_rep = kv * max(1, world // k.shape[2])  # ulysses: K/V heads replicated to W
    lse = q.numel() // q.shape[-1] * 4
    part = (world - 1) / world
    forward = part * (2 * q.numel() * 4 + kv_rep + lse)  # q, k, v there; out, lse back
    # q, k, v, dout, lse, delta there; dq, dk, dv back
    backward = part * (2 * q.numel() * 4 + kv_rep + 2 * lse) + part * (q.numel() * 4 + kv_rep)
    return int(forward), int(backward)


def _check_matches_full_attention(backends, shapes):
    for backend in backends:
        _check_backend_matches_full_attention(backend, shapes)
        if backend != "pipelined_sdpa" and dist.get_world_size() > 1:  # sdpa: no window, softcap
            _check_windows_and_softcap(backend)
    return True


# (causal, window_size, softcap): a causal sliding window shorter than a zigzag chunk
# (Mistral's), a two-sided window with Gemma 2's attention softcap (50)
RING_MASKS = [(True, (3, -1), 0.0), (False, (2, 5), 50.0)]


def _check_windows_and_softcap(backend):
    """Windows and softcap in bf16 on every layout (MQA, odd head dim): out, lse, dq, dk, dv
    within twice (three times for gradients) the error of the same math in bf16 against
    fp64; the triton ring's forward moves exactly the K/V rows its queries see."""
    rank, world = dist.get_rank(), dist.get_world_size()
    b, h, hk, d = SHAPES[-1]
    s = 6 * world
    g = torch.Generator().manual_seed(5)  # the same full sequence on every rank
    full = [torch.randn(b, s, n, d, generator=g).bfloat16() for n in (h, hk, hk)]
    dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    dlse = torch.randn(b, h, s, generator=g, dtype=torch.float64)
    for layout in ("zigzag", "contiguous"):
        for causal, window, softcap in RING_MASKS:
            mask = dict(scale=d ** -0.5, causal=causal, window=window, softcap=softcap)
            exact = reference_results(full, torch.float64, dout, dlse, **mask)
            low = reference_results(full, torch.bfloat16, dout, dlse, **mask)
            q, k, v = (_shard(t, 1, layout, rank, world).requires_grad_() for t in full)
            with fusedpar.comm.count_bytes() as forward:
                out, lse = fusedpar.ops.ring_attention_with_lse(
                    q, k, v, causal=causal, window_size=window, softcap=softcap, layout=layout,
                    backend=backend)
            torch.autograd.backward((out, lse), (_shard(dout, 1, layout, rank, world).bfloat16(),
                                                 _shard(dlse, 2, layout, rank, world).float()))
            where = (backend, layout, causal, window, softcap, rank)
            for name, got, lo, ex, dim in zip(["out", "lse", "dq", "dk", "dv"],
                                              [out, lse, q.grad, k.grad, v.grad], low, exact,
                                              (1, 2, 1, 1, 1)):
                assert_peers_rule(f"{name} {where}", got.detach(), _shard(lo, dim, layout, rank, world),
                                  _shard(ex, dim, layout, rank, world), 2 if name in ("out", "lse") else 3)
            if backend == "triton":
                rows = seen_key_rows(world, rank, layout, s // world,
                                     visible_keys(s, s, causal, window))
                assert forward.total() == rows * 2 * hk * d * 2 * b, (where, forward.total(), rows)


def _check_backend_matches_full_attention(backend, shapes):
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, (b, h, hk, d) in enumerate(shapes):
        s = 4 * world + 2 * world * i  # divisible by 2W; S_local even, not a power of two
        g = torch.Generator().manual_seed(i)
        full = [torch.randn(b, s, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk)]
        dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
        dlse = torch.randn(b, h, s, generator=g, dtype=torch.float64)
        for layout in ("zigzag", "contiguous"):
            for causal in (True, False):
                # pipelined_sdpa: without an lse gradient (causal) its steps' backward is torch's;
                # with one another ring's
                lse_grad = backend != "pipelined_sdpa" or not causal
                ref = [t.clone().requires_grad_() for t in full]
                ref_out, ref_lse = sdpa64(*ref, causal)
                torch.autograd.backward((ref_out, ref_lse), (dout, dlse * lse_grad))
                q, k, v = (_shard(t, 1, layout, rank, world).float().requires_grad_() for t in full)
                with fusedpar.comm.count_bytes() as forward:
                    out, lse = fusedpar.ops.ring_attention_with_lse(
                        q, k, v, causal=causal, layout=layout, backend=backend)
                with fusedpar.comm.count_bytes() as backward:
                    grads = (_shard(dout, 1, layout, rank, world).float(),
                             _shard(dlse, 2, layout, rank, world).float())
                    torch.autograd.backward((out, lse)[:1 + lse_grad], grads[:1 + lse_grad])
                where = (backend, layout, causal, b, h, hk, d)
                torch.testing.assert_close(_unshard(out.detach(), 1, layout).double(), ref_out,
                                           atol=1e-5, rtol=0, msg=str(where))
                torch.testing.assert_close(_unshard(lse.detach(), 2, layout).double(), ref_lse,
                                           atol=1e-5, rtol=0, msg=str(where))
                for t, r in zip((q, k, v), ref):
                    torch.testing.assert_close(t.grad.double(), _shard(r.grad, 1, layout, rank, world),
                                               atol=1e-4, rtol=0, msg=str(where))
                expected_forward, expected_backward = _expected_bytes(backend, q, k, world, causal, layout)
                assert (forward.total(), backward.total()) == (expected_forward, expected_backward), where


# the interpreted triton kernel is slow: W <= 2 and one shape here; W=4 in test_loopback_*.
# The two pipelined rings (step kernel ours or torch's) share a pool run.
GROUPS = [("pipelined", "pipelined_sdpa") if b == "pipelined" else (b,) for b in BACKENDS
          if b != "pipelined_sdpa"]
CASES = [(g, w) for g in GROUPS for w in (1, 2, 4) if not (g == ("triton",) and w == 4)]


@pytest.mark.parametrize("backends,world", CASES, ids=[f"{'+'.join(g)}-{w}" for g, w in CASES])
def test_matches_full_sequence_attention(pools, world, backends):
    shapes = SHAPES[:1] if backends == ("triton",) else SHAPES
    assert pools(world).run(_check_matches_full_attention, backends, shapes) == [True] * world


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (2, "contiguous"), (4, "zigzag"),
                                          (4, "contiguous")])
def test_loopback_matches_full_attention_at_the_byte_lower_bound(world, layout):
    """Several query blocks (S_local = 40 > the interpreter's 32-row blocks), GQA (H=4,
    H_kv=2), B=2 at W=2: out and lse equal fp64 attention, and each peer's K/V rows that a
    rank's queries see cross once: (W-1) x K/V bytes per rank without causal masking, and a
    causal sliding window (17 keys back, shorter than a zigzag chunk at W=4) moves only the
    rows it reaches, less than causal."""
    s = 40 * world
    g = torch.Generator().manual_seed(world)
    q, k, v = (torch.randn(2 if world == 2 else 1, s, n, 24, generator=g) for n in (4, 2, 2))
    shard = ((lambda x, d, r: zigzag_shard(x, d, r, world)) if layout == "zigzag"
             else (lambda x, d, r: x.chunk(world, d)[r]))
    kv = 2 * k.numel() // world * 4
    moved = {}
    for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (17, -1))):
        ref_out, ref_lse = attention_ref(q.double(), k.double(), v.double(), 24 ** -0.5, causal, window)
        with fusedpar.comm.count_bytes() as counter:
            results = fusedpar.ops.ring_attention_loopback(
                *([shard(t, 1, r) for r in range(world)] for t in (q, k, v)), causal=causal,
                window_size=window, layout=layout)
        for r, (out, lse) in enumerate(results):
            torch.testing.assert_close(out.double(), shard(ref_out, 1, r), atol=1e-5, rtol=0)
            torch.testing.assert_close(lse.double(), shard(ref_lse, 2, r), atol=1e-5, rtol=0)
        if window == (-1, -1):
            expected = sum(visible_kv_bytes(kv, world, r, causal, layout) for r in range(world))
        else:  # a sliding window: the rows some query sees, fewer than causal's
            visible = visible_keys(s, s, causal, window)
            expected = sum(seen_key_rows(world, r, layout, s // world, visible)
                           for r in range(world)) * kv // (s // world)
        moved[causal, window] = counter.total()
        assert counter.total() == expected, (causal, window, counter.total(), expected)
    assert moved[False, (-1, -1)] == world * (world - 1) * kv
    assert moved[True, (17, -1)] < moved[True, (-1, -1)]


def per_document_ref(q, k, v, documents, scale, causal, window):
    """``(out, lse)`` of ``attention_ref`` on each ``[start, end)`` document alone."""
    pieces = [attention_ref(q[:, a:z], k[:, a:z], v[:, a:z], scale, causal, window)
              for a, z in documents]
    return torch.cat([o for o, _ in pieces], 1), torch.cat([l for _, l in pieces], 2)


def _check_packed_documents(backends, lengths, layouts, heads):
    """Documents of ``lengths`` that cross rank (and zigzag chunk)
    boundaries, sharded as each of ``layouts`` says, against per-document fp64 attention of
    the full sequence (out, lse and the gradients of q, k, v through both), on each backend
    that takes them, with and without a sliding window; the pipelined rings move K/V once
    around, and the triton ring only the K/V rows of its queries' documents."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ends = torch.tensor([0, *lengths]).cumsum(0).tolist()
    s, cu = ends[-1], torch.tensor(ends, dtype=torch.int32)
    documents = list(zip(ends, ends[1:]))
    same_doc = torch.zeros(s, s, dtype=torch.bool)
    for a, z in documents:
        same_doc[a:z, a:z] = True
    h, hk = heads
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(1, s, n, 16, generator=g, dtype=torch.float64) for n in (h, hk, hk)]
    dout = torch.randn(1, s, h, 16, generator=g, dtype=torch.float64)
    dlse = torch.randn(1, h, s, generator=g, dtype=torch.float64)
    masks = {"triton": [(True, (2, -1))], "allgather_kv": [(True, (2, -1)), (False, (-1, -1))]}
    for backend in backends:
        for layout in layouts:
            def shard(x, dim, layout=layout):
                return _shard(x, dim, layout, rank, world, cu)

            for causal, window in masks.get(backend, [(True, (-1, -1)), (False, (-1, -1)), (True, (2, -1))]):
                ref = [t.clone().requires_grad_() for t in full]
                ref_out, ref_lse = per_document_ref(*ref, documents, 0.25, causal, window)
                torch.autograd.backward((ref_out, ref_lse), (dout, dlse))
                q, k, v = (shard(t, 1).float().requires_grad_() for t in full)
                with fusedpar.comm.count_bytes() as forward:
                    out, lse = fusedpar.ops.ring_attention_with_lse(
                        q, k, v, causal=causal, window_size=window, layout=layout, cu_seqlens=cu,
                        backend=backend)
                torch.autograd.backward((out, lse), (shard(dout, 1).float(), shard(dlse, 2).float()))
                where = (backend, layout, causal, window)
                torch.testing.assert_close(out.detach().double(), shard(ref_out.detach(), 1),
                                           atol=1e-5, rtol=0, msg=str(where))
                torch.testing.assert_close(lse.detach().double(), shard(ref_lse.detach(), 2),
                                           atol=1e-5, rtol=0, msg=str(where))
                for t, r in zip((q, k, v), ref):
                    torch.testing.assert_close(t.grad.double(), shard(r.grad, 1),
                                               atol=1e-4, rtol=0, msg=str(where))
                kv = 2 * k.numel() * 4
                if backend == "triton":
                    visible = same_doc & visible_keys(s, s, causal, window)
                    rows = seen_key_rows(world, rank, layout, s // world, visible, documents)
                    assert forward.total() == rows * 2 * hk * 16 * 4, (where, forward.total(), rows)
                else:
                    assert forward.total() == (world - 1) * kv, (where, forward.total())
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_across_ranks(pools, world):
    """Packed documents on the rings and allgather_kv (the interpreted triton ring at W=2),
    the whole row zigzag (and contiguous at W=2): a long document spans ranks; a 1-token one."""
    backends = [b for b in ("triton", "pipelined", "allgather_kv") if b in BACKENDS and
                not (b == "triton" and world == 4)]
    lengths = [3, 4 * world + 1, 4 * world - 5, 1]
    layouts = ("zigzag", "contiguous")[:4 // world]
    assert pools(world).run(_check_packed_documents, backends, lengths, layouts, (2, 1)) == [True] * world


@pytest.mark.parametrize("world", [2, 4])
def test_documents_sharded_zigzag_each(pools, world):
    """``layout="zigzag_docs"``: every document zigzag over the ring (ring-flash-attn's varlen
    zigzag), documents of odd multiples of 2W (chunks of 1, 3 and 5 rows), GQA; the
    interpreted triton ring at W=2."""
    backends = [b for b in ("triton", "pipelined", "allgather_kv") if b in BACKENDS and
                not (b == "triton" and world == 4)]
    lengths = [6 * world, 2 * world, 10 * world]
    assert pools(world).run(_check_packed_documents, backends, lengths, ("zigzag_docs",),
                            (4, 2)) == [True] * world


def test_loopback_documents_zigzag_each_at_the_byte_lower_bound():
    """``zigzag_docs`` on the triton ring at W=4 (loopback): out and lse equal per-document
    fp64 attention, and each rank receives exactly the peers' K/V rows its queries see in
    their documents (causal: the first half of each document's rows from the ranks before
    it, all from those after, as the whole-row zigzag moves for one document)."""
    world, lengths = 4, [24, 8, 8]  # chunks of 3, 1 and 1 rows
    ends = torch.tensor([0, *lengths]).cumsum(0).tolist()
    s, documents = ends[-1], list(zip(ends, ends[1:]))
    cu = torch.tensor(ends, dtype=torch.int32)
    same_doc = torch.zeros(s, s, dtype=torch.bool)
    for a, z in documents:
        same_doc[a:z, a:z] = True
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, s, n, 16, generator=g) for n in (4, 2, 2))
    for causal, window in ((True, (-1, -1)),):  # a window: test_documents_sharded_zigzag_each
        ref_out, ref_lse = per_document_ref(q.double(), k.double(), v.double(), documents, 0.25,
                                            causal, window)
        with fusedpar.comm.count_bytes() as counter:
            results = fusedpar.ops.ring_attention_loopback(
                *([_shard(t, 1, "zigzag_docs", r, world, cu) for r in range(world)] for t in (q, k, v)),
                causal=causal, window_size=window, softmax_scale=0.25, layout="zigzag_docs",
                cu_seqlens=cu)
        for r, (out, lse) in enumerate(results):
            torch.testing.assert_close(out.double(), _shard(ref_out, 1, "zigzag_docs", r, world, cu),
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(lse.double(), _shard(ref_lse, 2, "zigzag_docs", r, world, cu),
                                       atol=1e-5, rtol=0)
        visible = same_doc & visible_keys(s, s, causal, window)
        rows = sum(seen_key_rows(world, r, "zigzag_docs", s // world, visible, documents)
                   for r in range(world))
        assert counter.total() == rows * 2 * 2 * 16 * 4, (causal, window, counter.total(), rows)
        kv = 2 * k.numel() // world * 4  # one rank's K/V bytes
        assert counter.total() == sum(visible_kv_bytes(kv, world, r, True, "zigzag") for r in range(world))


@contextlib.contextmanager
def counted_reads(*watched):
    """``reads[i]``: how many times ``watched[i]`` was read to the host (``tolist``) inside."""
    tolist, reads = torch.Tensor.tolist, [0] * len(watched)

    def counting(self):
        reads[:] = [n + (t is self) for n, t in zip(reads, watched)]
        return tolist(self)

    torch.Tensor.tolist = counting
    try:
        yield reads
    finally:
        torch.Tensor.tolist = tolist


def test_host_list_reads_a_tensor_once_per_contents():
    """``host_list`` reads a tensor again only after an in-place write (also through a view);
    a new tensor of equal values is read; fake and meta tensors behave as ``tolist``; the
    copy keeps no tensor alive."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    fresh = cu.clone()
    with counted_reads(cu, fresh) as reads:
        assert [host_list(cu) for _ in range(3)] == [[0, 4, 12]] * 3 and reads == [1, 0]
        host_list(cu).append(99)  # the caller's own list
        assert host_list(cu) == [0, 4, 12] and reads == [1, 0]
        cu[1] = 8
        assert host_list(cu) == [0, 8, 12] and reads == [2, 0]
        cu[1:2].fill_(6)
        assert host_list(cu) == [0, 6, 12] and reads == [3, 0]
        assert host_list(fresh) == [0, 4, 12] and host_list(fresh) == [0, 4, 12] and reads == [3, 1]
    with torch.inference_mode():  # no version counter: read every time
        frozen = torch.tensor([0, 3], dtype=torch.int32)
    with counted_reads(frozen) as reads:
        assert host_list(frozen) == host_list(frozen) == [0, 3] and reads == [2]
    meta = torch.empty(3, dtype=torch.int32, device="meta")
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(cu)
    for t in (meta, fake):
        with pytest.raises(Exception) as by_torch:
            t.tolist()
        with pytest.raises(by_torch.type):
            host_list(t)
    gone = weakref.ref(cu)
    del cu
    gc.collect()
    assert gone() is None


def _count_reads_across_layers():
    """One step of a 3-layer packed-row model under cp: ``cp_shard`` and every layer's
    ``packed_layout`` and ring attention, forward and backward, read cu_seqlens to the host
    once; an in-place write is read again (the new documents: the whole row zigzag, and the
    same outputs as a new tensor of those values)."""
    from fusedpar.parallel.forward import cp_shard

    world, name = dist.get_world_size(), dist.group.WORLD.group_name
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(1, 32, 2, 8, generator=g) for _ in range(3)]

    def step(cu):
        q, k, v = (t.requires_grad_() for t in cp_shard(name, *full, documents=cu))
        x, layouts = q, []
        for _ in range(3):
            layouts.append(packed_layout(cu, world))
            x = fusedpar.ops.ring_attention(x, k, v, causal=True, layout=layouts[-1], cu_seqlens=cu,
                                            backend="pipelined")
        x.sum().backward()
        return x.detach(), set(layouts)

    cu = torch.tensor([0, 8, 20, 32], dtype=torch.int32)  # multiples of 2W: each document zigzag
    with counted_reads(cu) as reads:
        _, layouts = step(cu)
        assert (reads, layouts) == ([1], {"zigzag_docs"}), (reads, layouts)
        cu[1] = 10  # 10 rows: the whole row zigzag
        out, layouts = step(cu)
        assert (reads, layouts) == ([2], {"zigzag"}), (reads, layouts)
    assert torch.equal(out, step(cu.clone())[0])
    return True


def test_packed_row_read_to_the_host_once_per_step(pools):
    assert pools(2).run(_count_reads_across_layers) == [True, True]


def _check_errors():
    rank = dist.get_rank()
    ring = fusedpar.ops.ring_attention
    q, kv = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8)
    odd = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8)

    def detail_ring(*args, **kwargs):
        with debug_level():
            return ring(*args, **kwargs)

    return capture_errors({
        "odd_zigzag": lambda: ring(odd[0], odd[1], odd[1]),
        "layout": lambda: ring(q, kv, kv, layout="striped"),
        "heads": lambda: ring(q, torch.randn(1, 6, 3, 8), torch.randn(1, 6, 3, 8)),
        "ulysses_heads": lambda: ring(torch.randn(1, 6, 3, 8), torch.randn(1, 6, 3, 8),
                                      torch.randn(1, 6, 3, 8), backend="ulysses"),
        "dtype": lambda: ring(q, kv.double(), kv),
        "packed_total": lambda: ring(q, kv, kv, cu_seqlens=torch.tensor([0, 5, 11], dtype=torch.int32)),
        "packed_ulysses": lambda: ring(q, kv, kv, cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32),
                                       backend="ulysses"),
        "docs_without_cu": lambda: ring(q, kv, kv, layout="zigzag_docs"),
        "docs_not_2w": lambda: ring(q, kv, kv, layout="zigzag_docs",
                                    cu_seqlens=torch.tensor([0, 6, 12], dtype=torch.int32)),
        "docs_ulysses": lambda: ring(q, kv, kv, layout="zigzag_docs", backend="ulysses",
                                     cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32)),
        "docs_sdpa": lambda: ring(q, kv, kv, layout="zigzag_docs", backend="pipelined_sdpa",
                                  cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32)),
        "window": lambda: ring(q, kv, kv, window_size=(3, -2)),
        "mask_align": lambda: ring(q, kv, kv, mask_align="lower_right"),
        "sdpa_window": lambda: ring(q, kv, kv, window_size=(3, 0), backend="pipelined_sdpa"),
        # not the first ring call on WORLD in this pool: checked at torch's DETAIL debug level
        "ranks_differ": lambda: detail_ring(torch.randn(1, 6 + 2 * rank, 4, 8),
                                            torch.randn(1, 6 + 2 * rank, 2, 8),
                                            torch.randn(1, 6 + 2 * rank, 2, 8), backend="pipelined"),
        # a failed symmetric-memory call leaves its buffer unusable: a group of its own
        "ranks_differ_triton": lambda: ring(*(torch.randn(1, 6, 4 - 2 * rank, 8) for _ in range(3)),
                                            subgroup(), backend="triton"),
    })


def test_bad_inputs_raise_clear_errors(pools):
    for errors in pools(2).run(_check_errors):
        assert errors["odd_zigzag"][0] == "ValueError" and "divisible by 2W = 4" in errors["odd_zigzag"][1]
        assert "layout='striped'" in errors["layout"][1]
        assert "multiple of H_kv" in errors["heads"][1]
        assert errors["ulysses_heads"][0] == "BackendNotSupportedError"
        assert "H % W != 0" in errors["ulysses_heads"][1]
        assert "cast them to one dtype" in errors["dtype"][1]
        assert "(W * S_local) has 12 rows" in errors["packed_total"][1]
        assert "triton, pipelined and allgather_kv" in errors["packed_ulysses"][1]
        assert "pass cu_seqlens" in errors["docs_without_cu"][1], errors["docs_without_cu"]
        assert ("document 0: 6, document 1: 6" in errors["docs_not_2w"][1] and "pad each document to a "
                "multiple of 4, or use layout='zigzag'" in errors["docs_not_2w"][1]), errors["docs_not_2w"]
        for name in ("docs_ulysses", "docs_sdpa"):
            assert errors[name][0] == "BackendNotSupportedError", errors[name]
            assert "triton, pipelined and allgather_kv" in errors[name][1], errors[name]
        assert "window_size=(3, -2)" in errors["window"][1] and "-1 for an unbounded side" in errors["window"][1]
        assert "choose one of ('top_left', 'bottom_right')" in errors["mask_align"][1]
        assert "no sliding window" in errors["sdpa_window"][1]
        assert "passed different inputs" in errors["ranks_differ"][1]
        assert "passed different inputs" in errors["ranks_differ_triton"][1], errors["ranks_differ_triton"]


def _compiled(backends):
    """Compiled forward and backward equal eager, per backend. The shapes are the ones that
    made the ulysses backend's output strides differ from its fake's (K/V heads replicated
    to W)."""
    name = dist.group.WORLD.group_name
    q = torch.randn(4, 16, 2, 16, requires_grad=True)
    k, v = (torch.randn(4, 16, 1, 16, requires_grad=True) for _ in range(2))
    equal = []
    for backend in backends:
        def attend(q, k, v, backend=backend):
            return fusedpar.ops.ring_attention(q, k, v, name, causal=True, backend=backend)

        compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
        out, expected = compiled(q, k, v), attend(q, k, v)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        equal.append(torch.equal(out, expected) and all(
            torch.equal(g, e) for g, e in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v)))))
    return equal


@pytest.mark.parametrize("backends", [("pipelined", "pipelined_sdpa"), ("ulysses",)],
                         ids=["pipelined+pipelined_sdpa", "ulysses"])
def test_torch_compile_fullgraph(pools, backends):
    assert pools(2).run(_compiled, backends) == [[True] * len(backends)] * 2


def _layouts_match_the_fake():
    """Every backend's out and lse have the sizes, strides and dtypes of the fake
    implementation's (what torch.compile plans with); K/V heads replicated (ulysses)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn(4, 16, 2, 16)
    k, v = torch.randn(4, 16, 1, 16), torch.randn(4, 16, 1, 16)
    mismatches = []
    for backend in BACKENDS:
        real = fusedpar.ops.ring_attention_with_lse(q, k, v, causal=True, backend=backend)
        with FakeTensorMode() as mode:
            fake = fusedpar.ops.ring_attention_with_lse(*map(mode.from_tensor, (q, k, v)),
                                                        causal=True, backend=backend)
        mismatches += [(backend, r.shape, r.stride(), r.dtype, f.stride()) for r, f in zip(real, fake)
                       if (r.shape, r.stride(), r.dtype) != (f.shape, f.stride(), f.dtype)]
    return mismatches


def test_outputs_have_the_fake_implementations_layout(pools):
    assert pools(2).run(_layouts_match_the_fake) == [[], []]


def _ring_triton(x, group):
    """timeout_case's op: x ``[4W, 3]`` as q = k = v ``[1, 4W, 3, 1]``."""
    t = x.view(1, x.shape[0], x.shape[1], 1)
    return fusedpar.ops.ring_attention(t, t, t, group, causal=True, backend="triton")


def test_a_stalled_peer_times_out(pools):
    """The triton kernel's wait on a peer that never stages its K/V is bounded."""
    assert "rank 1" in stalled_peer_error(pools, _ring_triton)


def _check_bf16():
    """bf16 inputs: every backend returns bf16 out (fp32 lse); blocks merge in fp32, so the
    error is about one bf16 rounding of the output. The rings' backward moves K/V and the
    travelling dK/dV in bf16 (the lower bound, 2 (W-1) |K/V| bytes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    full = [torch.randn(1, 8 * world, n, 16, generator=g).bfloat16() for n in (2, 2, 2)]
    dout = torch.randn(1, 8 * world, 2, 16, generator=g).bfloat16()
    ref = [t.double().requires_grad_() for t in full]
    ref_out, _ = sdpa64(*ref, True)
    ref_out.backward(dout.double())
    expected = zigzag_shard(ref_out.detach(), 1, rank, world)
    errors = {}
    for backend in BACKENDS:
        q, k, v = (zigzag_shard(t, 1, rank, world).requires_grad_() for t in full)
        out, lse = fusedpar.ops.ring_attention_with_lse(q, k, v, causal=True, backend=backend)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32, backend
        errors[backend] = (out.double() - expected).abs().max().item()
        if backend in ("pipelined", "pipelined_sdpa", "triton"):
            with fusedpar.comm.count_bytes() as moved:
                out.backward(zigzag_shard(dout, 1, rank, world))
            assert moved.total() == 2 * (world - 1) * 2 * k.numel() * 2, (backend, moved.total())
            errors[backend + " grads"] = max(
                ((t.grad.double() - zigzag_shard(r.grad, 1, rank, world)).abs().max()
                 / r.grad.abs().max()).item() for t, r in zip((q, k, v), ref))
    return errors


def test_bf16_outputs_and_ring_gradients(pools):
    for errors in pools(2).run(_check_bf16):
        assert all(err < 2e-2 for err in errors.values()), errors


# ---- the triton ring's host path: one plan per call signature, capture (issue 43) ------------

def _ring_inputs(world, seed, layout="zigzag", s_local=8, heads=(2, 1, 1), d=16):
    """Every rank's q, k, v of a full sequence (``[1, W * s_local, H, D]``, rank-encoded:
    rank r's rows are shifted by r) and the full tensors."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, world * s_local, h, d, generator=g) for h in heads]
    shard = _shard if layout != "zigzag" else (lambda x, dim, layout, r, w: zigzag_shard(x, dim, r, w))
    return [[shard(t, 1, layout, r, world) for r in range(world)] for t in full], full


def _assert_loopback_right(results, full, layout, causal=True, window=(-1, -1)):
    world = len(results)
    q, k, v = (t.double() for t in full)
    ref_out, ref_lse = attention_ref(q, k, v, q.shape[-1] ** -0.5, causal, window)
    for r, (out, lse) in enumerate(results):
        torch.testing.assert_close(out.double(), _shard(ref_out, 1, layout, r, world), atol=1e-5, rtol=0)
        torch.testing.assert_close(lse.double(), _shard(ref_lse, 2, layout, r, world), atol=1e-5, rtol=0)


@pytest.fixture
def fresh_loopback():
    """Loopback buffers (and their plans) no other test has touched, dropped afterwards."""
    fusedpar.comm.release_buffers()
    yield
    fusedpar.comm.release_buffers()


def test_ring_schedule_puts_every_copy_before_the_step_that_ends_the_call():
    """Copy i + 1 is issued after the steps that read its slot last (peer i - 1's); the last
    step ends the call, so every copy comes before it, the main stream waiting for the last
    copy right before it: a peer none of whose keys this rank sees (a fingerprint check, no
    rows) is checked before the end, also when only the own block is attended."""
    from fusedpar.ops.ring_attention.triton_ring import COPY, STEP, WAIT, ring_schedule

    every = ring_schedule([3, 2, 1], {3: True, 2: True, 1: True}, 1, {3: 1, 2: 2, 1: 1})
    assert every == [(COPY, 0), (STEP, 0), (COPY, 1), (WAIT, 0), (STEP, 1), (COPY, 2), (WAIT, 1),
                     (STEP, 2), (STEP, 3), (WAIT, 2), (STEP, 4)]
    last_unseen = ring_schedule([3, 2, 1], {3: True, 2: True, 1: False}, 1, {3: 1, 2: 1, 1: 0})
    assert last_unseen == [(COPY, 0), (STEP, 0), (COPY, 1), (WAIT, 0), (STEP, 1), (COPY, 2),
                           (WAIT, 1), (WAIT, 2), (STEP, 2)]
    own_only = ring_schedule([3, 2, 1], {3: False, 2: False, 1: False}, 2, {3: 0, 2: 0, 1: 0})
    assert own_only == [(COPY, 0), (STEP, 0), (COPY, 1), (COPY, 2), (WAIT, 2), (STEP, 1)]
    assert ring_schedule([], {}, 1, {}) == [(STEP, 0)]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_loopback_launches_take_the_same_arguments_at_every_call(fresh_loopback, layout):
    """W=3 loopback, three calls of one signature with new inputs each: right results, and
    every launch's non-tensor arguments (grid, scalars, constexprs) are the same at every call
    (what a CUDA graph freezes), the epochs all 0 (the call's, read on the device). Per rank:
    one stage, the peers' K/V copies, the attention steps; the last step ends the call (no
    launch of its own for DONE or the NaN-fill of a failed call)."""
    world = 3
    per_call = []
    for seed in range(3):
        (qs, ks, vs), full = _ring_inputs(world, seed, layout)
        with scalar_arguments() as launches:
            results = fusedpar.ops.ring_attention_loopback(qs, ks, vs, causal=True, layout=layout)
        _assert_loopback_right(results, full, layout)
        per_call.append(launches)
    assert per_call[0] == per_call[1] == per_call[2]
    names = [name for name, _, _ in per_call[0]]
    assert set(names) == {"stage_kernel", "ring_kv_copy_kernel", "ring_attn_step_kernel"}, names
    assert names.count("stage_kernel") == world and names[:world] == ["stage_kernel"] * world
    # every peer of every rank is checked, and copied where seen
    assert names.count("ring_kv_copy_kernel") >= world * (world - 1)
    args = [dict(named) for _, _, named in per_call[0]]
    assert all(a["epoch"] == 0 for a, name in zip(args, names) if name != "stage_kernel")
    ends = [a["rank"] for a, name in zip(args, names) if name == "ring_attn_step_kernel" and a["END"]]
    assert ends == list(range(world))  # one per rank: its last launch
    for rank in range(world):
        mine = [(name, a) for name, a in zip(names, args) if name != "stage_kernel" and a["rank"] == rank]
        assert mine[-1][0] == "ring_attn_step_kernel" and mine[-1][1]["END"], (rank, mine[-1])


def test_capture_runs_a_planned_ring_and_refuses_packed_documents(monkeypatch, fresh_loopback):
    """Capture faked on CPU (``symmetric.capturing``): a call of a signature run eagerly
    before runs (its buffers marked captured) and gives the eager results; the first call of
    a new signature refuses capture (its plan checks and allocates); a call with packed
    documents refuses it even after an eager call, naming the fix, before any host read."""
    from fusedpar.comm import symmetric
    from fusedpar.ops import backend as backend_module

    world = 2
    (qs, ks, vs), full = _ring_inputs(world, 1)
    eager = fusedpar.ops.ring_attention_loopback(qs, ks, vs, causal=True)
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    packed = [[_shard(t, 1, "zigzag", r, world, cu) for r in range(world)] for t in full]
    fusedpar.ops.ring_attention_loopback(*packed, causal=True, cu_seqlens=cu)
    monkeypatch.setattr(symmetric, "capturing", lambda device: True)
    monkeypatch.setattr(backend_module, "capturing", lambda device: True)
    replayed = fusedpar.ops.ring_attention_loopback(qs, ks, vs, causal=True)
    for (out, lse), (eager_out, eager_lse) in zip(replayed, eager):
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert all(view.captured for view in fusedpar.comm.get_loopback_buffers(world, 1, torch.device("cpu")))
    with pytest.raises(fusedpar.FusedparError, match="run one eager call of it before capturing"):
        fusedpar.ops.ring_attention_loopback(qs, ks, vs, causal=False)
    with counted_reads(cu) as reads, pytest.raises(
            fusedpar.FusedparError, match=r"packed documents \(cu_seqlens\) cannot be captured.*Run "
                                          "packed calls eagerly"):
        fusedpar.ops.ring_attention_loopback(*packed, causal=True, cu_seqlens=cu)
    assert reads == [0]


def test_a_failed_loopback_call_is_nan_and_raises(monkeypatch, fresh_loopback):
    """Simulated rank 1 publishes another fingerprint: rank 0's copy of its K/V gives up, the
    step of its block is skipped, and rank 0's last step NaN-fills out and lse (rank 1,
    which saw rank 0's fingerprint equal its own, is right); the call raises naming both
    ranks; the next call, on fresh buffers, is right."""
    from fusedpar.kernels import signal
    from fusedpar.ops.ring_attention import triton_ring

    world = 2
    (qs, ks, vs), full = _ring_inputs(world, 2)
    real_stage = signal.stage
    monkeypatch.setattr(signal, "stage", lambda x, dst, pad_table, rank, w, meta, *a, **k:
                        real_stage(x, dst, pad_table, rank, w, meta + rank, *a, **k))
    outputs = []
    real_attend = triton_ring._RingView.attend
    monkeypatch.setattr(triton_ring._RingView, "attend",
                        lambda self, q: outputs.append(real_attend(self, q)) or outputs[-1])
    with pytest.raises(ValueError, match="rank 0 and rank 1 .* passed different inputs"):
        fusedpar.ops.ring_attention_loopback(qs, ks, vs, causal=True)
    (out0, lse0), (out1, lse1) = outputs
    assert out0.isnan().all() and lse0.isnan().all()
    assert torch.isfinite(out1).all() and torch.isfinite(lse1).all()
    monkeypatch.undo()
    _assert_loopback_right(fusedpar.ops.ring_attention_loopback(qs, ks, vs, causal=True), full, "zigzag")


def test_copies_run_on_a_side_stream_in_the_order_the_slots_need(monkeypatch, fresh_loopback):
    """The CUDA path's stream logic on CPU (streams and events faked, the kernels run in
    program order): at W=4, on each rank, every K/V copy is launched on the side stream after
    the steps that last read its slot, every step that reads a slot after that slot's copy,
    the call's last step (which raises DONE) after every copy, and the current stream is the
    main one again at the end; results are right. Zigzag: every peer's block is attended;
    contiguous: rank 0 sees no peer's keys, so its copies only check."""
    from triton.runtime.interpreter import InterpretedFunction

    from fusedpar.ops.ring_attention import triton_ring

    class Stream:
        def __init__(self, name):
            self.name, self.done = name, set()  # launches before this stream's next op

        def wait_event(self, event):
            self.done |= event.done

    class Event:
        def record(self, stream):
            self.done = set(stream.done)

    main, side = Stream("main"), Stream("side")
    current = [main]
    launches = []
    run = InterpretedFunction.run

    def run_on_stream(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args), **kwargs)
        stream = current[0]
        launches.append((self.fn.__name__, stream.name, named.get("rank"), named.get("src"),
                         bool(named.get("END")), set(stream.done)))
        stream.done.add(len(launches) - 1)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run_on_stream)
    monkeypatch.setattr(triton_ring, "_copy_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.__setitem__(0, stream))
    world = 4
    for layout in ("zigzag", "contiguous"):
        (qs, ks, vs), full = _ring_inputs(world, 3, layout, s_local=4, heads=(1, 1, 1), d=8)
        launches.clear()
        _assert_loopback_right(fusedpar.ops.ring_attention_loopback(qs, ks, vs, causal=True,
                                                                    layout=layout), full, layout)
        assert current == [main]
        for rank in range(world):
            peers = [(rank - step) % world for step in range(1, world)]
            mine = [(n, *launch) for n, launch in enumerate(launches)
                    if launch[0] != "stage_kernel" and launch[2] == rank]
            copies = {src: [n for n, name, _, _, s, _, _ in mine if name == "ring_kv_copy_kernel" and s == src]
                      for src in peers}
            steps = {src: [n for n, name, _, _, s, _, _ in mine if name == "ring_attn_step_kernel" and s == src]
                     for src in [rank] + peers}
            assert all(stream == ("side" if name == "ring_kv_copy_kernel" else "main")
                       for _, name, stream, *_ in mine), (layout, rank)
            before = {n: done for n, *_, done in mine}
            for i, src in enumerate(peers):
                assert copies[src], (layout, rank, src)  # every peer is at least checked
                for step in steps[src]:  # its slot's rows landed first
                    assert set(copies[src]) <= before[step], (layout, rank, src)
                if i >= 2:  # the slot's last reader finished first
                    for copy in copies[src]:
                        assert set(steps[peers[i - 2]]) <= before[copy], (layout, rank, src)
            last = mine[-1]
            assert last[1] == "ring_attn_step_kernel" and last[5], (layout, rank)
            assert {n for src in peers for n in copies[src]} <= before[last[0]], (layout, rank)
        if layout == "contiguous":  # rank 0 attends its own block only
            assert [s for _, name, _, r, s, _, _ in [(n, *x) for n, x in enumerate(launches)]
                    if name == "ring_attn_step_kernel" and r == 0] == [0]


def _group_plans():
    """One-rank group (fresh): calls of one signature with new inputs are right and only the
    first checks its inputs and chooses a backend; a packed call refuses a faked capture
    (``symmetric.capturing``) naming the fix, a call without documents runs under it."""
    from fusedpar.comm import symmetric
    ring_module = importlib.import_module("fusedpar.ops.ring_attention")  # not the function

    group = subgroup()
    counts = {"checks": 0, "selects": 0}
    check, select = ring_module.check_ring_inputs, ring_module.DISPATCHER.select

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    ring_module.check_ring_inputs = counting("checks", check)
    ring_module.DISPATCHER.select = counting("selects", select)
    outs = []
    try:
        for seed in range(3):
            (q, k, v), = zip(*_ring_inputs(1, seed)[0])
            out, lse = fusedpar.ops.ring_attention_with_lse(q, k, v, group, causal=True, backend="triton")
            ref_out, ref_lse = attention_ref(q.double(), k.double(), v.double(), 16 ** -0.5, True, (-1, -1))
            torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)
            torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)
            outs.append(out)
    finally:
        ring_module.check_ring_inputs = check
        del ring_module.DISPATCHER.select
    assert counts == {"checks": 1, "selects": 1}, counts
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    fusedpar.ops.ring_attention(q, k, v, group, causal=True, cu_seqlens=cu, backend="triton")
    capturing = symmetric.capturing
    symmetric.capturing = lambda device: True
    try:
        with pytest.raises(fusedpar.FusedparError, match=r"packed documents \(cu_seqlens\) cannot be "
                                                         "captured in a CUDA graph"):
            fusedpar.ops.ring_attention(q, k, v, group, causal=True, cu_seqlens=cu, backend="triton")
        under_capture = fusedpar.ops.ring_attention(q, k, v, group, causal=True, backend="triton")
    finally:
        symmetric.capturing = capturing
    assert torch.equal(under_capture, outs[-1])
    return True


def test_group_calls_of_one_signature_plan_once_and_packed_ones_refuse_capture(pools):
    assert pools(1).run(_group_plans) == [True]
