"""``fusedpar.ops.flash_attention``: softmax attention with the log-sum-exp, fused in one
Triton kernel per direction (``kernels/flash_attention.py``), GQA without repeating K/V;
beside it torch's own attention kernels with their lse (``sdpa``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import BackendNotSupportedError
from ..kernels import flash_attention as kernels
from ..kernels.interpreter import triton_device_reasons
from .backend import Backend, Dispatcher, autocast_inputs, autocast_off
from .registry import EXAMPLE_WORLD, register
from .tuning import pow2

OP = "flash_attention"
MASK_SCHEMA = ("bool causal, float softmax_scale, int window_left, int window_right, float softcap, "
               "bool bottom_right, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
               "int max_seqlen_k, str backend")
SCHEMA = f"(Tensor q, Tensor k, Tensor v, {MASK_SCHEMA}) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, Tensor? dlse, "
                   f"{MASK_SCHEMA}) -> (Tensor, Tensor, Tensor)")
MASK_ALIGNS = ("top_left", "bottom_right")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class AttentionCall:
    """One attention: ``q [B, S_q, H, D]``, ``k``/``v [B, S_k, H_kv, D]`` (packed ``[T, ., D]``
    with ``cu_seqlens``, and k/v's own ``cu_seqlens_k`` when their documents' lengths differ);
    a block of a ring attention is one too. The mask as ``flash_attention`` says."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    scale: float
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    out_dtype: torch.dtype | None = None  # of the output; None: q's
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    bottom_right: bool = False
    cu_seqlens_k: torch.Tensor | None = None  # None: cu_seqlens
    max_seqlen_k: int = 0
    lse_grad: bool = False  # a backward call whose lse has a gradient
    delta: torch.Tensor | None = None  # a backward's rowsum(dout * out) - dlse, where the caller has it
    diag_offset: int = 0  # top-left: query 0's diagonal key (a block of a larger attention)

    def kernel_mask(self) -> dict:
        """The mask and packing arguments of the kernels' launchers."""
        return dict(window=self.window, softcap=self.softcap, bottom_right=self.bottom_right,
                    cu_seqlens_k=self.cu_seqlens_k, max_seqlen_k=self.max_seqlen_k,
                    diag_offset=self.diag_offset)

    def cache_key(self) -> tuple:
        """What the backends' reasons depend on (sdpa's: the mask, packing, head counts and
        dim, whether the lengths are equal, the kernels ``sdpa_kernel`` allows)."""
        return (self.q.device.type, self.q.dtype, self.lse_grad, self.q.shape[-1], self.q.shape[-2],
                self.k.shape[-2], self.causal, self.window, self.softcap > 0, self.bottom_right,
                self.cu_seqlens is not None, self.q.shape[-3] == self.k.shape[-3],
                self.diag_offset != 0, self.delta is not None, _sdpa_allowed())

    def bucket(self) -> tuple:
        """The tuning bucket: batch x heads, K/V heads, query and key lengths (packed: the
        totals) as powers of two, the head dim, and the mask's kind (causal, windowed or
        capped, packed)."""
        packed = self.cu_seqlens is not None
        rows = self.q.shape[-2] * (1 if packed else self.q.shape[0])
        sizes = (rows, self.k.shape[-2], self.q.shape[-3], self.k.shape[-3])
        return (*(pow2(n) for n in sizes), self.q.shape[-1], int(self.causal),
                int(self.window != (-1, -1) or self.softcap > 0), int(packed))

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


def check_attention_inputs(op: str, q, k, v, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None,
                           max_seqlen_k=None) -> tuple[int, int]:
    """Shapes, dtypes, devices and packing (k/v's documents ``cu_seqlens_k``, default q's);
    returns ``(max_seqlen, max_seqlen_k)`` (0 when not packed)."""
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
        return 0, 0
    if cu_seqlens_k is None and k.shape[0] != q.shape[0]:
        raise ValueError(f"fusedpar.{op}: packed q has T={q.shape[0]} rows but k/v have {k.shape[0]}; "
                         "with one cu_seqlens q and k/v hold the same documents (pass "
                         "cu_seqlens_q and cu_seqlens_k for documents of other lengths)")
    longest = _check_max(op, "max_seqlen", max_seqlen,
                         check_cu_seqlens(op, cu_seqlens, q.shape[0], q.device, "q has T="))
    if cu_seqlens_k is None:
        return longest, longest
    longest_k = _check_max(op, "max_seqlen_k", max_seqlen_k,
                           check_cu_seqlens(op, cu_seqlens_k, k.shape[0], q.device, "k/v have T=",
                                            "cu_seqlens_k"))
    if cu_seqlens_k.numel() != cu_seqlens.numel():
        raise ValueError(f"fusedpar.{op}: cu_seqlens_q holds {cu_seqlens.numel() - 1} documents, "
                         f"cu_seqlens_k {cu_seqlens_k.numel() - 1}; document i of q attends to "
                         "document i of k/v, so both need one entry per document")
    return longest, longest_k


def _check_max(op: str, name: str, given, longest: int) -> int:
    if given and given < longest:
        raise ValueError(f"fusedpar.{op}: {name}={given} but a document has {longest} tokens; "
                         f"pass {name} >= the longest document (or None)")
    return given or longest


def check_mask_args(op: str, window_size, softcap, mask_align: str) -> tuple[tuple[int, int], float, bool]:
    """``(window, softcap, bottom_right)`` of ``flash_attention``'s mask arguments."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        raise ValueError(f"fusedpar.{op}: window_size={window_size!r}; pass (left, right), two ints "
                         ">= 0, or -1 for an unbounded side (flash-attn's convention)")
    if not isinstance(softcap, (int, float)) or not 0 <= softcap < float("inf"):
        raise ValueError(f"fusedpar.{op}: softcap={softcap!r}; pass a finite value > 0, or 0 for none")
    if mask_align not in MASK_ALIGNS:
        raise ValueError(f"fusedpar.{op}: mask_align={mask_align!r}; choose one of {MASK_ALIGNS}")
    return (int(window_size[0]), int(window_size[1])), float(softcap), mask_align == "bottom_right"


# host_list's copies: tensor -> ((version, data pointer, dtype, shape, strides), values); an
# entry goes when its tensor dies
_HOST_LISTS = WeakIdKeyDictionary()


def host_list(t: torch.Tensor) -> list:
    """``t.tolist()``, read from the device once per tensor and contents: every layer's
    attention of a packed row reads the same cu_seqlens, and on a GPU each read is a
    device-to-host sync that stalls the CPU until the stream drains. A copy is reused only
    for the same tensor object with the same ``_version`` (an in-place write reads again),
    data pointer, dtype, shape and strides; a new tensor of equal values is read. Writes torch
    does not count (through ``.data``, or a numpy or DLPack alias) are not seen. Fake, meta
    and inference tensors and code under ``torch.compile`` read every time."""
    if not _keepable(t):
        return t.tolist()
    key = _contents(t)
    held = _HOST_LISTS.get(t)
    if held is None or held[0] != key:
        held = _HOST_LISTS[t] = (key, t.tolist())
    return list(held[1])  # the caller's own list, as tolist's


def from_host_list(values: list[int], device) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int32, device=device)`` whose :func:`host_list` is
    ``values`` from the start: int32 values made on the host (a packed row's cu_seqlens) are
    never read back from the device."""
    t = torch.tensor(values, dtype=torch.int32, device=device)  # raises if an int does not fit
    if _keepable(t):
        _HOST_LISTS[t] = (_contents(t), [int(x) for x in values])
    return t


def _keepable(t: torch.Tensor) -> bool:
    """Whether ``host_list`` may keep ``t``'s values: a plain tensor with values and a version
    counter (not fake, meta or inference), outside ``torch.compile``."""
    return not (torch.compiler.is_compiling() or type(t) is not torch.Tensor
                or t.device.type == "meta" or t.is_inference())


def _contents(t: torch.Tensor) -> tuple:
    """What must be unchanged for ``host_list`` to reuse a tensor's values."""
    return t._version, t.data_ptr(), t.dtype, t.shape, t.stride()


def check_cu_seqlens(op: str, cu_seqlens, total: int, device, total_is: str,
                     name: str = "cu_seqlens") -> int:
    """int32 ``[0, end_1, ..., total]``, strictly increasing, on ``device``; returns the
    longest document's length. ``total_is`` names the total in the error, ``name`` the
    argument."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        got = (f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
               if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__)
        raise TypeError(f"fusedpar.{op}: {name} must be a 1-D int32 tensor (cumulative sequence "
                        f"ends, starting at 0), got {got}; use .to(torch.int32)")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"fusedpar.{op}: {name} has {cu_seqlens.numel()} entries; it needs "
                         "[0, end_1, ..., T] (one more than the number of documents)")
    if cu_seqlens.device != device:
        raise ValueError(f"fusedpar.{op}: {name} is on {cu_seqlens.device}, q on {device}")
    ends = host_list(cu_seqlens)  # host values: checked once, before any kernel reads them
    lengths = [b - a for a, b in zip(ends, ends[1:])]
    if ends[0] != 0 or min(lengths) <= 0:
        raise ValueError(f"fusedpar.{op}: {name} = {ends[:8]}{'...' if len(ends) > 8 else ''} "
                         "must start at 0 and be strictly increasing")
    if ends[-1] != total:
        raise ValueError(f"fusedpar.{op}: {name} ends at {ends[-1]} but {total_is}{total} "
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
                                   call.max_seqlen, **call.kernel_mask())
        return out, lse

    def backward(self, call: AttentionCall, out, lse, dout, dlse):
        delta = delta_of(out, dout, dlse) if call.delta is None else call.delta
        q, k, v, dout = (_last_dim_contiguous(t) for t in (call.q, call.k, call.v, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kernels.flash_attn_backward(q, k, v, dout, lse.contiguous(), delta, dq, dk, dv,
                                    call.causal, call.scale, call.cu_seqlens, call.max_seqlen,
                                    **call.kernel_mask())
        return dq, dk, dv


class Reference(Backend):
    """The docstring's math in (at least) fp32 with K/V heads repeated; packed documents
    one by one."""

    name = "reference"

    def _pieces(self, call: AttentionCall):
        """``[(q, k, v, q rows, k rows)]``: batched tensors per document (or the whole batch)."""
        if call.cu_seqlens is None:
            return [(call.q, call.k, call.v, slice(None), slice(None))]
        ends = host_list(call.cu_seqlens)
        ends_k = ends if call.cu_seqlens_k is None else host_list(call.cu_seqlens_k)
        return [(call.q[a:b][None], call.k[c:d][None], call.v[c:d][None], slice(a, b), slice(c, d))
                for a, b, c, d in zip(ends, ends[1:], ends_k, ends_k[1:])]

    @staticmethod
    def _scores(q, k, v, call):
        """``(scores, K, V, visible or None, tanh of the capped scores or None)``."""
        work = torch.promote_types(q.dtype, torch.float32)
        group = q.shape[2] // k.shape[2]
        kk = k.to(work).repeat_interleave(group, 2)
        vv = v.to(work).repeat_interleave(group, 2)
        s = torch.einsum("bshd,bthd->bhst", q.to(work), kk) * call.scale
        capped = None
        if call.softcap:
            capped = torch.tanh(s / call.softcap)
            s = capped * call.softcap
        visible = band_mask(q.shape[1], k.shape[1], call.causal, call.window, call.bottom_right,
                            q.device, call.diag_offset)
        if visible is not None:
            s = s.masked_fill(~visible, float("-inf"))
        return s, kk, vv, visible, capped

    def forward(self, call: AttentionCall):
        out = torch.empty_like(call.q, dtype=call.out_dtype or call.q.dtype)
        lse = torch.empty(call.lse_shape(), dtype=torch.float32, device=call.q.device)
        for q, k, v, rows, _ in self._pieces(call):
            s, _, vv, _, _ = self._scores(q, k, v, call)
            piece_lse = torch.logsumexp(s, -1)  # -inf where a row sees no key: its output is 0
            p = torch.exp(s - piece_lse.masked_fill(piece_lse == float("-inf"), 0)[..., None])
            piece_out = torch.einsum("bhst,bthd->bshd", p, vv)
            if call.cu_seqlens is None:
                out.copy_(piece_out)
                lse.copy_(piece_lse)
            else:
                out[rows] = piece_out[0].to(out.dtype)
                lse[:, rows] = piece_lse[0]
        return out, lse

    def backward(self, call: AttentionCall, out, lse, dout, dlse):
        delta = delta_of(out, dout, dlse) if call.delta is None else call.delta
        dq, dk, dv = (torch.empty_like(t) for t in (call.q, call.k, call.v))
        for q, k, v, rows, keys in self._pieces(call):
            s, kk, vv, visible, capped = self._scores(q, k, v, call)
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
            if capped is not None:  # d(softcap * tanh(s / softcap)) / ds
                ds = ds * (1 - capped * capped)
            group = q.shape[2] // k.shape[2]
            b, t, hk, d = k.shape
            pieces = (torch.einsum("bhst,bthd->bshd", ds, kk) * call.scale,
                      (torch.einsum("bhst,bshd->bthd", ds, q.to(work)) * call.scale)
                      .view(b, t, hk, group, d).sum(3),
                      torch.einsum("bhst,bshd->bthd", p, do).view(b, t, hk, group, d).sum(3))
            for grad, piece, at in zip((dq, dk, dv), pieces, (rows, keys, keys)):
                if call.cu_seqlens is None:
                    grad.copy_(piece)
                else:
                    grad[at] = piece[0].to(grad.dtype)
        return dq, dk, dv


# the kernels whose aten ops return the lse (CPU: its flash kernel; CUDA: the three fused ones)
LSE_KERNELS = {"cpu": (SDPBackend.FLASH_ATTENTION,),
               "cuda": (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION)}
EFFICIENT_LSE_ALIGN = 32  # the memory-efficient kernel pads its lse rows to a multiple of this
aten = torch.ops.aten


def sdpa_choice(call: AttentionCall) -> tuple[SDPBackend, bool]:
    """``(kernel, repeat)``: the kernel torch's SDPA picks for ``call`` (``torch._fused_sdp_choice``,
    which honours ``torch.nn.attention.sdpa_kernel``), and whether K/V heads must be repeated
    to reach it: with GQA, first as SDPA's ``enable_gqa`` (a kernel chosen so takes the
    K/V heads as they are), else with the heads repeated."""
    q, k, v = _sdpa_inputs(call, False)
    gqa = q.shape[1] != k.shape[1]
    kernel = _fused_choice(call, q, k, v, enable_gqa=gqa)
    if not gqa or kernel in LSE_KERNELS[q.device.type]:
        return kernel, False
    k, v = _sdpa_inputs(call, True)[1:]
    return _fused_choice(call, q, k, v), True


def _sdpa_allowed() -> tuple[bool, ...]:
    """The torch attention kernels enabled now (``torch.nn.attention.sdpa_kernel`` sets them)."""
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(),
            b.math_sdp_enabled())


def _fused_choice(call: AttentionCall, q, k, v, **gqa) -> SDPBackend:
    """torch's pick for these inputs, or ERROR where ``sdpa_kernel`` allows no kernel that
    takes them (torch raises then: e.g. the memory-efficient kernel alone, which has no GQA)."""
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=call.causal, scale=call.scale, **gqa))
    except RuntimeError:  # "No viable backend for scaled_dot_product_attention was found"
        return SDPBackend.ERROR


def _sdpa_inputs(call: AttentionCall, repeat: bool):
    """q, k, v as ``[B, H, S, D]`` views, last dim contiguous as the fused kernels need (K/V
    heads repeated to H when ``repeat``)."""
    group = call.q.shape[2] // call.k.shape[2]
    q, k, v = (_last_dim_contiguous(t).transpose(1, 2) for t in (call.q, call.k, call.v))
    if repeat:
        k, v = (t.repeat_interleave(group, 1) for t in (k, v))
    return q, k, v


class Sdpa(Backend):
    """torch's own attention kernels with their lse: on CUDA the one SDPA would pick (flash,
    cuDNN or memory-efficient), on CPU its flash kernel; forward and backward through the
    aten ops that return and take the lse (what torch's ``context_parallel`` calls)."""

    name = "sdpa"

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        device = call.q.device.type
        if device not in LSE_KERNELS:
            return [f"no torch attention kernel with an lse on device type {device!r}"]
        reasons = []
        if call.cu_seqlens is not None:
            reasons.append("packed documents (cu_seqlens): torch's fused attention ops take one "
                           "dense batch")
        if call.window != (-1, -1):
            reasons.append(f"window_size={call.window}: torch's attention kernels have no sliding window")
        if call.softcap:
            reasons.append(f"softcap={call.softcap}: torch's attention kernels have no logit soft-capping")
        if call.causal and call.diag_offset:
            reasons.append(f"a causal diagonal moved by {call.diag_offset} keys (a block of a larger "
                           "attention): torch's is_causal is top-left")
        if call.lse_grad:
            # the next backend computes the same gradients; torch's backward ops take
            # rowsum(dout * out) from out and have no input for the lse's gradient
            reasons.append("a gradient of the lse: torch's attention backward ops take none")
        if call.delta is not None:
            reasons.append("a backward given rowsum(dout * out) instead of out: torch's attention "
                           "backward ops read out")
        if reasons:
            return reasons
        seqlen_q, seqlen_k, d = call.q.shape[1], call.k.shape[1], call.q.shape[-1]
        if call.causal and seqlen_q != seqlen_k:
            if call.bottom_right:
                reasons.append(f"causal aligned bottom-right with S_q={seqlen_q} != S_k={seqlen_k}: "
                               "torch's is_causal is top-left")
            elif device == "cuda":
                reasons.append(f"causal with S_q={seqlen_q} != S_k={seqlen_k} on CUDA: torch's flash "
                               "kernel aligns that mask bottom-right (SDPA never sends it such calls)")
        if device == "cuda" and d % 8:
            reasons.append(f"head dim D={d} is not a multiple of 8 (SDPA pads it before its fused "
                           "kernels)")
        if reasons:
            return reasons
        kernel = sdpa_choice(call)[0]
        if kernel == SDPBackend.ERROR:
            reasons.append("no attention kernel that torch.nn.attention.sdpa_kernel() allows here "
                           f"takes this call ({call.q.dtype}, D={d}, H={call.q.shape[2]}, "
                           f"H_kv={call.k.shape[2]})")
        elif kernel not in LSE_KERNELS[device]:
            reasons.append(f"torch's SDPA picks its {kernel.name} kernel for {call.q.dtype}, D={d} "
                           "here, which returns no lse")
        return reasons

    def forward(self, call: AttentionCall):
        kernel, repeat = sdpa_choice(call)
        if kernel not in LSE_KERNELS[call.q.device.type]:  # reasons are cached per cache_key()
            raise BackendNotSupportedError(
                f"fusedpar.{OP}: torch's SDPA picks its {kernel.name} kernel for {call.describe()}, "
                "which returns no lse; pass backend='triton' or 'reference'")
        q, k, v = _sdpa_inputs(call, repeat)
        seqlen_q, causal, scale = q.shape[2], call.causal, call.scale
        if q.device.type == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        elif kernel == SDPBackend.FLASH_ATTENTION:
            out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        elif kernel == SDPBackend.CUDNN_ATTENTION:  # lse [B, H, S, 1]
            out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                scale=scale)[:2]
        else:  # memory-efficient: lse padded to EFFICIENT_LSE_ALIGN rows
            out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                    scale=scale)[:2]
        lse = lse.flatten(2)[..., :seqlen_q].float().contiguous()
        return out.transpose(1, 2).to(call.out_dtype or call.q.dtype).contiguous(), lse

    def backward(self, call: AttentionCall, out, lse, dout, dlse):
        assert dlse is None, "not_supported_reasons declines an lse gradient"
        kernel, repeat = sdpa_choice(call)
        q, k, v = _sdpa_inputs(call, repeat)
        out, dout = (t.transpose(1, 2).to(q.dtype) for t in (out, dout))
        seqlen_q, seqlen_k, causal, scale = q.shape[2], k.shape[2], call.causal, call.scale
        lse = lse.contiguous()  # the kernels read its rows as contiguous
        if q.device.type == "cpu":  # its lse in the dtype it accumulates in
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse.to(torch.promote_types(q.dtype, torch.float32)), 0.0, causal,
                scale=scale)
        elif kernel == SDPBackend.FLASH_ATTENTION:  # its rng state as its forward gives it; unread
            seed = torch.empty(2, dtype=torch.uint64, device=q.device)
            offset = torch.empty((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, None, None, seqlen_q, seqlen_k, 0.0, causal, seed, offset,
                scale=scale)
        else:  # philox seed and offset as their forwards give them; unread without dropout
            seed = offset = torch.empty((), dtype=torch.int64, device=q.device)
            if kernel == SDPBackend.CUDNN_ATTENTION:
                dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                    dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, None, None, seqlen_q,
                    seqlen_k, 0.0, causal, scale=scale)
            else:
                padded = F.pad(lse, (0, -seqlen_q % EFFICIENT_LSE_ALIGN))
                dq, dk, dv = aten._scaled_dot_product_efficient_attention_backward(
                    dout, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False],
                    causal, scale=scale)[:3]
        if repeat:  # the repeated heads' gradients summed into their K/V head
            b, _, s, d = dk.shape
            dk, dv = (g.view(b, call.k.shape[2], -1, s, d).sum(2) for g in (dk, dv))
        return tuple(g.transpose(1, 2).contiguous() for g in (dq, dk, dv))


def band_mask(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int],
              bottom_right: bool, device, diag_offset: int = 0) -> torch.Tensor | None:
    """``[S_q, S_k]`` bool, True where query i sees key j (``flash_attention``'s rule, the
    diagonal moved by ``diag_offset`` keys), or None when every query sees every key."""
    left, right = window
    right = 0 if causal else right
    if left < 0 and right < 0:
        return None
    diag = torch.arange(seqlen_q, device=device)[:, None] + diag_offset + (
        seqlen_k - seqlen_q if bottom_right else 0)
    j = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    return visible


# sdpa last: on CPU (nothing timed) today's order stays; on a GPU the tuning table chooses
DISPATCHER = Dispatcher(OP, [Triton(), Reference(), Sdpa()])


def backward_backend(dispatcher: Dispatcher, call, requested: str) -> Backend:
    """The backend of a backward ``call`` (flash or ring attention): the forward's (the one
    ``requested`` or the dispatcher's choice), unless a forced one declines this call
    (``sdpa`` with an lse gradient): then the first in priority order that takes it (every
    backend computes the same gradients)."""
    forced = dispatcher.forced_name(requested)
    if forced and call.lse_grad and dispatcher.backends[forced].not_supported_reasons(call):
        for backend in dispatcher.backends.values():
            if not backend.not_supported_reasons(call):
                return backend
    return dispatcher.select(call, requested)


def _call(q, k, v, causal, softmax_scale, window_left, window_right, softcap, bottom_right,
          cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, lse_grad=False) -> AttentionCall:
    max_seqlen_q, max_seqlen_k = check_attention_inputs(OP, q, k, v, cu_seqlens_q, max_seqlen_q,
                                                        cu_seqlens_k, max_seqlen_k)
    # the host values check_attention_inputs read (no second device read, as torch.equal's)
    if cu_seqlens_k is not None and (cu_seqlens_k is cu_seqlens_q
                                     or host_list(cu_seqlens_k) == host_list(cu_seqlens_q)):
        cu_seqlens_k = None  # q's documents: the kernels' variant for equal lengths
    return AttentionCall(q, k, v, causal, softmax_scale, cu_seqlens_q, max_seqlen_q,
                         window=(window_left, window_right), softcap=softcap,
                         bottom_right=bottom_right, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_k=max_seqlen_k, lse_grad=lse_grad)


@torch.library.custom_op("fusedpar::flash_attention", mutates_args=(), schema=SCHEMA)
def _flash_attention_op(q, k, v, causal, softmax_scale, window_left, window_right, softcap,
                        bottom_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend):
    call = _call(q, k, v, causal, softmax_scale, window_left, window_right, softcap, bottom_right,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return DISPATCHER.select(call, backend).forward(call)


@_flash_attention_op.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, bottom_right,
      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend):
    call = AttentionCall(q, k, v, causal, softmax_scale, cu_seqlens_q)
    return torch.empty_like(q), q.new_empty(call.lse_shape(), dtype=torch.float32)


@torch.library.custom_op("fusedpar::flash_attention_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _flash_attention_backward_op(q, k, v, out, lse, dout, dlse, causal, softmax_scale, window_left,
                                 window_right, softcap, bottom_right, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, backend):
    call = _call(q, k, v, causal, softmax_scale, window_left, window_right, softcap, bottom_right,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, lse_grad=dlse is not None)
    return backward_backend(DISPATCHER, call, backend).backward(call, out, lse, dout, dlse)


@_flash_attention_backward_op.register_fake
def _(q, k, v, out, lse, dout, dlse, *mask_and_backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *ctx.mask = inputs  # (causal, softmax_scale, ..., backend) as the schema lists them
    cu_seqlens_q, cu_seqlens_k = ctx.mask[6:8]
    ctx.mask[6:8] = None, None  # saved as tensors
    ctx.save_for_backward(q, k, v, *output, cu_seqlens_q, cu_seqlens_k)
    ctx.set_materialize_grads(False)  # lse is often unused: its gradient stays None


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    mask = list(ctx.mask)
    mask[6:8] = cu_seqlens_q, cu_seqlens_k
    dq, dk, dv = _flash_attention_backward_op(q, k, v, out, lse, dout, dlse, *mask)
    return (dq, dk, dv) + (None,) * len(mask)


_flash_attention_op.register_autograd(_backward, setup_context=_setup_context)


def default_scale(q: torch.Tensor, softmax_scale) -> float:
    return float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, mask_align: str = "top_left", return_lse: bool = False,
                    cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                    cu_seqlens_q: torch.Tensor | None = None,
                    cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                    max_seqlen_k: int | None = None, backend: str | None = None):
    """Softmax attention on ``[B, S, H, D]`` tensors; the same as::

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        s = qt @ kt.repeat_interleave(H // H_kv, 1).transpose(-1, -2) * scale  # [B, H, S_q, S_k]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~visible, float("-inf"))          # visible: below
        lse = torch.logsumexp(s, -1)                        # fp32 [B, H, S_q]
        out = (torch.softmax(s, -1) @ vt.repeat_interleave(H // H_kv, 1)).transpose(1, 2)

    which, with no window and no softcap, is ``F.scaled_dot_product_attention(qt, kt, vt,
    is_causal=causal, scale=scale, enable_gqa=True).transpose(1, 2)``.

    q: ``[B, S_q, H, D]``; k, v: ``[B, S_k, H_kv, D]`` with ``H % H_kv == 0`` (GQA/MQA; K/V
    are never repeated in memory); ``D <= 256``. ``softmax_scale`` defaults to ``D ** -0.5``.

    Mask (flash-attn's arguments): query ``i`` sees key ``j`` iff
    ``i + off - left <= j <= i + off + right`` for ``window_size=(left, right)`` (-1: that
    side unbounded; the default sees every key); ``causal`` sets ``right = 0``.
    ``mask_align`` places the diagonal: ``"top_left"`` (default; ``off = 0``: query ``i``'s
    diagonal is key ``i``, as SDPA's ``is_causal`` and torch's ``causal_upper_left``) or
    ``"bottom_right"`` (``off = S_k - S_q``: the last query's diagonal is the last key, as
    flash-attn >= 2.1 and torch's ``causal_lower_right``; one query against 147 keys sees
    all 147). Both agree when ``S_q == S_k``. A query that sees no key gets output 0 and lse
    -inf (flash-attn: +inf), and passes no gradient. ``softcap > 0``: Gemma 2's logit
    soft-capping, ``softcap * tanh(s / softcap)`` of the scaled scores, before the mask.

    Packed documents: q ``[T_q, H, D]``, k, v ``[T_k, H_kv, D]`` with ``cu_seqlens`` (int32
    ``[0, end_1, .., T]``, flash-attn's convention; q and k/v the same documents,
    ``max_seqlen`` optional) or ``cu_seqlens_q`` and ``cu_seqlens_k`` (document ``i`` of q
    attends to document ``i`` of k/v; ``max_seqlen_q`` / ``max_seqlen_k`` optional): each
    document attends within itself, masked as above with its own lengths; lse is then
    ``[H, T_q]``. Returns ``out`` (q's dtype), or ``(out, lse)`` with ``return_lse`` (lse
    fp32, differentiable too). Backends: ``triton`` (GPU; CPU in the interpreter),
    ``sdpa`` (torch's kernels with their lse: on CUDA the one SDPA picks, flash, cuDNN or
    memory-efficient; CPU's flash kernel; no window, softcap, packing or bottom-right with
    S_q != S_k; a backward with an lse gradient runs on the next backend),
    ``reference`` (the math above in fp32). fp16/bf16/fp32 in the kernels. Under
    ``torch.autocast``, q, k and v are cast to its dtype first, as SDPA's inputs are.
    """
    window, softcap, bottom_right = check_mask_args(OP, window_size, softcap, mask_align)
    if cu_seqlens is not None and (cu_seqlens_q is not None or cu_seqlens_k is not None):
        raise ValueError(f"fusedpar.{OP}: pass cu_seqlens (q and k/v the same documents) or "
                         "cu_seqlens_q and cu_seqlens_k, not both")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError(f"fusedpar.{OP}: cu_seqlens_q and cu_seqlens_k go together; pass both "
                         "(or cu_seqlens when q and k/v hold the same documents)")
    if cu_seqlens is not None:
        cu_seqlens_q = cu_seqlens
        max_seqlen_q = max_seqlen_k = max_seqlen
    q, k, v = autocast_inputs(q, k, v)
    with autocast_off(q):
        out, lse = _flash_attention_op(q, k, v, bool(causal), default_scale(q, softmax_scale),
                                       *window, softcap, bottom_right, cu_seqlens_q, cu_seqlens_k,
                                       int(max_seqlen_q or 0), int(max_seqlen_k or 0), backend or "")
    return (out, lse) if return_lse else out


def attend_block(q, k, v, causal: bool, scale: float, backend: str, mask: dict | None = None):
    """``(out, lse)`` of one block of a larger attention (no checks, no autograd), both fp32
    (blocks are merged before the one rounding to q's dtype); ``backend`` is a name of
    DISPATCHER; ``mask``: AttentionCall's ``window``, ``softcap``, ``diag_offset``. Ring
    attention's building block."""
    call = AttentionCall(q, k, v, causal, scale, out_dtype=torch.float32, **(mask or {}))
    return DISPATCHER.backends[backend].forward(call)


def attend_block_backward(q, k, v, out, lse, dout, dlse, causal: bool, scale: float, backend: str,
                          mask: dict | None = None, delta: torch.Tensor | None = None):
    """``(dq, dk, dv)`` of one block, from the global ``out``, ``lse`` (and ``dlse``) of its
    rows: the block's ``exp(S - lse)`` is its share of the whole softmax. ``delta``
    (``delta_of(out, dout, dlse)``, computed by the caller) replaces ``out`` and ``dlse`` for
    the backends that take it."""
    call = AttentionCall(q, k, v, causal, scale, lse_grad=dlse is not None, delta=delta,
                         **(mask or {}))
    return DISPATCHER.backends[backend].backward(call, out, lse, dout, dlse)


register(DISPATCHER, (flash_attention,), checks="fusedpar.testing.flash_attention_cases", example=lambda device: AttentionCall(
    *[torch.zeros(1, 2 * EXAMPLE_WORLD, 2, 16, device=device)] * 3, True, 0.25))
