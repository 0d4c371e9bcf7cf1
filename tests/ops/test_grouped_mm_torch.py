"""grouped_mm's ``torch`` backend (``torch._grouped_mm``; ``torch.bmm`` for ``masked_m``)
against the reference where it runs on CPU, its reasons where it does not, and the kernel
that zeroes what those GEMMs leave (tests/ops/test_grouped_mm.py: the masked forms exactly)."""

import importlib
import os
import subprocess
import sys

import pytest
import torch

from fusedpar.errors import BackendNotSupportedError
from fusedpar.kernels.grouped_mm import zero_rows_past
from fusedpar.ops import grouped_mm
from fusedpar.ops.grouped_mm import DISPATCHER, check_inputs, torch_layout_reasons
from tests.ops.collective_cases import captured, requires_cuda


def _offs(*ends):
    return torch.tensor(ends, dtype=torch.int32)


# aligned shapes (K, N multiples of 8 elements: 16 bytes of bf16); an empty group; rows / columns past
# offs[-1], which torch._grouped_mm leaves unwritten and the contract makes zeros
CASES = {
    "rows": lambda: (torch.randn(21, 8), torch.randn(3, 8, 16), _offs(5, 5, 17)),
    "k": lambda: (torch.randn(8, 24), torch.randn(24, 16), _offs(8, 8, 20)),
    "columns": lambda: (torch.randn(3, 8, 8), torch.randn(8, 32), _offs(8, 8, 20)),
    "column-major b": lambda: (torch.randn(16, 8), torch.randn(3, 16, 8).transpose(1, 2), _offs(3, 7, 16)),
}


@pytest.fixture(params=["kernel", "masked fill"])
def zeroing(request, monkeypatch):
    """How the backend zeroes the rows past the bounds: the Triton kernel (the interpreter
    here), or the masked fill of devices without Triton."""
    if request.param == "masked fill":
        module = importlib.import_module("fusedpar.ops.grouped_mm")  # the package's name is the op
        monkeypatch.setattr(module, "triton_device_reasons", lambda device: ["no Triton"])
    return request.param


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_equals_the_reference(case, dtype, zeroing):
    torch.manual_seed(0)
    a, b, offs = (t.to(dtype) if t.is_floating_point() else t for t in CASES[case]())
    a.requires_grad_(), b.requires_grad_()
    out = grouped_mm(a, b, offs, backend="torch")
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ref = grouped_mm(a32, b32, offs, backend="reference")  # fp32: the products of bf16 exact
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    if case in ("rows", "columns"):  # the part past offs[-1]: zeros
        tail = out[:, 20:] if case == "columns" else out[17:]
        assert tail.numel() and not tail.any()
    grad = torch.randn_like(out)
    ga, gb = torch.autograd.grad(out, (a, b), grad)  # backward: whatever backend takes it
    ra, rb = torch.autograd.grad(ref, (a32, b32), grad.float())
    torch.testing.assert_close(ga.float(), ra, **tol)
    torch.testing.assert_close(gb.float(), rb, **tol)


def test_torch_backend_says_why_not():
    odd = check_inputs(torch.randn(14, 11), torch.randn(4, 11, 7), _offs(3, 6, 9, 14))
    reasons = DISPATCHER.backends["torch"].not_supported_reasons(odd)
    assert any("strides of a multiple of 16 bytes; a has strides (11, 1)" in r for r in reasons)
    masked_fp32_out = check_inputs(torch.randn(2, 4, 8).bfloat16(), torch.randn(2, 8, 4).bfloat16(),
                                   None, torch.tensor([4, 2], dtype=torch.int32), torch.float32)
    assert DISPATCHER.backends["torch"].not_supported_reasons(masked_fp32_out) == [
        "torch.bmm takes out_dtype=torch.float32 for torch.bfloat16 inputs only on CUDA, not cpu"]
    fp32_out = check_inputs(torch.randn(8, 8).bfloat16(), torch.randn(2, 8, 8).bfloat16(),
                            _offs(4, 8), out_dtype=torch.float32)
    assert any("on CPU needs out_dtype == the inputs' dtype" in r
               for r in DISPATCHER.backends["torch"].not_supported_reasons(fp32_out))
    with pytest.raises(BackendNotSupportedError, match="backend 'torch' was forced"):
        grouped_mm(torch.randn(14, 11), torch.randn(4, 11, 7), _offs(3, 6, 9, 14), backend="torch")


def test_torch_comes_after_fusedpars_backends():
    assert DISPATCHER.names[-1] == "torch"
    a, b, offs = CASES["rows"]()
    assert DISPATCHER.select(check_inputs(a, b, offs)).name != "torch"  # CPU: priority order


def _major(t, order):
    """A copy of ``t`` (its last two dims) row-major ("row") or column-major ("col")."""
    return t.contiguous() if order == "row" else t.transpose(-1, -2).contiguous().transpose(-1, -2)


# (form, a's major order, b's major order): the inputs whose group sizes torch._grouped_mm's
# CUDA kernels assert on the device ("out": its row-major output's grouped columns). Sizes are
# multiples of 8 (16 bytes of bf16); the groups (5, 0, 12 or 15) are not
LAYOUTS = {
    ("rows", "row", "row"): [], ("rows", "row", "col"): [],  # b [E, K, N] is not grouped
    ("rows", "col", "row"): ["a"], ("rows", "col", "col"): ["a"],
    ("k", "col", "row"): [], ("k", "row", "row"): ["a"], ("k", "col", "col"): ["b"],
    ("k", "row", "col"): ["a", "b"],
    ("columns", "row", "row"): ["out"], ("columns", "row", "col"): ["out"],
    ("columns", "col", "col"): ["out"],
}


def _layout_case(form, a_order, b_order, dtype=torch.bfloat16):
    """Integer-valued a, b in the given major orders and offs with an empty group and groups
    not a multiple of 16 bytes."""
    g = torch.Generator().manual_seed(len(form) + 2 * (a_order == "row") + (b_order == "row"))
    ints = lambda *shape: torch.randint(-3, 4, shape, generator=g).to(dtype)
    a_shape, b_shape, offs = {"rows": ((24, 16), (3, 16, 16), _offs(5, 5, 17)),
                              "k": ((16, 24), (24, 16), _offs(5, 5, 20)),
                              "columns": ((3, 16, 16), (16, 24), _offs(5, 5, 20))}[form]
    return _major(ints(*a_shape), a_order), _major(ints(*b_shape), b_order), offs


@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_layouts_torch_grouped_mm_would_assert_on_are_declined(layout):
    """The torch backend's layout reasons (applied on CUDA): one per asserted input, naming
    it, its strides and the layout that takes any group sizes; the column-grouped form always
    (torch's output is row-major)."""
    a, b, offs = _layout_case(*layout)
    reasons = torch_layout_reasons(check_inputs(a, b, offs))
    expected = LAYOUTS[layout]
    assert len(reasons) == len(expected)
    fixes = {("rows", "a"): "row-major (a.contiguous())",
             ("k", "a"): "column-major (a.t().contiguous().t())", ("k", "b"): "row-major (b.contiguous())"}
    for name, reason in zip(expected, reasons):
        if name == "out":
            assert reason.startswith("torch._grouped_mm's output is row-major, so each group of its columns")
        else:
            t = a if name == "a" else b
            fix = fixes[layout[0], name]
            assert f"; {name} {tuple(t.shape)} has strides {t.stride()}: give {name} {fix}" in reason
            assert "asserts on the device (fatal to the CUDA context)" in reason


def test_layout_decision_edge_cases():
    """A 1-column a (rows form) or 1-row a (groups along K) has both strides 1: torch's
    CUTLASS kernel sees it row-major, cuBLASLt sees the grouped dim unit-stride, so one of
    them asserts group sizes either way. The masked forms (torch.bmm) take any layout. The
    layout decision is part of the dispatcher's cache key."""
    rows = check_inputs(torch.randn(24, 1).bfloat16(), torch.randn(3, 1, 8).bfloat16(), _offs(5, 5, 17))
    k = check_inputs(torch.randn(24, 1).bfloat16().t(), torch.randn(24, 8).bfloat16(), _offs(5, 5, 20))
    for call, shape in ((rows, "(24, 1)"), (k, "(1, 24)")):
        (reason,) = torch_layout_reasons(call)
        assert f"; a {shape} has strides (1, 1): give a" in reason
    counts = torch.tensor([3, 8], dtype=torch.int32)
    batched = check_inputs(_major(torch.randn(2, 16, 8), "col"), torch.randn(2, 8, 8), None, counts)
    along_k = check_inputs(_major(torch.randn(8, 32), "row"), _major(torch.randn(32, 8), "col"), None, counts)
    assert torch_layout_reasons(batched) == torch_layout_reasons(along_k) == []
    a, b, offs = _layout_case("rows", "row", "row")
    assert check_inputs(a, b, offs).cache_key() != check_inputs(_major(a, "col"), b, offs).cache_key()


def _fp64_loop(a, b, ends):
    """The contract as a loop of matmuls (zeros past ``ends[-1]``)."""
    starts, parts = [0] + ends[:-1], []
    for g, (s, e) in enumerate(zip(starts, ends)):
        parts.append(a[s:e] @ b[g] if b.dim() == 3 else
                     a[:, s:e] @ b[s:e] if a.dim() == 2 else a[g] @ b[:, s:e])
    if a.dim() == 2 and b.dim() == 2:
        return torch.stack(parts)
    if b.dim() == 3:
        return torch.cat(parts + [a.new_zeros(a.shape[0] - ends[-1], b.shape[2])])
    return torch.cat(parts + [a.new_zeros(a.shape[1], b.shape[1] - ends[-1])], dim=1)


@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_torch_backend_equals_the_fp64_loop_in_every_layout(layout):
    """Where torch._grouped_mm runs whatever the layout (CPU): output and both gradients
    exactly the fp64 reference's (integer values, fp32)."""
    a, b, offs = (t.requires_grad_() if t.is_floating_point() else t
                  for t in _layout_case(*layout, dtype=torch.float32))
    out = grouped_mm(a, b, offs, backend="torch")
    grad = torch.randint(-3, 4, out.shape, generator=torch.Generator().manual_seed(9)).float()
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = _fp64_loop(a64, b64, offs.tolist())
    assert torch.equal(out.double(), ref)
    got, want = torch.autograd.grad(out, (a, b), grad), torch.autograd.grad(ref, (a64, b64), grad.double())
    assert all(torch.equal(x.double(), y) for x, y in zip(got, want))


@pytest.mark.parametrize("form", ["offs", "counts"])
def test_zero_rows_past_touches_only_the_rows_past_each_bound(form):
    """``c[g, ends[first + g]:] = 0`` on a strided view of a NaN-filled buffer: the rows
    past each bound (clamped to [0, R]) are zeros, every other element is left as it was.
    Odd sizes over several blocks of rows and columns."""
    G, R, C = (1, 70, 67) if form == "offs" else (5, 9, 67)
    buf = torch.full((G, R + 1, C + 3), float("nan"))
    c = buf[:, 1:, 2:-1]  # row stride C + 3, unit column stride
    if form == "offs":  # the rows past offs[-1] = 37 (first = E - 1)
        ends, first, bounds = torch.tensor([5, 20, 37], dtype=torch.int32), 2, [37]
    else:  # counts 0, P, between, and out of range (clamped)
        ends, first, bounds = torch.tensor([0, 9, 4, -2, 12], dtype=torch.int32), 0, [0, 9, 4, 0, 9]
    zero_rows_past(c, ends, first)
    for g, end in enumerate(bounds):
        assert torch.equal(c[g, end:], torch.zeros(R - end, C))
        assert c[g, :end].isnan().all()
    assert buf[:, 0].isnan().all() and buf[:, :, :2].isnan().all() and buf[:, :, -1].isnan().all()


def test_masked_batched_form_with_empty_or_strided_counts(zeroing):
    """No groups at all, and counts given as a strided view (the kernel reads them with
    stride 1); the products of the batch's rows in fp32 against the reference."""
    a, b = torch.randn(0, 4, 8), torch.randn(0, 8, 3)
    assert grouped_mm(a, b, masked_m=torch.zeros(0, dtype=torch.int32), backend="torch").shape == (0, 4, 3)
    counts = torch.tensor([5, 77, 0, -1, 2], dtype=torch.int32)[::2]
    a, b = torch.randn(3, 5, 7), torch.randn(3, 7, 6)
    out = grouped_mm(a, b, masked_m=counts, backend="torch")
    torch.testing.assert_close(out, grouped_mm(a, b, masked_m=counts, backend="reference"))
    assert torch.equal(out[1], torch.zeros(5, 6)) and torch.equal(out[2, 2:], torch.zeros(3, 6))


# ---- on CUDA: torch's CUDA GEMMs and the compiled zeroing kernel (skipped without a GPU) ----

def _masked_case(device, dtype=torch.bfloat16):
    """a [5, 40, 24] with NaN in the rows past each count (counts 0, P, between), b [5, 24, 16],
    counts, and the fp32 reference's output and gradients for a random output gradient."""
    torch.manual_seed(0)
    counts = torch.tensor([0, 40, 13, 39, 1], dtype=torch.int32)
    a, b, grad = torch.randn(5, 40, 24).to(dtype), torch.randn(5, 24, 16).to(dtype), torch.randn(5, 40, 16)
    a[torch.arange(40)[None, :] >= counts[:, None]] = float("nan")
    a32, b32 = a.float().requires_grad_(), b.float().requires_grad_()
    ref = grouped_mm(a32, b32, masked_m=counts, backend="reference")
    ref_grads = torch.autograd.grad(ref, (a32, b32), grad)
    on = lambda t: t.to(device)  # noqa: E731
    return on(a), on(b), on(counts), on(grad), ref.detach(), ref_grads


def _check_masked_torch_backend(device, out_dtype):
    """The batched masked form on the torch backend: rows past each count exactly zero (NaN
    rows of a included), the rest and both gradients the fp32 reference's within bf16's
    rounding."""
    a, b, counts, grad, ref, (ref_a, ref_b) = _masked_case(device)
    a.requires_grad_(), b.requires_grad_()
    out = grouped_mm(a, b, masked_m=counts, out_dtype=out_dtype, backend="torch")
    assert out.dtype == (out_dtype or a.dtype)
    ga, gb = torch.autograd.grad(out, (a, b), grad.to(out.dtype))
    tol = dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(out.float().cpu(), ref, **tol)  # zeros included: exactly 0 there
    torch.testing.assert_close(ga.float().cpu(), ref_a, **tol)
    torch.testing.assert_close(gb.float().cpu(), ref_b, **tol)
    past = torch.arange(40)[None, :] >= counts.cpu()[:, None]
    assert not out.cpu()[past].any() and not ga.cpu()[past].any()


@requires_cuda
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_gpu_masked_batched_form_on_the_torch_backend(out_dtype):
    _check_masked_torch_backend("cuda", out_dtype)


@requires_cuda
def test_gpu_rows_past_offs_are_zeros_in_reused_memory():
    """torch._grouped_mm leaves the rows past offs[-1] unwritten: the output's block, just
    freed full of NaN (the caching allocator hands it out again), reads zeros there."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm's CUDA kernels need compute capability 9.0+")
    torch.manual_seed(0)
    a, b = torch.randn(1000, 64).bfloat16(), torch.randn(3, 64, 200).bfloat16()
    offs = torch.tensor([100, 100, 700], dtype=torch.int32)
    ref = grouped_mm(a.float(), b.float(), offs, backend="reference")
    torch.full((1000, 200), float("nan"), dtype=torch.bfloat16, device="cuda")  # freed at once
    out = grouped_mm(a.cuda(), b.cuda(), offs.cuda(), backend="torch").cpu()
    assert torch.equal(out[700:], torch.zeros(300, 200, dtype=torch.bfloat16))
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=2e-2)


@requires_cuda
def test_gpu_masked_form_on_the_torch_backend_replays_in_a_cuda_graph():
    """No host read of the counts: captured once, replayed with new counts."""
    torch.manual_seed(0)
    a, b = torch.randn(3, 40, 24, device="cuda"), torch.randn(3, 24, 16, device="cuda")
    counts = torch.tensor([40, 0, 7], dtype=torch.int32, device="cuda")
    graph, out = captured(lambda: grouped_mm(a, b, masked_m=counts, backend="torch"))
    for new in ([1, 40, 0], [13, 22, 39]):
        counts.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.testing.assert_close(out, grouped_mm(a, b, masked_m=counts, backend="reference"))


def _needs_grouped_mm_kernels():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm's CUDA kernels need compute capability 9.0+")


@requires_cuda
@pytest.mark.parametrize("layout", [k for k, asserted in LAYOUTS.items() if not asserted], ids="-".join)
def test_gpu_layouts_the_torch_backend_takes_run_any_group_sizes(layout):
    """The layouts the torch backend keeps, on torch._grouped_mm's CUDA kernels with an empty
    group and groups not a multiple of 16 bytes: exactly the fp64 loop's (integer values)."""
    _needs_grouped_mm_kernels()
    a, b, offs = _layout_case(*layout)
    call = check_inputs(a.cuda(), b.cuda(), offs.cuda())
    assert DISPATCHER.backends["torch"].not_supported_reasons(call) == []
    out = grouped_mm(call.a, call.b, call.offs, backend="torch").cpu()
    assert torch.equal(out.double(), _fp64_loop(a.double(), b.double(), offs.tolist()))


@requires_cuda
@pytest.mark.parametrize("layout", [("rows", "col", "row"), ("k", "row", "row"), ("k", "col", "col"),
                                    ("columns", "row", "col")], ids="-".join)
def test_gpu_layouts_the_torch_backend_declines_do_fail_torchs_device_assert(layout):
    """One layout per asserted input (a along rows, a and b along K, the output's columns with
    b not asserted): declined with the reason, and torch._grouped_mm itself, in a process of
    its own (the assert kills the CUDA context), fails the device-side assert."""
    _needs_grouped_mm_kernels()
    a, b, offs = _layout_case(*layout)
    call = check_inputs(a.cuda(), b.cuda(), offs.cuda())
    assert torch_layout_reasons(call)
    with pytest.raises(BackendNotSupportedError, match="asserts on the device|output is row-major"):
        grouped_mm(call.a, call.b, call.offs, backend="torch")
    code = ("import torch; from tests.ops.test_grouped_mm_torch import _layout_case; "
            f"a, b, offs = _layout_case(*{layout!r}); "
            "torch._grouped_mm(a.cuda(), b.cuda(), offs.cuda()); torch.cuda.synchronize(); print('ran')")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", code], check=False, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "ran" not in run.stdout, run.stdout
    assert "device-side assert" in run.stderr, run.stderr[-2000:]
