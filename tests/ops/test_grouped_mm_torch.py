"""grouped_mm's ``torch`` backend (``torch._grouped_mm``; ``torch.bmm`` for ``masked_m``)
against the reference where it runs on CPU, its reasons where it does not, and the kernel
that zeroes what those GEMMs leave (tests/ops/test_grouped_mm.py: the masked forms exactly)."""

import importlib

import pytest
import torch

from fusedpar.errors import BackendNotSupportedError
from fusedpar.kernels.grouped_mm import zero_rows_past
from fusedpar.ops import grouped_mm
from fusedpar.ops.grouped_mm import DISPATCHER, check_inputs
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
