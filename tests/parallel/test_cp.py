"""Zigzag sequence layout helpers."""

import pytest
import torch
import torch.distributed as dist

from fusedpar.parallel import zigzag_positions, zigzag_shard, zigzag_unshard

pytestmark = [pytest.mark.timeout(120)]


def test_shard_and_positions():
    x = torch.arange(16).view(1, 16)
    assert zigzag_shard(x, 1, 0, 4).tolist() == [[0, 1, 14, 15]]
    assert zigzag_shard(x, 1, 3, 4).tolist() == [[6, 7, 8, 9]]
    for rank in range(4):
        assert torch.equal(zigzag_positions(16, rank, 4), zigzag_shard(torch.arange(16), 0, rank, 4))
    # every position exactly once
    assert sorted(torch.cat([zigzag_positions(24, r, 3) for r in range(3)]).tolist()) == list(range(24))


def test_length_not_divisible_by_2w_is_refused():
    with pytest.raises(ValueError, match="not divisible by 2 \\* world size = 6"):
        zigzag_shard(torch.zeros(2, 10), 1, 0, 3)
    with pytest.raises(ValueError, match="pad the sequence to a multiple of 4"):
        zigzag_positions(6, 1, 2)


def _round_trip():
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(3 * 4 * world * 2, dtype=torch.float32).view(3, 4 * world, 2) * (1 + rank * 0)
    local = zigzag_shard(full, 1, rank, world).requires_grad_()
    out = zigzag_unshard(local, 1, backend="reference")
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    # every rank's loss has the same weights: the gradient is W times the weight of its rows
    weights = zigzag_shard(torch.arange(out.numel()).view_as(out).float(), 1, rank, world)
    return torch.equal(out, full) and torch.equal(local.grad, world * weights)


@pytest.mark.parametrize("world", [2, 4])
def test_unshard_restores_the_sequence(pools, world):
    assert pools(world).run(_round_trip) == [True] * world
