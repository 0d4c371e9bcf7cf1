"""``fusedpar.ops.all_gather_scaled_matmul`` and ``fusedpar.ops.scaled_matmul_reduce_scatter``:
the fp8 forms of all_gather_matmul / matmul_reduce_scatter, with torch's
``symm_mem.fused_all_gather_scaled_matmul`` / ``fused_scaled_matmul_reduce_scatter``
contracts (scales are ``torch._scaled_mm``'s: fp8 value x scale = real value).

Scale layouts. A: tensorwise (one element), rowwise (``A.shape[:-1] + (1,)``; for the
all-gather either the shard's rows, gathered with A, or the gathered A's rows) ; each B
``[K, N]``: tensorwise or per column ``[1, N]``. A tensorwise scale of an all-gathered A
must be the same on every rank (it scales the whole gathered A). gloo has no float8 dtype:
fp8 travels as its bytes (``uint8``). The fp8 operands are not differentiable: training goes
through ``fusedpar.nn.float8_linear``, which quantizes high-precision tensors with torchao's
recipes and whose backward runs these two ops the other way round.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm import counters, get_buffer, get_loopback_buffers, group_name, resolve_group, symmetric
from ..kernels import gemm_peers
from . import protocol
from .all_gather_matmul import Gather, shard_rows, symm_mem_reasons, unflattener
from .backend import Backend, Dispatcher, Plans
from .calls import MatmulCall, check_matmul_inputs, check_scatter
from .matmul_reduce_scatter import ScatterViews, chunk_layout
from .float8_scales import FP8_DTYPES, check_fp8, col_major, fp8_tensor_core_reasons, scaled_mm
from .registry import register
from .scaled_grouped_mm import scaled_grouped_mm

AG = "all_gather_scaled_matmul"
RS = "scaled_matmul_reduce_scatter"
AG_SCHEMA = ("(Tensor A_shard, Tensor[] Bs, Tensor A_scale, Tensor[] B_scales, int gather_dim, "
             "str group_name, *, ScalarType[] out_dtypes, bool return_A=True, "
             "bool use_fast_accum=False, str backend=\"\") -> (Tensor?, Tensor[])")
RS_SCHEMA = ("(Tensor A, Tensor B, Tensor A_scale, Tensor B_scale, str reduce_op, int scatter_dim, "
             "str group_name, *, ScalarType out_dtype, bool use_fast_accum=False, "
             "str backend=\"\") -> Tensor")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_OUT_DTYPE = torch.bfloat16
#: torch 2.11 (the GPU image's; not 2.14) hands a custom op's ``ScalarType[]`` argument over as
#: c10::ScalarType codes (ints, those ``prim::dtype`` returns), not as dtypes
_SCALAR_TYPE_CODES = {torch.ops.prim.dtype(torch.empty(0, dtype=d)): d for d in OUT_DTYPES}


def _as_dtypes(out_dtypes) -> list:
    return [_SCALAR_TYPE_CODES.get(d, d) if isinstance(d, int) else d for d in out_dtypes]


# A's scale layouts
TENSORWISE, ROWWISE, ROWWISE_SHARD, ROWWISE_GATHERED = "tensorwise", "rowwise", "rowwise_shard", \
    "rowwise_gathered"


class ScaledCall(MatmulCall):
    """A call of a scaled op: a MatmulCall (``x`` = fp8 A, ``bs`` = fp8 Bs) plus the scales
    (``a_mode``: A's scale layout), one output dtype per B and the accumulation flag."""

    def __init__(self, op, a, dim, world_size, group, bs, a_scale, b_scales, out_dtypes,
                 use_fast_accum=False, return_a=True, reduce_op="", a_mode=TENSORWISE):
        super().__init__(op, a, dim, world_size, group, bs, return_a, reduce_op)
        self.a_scale, self.b_scales = a_scale, list(b_scales)
        self.out_dtypes, self.use_fast_accum, self.a_mode = list(out_dtypes), use_fast_accum, a_mode

    def cache_key(self) -> tuple:
        """What the backends' reasons read beyond the group, device and dtype (the
        dispatcher caches its choice by this)."""
        words = self.x.shape[-1] % 4 == 0  # rows of whole int32 words (AgTriton)
        return super().cache_key() + (self.a_mode, self.last_dim, self.x.dim() == 2 and self.dim == 0,
                                      torch.float16 in self.out_dtypes, words,
                                      tuple(s.numel() > 1 for s in self.b_scales))

    def maker(self):
        op, dim, world, group, return_a, reduce_op = (self.op, self.dim, self.world_size, self.group,
                                                      self.return_a, self.reduce_op)
        out_dtypes, fast, mode = self.out_dtypes, self.use_fast_accum, self.a_mode
        return lambda a, bs, a_scale, b_scales: ScaledCall(op, a, dim, world, group, bs, a_scale, b_scales,
                                                           out_dtypes, fast, return_a, reduce_op, mode)

    def fingerprint(self) -> int:
        return symmetric.fingerprint(super().fingerprint(), self.a_mode, tuple(self.a_scale.shape),
                                     [tuple(s.shape) for s in self.b_scales], self.out_dtypes)

    def describe(self) -> str:
        return (f"{super().describe()}, A_scale {self.a_mode} {tuple(self.a_scale.shape)}, "
                f"B_scales {[tuple(s.shape) for s in self.b_scales]}, out dtypes "
                f"{[str(d).replace('torch.', '') for d in self.out_dtypes]}")


# ---- checks ---------------------------------------------------------------------------


def _check_scale(op: str, name: str, s) -> None:
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        got = s.dtype if isinstance(s, torch.Tensor) else type(s).__name__
        raise TypeError(f"fusedpar.{op}: {name} is {got}; scales are float32 tensors "
                        "(torch._scaled_mm's scale_a / scale_b)")


def _check_operands(op: str, a, bs, a_scale, b_scales, dim: int, dim_name: str, out_dtypes) -> int:
    """fp8 A and Bs, float32 scales of known layouts, K a multiple of 16 on CUDA; returns
    ``dim`` made non-negative."""
    check_fp8(op, "A", a)
    for i, b in enumerate(bs):
        check_fp8(op, f"Bs[{i}]" if op == AG else "B", b)
    dim = check_matmul_inputs(op, a, bs, dim, dim_name, dtypes=FP8_DTYPES, k=None) \
        if all(b.dtype == a.dtype for b in bs) else _check_mixed(op, a, bs, dim, dim_name)
    _check_scale(op, "A_scale", a_scale)
    if len(b_scales) != len(bs):
        raise ValueError(f"fusedpar.{op}: {len(bs)} B(s) but {len(b_scales)} B scale(s); pass one "
                         "scale per B")
    for i, (b, s) in enumerate(zip(bs, b_scales)):
        name = f"B_scales[{i}]" if op == AG else "B_scale"
        _check_scale(op, name, s)
        if s.numel() != 1 and tuple(s.shape) != (1, b.shape[1]):
            raise ValueError(f"fusedpar.{op}: {name} has shape {tuple(s.shape)}; a B of shape "
                             f"{tuple(b.shape)} takes one element (tensorwise) or shape "
                             f"(1, {b.shape[1]}) (one per column)")
    if len(out_dtypes) != len(bs):
        raise ValueError(f"fusedpar.{op}: out_dtypes has {len(out_dtypes)} entries for {len(bs)} Bs")
    for d in out_dtypes:
        if d not in OUT_DTYPES:
            raise TypeError(f"fusedpar.{op}: out dtype {d}; supported: bfloat16, float16, float32")
    if a.is_cuda:  # cuBLAS's fp8 GEMM: 16-byte aligned K and N
        k = a.shape[-1]
        for i, b in enumerate(bs):
            if k % 16 or b.shape[1] % 16:
                raise ValueError(f"fusedpar.{op}: torch._scaled_mm on CUDA needs K and N multiples of "
                                 f"16, got K={k}, N={b.shape[1]} (B{i}); pad A's last dim and B "
                                 "with zeros to the next multiple of 16")
    return dim


def _check_mixed(op, a, bs, dim, dim_name) -> int:
    """``check_matmul_inputs`` for e4m3 x e5m2 operands (it wants one dtype): check with A's."""
    return check_matmul_inputs(op, a, [b.view(a.dtype) for b in bs], dim, dim_name, dtypes=FP8_DTYPES)


def _a_mode_gather(a, s, dim: int, world: int) -> str:
    """A_shard's scale layout, as torch's ``_check_and_verify_fp8_all_gather_scale_mode``
    reads it (a rowwise shape wins over one element when both fit)."""
    rows = tuple(a.shape[:-1])
    if tuple(s.shape) == rows + (1,):
        return ROWWISE_SHARD
    if s.numel() == 1:
        return TENSORWISE
    gathered = list(rows)
    gathered[dim] *= world
    if tuple(s.shape) == tuple(gathered) + (1,):
        return ROWWISE_GATHERED
    raise ValueError(f"fusedpar.{AG}: A_scale has shape {tuple(s.shape)}; for A_shard of shape "
                     f"{tuple(a.shape)} gathered along dim {dim} over {world} ranks pass one "
                     f"element (tensorwise), {rows + (1,)} (the shard's rows) or "
                     f"{tuple(gathered) + (1,)} (the gathered A's rows)")


def _a_mode_rows(op: str, a, s) -> str:
    if s.numel() == 1:
        return TENSORWISE
    if tuple(s.shape) == tuple(a.shape[:-1]) + (1,):
        return ROWWISE
    raise ValueError(f"fusedpar.{op}: A_scale has shape {tuple(s.shape)}; for A of shape "
                     f"{tuple(a.shape)} pass one element (tensorwise) or {tuple(a.shape[:-1]) + (1,)}"
                     " (one per row)")


# ---- the backends ---------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as uint8 (what gloo moves for fp8), flat."""
    return t.contiguous().view(-1).view(torch.uint8)


def gather_rows(rows: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``[m, K]`` ``rows`` (any dtype, fp8 included) stacked in rank order,
    ``[W * m, K]``: ``dist.all_gather_single`` on their bytes (gloo has no float8)."""
    world = dist.get_world_size(group)
    out = torch.empty(world * rows.numel() * rows.element_size(), dtype=torch.uint8, device=rows.device)
    protocol.all_gather_single(out, _bytes(rows), group)
    return out.view(rows.dtype).view(world * rows.shape[0], rows.shape[1])


def _scale_rows(call: ScaledCall, gathered_scale: torch.Tensor | None) -> torch.Tensor:
    """A's scale for the gathered rows' GEMM: one element, or ``[W * rows, 1]`` in gathered order."""
    if call.a_mode == TENSORWISE:
        return call.a_scale
    if call.a_mode == ROWWISE_GATHERED:  # given for the gathered A: its rows in gathered order
        return call.a_scale.movedim(call.dim, 0).reshape(-1, 1)
    return gathered_scale


def _ag_moved(call: ScaledCall) -> int:
    """Bytes a rank receives: the W-1 peer shards' fp8 bytes, plus their row scales when
    they travel with A (``rowwise_shard``)."""
    per_rank = call.x.numel() * call.x.element_size()
    if call.a_mode == ROWWISE_SHARD:
        per_rank += call.a_scale.numel() * 4
    return (call.world_size - 1) * per_rank


def _ag_results(call: ScaledCall, gathered: torch.Tensor, outs: list[torch.Tensor]):
    """Rows in gathered order (the gathered dim first) back to the caller's layout."""
    world = call.world_size
    back = [call.unflatten(o, world) for o in outs]
    return (call.unflatten(gathered, world) if call.return_a else None), back


class AgReference(Backend):
    """All-gather A's bytes (and its row scales when they are the shard's), then one
    ``torch._scaled_mm`` per B on the gathered rows."""

    name = "reference"

    def run(self, call: ScaledCall):
        protocol.raise_on_mismatch(call)
        rows = call.rows()
        gathered = gather_rows(rows, call.group)
        scale = None
        if call.a_mode == ROWWISE_SHARD:
            scale = gather_rows(call.a_scale.movedim(call.dim, 0).reshape(-1, 1), call.group)
        a_scale = _scale_rows(call, scale)
        counters.record(AG, self.name, _ag_moved(call))
        outs = [scaled_mm(gathered, b, a_scale, s, d, call.use_fast_accum)
                for b, s, d in zip(call.bs, call.b_scales, call.out_dtypes)]
        return _ag_results(call, gathered, outs)


class AgPipelined(Backend):
    """W steps around a ring, own shard first: the shard received at step s (its fp8 bytes
    and, rowwise, its float32 row scales in one message) travels on at step s+1 while the
    ``_scaled_mm`` of step s runs on it, writing its rows of each output."""

    name = "pipelined"

    def run(self, call: ScaledCall):
        group, world = call.group, call.world_size
        rank, left, right = protocol.ring_neighbours(group)
        protocol.raise_on_mismatch(call)
        a = call.rows().contiguous()
        m, k = a.shape
        with_scale = call.a_mode == ROWWISE_SHARD
        width = m * k + (4 * m if with_scale else 0)  # bytes of one shard's message
        messages = torch.empty(world, width, dtype=torch.uint8, device=a.device)
        messages[rank, :m * k] = _bytes(a)
        if with_scale:
            messages[rank, m * k:] = _bytes(call.a_scale.movedim(call.dim, 0).reshape(-1))
        gathered_scale = _scale_rows(call, None)
        outs = [torch.empty(world * m, b.shape[1], dtype=d, device=a.device)
                for b, d in zip(call.bs, call.out_dtypes)]
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                requests = protocol.exchange(messages[src], messages[(src - 1) % world], left, right, group)
            shard = messages[src, :m * k].view(a.dtype).view(m, k)
            if with_scale:
                scale = messages[src, m * k:].view(torch.float32).view(m, 1)
            elif call.a_mode == ROWWISE_GATHERED:
                scale = gathered_scale[src * m:(src + 1) * m]
            else:
                scale = gathered_scale
            for out, b, s, d in zip(outs, call.bs, call.b_scales, call.out_dtypes):
                out[src * m:(src + 1) * m] = scaled_mm(shard, b, scale, s, d, call.use_fast_accum)
            if step < world - 1:
                for request in requests:
                    request.wait()
        counters.record(AG, self.name, _ag_moved(call))
        gathered = messages[:, :m * k].view(a.dtype).reshape(world * m, k)  # a copy when scales travel
        return _ag_results(call, gathered, outs)


def _one_granularity(call: ScaledCall) -> list[str]:
    """torch's fused ops hand the scales to ``_scaled_mm`` as they are: both tensorwise or
    both rowwise."""
    a_rowwise = call.a_mode != TENSORWISE
    if any((s.numel() > 1) != a_rowwise for s in call.b_scales):
        return ["torch's fused scaled ops take A and B scales of one granularity (both tensorwise "
                "or both rowwise); expand the tensorwise one, or use another backend"]
    return []


class AgSymmMem(Backend):
    """torch's ``torch.ops.symm_mem.fused_all_gather_scaled_matmul`` (forward only)."""

    name = "symm_mem"

    def not_supported_reasons(self, call):
        return symm_mem_reasons(call, "fused_all_gather_scaled_matmul") + _one_granularity(call)

    def run(self, call: ScaledCall):
        n = len(call.bs)
        gathered, outs = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
            call.x, [col_major(b) for b in call.bs], call.a_scale, call.b_scales, call.dim,
            call.group.group_name,
            [None] * n, [None] * n, call.out_dtypes, [call.use_fast_accum] * n)
        return gathered.contiguous() if call.return_a else None, [o.contiguous() for o in outs]


def triton_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``scaled_mm`` on fusedpar's Triton fp8 GEMM: ``scaled_grouped_mm``'s persistent kernel
    with one group (fp8 ``tl.dot``, fp32 accumulation, ``acc * a_scale[row] * b_scale[col]``
    in the epilogue); tensorwise scales are expanded to rows / columns."""
    m, n = a.shape[0], b.shape[1]
    sa = a_scale.reshape(-1).expand(m) if a_scale.numel() == 1 else a_scale.reshape(-1)
    sb = b_scale.reshape(1, -1).expand(1, n)
    offs = torch.full((1,), m, dtype=torch.int32, device=a.device)
    return scaled_grouped_mm(a, b.unsqueeze(0), sa.contiguous(), sb.contiguous(), offs, out_dtype=out_dtype,
                             backend="triton")


def _triton_reasons(call: ScaledCall) -> list[str]:
    """Why the triton backends cannot run ``call``: no Triton here or no symmetric memory for
    its group, a GPU without fp8 tensor cores (sm_80: refused rather than emulated), an fp16
    output of the all-gather (its GEMM stores bf16 or fp32; the reduce-scatter's stores float32
    partials and rounds their sums to any output dtype)."""
    reasons = protocol.triton_reasons(call)  # Triton here; symmetric memory for the group's collective
    if not reasons:
        reasons = fp8_tensor_core_reasons(call.x, ": use the pipelined or reference backend")
    if call.op == AG and torch.float16 in call.out_dtypes:
        reasons.append("the Triton fp8 GEMM stores bfloat16 or float32, not float16")
    return reasons


def _staged_bytes(call: ScaledCall) -> int:
    """The bytes of a staged row (``_staged_rows``): K, plus 4 when the scales travel."""
    return call.x.shape[-1] + (4 if call.a_mode == ROWWISE_SHARD else 0)


def _staged_rows(rows: torch.Tensor, shard_scale: torch.Tensor | None) -> torch.Tensor:
    """What a rank stages (``ScaledGather``): its A rows' fp8 bytes, each row followed by its
    float32 scale's 4 bytes when the scales travel (``shard_scale``: the shard's, one per
    row), as int32 words ``[m, (K + 4) / 4]`` (``[m, K / 4]`` without)."""
    rows = rows.view(torch.uint8)
    if shard_scale is not None:
        rows = torch.cat([rows, shard_scale.reshape(-1, 1).view(torch.uint8)], dim=1)
    return rows.view(torch.int32)


def _stride(scale: torch.Tensor) -> int:
    """A flat scale's stride for the GEMM's epilogue: 0 repeats a tensorwise one."""
    return scale.stride(0) if scale.numel() > 1 else 0


class ScaledGather(Gather):
    """all_gather_matmul's gather (``Gather``: stage, per-source copies and flags, the peers
    kernel multiplying each shard's rows as they land) of fp8 rows: the staged rows are int32
    words of the fp8 bytes and, ``rowwise_shard``, each row's float32 scale after them
    (``_staged_rows``), so a scale lands with its row; the peers kernel reads A from those
    bytes (pointer loads with a row stride of K + 4 bytes when scales travel, TMA otherwise)
    and multiplies each output tile by its rows' and columns' scales in its epilogue
    (``SCALED``). ``operands``: ``(Bs, A's row scales or None, B_scales)``; the row scales
    are A_scale (tensorwise) or the gathered rows' (``rowwise_gathered``), None when they
    travel."""

    def __init__(self, call: ScaledCall, bufs, copy_engine: bool):
        self.fp8, self.k_bytes = call.x.dtype, call.x.shape[-1]
        self.with_scale = call.a_mode == ROWWISE_SHARD
        super().__init__(call, bufs, copy_engine, staged=(torch.int32, _staged_bytes(call) // 4))
        self.out_dtypes = list(call.out_dtypes)

    def a(self, staged: torch.Tensor) -> torch.Tensor:
        """The fp8 A ``[rows, K]`` in staged rows (a strided view when scales travel)."""
        return staged.view(torch.uint8)[:, :self.k_bytes].view(self.fp8)

    def gathered(self, staged: torch.Tensor) -> torch.Tensor:
        """The returned A_gathered: a contiguous copy when scales travel."""
        a = self.a(staged)
        return a.contiguous() if self.with_scale else a

    def _row_scales(self, a_all: torch.Tensor, a_scale) -> torch.Tensor:
        """A's scale for the gathered rows: ``[rows]`` (strided when they travel) or one element."""
        if self.with_scale:
            return a_all.view(torch.uint8)[:, self.k_bytes:].view(torch.float32)[:, 0]
        return a_scale.reshape(-1)

    def _launch(self, call: ScaledCall):
        return gemm_peers.GatherLaunch(self.a(self.views[0].region), call.bs[0], self.views[0].run_rows,
                                       scaled=True)

    def _gemm(self, view, a_all, g, operands, out) -> None:
        bs, a_scale, b_scales = operands
        sa, sb = self._row_scales(a_all, a_scale), b_scales[0].reshape(-1)
        self.gemm(self.a(a_all), bs[0], out, view.blocks, view.runs, view.run_rows, view.pad_table,
                  view.rank, self.world, self.timeout_ns, gathered=None if g is None else g.view(self.fp8),
                  scales=(sa, _stride(sa), sb, _stride(sb)))

    def _rest(self, a_all, operands) -> list:
        bs, a_scale, b_scales = operands
        a, sa = self.a(a_all).contiguous(), self._row_scales(a_all, a_scale)
        return [triton_gemm(a, b, sa, s, d) for b, s, d in zip(bs[1:], b_scales[1:], self.out_dtypes[1:])]


class AgTriton(Backend):
    """The bf16 all_gather_matmul's overlapped gather (``ScaledGather``): every rank stages
    its shard's fp8 rows (with their float32 scales when they are the shard's, as extra bytes
    of each row) in its symmetric buffer and raises READY; each peer's rows are copied into
    the local gathered rows (copy engine on a GPU in a group), raising a per-source flag,
    while one persistent Triton fp8 GEMM (``gemm_peers``' peers kernel, ``SCALED``: fp8
    ``tl.dot``, fp32 accumulation, ``acc * a_scale[row] * b_scale[col]`` in its epilogue)
    multiplies each shard's rows as soon as its flag is up, own shard first. Further Bs: the
    Triton fp8 GEMM (``triton_gemm``) on the gathered A. One plan per signature
    (``AG_PLANS``); a call can be captured in a CUDA graph as the bf16 op's can."""

    name = "triton"

    def not_supported_reasons(self, call):
        reasons = _triton_reasons(call)
        if call.x.shape[-1] % 4:
            reasons.append(f"A's rows of {call.x.shape[-1]} fp8 bytes travel as int32 words: make K "
                           "a multiple of 4")
        return reasons

    def run(self, call: ScaledCall):
        return self.plan(call)(call.x, call.bs, call.a_scale, call.b_scales)

    def plan(self, call: ScaledCall):
        a, world, dim, mode = call.rows(), call.world_size, call.dim, call.a_mode
        buf = get_buffer(call.group, world * a.shape[0] * _staged_bytes(call), a.device)
        gather = ScaledGather(call, [buf], copy_engine=a.is_cuda and world > 1)
        unflatten = unflattener(call)

        def run(A, Bs, A_scale, B_scales):
            staged, a_scale = _ag_staged(A, A_scale, dim, mode)
            g, outs = gather.run_one(staged, (Bs, a_scale, B_scales))
            return (None if g is None else unflatten(gather.gathered(g))), [unflatten(o) for o in outs]

        return run


def _ag_staged(A, A_scale, dim: int, mode: str):
    """A rank's staged rows (``_staged_rows``) and A's scale for the GEMM's epilogue (None
    when it travels with the rows)."""
    rows = shard_rows(A, dim)
    if mode == ROWWISE_SHARD:
        return _staged_rows(rows, shard_rows(A_scale, dim)), None
    return _staged_rows(rows, None), (shard_rows(A_scale, dim) if mode == ROWWISE_GATHERED else A_scale)


AG_DISPATCHER = Dispatcher(AG, [AgTriton(), AgPipelined(), AgReference(), AgSymmMem()])  # vendor's last


def _rs_out_shape(call: ScaledCall) -> list[int]:
    shape = list(call.x.shape[:-1]) + [call.bs[0].shape[1]]
    shape[call.dim] //= call.world_size
    return shape


def _rs_partial(call: ScaledCall, a_rows: torch.Tensor, a_scale_rows: torch.Tensor) -> torch.Tensor:
    """This rank's float32 partial product of ``a_rows`` (``[rows, K]``, its scale per row or one)."""
    return scaled_mm(a_rows, call.bs[0], a_scale_rows, call.b_scales[0], torch.float32,
                     call.use_fast_accum)


def _rs_rows(call: ScaledCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A as [rows, K], its scale: one element or [rows, 1])``, the scattered dim first
    (scattering the output's columns: A's rows as they are)."""
    dim = 0 if call.last_dim else call.dim
    a = call.x.movedim(dim, 0).flatten(0, -2).contiguous()
    if call.a_mode == TENSORWISE:
        return a, call.a_scale
    return a, call.a_scale.movedim(dim, 0).reshape(-1, 1)


def _rs_finish(call: ScaledCall, total: torch.Tensor) -> torch.Tensor:
    """This rank's reduced float32 chunk (scattered dim first, ``[rows / W, N]``; scattering
    the output's columns: ``[rows, N / W]``): averaged if asked, rounded once to the output
    dtype, in the caller's layout."""
    if call.reduce_op == "avg":
        total = total / call.world_size
    out = total.to(call.out_dtypes[0])
    if call.last_dim:
        return out.reshape(*call.x.shape[:-1], -1).contiguous()
    shape = _rs_out_shape(call)
    lead = [shape[call.dim]] + [s for i, s in enumerate(shape[:-1]) if i != call.dim]
    return out.view(*lead, shape[-1]).movedim(0, call.dim).contiguous()


def _rs_moved(call: ScaledCall) -> int:
    """The W-1 peer float32 partials of this rank's output chunk."""
    return (call.world_size - 1) * math.prod(_rs_out_shape(call)) * 4


class RsReference(Backend):
    """One ``torch._scaled_mm`` into float32, ``dist.reduce_scatter_single`` of it (float32
    sums), then one rounding to the output dtype. Scattering the output's last dim (N's
    columns): the product's columns are moved first."""

    name = "reference"

    def run(self, call: ScaledCall):
        protocol.raise_on_mismatch(call)
        world = call.world_size
        product = _rs_partial(call, *_rs_rows(call))  # [rows, N]
        if call.last_dim:
            product = product.t()  # the scattered dim (N) first
        product = product.contiguous()
        out = torch.empty(product.shape[0] // world, product.shape[1], dtype=torch.float32,
                          device=product.device)
        protocol.reduce_scatter_single(out.view(-1), product.view(-1), call.group)
        counters.record(RS, self.name, _rs_moved(call))
        return _rs_finish(call, out.t() if call.last_dim else out)


class RsPipelined(Backend):
    """A ring reduce-scatter of the W chunks of the float32 product (row chunks; scattering
    the output's last dim, column chunks: A times B's columns of the chunk): at step s a rank
    computes the partial of chunk ``(rank - s - 1) % W`` while the running float32 sum of the
    previous chunk travels to its right neighbour; the own chunk comes last and is rounded
    once."""

    name = "pipelined"

    def run(self, call: ScaledCall):
        group, world = call.group, call.world_size
        rank, left, right = protocol.ring_neighbours(group)
        protocol.raise_on_mismatch(call)
        rows, scales = _rs_rows(call)
        if call.last_dim:
            b, b_scale = call.bs[0], call.b_scales[0]
            cols = b.shape[1] // world

            def partial(c):
                part = slice(c * cols, (c + 1) * cols)
                return scaled_mm(rows, b[:, part], scales, b_scale if b_scale.numel() == 1 else
                                 b_scale[:, part], torch.float32, call.use_fast_accum)
        else:
            chunks = rows.unflatten(0, (world, -1))
            scale_chunks = scales.unflatten(0, (world, -1)) if call.a_mode != TENSORWISE else None

            def partial(c):
                return _rs_partial(call, chunks[c], scales if scale_chunks is None else scale_chunks[c])

        acc = partial((rank - 1) % world)
        incoming = torch.empty_like(acc)
        for step in range(1, world):
            requests = protocol.exchange(acc, incoming, left, right, group)
            nxt = partial((rank - step - 1) % world)
            for request in requests:
                request.wait()
            acc = nxt + incoming
        counters.record(RS, self.name, _rs_moved(call))
        return _rs_finish(call, acc)


class RsSymmMem(Backend):
    """torch's ``torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter`` (forward only) into
    float32, rounded once here (torch's own rounds each partial to the output dtype first).
    2-D A, a leading scatter dim."""

    name = "symm_mem"

    def not_supported_reasons(self, call):
        reasons = symm_mem_reasons(call, "fused_scaled_matmul_reduce_scatter") + _one_granularity(call)
        if call.x.dim() != 2 or call.dim != 0:
            reasons.append("torch's fused_scaled_matmul_reduce_scatter is called here for a 2-D A "
                           "scattered along dim 0 only")
        return reasons

    def run(self, call: ScaledCall):
        a, b = call.x, col_major(call.bs[0])
        total = torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
            a, b, call.a_scale, call.b_scales[0], call.reduce_op, 0, 0, call.group.group_name,
            [a.shape[0], b.shape[1]], out_dtype=torch.float32, use_fast_accum=call.use_fast_accum)
        return total.to(call.out_dtypes[0]).contiguous()


class RsTriton(Backend):
    """The bf16 matmul_reduce_scatter's overlapped protocol (``ScatterViews``, ``SCALED``):
    one persistent Triton fp8 GEMM (fp8 ``tl.dot``, fp32 accumulation, ``acc * a_scale[row]
    * b_scale[col]`` in its epilogue) writes float32 partials into this rank's symmetric
    buffer, chunks in rank-rotated order (own chunk last), and the tile that completes a
    chunk raises READY in that chunk owner's pad; each rank sums its chunk's W partials in
    float32, in rank order, as they arrive (in a group on a GPU: copied on a side stream
    while the GEMMs run, then ``reduce_chunks``), and rounds once to the output dtype.
    Scattering the output's last dim (N's columns): the same on ``Bᵀ @ Aᵀ`` scattered along
    its rows (B's column scales become the row scales), transposed back. One plan per
    signature (``RS_PLANS``); a call can be captured in a CUDA graph as the bf16 op's can."""

    name = "triton"

    def not_supported_reasons(self, call):
        return _triton_reasons(call)

    def run(self, call: ScaledCall):
        return self.plan(call)(call.x, call.bs, call.a_scale, call.b_scales)

    def plan(self, call: ScaledCall):
        operands, finish = _fused_operands(call), _fused_finish(call)
        a, b, _ = operands(call.x, call.bs[0], call.a_scale, call.b_scales[0])
        buf = get_buffer(call.group, a.shape[0] * b.shape[1] * 4, a.device)
        views = ScatterViews(call, a, b, [buf], side_stream=a.is_cuda and call.world_size > 1,  # W=1 copies nothing
                             scaled=True, out_dtype=call.out_dtypes[0])

        def run(A, Bs, A_scale, B_scales):
            a, b, scales = operands(A, Bs[0], A_scale, B_scales[0])
            return finish(views.run([a], [b], [scales])[0])

        return run


def _fused_operands(call: ScaledCall):
    """For every call of ``call``'s signature: ``(A, B, A_scale, B_scale) -> (a, b, scales)``,
    the fused GEMM's operands (``ScatterViews``): ``a [rows, K]`` with the scattered dim
    first, ``b = B`` and ``scales = (sa, stride_sa, sb, stride_sb)``: A's row scales (one a
    row, contiguous) and B's column scales (``[1, N]``) as they are, their strides fixed by
    the signature (0: tensorwise); scattering the output's columns, ``a = Bᵀ`` (a row-major
    copy: TMA's layout), ``b = Aᵀ`` (a view) and the scales swapped."""
    dim, a_rowwise = call.dim, call.a_scale.numel() > 1
    stride_a = 1 if a_rowwise else 0
    stride_b = call.b_scales[0].stride(-1) if call.b_scales[0].numel() > 1 else 0
    if call.last_dim:
        dense = call.a_scale.is_contiguous()  # A's row scales in row order

        def operands(A, B, A_scale, B_scale):
            return (B.t().contiguous(), A.flatten(0, -2).t(),
                    (B_scale, stride_b, A_scale if dense else A_scale.contiguous(), stride_a))
    else:
        def operands(A, B, A_scale, B_scale):
            return (shard_rows(A, dim), B,
                    (shard_rows(A_scale, dim) if a_rowwise else A_scale, stride_a, B_scale, stride_b))
    return operands


def _fused_finish(call: ScaledCall):
    """For every call of ``call``'s signature: this rank's reduced chunk as ``ScatterViews``
    gives it (the output dtype, ``[rows / W, N]``; scattering the columns ``[N / W, rows]``)
    in the caller's layout."""
    if call.last_dim:
        lead = tuple(call.x.shape[:-1])
        return lambda out: out.t().reshape(*lead, out.shape[0]).contiguous()
    return chunk_layout(call)


RS_DISPATCHER = Dispatcher(RS, [RsTriton(), RsPipelined(), RsReference(), RsSymmMem()])  # vendor's last


# ---- the custom ops -------------------------------------------------------------------


def _ag_call(A_shard, Bs, A_scale, B_scales, gather_dim, world, group, out_dtypes, return_A,
             use_fast_accum) -> ScaledCall:
    out_dtypes = _as_dtypes(out_dtypes)
    if isinstance(A_shard, torch.Tensor) and A_shard.dim() > 0 and gather_dim in (-1, A_shard.dim() - 1):
        raise ValueError(f"fusedpar.{AG}: gather_dim={gather_dim} is A's last dim (K): each shard's "
                         "scales cover its own K only; gather a leading dim (or all-gather A and "
                         "call torch._scaled_mm)")
    dim = _check_operands(AG, A_shard, Bs, A_scale, B_scales, gather_dim, "gather_dim", out_dtypes)
    mode = _a_mode_gather(A_shard, A_scale, dim, world)
    return ScaledCall(AG, A_shard, dim, world, group, Bs, A_scale, B_scales, out_dtypes,
                      use_fast_accum, return_A, a_mode=mode)


AG_PLANS = Plans(AG)


def _signature(*tensors) -> tuple:
    """The plan key's part from tensors: shapes, strides, dtypes, devices."""
    return tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)


@torch.library.custom_op(f"fusedpar::{AG}", mutates_args=(), schema=AG_SCHEMA)
def _ag_op(A_shard, Bs, A_scale, B_scales, gather_dim, group_name, *, out_dtypes, return_A=True,
           use_fast_accum=False, backend=""):
    key = (_signature(A_shard, A_scale, *Bs, *B_scales), len(Bs), gather_dim, group_name,
           tuple(out_dtypes), return_A, use_fast_accum, backend)
    plan = AG_PLANS.get(key)
    if plan is None:
        plan = AG_PLANS.make(key, A_shard.device,
                             lambda: _ag_plan(A_shard, Bs, A_scale, B_scales, gather_dim, group_name,
                                              out_dtypes, return_A, use_fast_accum, backend))
    return plan(A_shard, Bs, A_scale, B_scales)


def _ag_plan(A_shard, Bs, A_scale, B_scales, gather_dim, group_name, out_dtypes, return_A, use_fast_accum,
             backend):
    group = resolve_group(group_name)
    call = _ag_call(A_shard, Bs, A_scale, B_scales, gather_dim, dist.get_world_size(group), group,
                    out_dtypes, return_A, use_fast_accum)
    return AG_DISPATCHER.select(call, backend).plan(call)


@_ag_op.register_fake
def _(A_shard, Bs, A_scale, B_scales, gather_dim, group_name, *, out_dtypes, return_A=True,
      use_fast_accum=False, backend=""):
    world = dist.get_world_size(resolve_group(group_name))
    call = _ag_call(A_shard, Bs, A_scale, B_scales, gather_dim, world, None, out_dtypes, return_A,
                    use_fast_accum)
    shape = list(A_shard.shape)
    shape[call.dim] *= world
    gathered = A_shard.new_empty(shape) if return_A else None
    return gathered, [A_shard.new_empty(shape[:-1] + [b.shape[1]], dtype=d)
                      for b, d in zip(Bs, call.out_dtypes)]


def _rs_call(A, B, A_scale, B_scale, reduce_op, scatter_dim, world, group, out_dtype,
             use_fast_accum) -> ScaledCall:
    dim = _check_operands(RS, A, [B], A_scale, [B_scale], scatter_dim, "scatter_dim", [out_dtype])
    if dim == A.dim() - 1:
        check_scatter(RS, reduce_op, "reduce_op", "A @ B", B.shape[1], dim, "scatter_dim", world)
    else:
        check_scatter(RS, reduce_op, "reduce_op", "A", A.shape[dim], dim, "scatter_dim", world)
    mode = _a_mode_rows(RS, A, A_scale)
    return ScaledCall(RS, A, dim, world, group, [B], A_scale, [B_scale], [out_dtype],
                      use_fast_accum, reduce_op=reduce_op, a_mode=mode)


RS_PLANS = Plans(RS)


@torch.library.custom_op(f"fusedpar::{RS}", mutates_args=(), schema=RS_SCHEMA)
def _rs_op(A, B, A_scale, B_scale, reduce_op, scatter_dim, group_name, *, out_dtype,
           use_fast_accum=False, backend=""):
    key = (_signature(A, B, A_scale, B_scale), reduce_op, scatter_dim, group_name, out_dtype,
           use_fast_accum, backend)
    plan = RS_PLANS.get(key)
    if plan is None:
        plan = RS_PLANS.make(key, A.device,
                             lambda: _rs_plan(A, B, A_scale, B_scale, reduce_op, scatter_dim, group_name,
                                              out_dtype, use_fast_accum, backend))
    return plan(A, [B], A_scale, [B_scale])


def _rs_plan(A, B, A_scale, B_scale, reduce_op, scatter_dim, group_name, out_dtype, use_fast_accum,
             backend):
    group = resolve_group(group_name)
    call = _rs_call(A, B, A_scale, B_scale, reduce_op, scatter_dim, dist.get_world_size(group), group,
                    out_dtype, use_fast_accum)
    return RS_DISPATCHER.select(call, backend).plan(call)


@_rs_op.register_fake
def _(A, B, A_scale, B_scale, reduce_op, scatter_dim, group_name, *, out_dtype,
      use_fast_accum=False, backend=""):
    world = dist.get_world_size(resolve_group(group_name))
    call = _rs_call(A, B, A_scale, B_scale, reduce_op, scatter_dim, world, None, out_dtype,
                    use_fast_accum)
    return A.new_empty(_rs_out_shape(call), dtype=out_dtype)


# ---- public functions -----------------------------------------------------------------


def all_gather_scaled_matmul(A_shard: torch.Tensor, Bs: list[torch.Tensor], A_scale: torch.Tensor,
                             B_scales: list[torch.Tensor], gather_dim: int, group=None, *,
                             out_dtypes: list[torch.dtype | None] | None = None, return_A: bool = True,
                             use_fast_accum: bool = False, backend: str | None = None):
    """All-gather the fp8 ``A_shard`` (and a rowwise ``A_scale`` of the shard) along
    ``gather_dim`` and multiply by every fp8 B with its scale; the same as::

        A = torch.cat(dist_all_gather(A_shard, group), gather_dim)     # as bytes on gloo
        s = torch.cat(dist_all_gather(A_scale, group), gather_dim) if A_scale is the shard's rows else A_scale
        outs = [torch._scaled_mm(A.movedim(gather_dim, 0).flatten(0, -2), B, s_rows, B_scale,
                                 out_dtype=d).view(...).movedim(0, gather_dim)
                for B, B_scale, d in zip(Bs, B_scales, out_dtypes)]
        return (A if return_A else None), outs

    torch ``symm_mem.fused_all_gather_scaled_matmul``'s contract: ``A_shard`` 2-D or 3-D
    e4m3/e5m2; ``A_scale`` one element, ``A_shard.shape[:-1] + (1,)`` (the shard's rows) or
    the gathered A's rows; each B ``[K, N]`` fp8 with a tensorwise or ``[1, N]`` scale;
    ``out_dtypes`` one per B (None: bfloat16). ``gather_dim``: a leading dim. Backends:
    ``triton`` (all_gather_matmul's overlapped gather: every shard's fp8 rows, each with its
    float32 scale when the scales are the shard's, land in the symmetric buffer while one
    persistent Triton fp8 GEMM multiplies each shard's rows as soon as they are here, the
    scales in its epilogue; bfloat16 or float32 outputs, K a multiple of 4; GPUs with fp8
    tensor cores, sm_89+), ``pipelined``, ``reference``,
    ``symm_mem`` (torch's op, CUDA groups). Not
    differentiable (fp8 inputs): see ``fusedpar.nn.float8_linear``."""
    dtypes = [d or DEFAULT_OUT_DTYPE for d in (out_dtypes or [None] * len(Bs))]
    return _ag_op(A_shard, list(Bs), A_scale, list(B_scales), gather_dim, group_name(group),
                  out_dtypes=dtypes, return_A=return_A, use_fast_accum=use_fast_accum,
                  backend=backend or "")


def scaled_matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, A_scale: torch.Tensor,
                                 B_scale: torch.Tensor, reduce_op: str = "sum", scatter_dim: int = 0,
                                 group=None, *, out_dtype: torch.dtype | None = None,
                                 use_fast_accum: bool = False, backend: str | None = None):
    """Multiply the fp8 ``A`` by the fp8 ``B`` with their scales and reduce-scatter the
    product along ``scatter_dim``, summing in float32 and rounding once; the same as::

        P = torch._scaled_mm(A.movedim(scatter_dim, 0).flatten(0, -2), B, A_scale_rows, B_scale,
                             out_dtype=torch.float32)             # A's shape, N columns
        out = fusedpar.ops.reduce_scatter(P, reduce_op, scatter_dim, group).to(out_dtype)

    torch ``symm_mem.fused_scaled_matmul_reduce_scatter``'s contract (which rounds each
    partial to ``out_dtype`` before reducing; this op does not). ``A`` 2-D or 3-D fp8,
    ``A_scale`` one element or ``A.shape[:-1] + (1,)``; ``B`` ``[K, N]`` fp8, ``B_scale`` one
    element or ``[1, N]``; ``out_dtype`` None: bfloat16. ``scatter_dim``: a leading dim of A
    or the last (N's columns, on every backend but ``symm_mem``). Backends: ``triton``
    (matmul_reduce_scatter's overlapped protocol: one persistent Triton fp8 GEMM, scales in its
    epilogue, writes float32 partials chunk by chunk while each chunk's owner pulls and sums
    them; GPUs with fp8 tensor cores, sm_89+), ``pipelined``, ``reference``,
    ``symm_mem`` (torch's op, CUDA groups, 2-D A along dim 0). Not differentiable (fp8
    inputs): see ``fusedpar.nn.float8_linear``."""
    return _rs_op(A, B, A_scale, B_scale, reduce_op, scatter_dim, group_name(group),
                  out_dtype=out_dtype or DEFAULT_OUT_DTYPE, use_fast_accum=use_fast_accum,
                  backend=backend or "")


def all_gather_scaled_matmul_loopback(a_shards: list[torch.Tensor], Bs: list[torch.Tensor],
                                      A_scales: list[torch.Tensor], B_scales: list[torch.Tensor],
                                      gather_dim: int = 0, *, out_dtypes=None, return_A: bool = True):
    """Every rank's part of ``all_gather_scaled_matmul`` in this process (rank r's shard
    ``a_shards[r]`` with scale ``A_scales[r]``; every rank the same ``Bs``) with the
    ``triton`` backend over a loopback buffer: each rank's ``(A_gathered or None, outs)``.
    For single-device benchmarks and tests."""
    if not a_shards or len(A_scales) != len(a_shards):
        raise ValueError(f"fusedpar.{AG}_loopback: a_shards and A_scales must hold one tensor per "
                         "simulated rank")
    world = len(a_shards)
    dtypes = [d or DEFAULT_OUT_DTYPE for d in (out_dtypes or [None] * len(Bs))]
    calls = [_ag_call(a, list(Bs), s, list(B_scales), gather_dim, world, None, dtypes, return_A, False)
             for a, s in zip(a_shards, A_scales)]
    first = calls[0]
    for r, call in enumerate(calls):
        if call.x.shape != first.x.shape or call.x.dtype != first.x.dtype or call.a_mode != first.a_mode:
            raise ValueError(f"fusedpar.{AG}_loopback: a_shards[{r}] / A_scales[{r}] differ from rank 0's "
                             "in shape, dtype or scale layout")
    AG_DISPATCHER.select(first, "triton")  # raises why not
    rows = first.rows()
    bufs = get_loopback_buffers(world, world * rows.shape[0] * _staged_bytes(first), rows.device)
    gather = ScaledGather(first, bufs, copy_engine=False)
    staged = [_ag_staged(call.x, call.a_scale, call.dim, call.a_mode) for call in calls]
    results = gather.run([rows for rows, _ in staged],
                         [(call.bs, a_scale, call.b_scales) for call, (_, a_scale) in zip(calls, staged)])
    unflatten = unflattener(first)
    return [((unflatten(gather.gathered(g)) if return_A else None), [unflatten(o) for o in outs])
            for g, outs in results]


def scaled_matmul_reduce_scatter_loopback(As: list[torch.Tensor], Bs: list[torch.Tensor],
                                          A_scales: list[torch.Tensor], B_scales: list[torch.Tensor],
                                          reduce_op: str = "sum", scatter_dim: int = 0, *,
                                          out_dtype: torch.dtype | None = None,
                                          side_stream: bool = False) -> list[torch.Tensor]:
    """Every rank's part of ``scaled_matmul_reduce_scatter`` in this process (rank r
    multiplies ``As[r]`` by ``Bs[r]`` with their scales) with the ``triton`` backend over a
    loopback buffer: each rank's output. For single-device benchmarks and tests.
    ``side_stream`` (CUDA): the peers' partials copied on a side stream while the GEMMs run
    and summed by ``reduce_chunks``, as a group call does (``matmul_reduce_scatter_loopback``)."""
    if not As or not len(As) == len(Bs) == len(A_scales) == len(B_scales):
        raise ValueError(f"fusedpar.{RS}_loopback: As, Bs, A_scales and B_scales must hold one tensor "
                         "per simulated rank")
    if side_stream and not As[0].is_cuda:
        raise ValueError(f"fusedpar.{RS}_loopback: side_stream=True needs CUDA tensors (the copy "
                         f"engine); As are on {As[0].device}")
    world = len(As)
    calls = [_rs_call(a, b, sa, sb, reduce_op, scatter_dim, world, None, out_dtype or DEFAULT_OUT_DTYPE,
                      False) for a, b, sa, sb in zip(As, Bs, A_scales, B_scales)]
    first = calls[0]
    for r, call in enumerate(calls):
        if (call.x.shape, call.x.dtype, call.bs[0].shape, call.bs[0].dtype, call.a_mode,
                call.b_scales[0].shape) != (first.x.shape, first.x.dtype, first.bs[0].shape,
                                            first.bs[0].dtype, first.a_mode, first.b_scales[0].shape):
            raise ValueError(f"fusedpar.{RS}_loopback: As[{r}], Bs[{r}] or their scales differ from rank "
                             "0's in shape, dtype or scale layout")
    RS_DISPATCHER.select(first, "triton")  # raises why not
    operands = _fused_operands(first)
    fused = [operands(c.x, c.bs[0], c.a_scale, c.b_scales[0]) for c in calls]
    a, b, _ = fused[0]
    bufs = get_loopback_buffers(world, a.shape[0] * b.shape[1] * 4, a.device)
    views = ScatterViews(first, a, b, bufs, side_stream, scaled=True, out_dtype=first.out_dtypes[0])
    finish = _fused_finish(first)
    return [finish(out) for out in views.run(*(list(x) for x in zip(*fused)))]


def _example(op: str):
    def example(device):
        from .registry import EXAMPLE_WORLD

        a = torch.zeros(2 * EXAMPLE_WORLD, 16, device=device).to(torch.float8_e4m3fn)
        b = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        return ScaledCall(op, a, 0, EXAMPLE_WORLD, None, [b], one, [one], [DEFAULT_OUT_DTYPE],
                          reduce_op="sum" if op == RS else "")

    return example


register(AG_DISPATCHER, (all_gather_scaled_matmul, all_gather_scaled_matmul_loopback), checks="fusedpar.testing.scaled_matmul",
         example=_example(AG))
register(RS_DISPATCHER, (scaled_matmul_reduce_scatter, scaled_matmul_reduce_scatter_loopback), checks="fusedpar.testing.scaled_matmul",
         example=_example(RS))
