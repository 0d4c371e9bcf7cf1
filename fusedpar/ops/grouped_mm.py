"""``fusedpar.ops.grouped_mm``: one GEMM per group of rows (or of K), the
``torch._grouped_mm`` contract, with a persistent Triton kernel and autograd."""

from __future__ import annotations

import torch

from ..kernels import grouped_mm as kernels
from ..kernels.interpreter import triton_device_reasons
from .backend import Backend, Dispatcher, autocast_inputs, autocast_off
from .registry import EXAMPLE_WORLD, register
from .tuning import pow2

OP = "grouped_mm"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class GroupedCall:
    """One call: ``a`` 2-D and ``b`` 3-D (groups of rows of ``a``), ``a`` and ``b`` 2-D
    (groups along K), ``a`` 3-D and ``b`` 2-D (groups of columns of ``b``) or ``a`` and ``b``
    3-D (batched). ``offs``: cumulative group ends; ``masked_m``: counts of equal-size groups
    instead (one of the two, never both; the batched form takes only ``masked_m``, the
    column-grouped one only ``offs``). ``out_dtype``: the output's dtype (None: ``a``'s)."""

    def __init__(self, a, b, offs, masked_m=None, out_dtype=None):
        self.a, self.b, self.offs, self.masked_m = a, b, offs, masked_m
        self.out_dtype = out_dtype or a.dtype
        self.x = a  # what the shared availability checks look at

    @property
    def k_grouped(self) -> bool:
        return self.a.dim() == 2 and self.b.dim() == 2

    @property
    def n_grouped(self) -> bool:
        return self.a.dim() == 3 and self.b.dim() == 2

    @property
    def batched(self) -> bool:
        return self.a.dim() == 3 and self.b.dim() == 3

    @property
    def groups(self) -> int:
        return (self.masked_m if self.offs is None else self.offs).shape[0]

    def cache_key(self) -> tuple:
        # with what the torch backend's reasons read: masked_m, group count, alignment, layout
        return (self.a.device.type, self.a.dtype, self.a.dim(), self.b.dim(), self.out_dtype,
                self.masked_m is None, self.groups == 0, _aligned(self.a), _aligned(self.b),
                _asserted_operands(self))

    def bucket(self) -> tuple:
        """The tuning bucket: the form (``a.dim(), b.dim()``), then a's and b's sizes and
        the group count as powers of two."""
        sizes = (*self.a.shape, *self.b.shape, self.groups)
        return (self.a.dim(), self.b.dim(), *(pow2(s) for s in sizes))

    def describe(self) -> str:
        return (f"a {tuple(self.a.shape)} x b {tuple(self.b.shape)} {self.a.dtype} on "
                f"{self.a.device.type}, {self.groups} groups")

    def out_shape(self) -> tuple:
        if self.k_grouped:
            return (self.groups, self.a.shape[0], self.b.shape[1])
        if self.n_grouped:
            return (self.a.shape[1], self.b.shape[1])
        return (*self.a.shape[:-1], self.b.shape[2])


def check_inputs(a, b, offs, masked_m=None, out_dtype=None, *, op: str = OP,
                 check_dtypes=None) -> GroupedCall:
    """Shapes, dtypes and devices (no look at the values of ``offs`` / ``masked_m``);
    ``check_dtypes(a, b, out_dtype)`` raises for dtypes the op ``op`` does not take (default:
    grouped_mm's)."""
    check_dtypes = check_dtypes or _check_dtypes
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fusedpar.{op}: {name} must be a Tensor, got {type(t).__name__}")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise ValueError(f"fusedpar.{op}: a and b must each be 2-D or 3-D, got a "
                         f"{tuple(a.shape)} and b {tuple(b.shape)}")
    if (offs is None) == (masked_m is None):
        raise ValueError(f"fusedpar.{op}: give offs (cumulative group ends) or masked_m (rows per "
                         "equal-size group), exactly one of them")
    if a.dim() == 3 and b.dim() == 3 and offs is not None:
        raise ValueError(f"fusedpar.{op}: a 3-D a with a 3-D b is batched (group g is a[g]): "
                         "pass masked_m (rows of a[g] to multiply), not offs")
    if a.dim() == 3 and b.dim() == 2 and offs is None:
        raise ValueError(f"fusedpar.{op}: a 3-D a with a 2-D b groups b's columns: pass offs "
                         "(cumulative column ends, one per a[g]), not masked_m")
    for name, t in (("offs", offs), ("masked_m", masked_m)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
            what = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            fix = "counts.cumsum(0).to(torch.int32)" if name == "offs" else "counts.to(torch.int32)"
            raise TypeError(f"fusedpar.{op}: {name} must be a 1-D int32 tensor, got {what}; use {fix}")
        if t.device != a.device:
            raise ValueError(f"fusedpar.{op}: a and {name} must be on one device, got {a.device} "
                             f"and {t.device}")
    check_dtypes(a, b, out_dtype)
    if a.device != b.device:
        raise ValueError(f"fusedpar.{op}: a and b must be on one device, got {a.device} and {b.device}")
    k_a, k_b = a.shape[-1], (b.shape[0] if b.dim() == 2 else b.shape[1])
    if k_a != k_b:
        raise ValueError(f"fusedpar.{op}: K mismatch: a is {tuple(a.shape)} (K={k_a}) but b is "
                         f"{tuple(b.shape)} (K={k_b})")
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"fusedpar.{op}: batched a has {a.shape[0]} groups but b {b.shape[0]}")
    call = GroupedCall(a, b, offs, masked_m, out_dtype)
    if call.n_grouped and call.groups != a.shape[0]:
        raise ValueError(f"fusedpar.{op}: offs has {call.groups} group ends but a has {a.shape[0]} "
                         "groups (a[g] multiplies b's columns offs[g-1]:offs[g])")
    if b.dim() == 3 and call.groups != b.shape[0]:
        what = f"offs has {call.groups} group ends" if offs is not None else \
            f"masked_m has {call.groups} counts"
        raise ValueError(f"fusedpar.{op}: {what} but b has {b.shape[0]} groups")
    if masked_m is not None and a.dim() == 2 and (not masked_m.numel() or k_a % masked_m.numel()):
        raise ValueError(f"fusedpar.{op}: masked_m splits K={k_a} into {masked_m.numel()} equal "
                         "groups; K must be a multiple of the group count")
    return call


def _check_dtypes(a, b, out_dtype) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"fusedpar.{OP}: a is {a.dtype} but b is {b.dtype}; cast them to one dtype")
    if a.dtype not in DTYPES:
        raise TypeError(f"fusedpar.{OP}: dtype {a.dtype} is not supported; use fp32, fp16 or bf16")
    if out_dtype not in (None, a.dtype, torch.float32):
        raise TypeError(f"fusedpar.{OP}: out_dtype={out_dtype} for {a.dtype} inputs; give None "
                        f"({a.dtype}) or torch.float32")


def pad_rows(call: GroupedCall) -> int | None:
    """With ``masked_m``: the size of every group (rows of ``a[g]``, or its share of K)."""
    if call.masked_m is None:
        return None
    return call.a.shape[1] if call.batched else call.a.shape[1] // call.groups


def check_offs(call: GroupedCall) -> None:
    """Group ends non-decreasing, from 0 up to the grouped extent (or with ``masked_m``,
    counts from 0 to the group size). On a CPU tensor a clear error now; on CUDA a
    device-side assert, so no host sync."""
    if call.masked_m is not None:
        counts, size = call.masked_m, pad_rows(call)
        bad = (counts < 0) | (counts > size)
        if counts.device.type == "cuda":
            torch._assert_async(~bad.any(), f"fusedpar.{OP}: masked_m must be in [0, {size}]")
        elif bad.any():
            g = int(bad.nonzero()[0])
            raise ValueError(f"fusedpar.{OP}: masked_m[{g}] = {int(counts[g])}: each group holds "
                             f"{size} rows, so counts must be in [0, {size}]")
        return
    offs = call.offs
    extent, what = ((call.a.shape[1], "K") if call.k_grouped else
                    (call.b.shape[1], "columns of b") if call.n_grouped else (call.a.shape[0], "rows of a"))
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


def group_ranges(call: GroupedCall) -> list[tuple[int, int]]:
    """Each group's ``(start, end)`` along the grouped extent (a host read)."""
    if call.offs is not None:
        ends = call.offs.tolist()
        return list(zip([0] + ends[:-1], ends))
    size = pad_rows(call)
    return [(g * size, g * size + n) for g, n in enumerate(call.masked_m.tolist())]


class Reference(Backend):
    """A loop of matmuls (reads ``offs`` on the host)."""

    name = "reference"

    def run(self, call: GroupedCall) -> torch.Tensor:
        a, b = call.a.to(call.out_dtype), call.b.to(call.out_dtype)  # fp32 out: fp32 products
        out = a.new_zeros(call.out_shape())
        if call.batched:  # rows g*P.. of the flattened batch, P = a.shape[1]
            a, flat = a.reshape(-1, a.shape[-1]), out.view(-1, out.shape[-1])
        else:
            flat = out
        for g, (start, end) in enumerate(group_ranges(call)):
            if call.k_grouped:
                flat[g] = a[:, start:end] @ b[start:end]
            elif call.n_grouped:
                flat[:, start:end] = a[g] @ b[:, start:end]
            else:
                flat[start:end] = a[start:end] @ b[g]
        return out


class Triton(Backend):
    """One persistent Triton launch over the tiles of every group."""

    name = "triton"

    def not_supported_reasons(self, call):
        return triton_device_reasons(call.a.device)

    def run(self, call: GroupedCall) -> torch.Tensor:
        out = torch.empty(call.out_shape(), dtype=call.out_dtype, device=call.a.device)
        # the kernels read offs / masked_m with stride 1
        groups = (call.offs if call.offs is not None else call.masked_m).contiguous()
        if call.n_grouped:
            # out[:, cols g] = a[g] @ b[:, cols g] is, transposed, the row-grouped form
            # bᵀ[rows g] @ a[g]ᵀ; row-major copies keep to the kernels' compiled layouts
            out_t = torch.empty(out.shape[::-1], dtype=out.dtype, device=out.device)
            kernels.grouped_mm_rows(call.b.t().contiguous(), call.a.transpose(1, 2).contiguous(),
                                    groups, out_t)
            out.copy_(out_t.t())
        elif call.k_grouped:
            kernels.grouped_mm_k(call.a, call.b, groups, out, pad_rows=pad_rows(call))
        else:
            a = call.a.reshape(-1, call.a.shape[-1])  # batched: groups of P rows
            kernels.grouped_mm_rows(a, call.b, groups, out.view(-1, out.shape[-1]),
                                    pad_rows=pad_rows(call))
        return out


class Torch(Backend):
    """torch's own GEMMs. With ``offs``: ``torch._grouped_mm``, then zeros in the rows (or
    columns) past ``offs[-1]``, which it leaves unwritten. With ``masked_m``: ``torch.bmm``
    of the whole blocks, then zeros in each block's rows past its count (the batched form),
    or of copies of a and b with the K past each count zeroed (groups along K; see
    ``_bmm_masked``). Every bound is read on the device (no host sync); the zeroing writes
    only the rows past the bounds (columns: a masked fill, off CUDA). On CUDA it declines the layouts where a group's size could
    fail ``torch._grouped_mm``'s device-side assert (``torch_layout_reasons``)."""

    name = "torch"

    def not_supported_reasons(self, call: GroupedCall) -> list[str]:
        device = call.a.device
        if call.masked_m is not None:  # torch.bmm: any device, dtype and strides
            if call.out_dtype != call.a.dtype and device.type != "cuda":
                return [(f"torch.bmm takes out_dtype={call.out_dtype} for {call.a.dtype} inputs "
                         f"only on CUDA, not {device.type}")]
            return []
        if not hasattr(torch, "_grouped_mm"):
            return [f"torch {torch.__version__} has no torch._grouped_mm"]
        reasons = []
        if call.groups == 0:
            reasons.append("no groups")
        if device.type == "cpu" and call.out_dtype != call.a.dtype:
            reasons.append(f"torch._grouped_mm on CPU needs out_dtype == the inputs' dtype "
                           f"({call.a.dtype}), not {call.out_dtype}")
        if device.type == "cuda":
            if call.a.dtype != torch.bfloat16:
                reasons.append(f"torch._grouped_mm on CUDA takes bfloat16, not {call.a.dtype}")
            capability = torch.cuda.get_device_capability(device)
            if capability < (9, 0):
                reasons.append(f"torch._grouped_mm's CUDA kernels need compute capability 9.0+, "
                               f"this GPU has {capability[0]}.{capability[1]}")
        elif device.type != "cpu":
            reasons.append(f"torch._grouped_mm runs on CPU and CUDA, not {device.type}")
        for name, t in (("a", call.a), ("b", call.b)):
            if not _aligned(t):
                reasons.append(f"torch._grouped_mm needs {name} row- or column-major with strides "
                               f"of a multiple of 16 bytes; {name} has strides {t.stride()} of "
                               f"{t.element_size()}-byte elements")
        if device.type == "cuda":
            reasons += torch_layout_reasons(call)
        return reasons

    def run(self, call: GroupedCall) -> torch.Tensor:
        if call.masked_m is not None:
            return _bmm_masked(call)
        out = torch._grouped_mm(call.a, call.b, call.offs,
                                out_dtype=None if call.out_dtype == call.a.dtype else call.out_dtype)
        if not call.k_grouped:  # the rows (columns) past offs[-1]
            zero_past(out[None], call.offs.contiguous(), call.groups - 1, columns=call.n_grouped)
        return out


# torch._grouped_mm's CUDA kernels read offs on the device and CUDA_KERNEL_ASSERT (fatal to
# the CUDA context), for every group but the last, that its size along the grouped dimension
# times that dimension's stride is a multiple of 16 bytes, in a, b and the output: CUTLASS in
# prepare_grouped_gemm_data (aten/src/ATen/native/cuda/GroupMMCommon.cuh), which checks an
# operand when the grouped dim is unit-stride by major order (GroupMM.cu: a_row_major =
# a.stride(-1) == 1), and cuBLASLt (CUDA >= 13.3 builds) in populate_cublas_grouped_args_kernel
# (CublasGroupedArgs.cu), which checks the grouped dim's stride. The host only TORCH_CHECKs the
# strides (GroupedMMUtils.h, check_valid_strides_and_return_transposed). So a layout whose
# grouped dims have strides of a multiple of 16 bytes takes any group sizes; older torch's
# CUTLASS also asserts non-empty groups along K unless a is column-major and b row-major, the
# layout that is. The output, torch's own, is row-major: a 3-D a x 2-D b's grouped columns are
# unit-stride in every layout. Other layouts are declined rather than copied: the Triton backend
# ahead of this one takes them as they are, where a copy would be one more pass over the operand.
_GROUPED_DIMS = {  # form: (operand, its grouped dim, the layout that takes any group sizes)
    "rows": (("a", 0, "row-major (a.contiguous())"),),
    "k": (("a", 1, "column-major (a.t().contiguous().t())"), ("b", 0, "row-major (b.contiguous())")),
    "columns": (),  # the output's columns: no layout of a or b helps
}


def _form(call: GroupedCall) -> str:
    return "k" if call.k_grouped else "columns" if call.n_grouped else "rows"


def _asserted_operands(call: GroupedCall) -> tuple[str, ...]:
    """The inputs whose group sizes torch._grouped_mm's CUDA kernels may assert on the device
    (see above); none with ``masked_m`` (``torch.bmm``)."""
    if call.offs is None:
        return ()
    return tuple(name for name, dim, _ in _GROUPED_DIMS[_form(call)]
                 if not _takes_any_groups(getattr(call, name), dim))


def _takes_any_groups(t: torch.Tensor, dim: int) -> bool:
    """Whether a 2-D ``t``'s groups along ``dim`` pass both CUDA kernels' checks whatever their
    sizes: ``dim``'s stride a multiple of 16 bytes (cuBLASLt), and ``dim`` not the unit-stride
    one by major order (CUTLASS: rows grouped need ``stride(-1) == 1``)."""
    return (t.stride(dim) * t.element_size()) % 16 == 0 and (dim == 1 or t.stride(1) == 1)


def torch_layout_reasons(call: GroupedCall) -> list[str]:
    """Why the ``torch`` backend declines ``call`` on CUDA by its layout alone: a group whose
    size along a unit-stride grouped dimension is not a multiple of 16 bytes fails a
    device-side assert in ``torch._grouped_mm``, fatal to the process's CUDA context, and the
    group sizes are on the device (reading them is a host sync)."""
    if call.n_grouped:
        return [("torch._grouped_mm's output is row-major, so each group of its columns (a 3-D a "
                 "x 2-D b) must span a multiple of 16 bytes, asserted on the device (fatal to the "
                 "CUDA context) for group sizes fusedpar does not read (a host sync)")]
    layouts = {name: layout for name, _, layout in _GROUPED_DIMS[_form(call)]}
    return [f"torch._grouped_mm asserts on the device (fatal to the CUDA context) that each group "
            f"spans a multiple of 16 bytes along a unit-stride grouped dimension; {name} "
            f"{tuple(getattr(call, name).shape)} has strides {getattr(call, name).stride()}: give "
            f"{name} {layouts[name]} for any group sizes" for name in _asserted_operands(call)]


def _bmm_masked(call: GroupedCall) -> torch.Tensor:
    """The masked layout through ``torch.bmm`` (see ``Torch``)."""
    counts = call.masked_m.contiguous()
    bmm = lambda x, y: torch.bmm(x, y) if call.out_dtype == x.dtype else torch.bmm(x, y, call.out_dtype)
    if call.batched:
        out = bmm(call.a, call.b)
        zero_past(out, counts)
        return out
    groups, size = call.groups, pad_rows(call)
    # copies of a's and b's blocks with the K past each count zeroed, on both sides since
    # the padding may hold NaN (0 * NaN is NaN): no torch GEMM takes a K bound per batch read
    # on the device, and torch._grouped_mm's groups along K are contiguous (the padding would
    # be E - 1 more groups: E - 1 more [M, N] products written and held)
    a = _valid_rows(call.a.unflatten(1, (groups, size)).permute(1, 2, 0), counts)  # [E, P, M]
    b = _valid_rows(call.b.unflatten(0, (groups, size)), counts)  # [E, P, N]
    return bmm(a.transpose(1, 2), b)


def _valid_rows(t: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """A copy of ``t [E, P, X]`` with rows ``counts[g]:`` of ``t[g]`` zero."""
    keep = torch.arange(t.shape[1], device=t.device) < counts[:, None]
    return torch.where(keep[..., None], t, 0)


def zero_past(out: torch.Tensor, ends: torch.Tensor, first: int = 0, columns: bool = False) -> None:
    """``out[g, ends[first + g]:] = 0`` (``columns``: ``out[g, :, ends[first + g]:] = 0``) for
    ``out [G, R, C]``, without a host read: the Triton kernel for rows where Triton runs and
    rows are contiguous (it writes only the rows past the bounds), else a masked fill over
    ``out`` (columns: only on devices without Triton, since ``torch_layout_reasons`` keeps
    the column form off torch._grouped_mm on CUDA)."""
    if columns or triton_device_reasons(out.device) or out.stride(2) != 1:
        bounds = ends[first:first + out.shape[0]]
        past = torch.arange(out.shape[2 if columns else 1], device=out.device) >= bounds[:, None]
        out.masked_fill_(past[:, None, :] if columns else past[..., None], 0)
    else:
        kernels.zero_rows_past(out, ends, first)


def _aligned(t: torch.Tensor) -> bool:
    """One of the last two dims contiguous and every other stride a multiple of 16 bytes."""
    inner = t.stride()[-1] == 1 or t.stride()[-2] == 1
    return inner and t.data_ptr() % 16 == 0 and all(
        (s * t.element_size()) % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


DISPATCHER = Dispatcher(OP, [Triton(), Reference(), Torch()])  # vendor backends after ours


def runs_triton(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, backend: str = "") -> bool:
    """Whether ``grouped_mm(a, b, offs, backend=backend)`` would run the Triton kernel (for
    callers that launch its variants themselves)."""
    return DISPATCHER.select(check_inputs(a, b, offs), backend).name == Triton.name


@torch.library.custom_op("fusedpar::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                   masked_m: torch.Tensor | None, out_dtype: torch.dtype | None,
                   backend: str) -> torch.Tensor:
    call = check_inputs(a, b, offs, masked_m, out_dtype)
    check_offs(call)
    return DISPATCHER.select(call, backend).run(call)


@_grouped_mm_op.register_fake
def _(a, b, offs, masked_m, out_dtype, backend):
    call = check_inputs(a, b, offs, masked_m, out_dtype)
    return a.new_empty(call.out_shape(), dtype=call.out_dtype)


def _setup_context(ctx, inputs, output):
    a, b, offs, masked_m, _, ctx.backend = inputs
    ctx.save_for_backward(a, b, offs, masked_m)


def _backward(ctx, grad):
    a, b, offs, masked_m = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad = grad.to(a.dtype)  # an fp32 out_dtype's gradient, in the inputs' precision
    op = lambda x, y: _grouped_mm_op(x, y, offs, masked_m, None, ctx.backend)  # same groups
    batch = lambda x, y: _grouped_mm_op(x, y, None, masked_m, None, ctx.backend)
    grad_a = grad_b = None
    if a.dim() == 3 and b.dim() == 2:  # out[:, cols g] = a[g] @ b[:, cols g]
        # dgrad: groups along K = the columns, on a column-major dy and a row-major bᵀ (copied
        # when not so): the layouts the K-grouped Triton kernel is built for, and those
        # torch._grouped_mm's CUDA kernels take for any group sizes (along a unit-stride K they
        # must be multiples of 16 bytes)
        if need_a:
            grad_a = op(grad.t().contiguous().t(), b.t().contiguous())
        if need_b:
            grad_b = op(a.transpose(1, 2), grad)
    elif a.dim() == 3:  # out[g, :n_g] = a[g, :n_g] @ b[g]; groups of P = a.shape[1] rows
        if need_a:
            grad_a = batch(grad, b.transpose(1, 2))
        if need_b:
            grad_b = op(a.reshape(-1, a.shape[2]).t(), grad.reshape(-1, grad.shape[2]))
    elif b.dim() == 3:  # out[rows g] = a[rows g] @ b[g]
        if need_a:
            grad_a = op(grad, b.transpose(1, 2))
        if need_b:
            grad_b = op(a.t(), grad)
    elif offs is not None:  # out[g] = a[:, K_g] @ b[K_g]
        if need_a:
            grad_a = op(b, grad.transpose(1, 2)).t()
        if need_b:
            grad_b = op(a.t(), grad)
    else:  # the same with K_g = g*P : g*P + n_g, batched over the groups
        groups, size = masked_m.shape[0], a.shape[1] // masked_m.shape[0]
        if need_a:
            grad_a = batch(b.reshape(groups, size, b.shape[1]), grad.transpose(1, 2))
            grad_a = grad_a.reshape(-1, a.shape[0]).t()
        if need_b:
            grad_b = batch(a.t().reshape(groups, size, a.shape[0]), grad).reshape(-1, b.shape[1])
    return grad_a, grad_b, None, None, None, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, *,
               masked_m: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               backend: str | None = None) -> torch.Tensor:
    """One matmul per group, the ``torch._grouped_mm`` contract; the same as::

        start = 0
        for g, end in enumerate(offs.tolist()):      # int32 cumulative group ends
            if b.dim() == 3:                          # a [T, K] x b [E, K, N] -> [T, N]
                out[start:end] = a[start:end] @ b[g]  # rows past offs[-1] are zeros
            elif a.dim() == 2:                        # a [M, K] x b [K, N] -> [E, M, N]
                out[g] = a[:, start:end] @ b[start:end]
            else:                                     # a [E, M, K] x b [K, N] -> [M, N]
                out[:, start:end] = a[g] @ b[:, start:end]  # columns past offs[-1]: zeros
            start = end

    The 3-D form is an MoE layer's forward and input gradient (tokens sorted by expert,
    ``offs = tokens_per_expert.cumsum(0)``); the 2-D form, groups along K, its weight
    gradient (``grouped_mm(x.t(), dy, offs)``). Empty groups are fine.

    ``masked_m`` (int32 ``[E]``, in place of ``offs``; DeepGEMM's masked layout, what
    ``moe_dispatch(..., max_tokens_per_rank=)`` returns): the groups are equal blocks, and
    only the first ``masked_m[g]`` rows (or K) of block g count::

        # a [E, P, K] x b [E, K, N] -> [E, P, N] (batched; without masked_m: torch.bmm)
        out[g, :n] = a[g, :n] @ b[g];  out[g, n:] = 0            # n = masked_m[g] <= P
        # a [M, E*P] x b [E*P, N] -> [E, M, N] (groups along K, its weight gradient)
        out[g] = a[:, g*P : g*P + n] @ b[g*P : g*P + n]

    Nothing is read on the host, so a padded MoE layer can be captured in a CUDA graph, and
    the tiles past each count are not multiplied (the padding's rows are only zeroed).

    fp32, fp16 or bf16, any strides; differentiable in ``a`` and ``b``. ``out_dtype``:
    ``torch.float32`` gives 16-bit inputs' products unrounded (the accumulation is fp32
    either way); None: ``a``'s dtype.
    Backends: ``triton`` (one persistent launch over every group's tiles, reading ``offs``
    / ``masked_m`` on the device: no host sync), ``reference`` and ``torch``
    (``torch._grouped_mm`` where it takes the call; with ``masked_m``, ``torch.bmm`` of the
    whole blocks). Bad values raise on CPU;
    on CUDA they trip a device-side assert (checking on the host would sync). Under
    ``torch.autocast``, a and b are cast to its dtype first, as ``torch.matmul``'s inputs are.
    """
    a, b = autocast_inputs(a, b)
    if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 3
            and b.dim() == 3 and offs is None and masked_m is None):
        masked_m = torch.full((a.shape[0],), a.shape[1], dtype=torch.int32, device=a.device)
    with autocast_off(a):
        return _grouped_mm_op(a, b, offs, masked_m, out_dtype, backend or "")


register(DISPATCHER, (grouped_mm,), checks="fusedpar.testing.grouped_mm_cases", example=lambda device: GroupedCall(
    torch.zeros(2 * EXAMPLE_WORLD, 8, device=device), torch.zeros(2, 8, 4, device=device),
    torch.tensor([4, 8], dtype=torch.int32, device=device)))
