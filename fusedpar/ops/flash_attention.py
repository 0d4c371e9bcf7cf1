"""``fusedpar.ops.flash_attention``: softmax attention with the log-sum-exp, fused in one
Triton kernel per direction (``kernels/flash_attention.py``), GQA without repeating K/V."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import flash_attention as kernels
from ..kernels.interpreter import triton_device_reasons
from .backend import Backend, Dispatcher, autocast_inputs, autocast_off
from .registry import EXAMPLE_WORLD, register

OP = "flash_attention"
SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, Tensor? cu_seqlens, "
          "int max_seqlen, str backend) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor lse, Tensor dout, Tensor delta, bool causal, "
                   "float softmax_scale, Tensor? cu_seqlens, int max_seqlen, str backend) "
                   "-> (Tensor, Tensor, Tensor)")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class AttentionCall:
    """One attention: ``q [B, S_q, H, D]``, ``k``/``v [B, S_k, H_kv, D]`` (packed ``[T, ., D]``
    with ``cu_seqlens``); a block of a ring attention is one too."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    scale: float
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    out_dtype: torch.dtype | None = None  # of the output; None: q's

    def cache_key(self) -> tuple:
        return (self.q.device.type, self.q.dtype)

    def describe(self) -> str:
        return (f"q {tuple(self.q.shape)}, k/v {tuple(self.k.shape)} {self.q.dtype} on "
                f"{self.q.device.type}" + (", packed" if self.cu_seqlens is not None else ""))

    def lse_shape(self) -> list[int]:
        if self.cu_seqlens is not None:
            return [self.q.shape[1], self.q.shape[0]]  # [H, T]
        return [self.q.shape[0], self.q.shape[2], self.q.shape[1]]  # [B, H, S]


def seq_to_stat(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H]`` (packed ``[T, H]``) to the lse layout ``[B, H, S]`` (``[H, T]``)."""
    return x.movedim(-1, -2).contiguous()


def delta_of(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """``rowsum(dout * out) - dlse`` in fp32, laid out like lse: what the backward needs of
    the upstream gradients (``dlse`` enters every score's gradient with the opposite sign of
    ``rowsum(dO * O)``)."""
    delta = seq_to_stat((dout.float() * out.float()).sum(-1))
    return delta if dlse is None else delta - dlse.float()


def check_attention_inputs(op: str, q, k, v, cu_seqlens=None, max_seqlen=None) -> int:
    """Shapes, dtypes, devices and packing; returns ``max_seqlen`` (0 when not packed)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fusedpar.{op}: {name} must be a Tensor, got {type(t).__name__}")
    rank = 3 if cu_seqlens is not None else 4
    layout = "[T, H, D] (packed, with cu_seqlens)" if rank == 3 else "[B, S, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"fusedpar.{op}: {name} must be {layout}, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"fusedpar.{op}: q is {q.dtype} but {name} is {t.dtype}; cast them to one dtype")
        if t.device != q.device:
            raise ValueError(f"fusedpar.{op}: q is on {q.device} but {name} is on {t.device}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"fusedpar.{op}: q, k, v have dtype {q.dtype}; use a floating-point dtype")
    if k.shape != v.shape:
        raise ValueError(f"fusedpar.{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    d, heads, kv_heads = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"fusedpar.{op}: head dim mismatch: q has D={d}, k and v have D={k.shape[-1]}")
    if d > kernels.MAX_HEAD_DIM or d < 1:
        raise ValueError(f"fusedpar.{op}: head dim D={d} is not supported; use 1 <= D <= "
                         f"{kernels.MAX_HEAD_DIM}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"fusedpar.{op}: q has H={heads} heads, k/v have H_kv={kv_heads}; H must "
                         "be a multiple of H_kv (GQA/MQA)")
    if cu_seqlens is None:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"fusedpar.{op}: batch mismatch: q has B={q.shape[0]}, k/v B={k.shape[0]}")
        if q.shape[1] < 1 or k.shape[1] < 1:
            raise ValueError(f"fusedpar.{op}: empty sequence: q has S={q.shape[1]}, k/v S={k.shape[1]}")
        return 0
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"fusedpar.{op}: packed q has T={q.shape[0]} rows but k/v have {k.shape[0]}; "
                         "packed attention needs the same documents for q and k/v")
    longest = check_cu_seqlens(op, cu_seqlens, q.shape[0], q.device, "q has T=")
    if max_seqlen and max_seqlen < longest:
        raise ValueError(f"fusedpar.{op}: max_seqlen={max_seqlen} but a document has {longest} "
                         "tokens; pass max_seqlen >= the longest document (or None)")
    return max_seqlen or longest


def check_cu_seqlens(op: str, cu_seqlens, total: int, device, total_is: str) -> int:
    """int32 ``[0, end_1, ..., total]``, strictly increasing, on ``device``; returns the
    longest document's length. ``total_is`` names the total in the error."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        got = (f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
               if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__)
        raise TypeError(f"fusedpar.{op}: cu_seqlens must be a 1-D int32 tensor (cumulative sequence "
                        f"ends, starting at 0), got {got}; use .to(torch.int32)")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"fusedpar.{op}: cu_seqlens has {cu_seqlens.numel()} entries; it needs "
                         "[0, end_1, ..., T] (one more than the number of documents)")
    if cu_seqlens.device != device:
        raise ValueError(f"fusedpar.{op}: cu_seqlens is on {cu_seqlens.device}, q on {device}")
    ends = cu_seqlens.tolist()  # host values: checked once, before any kernel reads them
    lengths = [b - a for a, b in zip(ends, ends[1:])]
    if ends[0] != 0 or min(lengths) <= 0:
        raise ValueError(f"fusedpar.{op}: cu_seqlens = {ends[:8]}{'...' if len(ends) > 8 else ''} "
                         "must start at 0 and be strictly increasing")
    if ends[-1] != total:
        raise ValueError(f"fusedpar.{op}: cu_seqlens ends at {ends[-1]} but {total_is}{total} "
                         "rows; its last entry must be the total length")
    return max(lengths)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class Triton(Backend):
    """The Triton kernels of ``kernels/flash_attention.py``: GPU, or CPU under the interpreter."""

    name = "triton"

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = triton_device_reasons(call.q.device)
        if call.q.dtype not in KERNEL_DTYPES:
            reasons.append(f"dtype {call.q.dtype} (the kernels take float32, float16, bfloat16)")
        return reasons

    def forward(self, call: AttentionCall):
        q, k, v = (_last_dim_contiguous(t) for t in (call.q, call.k, call.v))
        out = torch.empty_like(q, dtype=call.out_dtype or q.dtype)
        lse = torch.empty(call.lse_shape(), dtype=torch.float32, device=q.device)
        kernels.flash_attn_forward(q, k, v, out, lse, call.causal, call.scale, call.cu_seqlens,
                                   call.max_seqlen)
        return out, lse

    def backward(self, call: AttentionCall, lse, dout, delta):
        q, k, v, dout = (_last_dim_contiguous(t) for t in (call.q, call.k, call.v, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kernels.flash_attn_backward(q, k, v, dout, lse.contiguous(), delta.contiguous(), dq, dk, dv,
                                    call.causal, call.scale, call.cu_seqlens, call.max_seqlen)
        return dq, dk, dv


class Reference(Backend):
    """The docstring's math in (at least) fp32 with K/V heads repeated; packed documents
    one by one."""

    name = "reference"

    def _pieces(self, call: AttentionCall):
        """``[(q, k, v, rows)]``: batched tensors per document (or the whole batch)."""
        if call.cu_seqlens is None:
            return [(call.q, call.k, call.v, slice(None))]
        ends = call.cu_seqlens.tolist()
        return [(call.q[a:b][None], call.k[a:b][None], call.v[a:b][None], slice(a, b))
                for a, b in zip(ends, ends[1:])]

    @staticmethod
    def _scores(q, k, v, call):
        work = torch.promote_types(q.dtype, torch.float32)
        group = q.shape[2] // k.shape[2]
        kk = k.to(work).repeat_interleave(group, 2)
        vv = v.to(work).repeat_interleave(group, 2)
        s = torch.einsum("bshd,bthd->bhst", q.to(work), kk) * call.scale
        visible = None
        if call.causal:
            visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
            s = s.masked_fill(~visible, float("-inf"))
        return s, kk, vv, visible

    def forward(self, call: AttentionCall):
        out = torch.empty_like(call.q, dtype=call.out_dtype or call.q.dtype)
        lse = torch.empty(call.lse_shape(), dtype=torch.float32, device=call.q.device)
        for q, k, v, rows in self._pieces(call):
            s, _, vv, _ = self._scores(q, k, v, call)
            piece_lse = torch.logsumexp(s, -1)
            piece_out = torch.einsum("bhst,bthd->bshd", torch.exp(s - piece_lse[..., None]), vv)
            if call.cu_seqlens is None:
                out.copy_(piece_out)
                lse.copy_(piece_lse)
            else:
                out[rows] = piece_out[0].to(out.dtype)
                lse[:, rows] = piece_lse[0]
        return out, lse

    def backward(self, call: AttentionCall, lse, dout, delta):
        dq, dk, dv = (torch.empty_like(t) for t in (call.q, call.k, call.v))
        for q, k, v, rows in self._pieces(call):
            s, kk, vv, visible = self._scores(q, k, v, call)
            work = s.dtype
            if call.cu_seqlens is None:
                piece_lse, piece_delta, do = lse, delta, dout
            else:
                piece_lse, piece_delta, do = lse[:, rows][None], delta[:, rows][None], dout[rows][None]
            p = torch.exp(s - piece_lse[..., None].to(work))
            if visible is not None:
                p = p.masked_fill(~visible, 0.0)
            do = do.to(work)
            ds = p * (torch.einsum("bshd,bthd->bhst", do, vv) - piece_delta[..., None].to(work))
            group = q.shape[2] // k.shape[2]
            b, t, hk, d = k.shape
            pieces = (torch.einsum("bhst,bthd->bshd", ds, kk) * call.scale,
                      (torch.einsum("bhst,bshd->bthd", ds, q.to(work)) * call.scale)
                      .view(b, t, hk, group, d).sum(3),
                      torch.einsum("bhst,bshd->bthd", p, do).view(b, t, hk, group, d).sum(3))
            for grad, piece in zip((dq, dk, dv), pieces):
                if call.cu_seqlens is None:
                    grad.copy_(piece)
                else:
                    grad[rows] = piece[0].to(grad.dtype)
        return dq, dk, dv


DISPATCHER = Dispatcher(OP, [Triton(), Reference()])


def _call(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen) -> AttentionCall:
    max_seqlen = check_attention_inputs(OP, q, k, v, cu_seqlens, max_seqlen)
    return AttentionCall(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen)


@torch.library.custom_op("fusedpar::flash_attention", mutates_args=(), schema=SCHEMA)
def _flash_attention_op(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen, backend):
    call = _call(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen)
    return DISPATCHER.select(call, backend).forward(call)


@_flash_attention_op.register_fake
def _(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen, backend):
    call = AttentionCall(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen)
    return torch.empty_like(q), q.new_empty(call.lse_shape(), dtype=torch.float32)


@torch.library.custom_op("fusedpar::flash_attention_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _flash_attention_backward_op(q, k, v, lse, dout, delta, causal, softmax_scale, cu_seqlens,
                                 max_seqlen, backend):
    call = _call(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen)
    return DISPATCHER.select(call, backend).backward(call, lse, dout, delta)


@_flash_attention_backward_op.register_fake
def _(q, k, v, lse, dout, delta, causal, softmax_scale, cu_seqlens, max_seqlen, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.scale, cu_seqlens, ctx.max_seqlen, ctx.backend = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.set_materialize_grads(False)  # lse is often unused: its gradient stays None


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    delta = delta_of(out, dout, dlse)
    dq, dk, dv = _flash_attention_backward_op(q, k, v, lse, dout, delta, ctx.causal, ctx.scale,
                                              cu_seqlens, ctx.max_seqlen, ctx.backend)
    return dq, dk, dv, None, None, None, None, None


_flash_attention_op.register_autograd(_backward, setup_context=_setup_context)


def default_scale(q: torch.Tensor, softmax_scale) -> float:
    return float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: float | None = None, return_lse: bool = False,
                    cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                    backend: str | None = None):
    """Softmax attention on ``[B, S, H, D]`` tensors; the same as::

        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal,
                                             scale=softmax_scale, enable_gqa=True).transpose(1, 2)
        lse = torch.logsumexp(q.transpose(1, 2) @ k.repeat_interleave(H // H_kv, 2)
                              .permute(0, 2, 3, 1) * scale + causal_mask, dim=-1)  # fp32 [B, H, S]

    q: ``[B, S_q, H, D]``; k, v: ``[B, S_k, H_kv, D]`` with ``H % H_kv == 0`` (GQA/MQA; K/V
    are never repeated in memory); ``D <= 256``. ``causal`` masks key ``j > i`` for query
    ``i`` (top-left aligned, as SDPA). ``softmax_scale`` defaults to ``D ** -0.5``.
    Packed documents: q, k, v ``[T, H, D]`` and ``cu_seqlens`` (int32 ``[0, end_1, .., T]``,
    flash-attn's convention; ``max_seqlen`` optional) attend within each document only;
    lse is then ``[H, T]``. Returns ``out`` (q's dtype), or ``(out, lse)`` with
    ``return_lse`` (lse fp32, differentiable too). Backends: ``triton`` (GPU; CPU in the
    interpreter), ``reference`` (the math above in fp32). fp16/bf16/fp32 in the kernels.
    Under ``torch.autocast``, q, k and v are cast to its dtype first, as SDPA's inputs are.
    """
    q, k, v = autocast_inputs(q, k, v)
    with autocast_off(q):
        out, lse = _flash_attention_op(q, k, v, bool(causal), default_scale(q, softmax_scale),
                                       cu_seqlens, int(max_seqlen or 0), backend or "")
    return (out, lse) if return_lse else out


def attend_block(q, k, v, causal: bool, scale: float, backend: str):
    """``(out, lse)`` of one block of a larger attention (no checks, no autograd), both fp32
    (blocks are merged before the one rounding to q's dtype); ``backend`` is a name of
    DISPATCHER. Ring attention's building block."""
    call = AttentionCall(q, k, v, causal, scale, out_dtype=torch.float32)
    return DISPATCHER.backends[backend].forward(call)


def attend_block_backward(q, k, v, lse, dout, delta, causal: bool, scale: float, backend: str):
    """``(dq, dk, dv)`` of one block, from the global ``lse`` and ``delta`` of its rows."""
    return DISPATCHER.backends[backend].backward(AttentionCall(q, k, v, causal, scale), lse, dout, delta)


register(DISPATCHER, (flash_attention,), example=lambda device: AttentionCall(
    *[torch.zeros(1, 2 * EXAMPLE_WORLD, 2, 16, device=device)] * 3, True, 0.25))
