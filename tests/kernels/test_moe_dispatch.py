"""MoE exchange kernels: the routes computed from the exchanged counts table.

(``pull_rows`` and the capacity check run in every dispatch of tests/ops/test_moe_dispatch.py.)
"""

import pytest
import torch

from fusedpar.kernels.moe_dispatch import routes


def _recv_layout(table, owner, world, max_tokens):
    """Rank ``owner``'s recv_x rows, built block by block: ``(source, row in the source's
    sorted copies)``, ``(-1, None)`` for padding."""
    local = len(table[0]) // world
    layout = []
    for e in range(local):
        col = owner * local + e
        block = []
        for src in range(world):
            count = table[src][col] if max_tokens is None else min(table[src][col], max_tokens)
            staged = sum(table[src][:col])
            block += [(src, staged + i) for i in range(count)]
        if max_tokens is not None:
            block += [(-1, None)] * (world * max_tokens - len(block))
        layout += block
    return layout


def _expected(table, rank, world, max_tokens, send_rows):
    """recv_src from this rank's layout; send_src as its inverse: where each of this rank's
    sorted copies sits in some owner's recv_x."""
    recv = _recv_layout(table, rank, world, max_tokens)
    send = [(-1, None)] * send_rows
    for owner in range(world):
        for row, (src, staged_row) in enumerate(_recv_layout(table, owner, world, max_tokens)):
            if src == rank:
                send[staged_row] = (owner, row)
    return recv, send


def _check(got, expected):
    ranks, rows = got.tolist()
    assert ranks == [src for src, _ in expected]
    assert [row for src, row in zip(ranks, rows) if src >= 0] == [row for src, row in expected if src >= 0]


# (world, local experts, max_tokens_per_rank): one rank; odd world and expert counts; padded
# with counts above max_tokens (cut) and not
@pytest.mark.parametrize("world, local, max_tokens", [(1, 3, None), (3, 1, None), (4, 3, None), (2, 2, 9),
                                                      (3, 2, 2), (4, 1, 3)])
def test_routes_match_the_blocks_built_one_by_one(world, local, max_tokens):
    g = torch.Generator().manual_seed(world * 10 + local)
    experts = world * local
    # [W, E + 1] as exchanged (the last column the token counts): the kernel reads a strided slice;
    # zeros make empty blocks, and one rank sends nothing at all
    full = torch.randint(0, 5, (world, experts + 1), generator=g, dtype=torch.int32)
    full[:, 0] = 0
    full[world - 1, :experts] = 0 if world > 1 else full[world - 1, :experts]
    table = full[:, :experts]
    listed = table.tolist()
    for rank in range(world):
        recv_rows = len(_recv_layout(listed, rank, world, max_tokens))
        send_rows = sum(listed[rank]) + 3  # 3 dropped copies sort last and go nowhere
        recv_src, send_src, per_expert = routes(table, rank, world, max_tokens, recv_rows, send_rows)
        recv, send = _expected(listed, rank, world, max_tokens, send_rows)
        _check(recv_src, recv)
        _check(send_src, send)
        fit = table.clamp(max=max_tokens) if max_tokens else table
        assert per_expert.tolist() == fit[:, rank * local:(rank + 1) * local].sum(0).tolist()


def test_routes_of_a_table_cut_by_its_capacity_stay_in_range():
    """A capacity failure's table (counts above max_tokens, more copies than rows): every
    route names a real rank or -1, so the pulls that the failure skips could not stray."""
    world, local, max_tokens = 2, 2, 2
    table = torch.tensor([[7, 0, 3, 1], [2, 9, 0, 4]], dtype=torch.int32)
    recv_src, send_src, per_expert = routes(table, 1, world, max_tokens, local * world * max_tokens, 5)
    for src in (recv_src, send_src):
        assert ((src[0] >= -1) & (src[0] < world)).all()
    assert per_expert.tolist() == [min(3, 2) + min(0, 2), min(1, 2) + min(4, 2)]
