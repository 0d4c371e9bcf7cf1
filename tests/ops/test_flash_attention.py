"""``fusedpar.ops.flash_attention`` (custom op, autograd, backends) against fp64 SDPA."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

import fusedpar
from fusedpar.errors import BackendNotSupportedError
from fusedpar.ops.flash_attention import DISPATCHER, AttentionCall
from tests.ops.attention_cases import assert_peers_rule, reference_results
from tests.ops.collective_cases import cpu_backends, requires_cuda

pytestmark = [pytest.mark.timeout(300)]

# (B, S, H, H_kv, D, causal): the head dims (64, 96, 128) small; odd S; GQA; MQA
CASES = [(2, 21, 4, 2, 32, True), (1, 17, 2, 1, 64, False), (1, 23, 2, 2, 96, True),
         (1, 16, 2, 1, 128, True), (1, 9, 3, 3, 24, False)]
BACKENDS = cpu_backends("flash_attention")
# torch's kernels (sdpa) have no window, softcap or packed documents: test_sdpa_refuses_*
MASK_BACKENDS = [b for b in BACKENDS if b != "sdpa"]
# (dtype, atol of out / lse, atol of the gradients)
TOLERANCES = {torch.float32: (2e-5, 1e-4), torch.float16: (4e-3, 2e-2), torch.bfloat16: (3e-2, 1.5e-1)}


def sdpa64(q, k, v, causal, scale=None):
    """``(out, lse)`` in fp64: SDPA's math backend and the logsumexp of its scores."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return out.transpose(1, 2), torch.logsumexp(s, -1)


def _leaves(b, s, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_()
            for shape in ((b, s, h, d), (b, s, hk, d), (b, s, hk, d))]


def _check(backend, case, dtype, lse_grad=True):
    """Out, lse and the gradients against fp64; ``lse_grad``: the lse has a gradient too
    (sdpa's backward then runs on the next backend)."""
    b, s, h, hk, d, causal = case
    q, k, v = _leaves(b, s, h, hk, d, dtype)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = sdpa64(*ref, causal)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(ref_lse.shape, generator=g, dtype=torch.float64) * lse_grad
    torch.autograd.backward((ref_out, ref_lse), (dout, dlse))
    out, lse = fusedpar.ops.flash_attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, s)
    torch.autograd.backward((out, lse) if lse_grad else (out,),
                            (dout.to(dtype), dlse.float()) if lse_grad else (dout.to(dtype),))
    atol, grad_atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=0)
    for name, t, r in zip("qkv", (q, k, v), ref):
        torch.testing.assert_close(t.grad.double(), r.grad, atol=grad_atol, rtol=0, msg=name)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend,lse_grad", [(b, True) for b in BACKENDS] + [("sdpa", False)])
def test_matches_fp64_sdpa_fp32(backend, lse_grad, case):
    _check(backend, case, torch.float32, lse_grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_matches_fp64_sdpa_low_precision(backend, dtype):
    _check(backend, (2, 19, 2, 1, 32, True), dtype, lse_grad=backend != "sdpa")


@pytest.mark.parametrize("s_q,s_k", [(13, 30), (30, 13)])
def test_sdpa_causal_with_unequal_lengths_is_top_left(s_q, s_k):
    """torch's CPU kernel aligns is_causal top-left, fusedpar's default: out, lse and the
    gradients equal the reference backend's (GQA, odd head dim)."""
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(1, s, n, 20, generator=g, requires_grad=True) for s, n in ((s_q, 4), (s_k, 2), (s_k, 2))]
    dout = torch.randn(1, s_q, 4, 20, generator=g)
    results = []
    for backend in ("sdpa", "reference"):
        out, lse = fusedpar.ops.flash_attention(*leaves, causal=True, return_lse=True, backend=backend)
        results.append([out, lse, *torch.autograd.grad(out, leaves, dout)])
    for name, got, want in zip(["out", "lse", "dq", "dk", "dv"], *results):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0, msg=name)


def test_sdpa_refuses_what_torch_kernels_cannot_do():
    """Each refusal says why (forced: BackendNotSupportedError); bottom-right with S_q ==
    S_k is top-left and runs."""
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    fa = fusedpar.ops.flash_attention
    cases = [
        (lambda: fa(q, k, v, window_size=(2, -1), backend="sdpa"), "no sliding window"),
        (lambda: fa(q, k, v, softcap=5.0, backend="sdpa"), "no logit soft-capping"),
        (lambda: fa(q, k[:, :5], v[:, :5], causal=True, mask_align="bottom_right", backend="sdpa"),
         "causal aligned bottom-right with S_q=8 != S_k=5: torch's is_causal is top-left"),
        (lambda: fa(q[0], k[0], v[0], cu_seqlens=cu, backend="sdpa"), "packed documents (cu_seqlens)"),
    ]
    for call, words in cases:
        with pytest.raises(BackendNotSupportedError) as info:
            call()
        assert words in str(info.value), (words, str(info.value))
    # sdpa_kernel() allowing no kernel that takes the call (torch's choice raises): refused
    # with the reason, and the default dispatch runs another backend
    outside = AttentionCall(q, k, v, True, 0.25).cache_key()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert AttentionCall(q, k, v, True, 0.25).cache_key() != outside  # choices cached apart
        with pytest.raises(BackendNotSupportedError, match="no attention kernel that torch.nn.attention"):
            fa(q, k, v, causal=True, backend="sdpa")
        torch.testing.assert_close(fa(q, k, v, causal=True), fa(q, k, v, causal=True, backend="reference"),
                                   atol=2e-5, rtol=0)
    square = fa(q, k, v, causal=True, mask_align="bottom_right", backend="sdpa")
    torch.testing.assert_close(square, fa(q, k, v, causal=True, backend="reference"), atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", MASK_BACKENDS)
def test_packed_documents(backend):
    ends = [0, 7, 8, 30]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(30, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor(ends, dtype=torch.int32)
    out, lse = fusedpar.ops.flash_attention(q, k, v, causal=True, cu_seqlens=cu, return_lse=True,
                                            backend=backend)
    assert lse.shape == (4, 30)
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    for a, z in zip(ends, ends[1:]):
        piece = [t.detach()[a:z][None].double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = sdpa64(*piece, True)
        torch.testing.assert_close(out[a:z].double(), ref_out[0], atol=2e-5, rtol=0)
        torch.testing.assert_close(lse[:, a:z].double(), ref_lse[0], atol=2e-5, rtol=0)
        ref_out.backward(dout[a:z][None].double())
        for t, r in zip((q, k, v), piece):
            torch.testing.assert_close(t.grad[a:z].double(), r.grad[0], atol=1e-4, rtol=0)


def test_strided_cu_seqlens():
    """cu_seqlens as a view with stride 2 (gaps holding other, valid-looking ends): the
    kernels read it with stride 1, so the op passes its values, not the view."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(30, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 7, 11, 8, 19, 30, 29], dtype=torch.int32)[::2]  # [0, 7, 8, 30]
    outs = []
    for ends in (cu, cu.contiguous()):
        out = fusedpar.ops.flash_attention(q, k, v, causal=True, cu_seqlens=ends, backend="triton")
        outs.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for got, want in zip(*outs):
        assert torch.equal(got, want)


def test_default_backend_and_compile():
    q, k, v = (t.detach() for t in _leaves(1, 8, 2, 1, 16, torch.float32))
    from fusedpar.ops.flash_attention import AttentionCall

    assert DISPATCHER.select(AttentionCall(q, k, v, True, 0.25)).name == "triton"
    for backend in ("reference", "sdpa"):  # forward and backward, compiled = eager
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        eager = fusedpar.ops.flash_attention(*leaves, causal=True, backend=backend)
        fn = torch.compile(lambda a, b, c, backend=backend: fusedpar.ops.flash_attention(
                               a, b, c, causal=True, backend=backend),
                           backend="aot_eager", fullgraph=True)
        compiled = fn(*leaves)
        assert torch.equal(compiled, eager), backend
        for got, want in zip(torch.autograd.grad(compiled.sum(), leaves),
                             torch.autograd.grad(eager.sum(), leaves)):
            assert torch.equal(got, want), backend


def test_bad_inputs_raise_clear_errors():
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    fa = fusedpar.ops.flash_attention
    cases = [
        (lambda: fa(q, torch.randn(1, 8, 3, 16), torch.randn(1, 8, 3, 16)), ValueError, "multiple of H_kv"),
        (lambda: fa(q, k.half(), v), TypeError, "cast them to one dtype"),
        (lambda: fa(q, torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)), ValueError, "head dim mismatch"),
        (lambda: fa(*(torch.randn(1, 4, 1, 300) for _ in range(3))), ValueError, "D=300"),
        (lambda: fa(q[0], k[0], v[0]), ValueError, "[B, S, H, D]"),
        (lambda: fa(q[0], k[0], v[0], cu_seqlens=torch.tensor([0, 8])), TypeError, "int32"),
        (lambda: fa(q[0], k[0], v[0], cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32)),
         ValueError, "strictly increasing"),
        (lambda: fa(q[0], k[0], v[0], cu_seqlens=torch.tensor([0, 5, 7], dtype=torch.int32)),
         ValueError, "total length"),
        (lambda: fa(q, k, v, backend="nope"), Exception, "does not exist"),
        (lambda: fa(q.long(), k.long(), v.long()), TypeError, "floating-point"),
    ]
    for call, kind, words in cases:
        with pytest.raises(kind, match=None) as info:
            call()
        assert words in str(info.value), (words, str(info.value))


# (B, S_q, S_k, H, H_kv, D, causal, window_size, softcap, mask_align): GQA with a sliding
# window; MQA, bottom-right causal against more keys, softcap; an asymmetric window
# bottom-right against fewer keys (the first rows see none)
MASK_CASES = [(1, 19, 19, 4, 2, 24, True, (5, -1), 0.0, "top_left"),
              (1, 13, 30, 2, 1, 40, True, (-1, -1), 3.0, "bottom_right"),
              (2, 30, 13, 2, 2, 16, False, (2, 4), 0.0, "bottom_right")]


@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("backend", MASK_BACKENDS)
def test_masks_within_twice_the_bf16_error(backend, case):
    """window_size, softcap and mask_align through the op and its autograd, bf16: within 2x
    (3x for the gradients) the error of the same math in bf16 against fp64."""
    b, sq, sk, h, hk, d, causal, window, softcap, align = case
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(b, s, n, d, generator=g).to(torch.bfloat16).requires_grad_()
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    douts = (torch.randn(b, sq, h, d, generator=g, dtype=torch.float64),
             torch.randn(b, h, sq, generator=g, dtype=torch.float64))
    mask = dict(scale=d ** -0.5, causal=causal, window=window, softcap=softcap,
                bottom_right=align == "bottom_right")
    low, exact = (reference_results((q, k, v), dtype, *douts, **mask)
                  for dtype in (torch.bfloat16, torch.float64))
    out, lse = fusedpar.ops.flash_attention(q, k, v, causal=causal, window_size=window,
                                            softcap=softcap, mask_align=align, return_lse=True,
                                            backend=backend)
    torch.autograd.backward((out, lse), (douts[0].to(out.dtype), douts[1].float()))
    for name, got, lo, ex in zip(["out", "lse", "dq", "dk", "dv"], [out, lse, q.grad, k.grad, v.grad],
                                 low, exact):
        assert_peers_rule(name, got, lo, ex, 2 if name in ("out", "lse") else 3)


@pytest.mark.parametrize("backend", MASK_BACKENDS)
def test_packed_documents_of_other_key_lengths(backend):
    """cu_seqlens_q / cu_seqlens_k: document i of q against document i of k/v, each masked
    with its own lengths (bottom-right causal, a window, softcap)."""
    ends_q, ends_k = [0, 7, 8, 26], [0, 3, 15, 31]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(t, h, 16, generator=g).to(torch.bfloat16).requires_grad_()
               for t, h in ((26, 4), (31, 2), (31, 2)))
    cu_q, cu_k = (torch.tensor(e, dtype=torch.int32) for e in (ends_q, ends_k))
    mask = dict(causal=True, window_size=(4, -1), softcap=2.0)
    out = fusedpar.ops.flash_attention(q, k, v, **mask, mask_align="bottom_right", cu_seqlens_q=cu_q,
                                       cu_seqlens_k=cu_k, backend=backend)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(dout.to(out.dtype))
    # the references document by document, assembled into packed tensors (out, dq, dk, dv)
    low, exact = ([torch.empty(t.shape, dtype=dtype) for t in (q, q, k, v)]
                  for dtype in (torch.bfloat16, torch.float64))
    for a, z, c, e in zip(ends_q, ends_q[1:], ends_k, ends_k[1:]):
        piece = (q[a:z][None], k[c:e][None], v[c:e][None])
        douts = (dout[a:z][None], torch.zeros(1, 4, z - a, dtype=torch.float64))
        for whole, dtype in ((low, torch.bfloat16), (exact, torch.float64)):
            ref = reference_results(piece, dtype, *douts, scale=0.25, causal=True, window=(4, -1),
                                    softcap=2.0, bottom_right=True)
            for x, r, rows in zip(whole, ref[:1] + ref[2:], ((a, z), (a, z), (c, e), (c, e))):
                x[slice(*rows)] = r[0]
    for name, *tensors in zip(["out", "dq", "dk", "dv"], [out, q.grad, k.grad, v.grad], low, exact):
        assert_peers_rule(name, *tensors, 2 if name == "out" else 3)


def test_bad_mask_and_packing_arguments_raise_clear_errors():
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    fa = fusedpar.ops.flash_attention
    cases = [
        (lambda: fa(q, k, v, window_size=(-2, 0)), "window_size=(-2, 0)"),
        (lambda: fa(q, k, v, window_size=4), "pass (left, right)"),
        (lambda: fa(q, k, v, softcap=-1.0), "softcap=-1.0"),
        (lambda: fa(q, k, v, softcap=float("inf")), "finite"),
        (lambda: fa(q, k, v, mask_align="lower_right"), "choose one of ('top_left', 'bottom_right')"),
        (lambda: fa(q[0], k[0], v[0], cu_seqlens=cu, cu_seqlens_q=cu, cu_seqlens_k=cu), "not both"),
        (lambda: fa(q[0], k[0], v[0], cu_seqlens_q=cu), "go together"),
        (lambda: fa(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)),
         "one entry per document"),
        (lambda: fa(q[0], k[0, :6], v[0, :6], cu_seqlens_q=cu, cu_seqlens_k=cu), "cu_seqlens_k ends at 8"),
        (lambda: fa(q[0], k[0, :6], v[0, :6], cu_seqlens=cu), "pass cu_seqlens_q and cu_seqlens_k"),
        (lambda: fa(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=2), "max_seqlen_k=2"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert words in str(info.value), (words, str(info.value))


@requires_cuda
@pytest.mark.parametrize("d", [64, 96, 128, 256])  # every config's head dim
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_bf16_within_twice_sdpa_error(d, causal):
    """The compiled kernels (the GPU configs): out and gradients within 2x the error of
    bf16 SDPA against fp32, odd S, GQA."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1000, n, d, generator=g, device="cuda") for n in (8, 2, 2))
    dout = torch.randn(q.shape, generator=g, device="cuda")

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout.to(dtype))
        return [out.float()] + [t.grad.float() for t in leaves]

    def sdpa(a, b, c):
        group = a.shape[2] // b.shape[2]
        return F.scaled_dot_product_attention(a.transpose(1, 2), b.repeat_interleave(group, 2).transpose(1, 2),
                                              c.repeat_interleave(group, 2).transpose(1, 2),
                                              is_causal=causal).transpose(1, 2)

    exact = grads(sdpa, torch.float32)
    torch_bf16 = grads(sdpa, torch.bfloat16)
    ours = grads(lambda a, b, c: fusedpar.ops.flash_attention(a, b, c, causal=causal, backend="triton"),
                 torch.bfloat16)
    for name, mine, theirs, ref in zip(["out", "dq", "dk", "dv"], ours, torch_bf16, exact):
        err, torch_err = (mine - ref).abs().max().item(), (theirs - ref).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, (name, err, torch_err)


@requires_cuda
@pytest.mark.parametrize("d", [64, 96, 128, 256])  # every config's head dim
@pytest.mark.parametrize("mask", [dict(causal=True, window_size=(255, -1)),  # Mistral-like
                                  dict(causal=True, window_size=(100, -1), softcap=30.0),
                                  dict(causal=False, window_size=(70, 33), mask_align="bottom_right"),
                                  dict(causal=True, softcap=50.0, mask_align="bottom_right")],
                         ids=["window", "window-softcap", "asymmetric", "bottom-right-softcap"])
def test_gpu_masks_within_twice_the_bf16_error(d, mask):
    """The compiled mask variants: out, lse and gradients of bf16 inputs within 2x (3x)
    the error of the same math in bf16 against fp32, odd lengths (S_q != S_k), GQA."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, s, n, d, generator=g, device="cuda").to(torch.bfloat16)
               for s, n in ((700, 8), (1001, 2), (1001, 2)))
    douts = (torch.randn(q.shape, generator=g, device="cuda"),
             torch.randn(2, 8, 700, generator=g, device="cuda"))
    ref_mask = dict(scale=d ** -0.5, causal=mask["causal"], window=mask.get("window_size", (-1, -1)),
                    softcap=mask.get("softcap", 0.0), bottom_right=mask.get("mask_align") == "bottom_right")
    low, exact = (reference_results((q, k, v), dtype, *douts, **ref_mask)
                  for dtype in (torch.bfloat16, torch.float32))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = fusedpar.ops.flash_attention(*leaves, **mask, return_lse=True, backend="triton")
    torch.autograd.backward((out, lse), (douts[0].to(out.dtype), douts[1]))
    got = [out, lse] + [t.grad for t in leaves]
    for name, x, lo, ex in zip(["out", "lse", "dq", "dk", "dv"], got, low, exact):
        assert_peers_rule(name, x, lo, ex, 2 if name in ("out", "lse") else 3)


@requires_cuda
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_ring_loopback_matches_flash_attention(d):
    world, s = 4, 512
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, s, n, d, generator=g, device="cuda").to(torch.bfloat16) for n in (8, 2, 2))
    whole, whole_lse = fusedpar.ops.flash_attention(q, k, v, causal=True, return_lse=True)
    from fusedpar.parallel import zigzag_shard

    parts = [[zigzag_shard(t, 1, r, world) for r in range(world)] for t in (q, k, v)]
    with fusedpar.comm.count_bytes() as moved:  # copies on the side stream, counted in-kernel
        results = fusedpar.ops.ring_attention_loopback(*parts, causal=True)
    kv = 2 * parts[1][0].numel() * 2
    assert moved.total() == 3 * world * (world - 1) // 4 * kv  # causal zigzag: the visible rows
    for r, (out, lse) in enumerate(results):
        torch.testing.assert_close(out.float(), zigzag_shard(whole, 1, r, world).float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(lse, zigzag_shard(whole_lse, 2, r, world), atol=1e-3, rtol=0)
