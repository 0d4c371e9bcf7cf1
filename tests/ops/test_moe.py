"""MoE ops: topk_route, moe_dispatch / moe_combine (gloo ranks)."""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.ops.moe import expert_counts, moe_combine, moe_dispatch, topk_route
from tests.ops.collective_cases import capture_errors, poison_symmetric, poisoned_allocations, subgroup

pytestmark = [pytest.mark.timeout(300)]


# ---- routing (single process) --------------------------------------------------------------


def test_topk_route_mixtral_semantics_and_aux_loss():
    torch.manual_seed(0)
    logits = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    idx, w, aux = topk_route(logits, 2)
    probs = logits.softmax(-1)
    top, ref_idx = probs.topk(2, dim=-1)
    assert torch.equal(idx, ref_idx) and torch.allclose(w, top / top.sum(-1, keepdim=True))
    counts = torch.bincount(idx.reshape(-1), minlength=6).double()
    assert torch.allclose(aux, 6 * (counts / 9 * probs.mean(0)).sum())
    (w.sum() + aux).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    _, raw, _ = topk_route(logits, 2, renormalize=False)
    assert torch.allclose(raw, top)


def test_topk_route_capacity_drops_explicitly():
    logits = torch.tensor([[5.0, 0, 0, 0]] * 5 + [[0, 5.0, 0, 0]])  # 5 tokens want expert 0
    logits[2, 0] = 9.0  # token 2 is the most confident
    idx, w, _ = topk_route(logits, 1, capacity_factor=2.0)  # capacity ceil(2 * 6 / 4) = 3
    kept = (idx[:, 0] == 0).nonzero().flatten().tolist()
    assert len(kept) == 3 and 2 in kept  # "probs": the highest probabilities stay
    assert ((idx == -1) == (w == 0)).all() and (idx == -1).sum() == 2
    idx, _, _ = topk_route(logits, 1, capacity_factor=2.0, drop_policy="position")
    assert (idx[:, 0] == 0).nonzero().flatten().tolist() == [0, 1, 2]
    assert idx[5, 0] == 1  # under capacity: nothing dropped


def test_expert_counts_count_ids_out_of_range_nowhere():
    """No host read and no out-of-bounds index (an id outside [-1, E) is flagged elsewhere)."""
    idx = torch.tensor([[0, 5], [-1, 1], [3, -7], [1, 4]])
    assert expert_counts(idx, 4, torch.int32).tolist() == [1, 2, 0, 1]


def test_topk_route_errors():
    with pytest.raises(ValueError, match="k=5 must be between 1 and the number of experts 4"):
        topk_route(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="drop_policy"):
        topk_route(torch.zeros(3, 4), 1, capacity_factor=1.0, drop_policy="random")


# ---- dispatch / combine on ranks -----------------------------------------------------------


def _routing(rank, T, k, E, mode):
    """Every rank can rebuild every rank's routing (seeded by rank)."""
    if mode == "one_expert":  # every kept copy on expert 0, the other copies dropped
        idx = torch.full((T, k), -1, dtype=torch.int64)
        idx[:, 0] = 0
        return idx
    g = torch.Generator().manual_seed(1000 + rank)
    pool = E - 1 if mode == "skip_last_expert" else E  # expert E-1 gets no copy
    rows = [torch.randperm(pool, generator=g)[:k] for _ in range(T)]
    return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)


def _tokens(rank, T, H):
    """Row t of rank r: [r, t, then small integers]: a row names its source and token."""
    x = torch.arange(T * H, dtype=torch.float32).view(T, H) % 7
    x[:, 0], x[:, 1] = rank, torch.arange(T)
    return x


def _compact(recv_x, per_expert, world, M):
    """recv_x's rows in (expert, source, token) order; with M, check the padding is zero."""
    if M is None:
        return recv_x
    local, block, H = recv_x.shape
    assert block == world * M
    for e_l in range(local):
        assert not recv_x[e_l, int(per_expert[e_l]):].any()  # padding rows stay zero
    return torch.cat([recv_x[e_l, :int(per_expert[e_l])] for e_l in range(local)]).view(-1, H)


def _check_provenance(recv_x, per_expert, rank, world, T, H, k, E, mode, M, routings=None):
    """Exactly the copies routed to ``rank``'s experts, by (expert, source, token); returns
    them as ``[(source, token)]``. ``routings``: every rank's topk_idx, if not ``_routing``'s."""
    local = E // world
    expected = []
    for e_l in range(local):
        e = rank * local + e_l
        for src in range(world):
            src_idx = _routing(src, T, k, E, mode) if routings is None else routings[src]
            for t in range(T):
                expected += [(src, t)] * int((src_idx[t] == e).sum())
        assert per_expert[e_l] == len(expected) - int(per_expert[:e_l].sum())
    rows = _compact(recv_x, per_expert, world, M)
    assert [tuple(r) for r in rows[:, :2].long().tolist()] == expected
    assert torch.equal(rows[:, 2:], _tokens(0, T, H)[[t for _, t in expected], 2:])
    return expected


def _check_dispatch_combine(T, H, k, E, mode, backend, M):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = E // world
    idx = _routing(rank, T, k, E, mode)
    w = (torch.arange(T * k, dtype=torch.float32).view(T, k) % 4 + 1) / 4  # exact in fp32
    x = _tokens(rank, T, H).requires_grad_()
    w.requires_grad_()
    if backend == "triton":
        poison_symmetric(dist.group.WORLD, 4096)
    with fusedpar.comm.count_bytes() as counter, poisoned_allocations():
        recv_x, per_expert, handle = moe_dispatch(x, idx, w, E, max_tokens_per_rank=M, backend=backend)
        out = moe_combine(recv_x, handle)  # identity experts
    kept = (idx >= 0).float()
    assert torch.equal(out, x.detach() * (w.detach() * kept).sum(1, keepdim=True))
    expected = _check_provenance(recv_x.detach(), per_expert, rank, world, T, H, k, E, mode, M)
    # bytes: only routed rows, to and from the other ranks
    sent_away = int(((idx >= 0) & (idx // local != rank)).sum())
    from_peers = sum(1 for src, _ in expected if src != rank)
    assert counter.by_op() == {("moe_dispatch", backend): from_peers * H * 4,
                               ("moe_combine", backend): sent_away * H * 4}
    # combine is the adjoint of dispatch: <dispatch(x), g> == <x, combine_unweighted(g)>
    g = torch.arange(recv_x.numel(), dtype=torch.float32).view_as(recv_x) % 5
    with fusedpar.comm.count_bytes() as backward:
        (out * 1.0).sum().backward()
    # the same rows again, each direction counted under the op that moves rows that way
    assert backward.by_op() == counter.by_op()
    assert torch.equal(x.grad, (w.detach() * kept).sum(1, keepdim=True).expand_as(x))
    assert torch.equal(w.grad, x.detach().sum(1, keepdim=True).expand(T, k) * kept)
    recv2, _, handle2 = moe_dispatch(x.detach(), idx, torch.ones(T, k), E, max_tokens_per_rank=M,
                                     backend=backend)
    sums = torch.stack([(recv2 * g).sum(), (x.detach() * moe_combine(g, handle2)).sum()])
    dist.all_reduce(sums)  # the adjoint identity holds over the whole group
    assert sums[0] == sums[1]
    return True


# (T, H, k, E, routing); the cases are spread over the world sizes to keep CI short
CASES = {
    1: [(13, 5, 2, 8, "random"), (7, 3, 4, 4, "one_expert")],
    2: [(13, 5, 1, 4, "random"), (9, 3, 4, 8, "random"), (11, 4, 2, 4, "skip_last_expert"),
        (0, 3, 2, 4, "random")],
    4: [(9, 3, 2, 8, "random"), (10, 3, 1, 4, "one_expert"), (6, 3, 4, 8, "skip_last_expert")],
}
# (backend, max_tokens_per_rank as a function of T): every case runs with each
VARIANTS = [("reference", None), ("reference", "T"), ("triton", None), ("triton", "T")]


def _run_cases(cases, backend, padded):
    for T, *rest in cases:
        _check_dispatch_combine(T, *rest, backend, max(T, 1) if padded else None)
    return True


@pytest.mark.parametrize("backend, padded", VARIANTS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_combine_route_every_copy(pools, world, backend, padded):
    assert pools(world).run(_run_cases, CASES[world], backend, padded) == [True] * world


def _errors(backend):
    x, w = torch.zeros(4, 3), torch.ones(4, 2)
    idx = torch.zeros(4, 2, dtype=torch.long)
    E = 2 * dist.get_world_size()

    def fresh(call):  # a failed triton call retires its group's buffer: give each its own group
        group = subgroup()
        return lambda: call(group)

    return capture_errors({
        "range": lambda: moe_dispatch(x, idx + E, w, E, backend=backend),
        "dtype": lambda: moe_dispatch(x, idx.float(), w, E, backend=backend),
        "weights": lambda: moe_dispatch(x, idx, w[:, :1], E, backend=backend),
        "divisible": lambda: moe_dispatch(x, idx, w, E + 1, backend=backend),
        "mismatch": fresh(lambda g: moe_dispatch(torch.zeros(4, 3 + dist.get_rank()), idx, w, E, g,
                                                 backend=backend)),
        # with max_tokens_per_rank the triton backend checks ids and capacity on the device
        "range_padded": fresh(lambda g: moe_dispatch(x, idx - 2, w, E, g, max_tokens_per_rank=4,
                                                     backend=backend)),
        "tokens": fresh(lambda g: moe_dispatch(x, torch.arange(4).view(4, 1), w[:, :1], E, g,
                                               max_tokens_per_rank=3, backend=backend)),
        "copies": fresh(lambda g: moe_dispatch(x, idx, w, E, g, max_tokens_per_rank=4, backend=backend)),
        # one rank's bad ids: every rank raises (none waits in the exchange for that rank)
        "range_one_rank": lambda: moe_dispatch(x, idx + E * dist.get_rank(), w, E, backend=backend),
    })


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_inputs_raise_clear_errors(pools, backend):
    errors = pools(2).run(_errors, backend)
    for rank, rank_errors in enumerate(errors):
        assert "int32 or int64" in rank_errors["dtype"][1]
        assert "topk_weights has shape (4, 1)" in rank_errors["weights"][1]
        assert "num_experts=5 is not divisible by the ep group size 2" in rank_errors["divisible"][1]
        assert rank_errors["tokens"][0] == rank_errors["copies"][0] == "ValueError"
        assert "max_tokens_per_rank=3 is too small" in rank_errors["tokens"][1]
        assert "max_tokens_per_rank=4 is too small" in rank_errors["copies"][1]
        # expert ids: flagged on the device, the same verdict on every rank naming the rank,
        # with the ids' span where that rank is this process
        assert rank_errors["range"][0] == rank_errors["range_one_rank"][0] == "ValueError"
        assert "rank 0's topk_idx holds expert ids outside [0, 4)" in rank_errors["range"][1]
        assert ("(its ids span [4, 4])" in rank_errors["range"][1]) == (rank == 0)
        assert "rank 0's topk_idx holds expert ids outside [0, 4)" in rank_errors["range_padded"][1]
        one = rank_errors["range_one_rank"][1]
        assert "rank 1's topk_idx holds expert ids outside [0, 4)" in one
        assert ("(its ids span [4, 4])" in one) == (rank == 1)
        if backend == "reference":
            assert "every rank of the ep group must agree" in rank_errors["mismatch"][1]
            assert ("(its ids span [-2, -2])" in rank_errors["range_padded"][1]) == (rank == 0)
        else:  # the same verdict on every rank, from the device-side checks
            message = rank_errors["mismatch"][1]
            assert "rank 0 shape (3, 4, 2, 0) float32" in message and "rank 1 shape (4, 4, 2, 0)" in message
            assert "shape = (hidden size, num_experts, k, max_tokens_per_rank)" in message
            assert "rank 0 passed 4 tokens" in rank_errors["tokens"][1]
            assert "routes 8 copies to expert 0" in rank_errors["copies"][1]
