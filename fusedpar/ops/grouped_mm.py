"""``fusedpar.ops.grouped_mm``: one GEMM per group of rows (or of K), the
``torch._grouped_mm`` contract, with a persistent Triton kernel and autograd."""

from __future__ import annotations

import torch

from ..kernels import grouped_gemm as kernels
from .backend import Backend, Dispatcher

OP = "grouped_mm"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class GroupedCall:
    """One call: ``a`` 2-D; ``b`` 3-D (groups of rows of ``a``) or 2-D (groups along K)."""

    def __init__(self, a, b, offs):
        self.a, self.b, self.offs = a, b, offs
        self.x = a  # what the shared availability checks look at

    @property
    def k_grouped(self) -> bool:
        return self.b.dim() == 2

    def cache_key(self) -> tuple:
        return (self.a.device.type, self.a.dtype, self.k_grouped)

    def describe(self) -> str:
        return (f"a {tuple(self.a.shape)} x b {tuple(self.b.shape)} {self.a.dtype} on "
                f"{self.a.device.type}, {self.offs.numel()} groups")

    def out_shape(self) -> tuple:
        if self.k_grouped:
            return (self.offs.shape[0], self.a.shape[0], self.b.shape[1])
        return (self.a.shape[0], self.b.shape[2])


def check_inputs(a, b, offs) -> GroupedCall:
    """Shapes, dtypes and devices (no look at the values of ``offs``)."""
    for name, t in (("a", a), ("b", b), ("offs", offs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fusedpar.{OP}: {name} must be a Tensor, got {type(t).__name__}")
    if a.dim() != 2 or b.dim() not in (2, 3):
        raise ValueError(f"fusedpar.{OP}: expected a 2-D and b 2-D or 3-D, got a {tuple(a.shape)} "
                         f"and b {tuple(b.shape)}")
    if offs.dim() != 1 or offs.dtype != torch.int32:
        raise TypeError(f"fusedpar.{OP}: offs must be a 1-D int32 tensor of cumulative group "
                        f"ends, got {offs.dtype} of shape {tuple(offs.shape)}; use "
                        "counts.cumsum(0).to(torch.int32)")
    if a.dtype != b.dtype:
        raise TypeError(f"fusedpar.{OP}: a is {a.dtype} but b is {b.dtype}; cast them to one dtype")
    if a.dtype not in DTYPES:
        raise TypeError(f"fusedpar.{OP}: dtype {a.dtype} is not supported; use fp32, fp16 or bf16")
    if not a.device == b.device == offs.device:
        raise ValueError(f"fusedpar.{OP}: a, b and offs must be on one device, got {a.device}, "
                         f"{b.device}, {offs.device}")
    if b.dim() == 3:
        if b.shape[1] != a.shape[1]:
            raise ValueError(f"fusedpar.{OP}: K mismatch: a is {tuple(a.shape)} (K={a.shape[1]}) "
                             f"but b is {tuple(b.shape)} (K={b.shape[1]})")
        if offs.shape[0] != b.shape[0]:
            raise ValueError(f"fusedpar.{OP}: offs has {offs.shape[0]} group ends but b has "
                             f"{b.shape[0]} groups")
    elif b.shape[0] != a.shape[1]:
        raise ValueError(f"fusedpar.{OP}: K mismatch: a is {tuple(a.shape)} (K={a.shape[1]}) but "
                         f"b is {tuple(b.shape)} (K={b.shape[0]})")
    return GroupedCall(a, b, offs)


def check_offs(call: GroupedCall) -> None:
    """Group ends non-decreasing, from 0 up to the grouped extent. On a CPU tensor a clear
    error now; on CUDA a device-side assert, so no host sync."""
    offs, extent = call.offs, call.a.shape[1] if call.k_grouped else call.a.shape[0]
    what = "K" if call.k_grouped else "rows of a"
    if offs.numel() == 0:
        return
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    bad = (offs < starts) | (offs > extent)
    if offs.device.type == "cuda":
        torch._assert_async(~bad.any(), f"fusedpar.{OP}: offs must be non-decreasing and <= {extent}")
        return
    if bad.any():
        g = int(bad.nonzero()[0])
        raise ValueError(f"fusedpar.{OP}: offs[{g}] = {int(offs[g])} after {int(starts[g])}: group "
                         f"ends must be non-decreasing and at most the {extent} {what}; "
                         f"offs = {offs.tolist()}")


class Reference(Backend):
    """A loop of matmuls (reads ``offs`` on the host)."""

    name = "reference"

    def run(self, call: GroupedCall) -> torch.Tensor:
        a, b = call.a, call.b
        out = a.new_zeros(call.out_shape())
        start = 0
        for g, end in enumerate(call.offs.tolist()):
            if call.k_grouped:
                out[g] = a[:, start:end] @ b[start:end]
            else:
                out[start:end] = a[start:end] @ b[g]
            start = end
        return out


class Triton(Backend):
    """One persistent Triton launch over the tiles of every group."""

    name = "triton"

    def not_supported_reasons(self, call):
        device = call.a.device
        if device.type == "cpu":
            if not kernels.interpreting():
                return ["Triton kernels run on CPU only in the interpreter: set TRITON_INTERPRET=1 "
                        "before importing fusedpar"]
            return []
        if device.type != "cuda":
            return [f"no Triton for device type {device.type!r}"]
        return ["TRITON_INTERPRET=1 is set: the interpreter cannot run on CUDA tensors"] \
            if kernels.interpreting() else []

    def run(self, call: GroupedCall) -> torch.Tensor:
        out = torch.empty(call.out_shape(), dtype=call.a.dtype, device=call.a.device)
        if call.k_grouped:
            kernels.grouped_mm_k(call.a, call.b, call.offs, out)
        else:
            kernels.grouped_mm_rows(call.a, call.b, call.offs, out)
        return out


BACKENDS = Dispatcher(OP, [Triton(), Reference()])


@torch.library.custom_op("fusedpar::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    call = check_inputs(a, b, offs)
    check_offs(call)
    return BACKENDS.select(call, backend).run(call)


@_grouped_mm_op.register_fake
def _(a, b, offs, backend):
    return a.new_empty(check_inputs(a, b, offs).out_shape())


def _setup_context(ctx, inputs, output):
    a, b, offs, ctx.backend = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a = grad_b = None
    if b.dim() == 3:  # out[rows g] = a[rows g] @ b[g]
        if need_a:
            grad_a = grouped_mm(grad, b.transpose(1, 2), offs, backend=ctx.backend)
        if need_b:
            grad_b = grouped_mm(a.t(), grad, offs, backend=ctx.backend)
    else:  # out[g] = a[:, K_g] @ b[K_g]
        if need_a:
            grad_a = grouped_mm(b, grad.transpose(1, 2), offs, backend=ctx.backend).t()
        if need_b:
            grad_b = grouped_mm(a.t(), grad, offs, backend=ctx.backend)
    return grad_a, grad_b, None, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *,
               backend: str | None = None) -> torch.Tensor:
    """One matmul per group, the ``torch._grouped_mm`` contract; the same as::

        start = 0
        for g, end in enumerate(offs.tolist()):      # int32 cumulative group ends
            if b.dim() == 3:                          # a [T, K] x b [E, K, N] -> [T, N]
                out[start:end] = a[start:end] @ b[g]  # rows past offs[-1] are zeros
            else:                                     # a [M, K] x b [K, N] -> [E, M, N]
                out[g] = a[:, start:end] @ b[start:end]
            start = end

    The 3-D form is an MoE layer's forward and input gradient (tokens sorted by expert,
    ``offs = tokens_per_expert.cumsum(0)``); the 2-D form, groups along K, its weight
    gradient (``grouped_mm(x.t(), dy, offs)``). Empty groups are fine. fp32, fp16 or bf16,
    any strides; differentiable in ``a`` and ``b``.
    Backends: ``triton`` (one persistent launch over every group's tiles, reading ``offs``
    on the device: no host sync) and ``reference``. Bad ``offs`` values raise on CPU; on
    CUDA they trip a device-side assert (checking on the host would sync).
    """
    return _grouped_mm_op(a, b, offs, backend or "")
