"""grouped_mm's ``torch`` backend (``torch._grouped_mm``) against the reference where it
runs on CPU, and its reasons where it does not."""

import pytest
import torch

from fusedpar.errors import BackendNotSupportedError
from fusedpar.ops import grouped_mm
from fusedpar.ops.grouped_mm import DISPATCHER, check_inputs


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


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_equals_the_reference(case, dtype):
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
    masked = check_inputs(torch.randn(2, 4, 8), torch.randn(2, 8, 4), None,
                          torch.tensor([4, 2], dtype=torch.int32))
    assert "torch._grouped_mm takes offs, not masked_m" in \
        DISPATCHER.backends["torch"].not_supported_reasons(masked)
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
