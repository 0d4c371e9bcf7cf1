"""fusedpar.ops.grouped_mm: backends vs a loop of matmuls, autograd, errors."""

import importlib

import pytest
import torch

import fusedpar
from fusedpar.ops.grouped_mm import grouped_mm
from tests.ops.collective_cases import cpu_backends

BACKENDS = cpu_backends("grouped_mm")
MASKED_BACKENDS = BACKENDS + ["torch"]  # torch.bmm takes the masked forms at any shape


def _ints(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).float()


def _loop(a, b, offs):
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(a[start:end] @ b[g] if b.dim() == 3 else a[:, start:end] @ b[start:end])
        start = end
    if b.dim() == 3:
        return torch.cat(out + [a.new_zeros(a.shape[0] - start, b.shape[2])])
    return torch.stack(out)


def _check_exact_with_grads(a, b, out, grad, reference):
    """``out`` (the op on ``a``, ``b``) and its gradients for ``grad`` equal exactly those of
    ``reference(a, b)`` in fp64."""
    out.backward(grad)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = reference(a64, b64)
    ref.backward(grad.double())
    assert torch.equal(out.double(), ref)
    assert torch.equal(a.grad.double(), a64.grad) and torch.equal(b.grad.double(), b64.grad)


def _check_rows_form(offs, backend, seed):
    """``a [14, 11] x b [4, 11, 7]`` grouped by ``offs`` (ends [3, 3, 12, 13]: the last row past
    them), and its dgrad ``grouped_mm(dy, b^T)`` and wgrad ``grouped_mm(a^T, dy)`` (groups
    along K), exactly the fp64 loop's."""
    a = _ints(14, 11, seed=seed).requires_grad_()
    b = _ints(4, 11, 7, seed=seed + 1).requires_grad_()
    out = grouped_mm(a, b, offs, backend=backend)
    _check_exact_with_grads(a, b, out, _ints(14, 7, seed=seed + 2), lambda a, b: _loop(a, b, offs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_gradients_exact(backend):
    _check_rows_form(torch.tensor([3, 0, 9, 1]).cumsum(0).to(torch.int32), backend, seed=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_grouped_form_and_its_gradients(backend):
    offs = torch.tensor([4, 4, 13], dtype=torch.int32)
    a = _ints(13, 6, seed=3).t().requires_grad_()  # [6, 13], column-major like x.t()
    b = _ints(13, 5, seed=4).requires_grad_()
    out = grouped_mm(a, b, offs, backend=backend)
    assert out.shape == (3, 6, 5) and torch.equal(out[1], torch.zeros(6, 5))
    _check_exact_with_grads(a, b, out, _ints(3, 6, 5, seed=5), lambda a, b: _loop(a, b, offs))


@pytest.mark.parametrize("backend", MASKED_BACKENDS)
def test_masked_batched_form_and_its_gradients(backend):
    """``a [E, P, K]`` with counts: rows past each count neither multiplied nor given
    gradient (the padding of moe_dispatch's max_tokens_per_rank layout)."""
    counts = torch.tensor([0, 3, 5], dtype=torch.int32)
    a = _ints(3, 5, 11, seed=10).requires_grad_()
    b = _ints(3, 11, 7, seed=11).requires_grad_()
    out = grouped_mm(a, b, masked_m=counts, backend=backend)
    grad = _ints(3, 5, 7, seed=12)  # nonzero on the padding too: it must not leak into b's grad
    keep = (torch.arange(5)[None, :] < counts[:, None].long())[..., None]
    _check_exact_with_grads(a, b, out, grad, lambda a, b: torch.where(keep, a @ b, 0.0))
    assert torch.equal(a.grad[0], torch.zeros(5, 11)) and torch.equal(a.grad[1, 3:], torch.zeros(2, 11))


@pytest.mark.parametrize("backend", MASKED_BACKENDS)
def test_batched_without_counts_is_bmm(backend):
    a, b = _ints(2, 6, 5, seed=13), _ints(2, 5, 3, seed=14)
    assert torch.equal(grouped_mm(a, b, backend=backend), torch.bmm(a, b))


@pytest.mark.parametrize("backend", MASKED_BACKENDS)
def test_masked_k_grouped_form_and_its_gradients(backend):
    """``a [M, E*P] x b [E*P, N]``: group g's K is ``g*P : g*P + masked_m[g]``; the K past
    each count (NaN here, as an unwritten padded buffer may hold) is never multiplied."""
    counts = torch.tensor([4, 0, 2], dtype=torch.int32)
    x, b = _ints(12, 6, seed=15), _ints(12, 5, seed=16)
    x[4:8] = x[10:] = b[4:8] = b[10:] = float("nan")
    a = x.t().requires_grad_()  # [6, 12]: E=3 groups of P=4
    b.requires_grad_()
    out = grouped_mm(a, b, masked_m=counts, backend=backend)
    _check_exact_with_grads(a, b, out, _ints(3, 6, 5, seed=17), lambda a, b: torch.stack(
        [a[:, g * 4:g * 4 + n] @ b[g * 4:g * 4 + n] for g, n in enumerate(counts.tolist())]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_offs_and_masked_m(backend):
    """offs / masked_m as strided views (every other element; out-of-range values between):
    the kernels read them with stride 1, so the op must not pass the view as it is."""
    _check_rows_form(torch.tensor([3, 99, 3, -7, 12, 10**6, 13, 5], dtype=torch.int32)[::2],
                     backend, seed=20)
    counts = torch.tensor([0, 77, 3, -1, 5, 9], dtype=torch.int32)[::2]
    a, b = _ints(3, 5, 11, seed=23), _ints(3, 11, 7, seed=24)
    keep = (torch.arange(5)[None, :] < counts[:, None].long())[..., None]
    assert torch.equal(grouped_mm(a, b, masked_m=counts, backend=backend),
                       torch.where(keep, a @ b, 0.0))


def test_matches_torch_grouped_mm_where_available():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm does not exist in this torch")
    offs = torch.tensor([8, 8, 24], dtype=torch.int32)  # K, N multiples of 4: 16-byte strides
    a, b = _ints(24, 16, seed=6), _ints(3, 16, 8, seed=7)
    assert torch.equal(grouped_mm(a, b, offs, backend="triton"), torch._grouped_mm(a, b, offs))


@pytest.mark.parametrize("form,zeroing", [("rows", "kernel"), ("rows", "masked fill"),
                                          ("columns", "masked fill")])
@pytest.mark.parametrize("ends", [[3, 3, 10], [0, 0, 0], [4, 8, 12], [5, 13, 13]],
                         ids=["mid-vector", "all-empty", "vector-edge", "none-past"])
def test_torch_backend_zeroes_what_torch_grouped_mm_leaves(form, ends, zeroing, monkeypatch):
    """torch._grouped_mm leaves the rows (columns) past offs[-1] unwritten: made NaN here, the
    torch backend's output and both gradients still equal the fp64 loop's exactly, zeroed by
    the Triton kernel (rows) or by the masked fill of devices without Triton (the column
    form runs torch._grouped_mm only there). 13 rows (columns) of
    4-element (16-byte fp32) vectors, ending mid-vector, at an edge, at 13."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm does not exist in this torch")
    if zeroing == "masked fill":
        module = importlib.import_module("fusedpar.ops.grouped_mm")  # the package's name is the op
        monkeypatch.setattr(module, "triton_device_reasons", lambda device: ["no Triton"])
    real = torch._grouped_mm

    def leaves_nan_past_offs(a, b, offs, **kwargs):
        out = real(a, b, offs, **kwargs)
        if a.dim() != b.dim():
            (out if b.dim() == 3 else out.t())[int(offs[-1]):] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", leaves_nan_past_offs)
    offs = torch.tensor(ends, dtype=torch.int32)
    grad = torch.empty(13, 16)[:, :12] if form == "rows" else torch.empty(8, 16)[:, :13]
    grad.copy_(_ints(*grad.shape, seed=52))  # 16-byte row strides, as torch._grouped_mm takes
    if form == "rows":  # a [13, 12] x b [3, 12, 12]
        a, b = _ints(13, 12, seed=50).requires_grad_(), _ints(3, 12, 12, seed=51).requires_grad_()
        reference = lambda a, b: _loop(a, b, offs)
    else:  # a [3, 8, 12] x b [12, 13], column-major like a weightᵀ
        a, b = _ints(3, 8, 12, seed=50).requires_grad_(), _ints(13, 12, seed=51).t().requires_grad_()
        reference = lambda a, b: torch.cat(
            [a[g] @ b[:, s:e] for g, (s, e) in enumerate(zip([0] + ends[:-1], ends))]
            + [a.new_zeros(8, 13 - ends[-1])], dim=1)
    out = grouped_mm(a, b, offs, backend="torch")
    _check_exact_with_grads(a, b, out, grad, reference)


def test_bad_inputs_raise_clear_errors():
    a, b = torch.zeros(6, 4), torch.zeros(2, 4, 3)
    good = torch.tensor([2, 6], dtype=torch.int32)
    cases = [
        (lambda: grouped_mm(a, b, good.long()), TypeError, "int32"),
        (lambda: grouped_mm(a, b, torch.tensor([4, 2], dtype=torch.int32)), ValueError,
         r"offs\[1\] = 2 after 4"),
        (lambda: grouped_mm(a, b, torch.tensor([2, 7], dtype=torch.int32)), ValueError, "at most the 6"),
        (lambda: grouped_mm(a, torch.zeros(2, 5, 3), good), ValueError, "K mismatch"),
        (lambda: grouped_mm(a, b.half(), good), TypeError, "cast them"),
        (lambda: grouped_mm(a, b, good[:1]), ValueError, "1 group ends but b has 2"),
        (lambda: grouped_mm(a, b, good, backend="nope"), fusedpar.errors.BackendNotSupportedError,
         "does not exist"),
        (lambda: grouped_mm(a, b), ValueError, "exactly one of them"),
        (lambda: grouped_mm(a, b, good, masked_m=good), ValueError, "exactly one of them"),
        (lambda: grouped_mm(a.view(2, 3, 4), b, good), ValueError, "pass masked_m"),
        (lambda: grouped_mm(a.view(2, 3, 4), b, masked_m=torch.tensor([1, 4], dtype=torch.int32)),
         ValueError, r"masked_m\[1\] = 4: each group holds 3 rows"),
        (lambda: grouped_mm(a.view(2, 3, 4), b, masked_m=good.long()), TypeError, "masked_m must be"),
        (lambda: grouped_mm(a.view(3, 2, 4), b, masked_m=good), ValueError, "3 groups but b 2"),
        (lambda: grouped_mm(a, torch.zeros(4, 3), masked_m=torch.zeros(3, dtype=torch.int32)),
         ValueError, "K must be a multiple"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_torch_compile_fullgraph():
    offs = torch.tensor([2, 5], dtype=torch.int32)
    a, b = _ints(5, 4, seed=8), _ints(2, 4, 3, seed=9)
    compiled = torch.compile(lambda a, b: grouped_mm(a, b, offs) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(a, b), grouped_mm(a, b, offs) * 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_column_grouped_form_and_its_gradients(backend):
    """``a [E, M, K] x b [K, N]``: a[g] multiplies b's columns ``offs[g-1]:offs[g]`` (the
    last column past offs[-1] gets zeros); dgrad groups along K, wgrad is this form again."""
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)
    a = _ints(3, 6, 11, seed=30).requires_grad_()
    b = _ints(13, 11, seed=31).t().requires_grad_()  # [11, 13], column-major like a weightᵀ
    out = grouped_mm(a, b, offs, backend=backend)
    assert out.shape == (6, 13)
    _check_exact_with_grads(a, b, out, _ints(6, 13, seed=32), lambda a, b: torch.cat(
        [a[0] @ b[:, :4], a[2] @ b[:, 4:12], a.new_zeros(6, 1)], dim=1))
    assert torch.equal(a.grad[1], torch.zeros(6, 11))  # an empty group


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_dtype_keeps_16_bit_products_in_fp32(backend):
    """bf16 inputs, ``out_dtype=torch.float32``: the fp32 sums of the exact products (eighths:
    not representable in bf16's 8 bits once summed), and bf16 gradients."""
    offs = torch.tensor([3, 7], dtype=torch.int32)
    a = (_ints(7, 9, seed=40) / 8 + 1).bfloat16().requires_grad_()
    b = (_ints(2, 9, 5, seed=41) / 8 + 1).bfloat16().requires_grad_()
    out = grouped_mm(a, b, offs, out_dtype=torch.float32, backend=backend)
    assert out.dtype == torch.float32
    ref = _loop(a.detach().double(), b.detach().double(), offs)
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=0)
    assert not torch.equal(grouped_mm(a, b, offs, backend=backend).double(), ref)  # bf16 rounds
    out.backward(torch.ones_like(out))
    assert a.grad.dtype == b.grad.dtype == torch.bfloat16


def test_column_grouped_form_matches_torch_grouped_mm_where_available():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm does not exist in this torch")
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)  # 16-byte strides, as torch requires
    a, b = _ints(3, 4, 8, seed=42), _ints(8, 12, seed=43)
    assert torch.equal(grouped_mm(a, b, offs, backend="triton"), torch._grouped_mm(a, b, offs))


def test_column_grouped_and_out_dtype_errors():
    a, b, offs = torch.zeros(2, 3, 4), torch.zeros(4, 6), torch.tensor([2, 6], dtype=torch.int32)
    cases = [
        (lambda: grouped_mm(a, b, masked_m=offs), ValueError, "pass offs"),
        (lambda: grouped_mm(a, b, offs[:1]), ValueError, "1 group ends but a has 2"),
        (lambda: grouped_mm(a, b, torch.tensor([2, 7], dtype=torch.int32)), ValueError,
         "at most the 6 columns of b"),
        (lambda: grouped_mm(a.bfloat16(), b.bfloat16(), offs, out_dtype=torch.float16), TypeError,
         "out_dtype=torch.float16"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
