"""MoE permutation kernels: counting sort by expert, gather, weighted combine."""

import pytest
import torch
import triton

from fusedpar.kernels import moe_permute
from fusedpar.kernels.moe_permute import INVALID_IDS, SORT_BLOCK, combine_rows, gather_rows, sort_by_expert


def _routing(T, k, E, seed, dropped=(), dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)] or [torch.zeros(0, k)]).to(dtype)
    idx = idx.view(T, k)
    for t, j in dropped:
        idx[t, j] = -1
    return idx


# (T, k, E, dropped copies, ids' dtype): one block and several (SORT_BLOCK copies each); more
# blocks than one tile of the scan holds (600 x 8 copies of 128 experts); E not a power of
# two with most experts empty; no copies
@pytest.mark.parametrize("T, k, E, dropped, dtype", [
    (37, 2, 8, [(3, 1), (0, 0)], torch.int64), (70, 1, 4, [], torch.int32), (5, 4, 4, [], torch.int64),
    (0, 2, 4, [], torch.int64), (301, 3, 8, [(300, 2), (150, 0)], torch.int32), (600, 8, 128, [(7, 7)], torch.int64),
    (9, 3, 100, [(8, 2)], torch.int32)])
def test_sort_is_stable_by_expert(T, k, E, dropped, dtype):
    idx = _routing(T, k, E, seed=T, dropped=dropped, dtype=dtype)
    pos, header = sort_by_expert(idx, E, flag_value=T)
    counts, flag = header[:E], int(header[E])
    flat = idx.reshape(-1).long()
    order = torch.argsort(torch.where(flat < 0, E, flat), stable=True)
    expected = torch.empty_like(flat)
    expected[order] = torch.arange(flat.numel())
    assert torch.equal(pos.long(), torch.where(flat < 0, -1, expected))
    assert torch.equal(counts.long(), torch.bincount(flat[flat >= 0].long(), minlength=E))
    assert flag == T  # every id in range: the flag slot holds flag_value


class _Launches:
    """A kernel whose launches are recorded: ``(name, programs, args, constexprs)``."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.kernel.fn.__name__, grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_sort_work_per_program_does_not_grow_with_copies_times_experts(monkeypatch):
    """No program of the sort walks every copy: launches of several programs give each at
    most SORT_BLOCK copies, and a one-program launch gets a count of blocks, never the copy
    count (a one-program counting sort steps through all T*k copies against all E experts)."""
    log = []
    for name, value in vars(moe_permute).items():
        if isinstance(value, type(moe_permute.gather_rows_kernel)):
            monkeypatch.setattr(moe_permute, name, _Launches(value, log))
    T, k, E = 300, 8, 128
    idx = _routing(T, k, E, seed=2)
    n, blocks = T * k, triton.cdiv(T * k, SORT_BLOCK)
    pos, header = sort_by_expert(idx, E)
    assert torch.equal(header[:E].long(), torch.bincount(idx.reshape(-1), minlength=E))
    assert sorted(pos.tolist()) == list(range(n))
    assert log
    for name, grid, args, kwargs in log:
        ints = [a for a in args if isinstance(a, int)]
        if grid == (1,):
            assert n not in ints and blocks in ints, (name, ints)
        else:
            assert grid == (blocks,) and kwargs["BLOCK"] == SORT_BLOCK and n in ints, (name, grid, kwargs)


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
    n = 2 * SORT_BLOCK + 33  # over several blocks
    idx = torch.full((n, 1), 2)
    pos, header = sort_by_expert(idx, 4)
    assert torch.equal(pos.long(), torch.arange(n)) and header.tolist() == [0, 0, n, 0, 0]


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
