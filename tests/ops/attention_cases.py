"""Plain-torch attention with flash-attn's masks (window, softcap, either causal alignment)
and the peers' accuracy rule, shared by the kernel and op tests of flash_attention."""

import torch


def visible_keys(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1),
                 bottom_right: bool = False, device="cpu") -> torch.Tensor:
    """``[S_q, S_k]``: query i sees key j iff ``i + off - left <= j <= i + off + right``
    (``off = S_k - S_q`` bottom-right, else 0; -1 unbounded; causal: right = 0)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q if bottom_right else 0)
    j = torch.arange(seqlen_k, device=device)[None, :]
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def attention_ref(q, k, v, scale: float, causal: bool = False, window=(-1, -1), softcap: float = 0.0,
                  bottom_right: bool = False):
    """``(out, lse)`` of ``[B, S, H, D]`` inputs, computed in their dtype (fp64 for the
    reference, bf16 for the same math in low precision); differentiable. A query that sees
    no key: output 0, lse -inf, no gradient."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bshd,bthd->bhst", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ok = visible_keys(q.shape[1], k.shape[1], causal, window, bottom_right, q.device)
    seen = ok.any(-1)[:, None]  # rows with a key; the others get 0 through torch.where
    s = torch.where(seen, s.masked_fill(~ok, float("-inf")), torch.zeros_like(s))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhst,bthd->bshd", torch.softmax(s, -1), v)
    out = torch.where(seen[None, :, :, None], out, torch.zeros_like(out))
    return out, torch.where(seen[:, 0], lse, torch.full_like(lse, float("-inf")))


def assert_peers_rule(name: str, got, low, exact, factor: float) -> None:
    """``got``'s largest error against ``exact`` is at most ``factor`` times ``low``'s (the
    same math in the low precision), flash-attention's test rule. Equal infinities (lse of a
    query that sees no key) count as no error."""
    def error(x):
        x, ref = x.double(), exact.double()
        same = (x == ref) | (x.isnan() & ref.isnan())
        return torch.where(same, torch.zeros_like(x), (x - ref).abs()).max().item()

    err, low_err = error(got), error(low)
    assert err <= factor * low_err + 1e-6, f"{name}: error {err:.3g} > {factor} x {low_err:.3g}"


def reference_results(inputs, dtype, dout, dlse, **mask) -> list:
    """``[out, lse, dq, dk, dv]`` of ``attention_ref`` on ``inputs`` (q, k, v) computed in
    ``dtype``, for upstream gradients ``dout`` and ``dlse`` (of the rows that see a key)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out, lse = attention_ref(*leaves, **mask)
    seen = lse.isfinite()
    torch.autograd.backward((out, torch.where(seen, lse, 0)), (dout.to(dtype), dlse.to(dtype)))
    return [out, lse] + [t.grad for t in leaves]
