"""``sequence_shard`` / ``sequence_unshard``: every ring_attention layout, packed documents
zigzag one by one (``"zigzag_docs"``), and which layout a packed row gets."""

import pytest
import torch
import torch.distributed as dist

from fusedpar.ops.ring_attention.call import packed_layout
from fusedpar.parallel import sequence_shard, sequence_unshard, zigzag_shard

pytestmark = [pytest.mark.timeout(120)]


def _cu(lengths):
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_layout_is_its_split(world):
    lengths = [2 * world * n for n in (3, 1, 5)]
    cu = _cu(lengths)
    x = torch.arange(2 * sum(lengths)).view(1, -1, 2).transpose(1, 2)  # sequence on dim 2
    docs = x.split(lengths, 2)
    parts = []
    for rank in range(world):
        part = sequence_shard(x, 2, rank, world, layout="zigzag_docs", cu_seqlens=cu)
        assert torch.equal(part, torch.cat([zigzag_shard(d, 2, rank, world) for d in docs], 2))
        parts.append(part)
        assert torch.equal(sequence_shard(x, 2, rank, world), zigzag_shard(x, 2, rank, world))
        assert torch.equal(sequence_shard(x, 2, rank, world, layout="contiguous"), x.chunk(world, 2)[rank])
    assert sorted(torch.cat(parts, 2)[0, 0].tolist()) == x[0, 0].tolist()  # every position once


def test_refusals_name_the_argument_and_the_fix():
    x = torch.zeros(1, 16)
    with pytest.raises(ValueError, match="pass cu_seqlens"):
        sequence_shard(x, 1, 0, 2, layout="zigzag_docs")
    with pytest.raises(ValueError, match="document 0: 6.*pad each document to a multiple of 4, "
                                         "or use layout='zigzag'"):
        sequence_shard(x, 1, 0, 2, layout="zigzag_docs", cu_seqlens=_cu([6, 10]))
    with pytest.raises(ValueError, match="cu_seqlens runs from 0 to 12 but the sequence has 16"):
        sequence_shard(x, 1, 0, 2, layout="zigzag_docs", cu_seqlens=_cu([4, 8]))
    with pytest.raises(ValueError, match="layout='striped'; choose one of"):
        sequence_shard(x, 1, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="not divisible by 6"):
        sequence_shard(x, 1, 0, 3, layout="zigzag")


def test_packed_layout_zigzags_each_document_only_when_all_divide():
    assert packed_layout(_cu([4, 12]), 2) == "zigzag_docs"
    assert packed_layout(_cu([4, 10, 2]), 2) == "zigzag"
    assert packed_layout(_cu([8, 8]), 4) == "zigzag_docs"
    assert packed_layout(_cu([8, 4, 4]), 4) == "zigzag"


def _round_trip(layout):
    rank, world = dist.get_rank(), dist.get_world_size()
    cu = _cu([2 * world * n for n in (3, 1, 2)])
    full = torch.arange(3 * int(cu[-1]) * 2, dtype=torch.float32).view(3, -1, 2)
    local = sequence_shard(full, 1, rank, world, layout=layout, cu_seqlens=cu).requires_grad_()
    out = sequence_unshard(local, 1, layout=layout, cu_seqlens=cu, backend="reference")
    weights = torch.arange(out.numel()).view_as(out).float() + rank  # rank-dependent
    (out * weights).sum().backward()
    # the gradient of a row: the sum over the ranks of its weight
    total = world * torch.arange(out.numel()).view_as(out).float() + sum(range(world))
    return (torch.equal(out, full) and
            torch.equal(local.grad, sequence_shard(total, 1, rank, world, layout=layout, cu_seqlens=cu)))


@pytest.mark.parametrize("world", [2, 4])
def test_unshard_restores_the_sequence(pools, world):
    for layout in ("zigzag_docs", "zigzag", "contiguous"):
        assert pools(world).run(_round_trip, layout) == [True] * world, layout
