"""The flash-attention kernels (``kernels/flash_attention.py``) against fp64 attention, through
their launchers: block sizes smaller than the sequence (several blocks, masked tails),
head dims that are not powers of two, GQA, causal with S_q != S_k, and an external lse/delta
(a block of a larger attention, as ring attention uses it)."""

import pytest
import torch

from fusedpar.kernels import flash_attention as kernels
from fusedpar.ops.ring_attention.blocks import ring_blocks
from fusedpar.parallel import zigzag_shard
from tests.ops.attention_cases import assert_peers_rule, attention_ref, reference_results

SMALL_BLOCKS = dict(BLOCK_M=16, BLOCK_N=16)


def attention64(q, k, v, causal, scale):
    """fp64 ``(out, lse)`` of ``[B, S, H, D]`` inputs, K/V heads repeated for GQA; ``causal``:
    a bool, or a ``[S_q, S_k]`` mask of the keys each query sees."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bshd,bthd->bhst", q, k) * scale
    if causal is True:
        causal = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
    if causal is not False:
        s = s.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhst,bthd->bshd", torch.exp(s - lse[..., None]), v), lse


def _inputs(b, sq, sk, h, hk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
            for shape in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))]


# (B, S_q, S_k, H, H_kv, D, causal)
CASES = [(2, 37, 37, 4, 2, 24, True), (1, 35, 21, 2, 1, 16, False), (1, 20, 33, 2, 2, 32, True),
         (1, 33, 33, 1, 1, 40, False)]


# the GPU configs' shapes: dK/dV's key blocks 4x its query blocks (sm_90, head dim 128), the
# forward's query blocks twice its key blocks; the forward and dQ loops split the key blocks
# seen whole (no masks) from the rest (the causal diagonal, the tail), which these ratios move
BLOCK_SHAPES = [SMALL_BLOCKS, dict(BLOCK_M=8, BLOCK_N=32), dict(BLOCK_M=32, BLOCK_N=16)]


@pytest.mark.parametrize("blocks", BLOCK_SHAPES, ids=lambda c: f"{c['BLOCK_M']}x{c['BLOCK_N']}")
@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_match_fp64(case, blocks):
    b, sq, sk, h, hk, d, causal = case
    q, k, v = _inputs(b, sq, sk, h, hk, d)
    scale = 0.3
    ref_out, ref_lse = attention64(q, k, v, causal, scale)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(ref_lse.shape, generator=g, dtype=torch.float64)
    torch.autograd.backward((ref_out, ref_lse), (dout, dlse))

    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    out = torch.full_like(q32, float("nan"))
    lse = torch.full((b, h, sq), float("nan"))
    kernels.flash_attn_forward(q32, k32, v32, out, lse, causal, scale, config=blocks)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=0)

    delta = ((dout * out.double()).sum(-1).transpose(1, 2) - dlse).float().contiguous()
    grads = [torch.full_like(t, float("nan")) for t in (q32, k32, v32)]
    kernels.flash_attn_backward(q32, k32, v32, dout.float(), lse, delta, *grads, causal, scale,
                                config=blocks)
    for grad, ref in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(grad.double(), ref, atol=1e-5, rtol=0)


def test_packed_documents_match_a_loop_over_documents():
    ends = [0, 5, 22, 23, 40]
    h, hk, d = 2, 1, 24
    q, k, v = (t.detach().float()[0] for t in _inputs(1, 40, 40, h, hk, d, seed=3))
    cu = torch.tensor(ends, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((h, 40), float("nan"))
    kernels.flash_attn_forward(q, k, v, out, lse, True, d ** -0.5, cu, 17, config=SMALL_BLOCKS)
    dout = torch.randn_like(q)
    delta = (dout * out).sum(-1).t().contiguous()
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels.flash_attn_backward(q, k, v, dout, lse, delta, *grads, True, d ** -0.5, cu, 17,
                                config=SMALL_BLOCKS)
    for a, z in zip(ends, ends[1:]):
        piece = [t[a:z][None].double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = attention64(*piece, True, d ** -0.5)
        torch.testing.assert_close(out[a:z].double(), ref_out[0], atol=2e-6, rtol=0)
        torch.testing.assert_close(lse[:, a:z].double(), ref_lse[0], atol=2e-6, rtol=0)
        ref_out.backward(dout[a:z][None].double())
        for grad, ref in zip(grads, piece):
            torch.testing.assert_close(grad[a:z].double(), ref.grad[0], atol=1e-5, rtol=0)


def test_strided_inputs():
    """q/k/v as views of a fused qkv projection (non-contiguous heads and rows)."""
    qkv = torch.randn(2, 19, 3, 2, 16)
    q, k, v = qkv.unbind(2)
    out = torch.empty(2, 19, 2, 16)
    lse = torch.empty(2, 2, 19)
    kernels.flash_attn_forward(q, k, v, out, lse, False, 0.25)
    ref_out, _ = attention64(q, k, v, False, 0.25)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=0)


def _ring_shard(x, layout, rank, world, dim=1):
    return zigzag_shard(x, dim, rank, world) if layout == "zigzag" else x.chunk(world, dim)[rank]


def _ring_steps(q, k, v, layout, world, rank, scale, mask, blocks):
    """``(out, lse)`` of ``rank``'s ring steps as the triton ring runs them: the own K/V
    first, then the peers' in ring order, each block of ``ring_blocks`` one launch (the
    first starts the state, the last writes out and lse). State, out and lse start as NaN."""
    causal, window, softcap = mask
    s_local = q.shape[1] // world
    mine = _ring_shard(q, layout, rank, world).contiguous()
    steps = [(src, blk) for src in [rank] + [(rank - i) % world for i in range(1, world)]
             for blk in ring_blocks(layout, world, rank, src, s_local, causal, window)]
    state = [torch.full_like(t, float("nan")) for t in kernels.ring_attn_state(mine)]
    out = torch.full_like(mine, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], s_local), float("nan"))
    pad = torch.zeros(1024, dtype=torch.int32)  # every rank's signal pad: no failure recorded
    pad_table = torch.full((world,), pad.data_ptr(), dtype=torch.int64)
    for i, (src, blk) in enumerate(steps):
        kv = torch.stack([_ring_shard(t, layout, src, world) for t in (k, v)]).contiguous()
        kernels.ring_attn_step(mine, kv, state, out, lse, pad_table, rank, src, blk.rows[0],
                               blk.keys, blk.causal, scale, first=i == 0, last=i == len(steps) - 1,
                               config=blocks, row_hi=blk.rows[1], diag=blk.diag, window=blk.window,
                               softcap=softcap)
    return out, lse


@pytest.mark.parametrize("blocks", BLOCK_SHAPES, ids=lambda c: f"{c['BLOCK_M']}x{c['BLOCK_N']}")
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_steps_match_fp64(layout, blocks):
    """Each rank's ring steps against fp64 attention of its rows to the full sequence.
    Half of a zigzag rank's rows (19) is not a multiple of any block size, so a query block
    straddles the rows that see a later rank's K/V; key tails too."""
    world, s_local, h, hk, d, scale = 3, 38, 2, 1, 24, 0.3
    q, k, v = (t.detach() for t in _inputs(2, world * s_local, world * s_local, h, hk, d, seed=4))
    for causal in (True, False):
        ref_out, ref_lse = attention64(q, k, v, causal, scale)
        for rank in range(world):
            out, lse = _ring_steps(q.float(), k.float(), v.float(), layout, world, rank, scale,
                                   (causal, (-1, -1), 0.0), blocks)
            where = (causal, rank)
            torch.testing.assert_close(out.double(), _ring_shard(ref_out, layout, rank, world),
                                       atol=2e-6, rtol=0, msg=str(where))
            torch.testing.assert_close(lse.double(), _ring_shard(ref_lse, layout, rank, world, 2),
                                       atol=2e-6, rtol=0, msg=str(where))


# (causal, window, softcap) of ring attention: a causal sliding window narrower than a
# zigzag chunk (blocks of two ranks only) and one wider (three), a two-sided window with
# softcap (the blocks of later ranks' keys too)
RING_MASKS = [(True, (7, -1), 0.0), (True, (29, -1), 5.0), (False, (9, 4), 5.0)]


@pytest.mark.parametrize("layout,world,blocks", [("zigzag", 2, SMALL_BLOCKS),
                                                 ("contiguous", 4, BLOCK_SHAPES[2])])
def test_ring_steps_with_windows_and_softcap(layout, world, blocks):
    """Windowed and soft-capped ring steps in bf16, each block with its own diagonal
    offset, rows and keys cut to what the window sees (GQA, odd head dim): within twice
    the error of the same math in bf16 against fp64, every rank."""
    s_local, h, hk, d, scale = 22, 4, 2, 20, 0.3
    q, k, v = (t.detach().to(torch.bfloat16)
               for t in _inputs(1, world * s_local, world * s_local, h, hk, d, seed=8))
    for causal, window, softcap in RING_MASKS:
        mask = dict(scale=scale, causal=causal, window=window, softcap=softcap)
        exact, low = (attention_ref(q.to(dtype), k.to(dtype), v.to(dtype), **mask)
                      for dtype in (torch.float64, torch.bfloat16))
        for rank in range(world):
            got = _ring_steps(q, k, v, layout, world, rank, scale, (causal, window, softcap), blocks)
            for name, x, lo, ex, dim in zip(("out", "lse"), got, low, exact, (1, 2)):
                assert_peers_rule(f"{name} {(causal, window, softcap, rank)}", x,
                                  _ring_shard(lo, layout, rank, world, dim),
                                  _ring_shard(ex, layout, rank, world, dim), 2)


@pytest.mark.parametrize("layout,world", [("zigzag", 2), ("contiguous", 3)])
def test_ring_blocks_through_the_flash_kernels(layout, world):
    """The pipelined ring's use of the flash kernels: every block of ``ring_blocks`` (its
    own diagonal offset, positive or negative, in the sliced tensors) forward, merged by
    lse, and backward from the merged lse and delta, dK/dV summed over every rank's
    queries. Sliding windows (one with softcap) and a two-sided window, bf16, GQA, odd
    head dim: within twice (out, lse) or three times (gradients) the bf16 math's error."""
    s_local, h, hk, d, scale = 14, 2, 1, 20, 0.3
    (q, k, v), dout, dlse = _bf16_case(1, world * s_local, world * s_local, h, hk, d, seed=9)
    for causal, window, softcap in [(True, (5, -1), 5.0), (False, (6, 3), 0.0)]:
        mask = dict(scale=scale, causal=causal, window=window, softcap=softcap)
        exact = reference_results((q, k, v), torch.float64, dout, dlse, **mask)
        low = reference_results((q, k, v), torch.bfloat16, dout, dlse, **mask)
        options = dict(window=window, softcap=softcap, config=SMALL_BLOCKS)
        shards = [[_ring_shard(t, layout, r, world) for r in range(world)] for t in (q, k, v)]
        plans = [[ring_blocks(layout, world, r, src, s_local, causal, window) for src in range(world)]
                 for r in range(world)]
        outs, lses = [], []
        for r in range(world):
            out = torch.zeros(1, s_local, h, d)
            lse = torch.full((1, h, s_local), float("-inf"))
            for src in range(world):
                for blk in plans[r][src]:
                    rows, keys = slice(*blk.rows), slice(*blk.keys)
                    b_out = torch.empty(1, rows.stop - rows.start, h, d)
                    b_lse = torch.empty(1, h, rows.stop - rows.start)
                    kernels.flash_attn_forward(shards[0][r][:, rows], shards[1][src][:, keys],
                                               shards[2][src][:, keys], b_out, b_lse, blk.causal,
                                               scale, diag_offset=blk.sliced_diag(), **options)
                    new = torch.logaddexp(lse[:, :, rows], b_lse)
                    out[:, rows] = (out[:, rows] * torch.exp(lse[:, :, rows] - new).transpose(1, 2)[..., None]
                                    + b_out * torch.exp(b_lse - new).transpose(1, 2)[..., None])
                    lse[:, :, rows] = new
            outs.append(out)
            lses.append(lse)
        grads = [[torch.zeros(t.shape) for t in shard] for shard in shards]
        for r in range(world):
            do = _ring_shard(dout, layout, r, world)
            delta = ((do * outs[r].double()).sum(-1).transpose(1, 2)
                     - _ring_shard(dlse, layout, r, world, 2)).float()
            for src in range(world):
                for blk in plans[r][src]:
                    rows, keys = slice(*blk.rows), slice(*blk.keys)
                    inputs = (shards[0][r][:, rows], shards[1][src][:, keys], shards[2][src][:, keys])
                    parts = [torch.empty(x.shape) for x in inputs]  # fp32, summed over blocks
                    kernels.flash_attn_backward(
                        *inputs, do[:, rows].to(torch.bfloat16), lses[r][:, :, rows].contiguous(),
                        delta[:, :, rows].contiguous(), *parts, blk.causal, scale,
                        diag_offset=blk.sliced_diag(), **options)
                    for grad, at, part in zip(grads, (r, src, src), parts):
                        grad[at][:, rows if grad is grads[0] else keys] += part
        for r in range(world):
            got = [outs[r], lses[r]] + [g[r] for g in grads]
            for name, x, lo, ex, dim in zip(["out", "lse", "dq", "dk", "dv"], got, low, exact,
                                            (1, 2, 1, 1, 1)):
                assert_peers_rule(f"{name} {(causal, window, r)}", x, _ring_shard(lo, layout, r, world, dim),
                                  _ring_shard(ex, layout, r, world, dim), 2 if name in ("out", "lse") else 3)


def test_gpu_configs_cover_every_head_dim():
    """Every head dim up to 256 maps to a registered (AOT-compiled) GPU config."""
    for d in range(1, kernels.MAX_HEAD_DIM + 1):
        assert max(64, kernels.block_d(d)) in (64, 128, 256)
    compiled = {(c.get("BLOCK_D"), opts["arch"], k.fn.__name__) for k, _, c, opts in kernels.AOT_EXAMPLES}
    for arch in (90, 80):
        assert (None, arch, "ring_kv_copy_kernel") in compiled  # one config for every head dim
        for bd in (64, 128, 256):
            for name in ("flash_fwd_kernel", "flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel",
                         "ring_attn_step_kernel"):
                assert (bd, arch, name) in compiled


# (B, S_q, S_k, H, H_kv, D, causal, window, bottom_right, softcap, blocks): sliding windows
# (wider than two blocks: a masked left edge, unmasked blocks, the masked diagonal; narrower
# than one), asymmetric and zero windows, bottom-right causal both ways round (S_q > S_k: the
# first rows see no key), softcap, GQA and MQA
MASK_CASES = [
    (1, 64, 64, 2, 1, 24, True, (33, -1), False, 0.0, SMALL_BLOCKS),
    (1, 40, 29, 2, 2, 40, False, (5, 3), True, 0.0, dict(BLOCK_M=8, BLOCK_N=32)),
    (1, 23, 50, 4, 1, 16, True, (-1, -1), True, 2.0, dict(BLOCK_M=32, BLOCK_N=16)),
    (2, 50, 23, 2, 1, 24, True, (4, -1), True, 0.0, SMALL_BLOCKS),
    (1, 33, 33, 2, 1, 16, False, (0, 0), False, 5.0, SMALL_BLOCKS),
    (1, 37, 21, 2, 2, 24, False, (0, 6), False, 0.0, dict(BLOCK_M=8, BLOCK_N=32)),
]


def _bf16_case(b, sq, sk, h, hk, d, seed=0):
    """bf16 leaves and their fp64 copies, and fp64 upstream gradients of (out, lse)."""
    q, k, v = (t.detach().to(torch.bfloat16) for t in _inputs(b, sq, sk, h, hk, d, seed))
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    dlse = torch.randn(b, h, sq, generator=g, dtype=torch.float64)
    return (q, k, v), dout, dlse


@pytest.mark.parametrize("case", MASK_CASES)
def test_masks_within_twice_the_bf16_error(case):
    """Windows, bottom-right causal and softcap, forward and backward, in bf16: within 2x
    (3x for the gradients) the error of the same math in bf16 against fp64."""
    b, sq, sk, h, hk, d, causal, window, bottom_right, softcap, blocks = case
    (q, k, v), dout, dlse = _bf16_case(b, sq, sk, h, hk, d)
    mask = dict(scale=0.3, causal=causal, window=window, softcap=softcap, bottom_right=bottom_right)
    exact = reference_results((q, k, v), torch.float64, dout, dlse, **mask)
    low = reference_results((q, k, v), torch.bfloat16, dout, dlse, **mask)
    options = dict(window=window, softcap=softcap, bottom_right=bottom_right)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"))
    kernels.flash_attn_forward(q, k, v, out, lse, causal, 0.3, config=blocks, **options)
    delta = ((dout * out.double()).sum(-1).transpose(1, 2) - dlse).float().contiguous()
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels.flash_attn_backward(q, k, v, dout.to(torch.bfloat16), lse, delta, *grads, causal, 0.3,
                                config=blocks, **options)
    for name, got, lo, ex in zip(["out", "lse", "dq", "dk", "dv"], [out, lse, *grads], low, exact):
        assert_peers_rule(name, got, lo, ex, 2 if name in ("out", "lse") else 3)


def test_packed_documents_of_other_key_lengths():
    """``cu_seqlens_k`` differing from q's: each document against its own keys, bottom-right
    causal with a window (a document with fewer keys than queries has rows that see none)."""
    ends_q, ends_k = [0, 5, 22, 23, 40], [0, 9, 20, 33, 35]
    h, hk, d, scale, window = 2, 1, 24, 0.3, (6, -1)
    q = _inputs(1, 40, 35, h, hk, d, seed=5)[0].detach()[0].to(torch.bfloat16)
    k, v = (t.detach()[0].to(torch.bfloat16) for t in _inputs(1, 40, 35, h, hk, d, seed=5)[1:])
    g = torch.Generator().manual_seed(6)
    dout = torch.randn(40, h, d, generator=g, dtype=torch.float64)
    cu_q, cu_k = (torch.tensor(e, dtype=torch.int32) for e in (ends_q, ends_k))
    options = dict(window=window, bottom_right=True, cu_seqlens_k=cu_k, max_seqlen_k=13)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((h, 40), float("nan"))
    kernels.flash_attn_forward(q, k, v, out, lse, True, scale, cu_q, 17, config=SMALL_BLOCKS, **options)
    delta = (dout * out.double()).sum(-1).t().float().contiguous()
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels.flash_attn_backward(q, k, v, dout.to(torch.bfloat16), lse, delta, *grads, True, scale,
                                cu_q, 17, config=SMALL_BLOCKS, **options)
    mask = dict(scale=scale, causal=True, window=window, bottom_right=True)
    # the references document by document, assembled into packed tensors
    low, exact = ([torch.empty(t.shape, dtype=dtype) for t in (q, lse, q, k, v)]
                  for dtype in (torch.bfloat16, torch.float64))
    for a, z, c, e in zip(ends_q, ends_q[1:], ends_k, ends_k[1:]):
        piece = (q[a:z][None], k[c:e][None], v[c:e][None])
        zero_dlse = torch.zeros(1, h, z - a, dtype=torch.float64)
        for whole, dtype in ((low, torch.bfloat16), (exact, torch.float64)):
            ref = reference_results(piece, dtype, dout[a:z][None], zero_dlse, **mask)
            for x, r, at in zip(whole, ref, ((a, z), None, (a, z), (c, e), (c, e))):
                if at is None:
                    x[:, a:z] = r[0]  # lse [H, T]
                else:
                    x[slice(*at)] = r[0]
    for name, got, lo, ex in zip(["out", "lse", "dq", "dk", "dv"], [out, lse, *grads], low, exact):
        assert_peers_rule(name, got, lo, ex, 2 if name in ("out", "lse") else 3)


def test_window_never_loads_key_blocks_outside_it():
    """A query block loads no key block wholly outside its window, and a key block no query
    block wholly outside: NaN in V's first 8 rows reaches only the query blocks whose window
    meets key block 0 (rows < 32), NaN in dO's last 16 rows only the key blocks those rows
    see (keys >= 40). A loaded, masked NaN row would still poison its block (0 * NaN)."""
    s, scale, window = 64, 0.3, (8, -1)
    q, k, v = (t.detach().float() for t in _inputs(1, s, s, 2, 1, 16, seed=7))
    ref_out, _ = attention_ref(q.double(), k.double(), v.double(), scale, True, window)
    v[:, :8] = float("nan")
    out, lse = torch.empty_like(q), torch.empty(1, 2, s)
    kernels.flash_attn_forward(q, k, v, out, lse, True, scale, config=SMALL_BLOCKS, window=window)
    assert out[:, :32].isnan().any()  # the poison is read where the window reaches it
    torch.testing.assert_close(out[:, 32:].double(), ref_out[:, 32:], atol=2e-6, rtol=0)
    v[:, :8] = 0.0
    do = torch.randn_like(q)
    do[:, 48:] = float("nan")
    grads = [torch.empty_like(t) for t in (q, k, v)]
    kernels.flash_attn_backward(q, k, v, do, lse, torch.zeros(1, 2, s), *grads, True, scale,
                                config=SMALL_BLOCKS, window=window)
    for grad in grads[1:]:  # dK, dV: key blocks before 32 never meet rows 48 onward
        assert grad[:, :32].isfinite().all() and grad[:, 40:].isnan().any()
