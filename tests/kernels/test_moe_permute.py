"""MoE permutation kernels: counting sort by expert, gather, weighted combine."""

import pytest
import torch

from fusedpar.kernels.moe_permute import INVALID_IDS, combine_rows, gather_rows, sort_by_expert


def _routing(T, k, E, seed, dropped=()):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)] or [torch.zeros(0, k)]).long()
    idx = idx.view(T, k)
    for t, j in dropped:
        idx[t, j] = -1
    return idx


# (T, k, E, dropped copies): more copies than one sort block; everything on one expert
@pytest.mark.parametrize("T, k, E, dropped", [(37, 2, 8, [(3, 1), (0, 0)]), (70, 1, 4, []),
                                              (5, 4, 4, []), (0, 2, 4, [])])
def test_sort_is_stable_by_expert(T, k, E, dropped):
    idx = _routing(T, k, E, seed=T, dropped=dropped)
    pos, header = sort_by_expert(idx, E, flag_value=T)
    counts, flag = header[:E], int(header[E])
    flat = idx.reshape(-1)
    order = torch.argsort(torch.where(flat < 0, E, flat), stable=True)
    expected = torch.empty_like(flat)
    expected[order] = torch.arange(flat.numel())
    assert torch.equal(pos.long(), torch.where(flat < 0, -1, expected))
    assert torch.equal(counts.long(), torch.bincount(flat[flat >= 0], minlength=E))
    assert flag == T  # every id in range: the flag slot holds flag_value


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sort_flags_ids_out_of_range_and_stays_in_bounds(dtype):
    """An id outside [-1, E) (int64 ones past int32's range too) sets the flag slot, counts
    nowhere and gets a position inside [0, T*k), or -1 (dropped) if negative, so gathering
    by it stays in bounds."""
    E = 4
    for bad in (-2, E, 5, 2**32 + 1, -(2**32)):
        if dtype == torch.int32 and not -(2**31) <= bad < 2**31:
            continue
        idx = torch.tensor([[0, 1], [bad, 3], [2, -1]], dtype=dtype)
        pos, header = sort_by_expert(idx, E, flag_value=7)
        assert int(header[E]) == INVALID_IDS, bad
        assert header[:E].tolist() == [1, 1, 1, 1], bad
        assert (-1 if bad < 0 else 0) <= int(pos[2]) < idx.numel() and int(pos[5]) == -1, (bad, pos)


def test_sort_reads_strided_ids_by_value():
    """``topk_idx`` views whose flattening keeps a stride (every other column of a wider
    tensor, k=1 as one column, a stride-0 expansion) sort like their contiguous copies (the
    kernel reads ids with stride 1; the gaps hold ids that would route elsewhere)."""
    idx = _routing(13, 2, 4, seed=3, dropped=[(2, 1)])
    wide = torch.stack([idx, (idx + 1) % 4], 2).reshape(13, 4)  # columns 0 and 2: idx
    views = [wide[:, ::2], wide[:, :1], torch.tensor([[3]]).expand(9, 1)]
    for view in views:
        assert not view.reshape(-1).is_contiguous()
        expected = sort_by_expert(view.contiguous(), 4, flag_value=5)
        for got, want in zip(sort_by_expert(view, 4, flag_value=5), expected):
            assert torch.equal(got, want), view.stride()


def test_all_copies_on_one_expert():
    idx = torch.full((33, 1), 2)
    pos, header = sort_by_expert(idx, 4)
    assert torch.equal(pos.long(), torch.arange(33)) and header.tolist() == [0, 0, 33, 0, 0]


def test_gather_then_combine_is_exact_on_integers():
    T, k, E, H = 37, 2, 8, 70  # H over one interpreter block
    idx = _routing(T, k, E, seed=1, dropped=[(5, 0)])
    pos, header = sort_by_expert(idx, E)
    counts = header[:E]
    x = torch.arange(T * H, dtype=torch.float32).view(T, H) % 17 + torch.arange(T)[:, None] * 32
    rows = int(counts.sum()) + 2  # two rows of padding stay zero
    gathered = gather_rows(x, pos, k, rows)
    kept = pos >= 0
    assert torch.equal(gathered[pos[kept].long()], x[(torch.arange(T * k) // k)[kept]])
    assert torch.equal(gathered[-2:], torch.zeros(2, H))
    w = torch.tensor([1.0, 2.0, 4.0, 0.5]).repeat(T * k)[: T * k]
    weighted = gather_rows(x, pos, k, rows, w)
    assert torch.equal(weighted[pos[kept].long()], x[(torch.arange(T * k) // k)[kept]] * w[kept, None])
    out = combine_rows(gathered, pos, k, T, w)
    expected = x * torch.where(kept, w, 0.0).view(T, k).sum(1, keepdim=True)
    assert torch.equal(out, expected)
