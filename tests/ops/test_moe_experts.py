"""moe_experts (the expert-parallel SwiGLU MLP) against the single-process dense loop."""

import time
import warnings
from functools import partial

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.comm import resolve_group
from fusedpar.ops import float8_scales
from fusedpar.ops import protocol
from fusedpar.ops.scaled_grouped_mm import float8_grouped_mm
from fusedpar.ops.moe import experts_dense, swiglu, topk_route
from fusedpar.ops.moe import moe_experts, moe_experts_loopback
from fusedpar.ops.moe.experts import DISPATCHER
from fusedpar.ops.moe.experts_call import ExchangePlan, ExpertsCall
from fusedpar.ops.moe.experts_fused import first_gemm_blocks
from fusedpar.ops.moe.mlp import grouped_swiglu, grouped_swiglu_vjp, weight_grads
from tests.kernels.test_grouped_mm import grouped_product
from tests.ops.collective_cases import capture_errors, env, poison_symmetric, poisoned_allocations, subgroup

pytestmark = [pytest.mark.timeout(300)]


def _check_experts(T, H, I, k, E_local, backend, skew, max_tokens=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    E = E_local * world
    torch.manual_seed(0)  # the same weights and every rank's tokens on every rank
    w13, w2 = torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4
    xs = [torch.randn(T, H) for _ in range(world)]
    logits = [torch.randn(T, E) for _ in range(world)]
    if skew:  # every token's first choice is expert 0: the other experts get few or none
        logits = [lg + torch.nn.functional.one_hot(torch.tensor(0), E) * 20 for lg in logits]
    # single process: every rank's tokens through the dense loop; loss summed over ranks
    ref_w13, ref_w2 = w13.double().requires_grad_(), w2.double().requires_grad_()
    ref_xs = [x.double().requires_grad_() for x in xs]
    ref_logits = [lg.double().requires_grad_() for lg in logits]
    total, idxs = 0, []
    for x, lg in zip(ref_xs, ref_logits):
        idx, w, aux = topk_route(lg, k)
        idxs.append(idx)
        total = total + (experts_dense(x, idx, w.double(), ref_w13, ref_w2) ** 2).sum() + aux
    total.backward()
    # this rank
    sl = slice(rank * E_local, (rank + 1) * E_local)
    my_w13, my_w2 = w13[sl].clone().requires_grad_(), w2[sl].clone().requires_grad_()
    x, lg = xs[rank].clone().requires_grad_(), logits[rank].clone().requires_grad_()
    idx, w, aux = topk_route(lg, k)
    with fusedpar.comm.count_bytes() as counter:
        y = moe_experts(x, idx, w, my_w13, my_w2, backend=backend, max_tokens_per_rank=max_tokens)
    with fusedpar.comm.count_bytes() as backward:
        ((y ** 2).sum() + aux).backward()
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), ref_xs[rank].grad, **tol)
    torch.testing.assert_close(lg.grad.double(), ref_logits[rank].grad, **tol)
    torch.testing.assert_close(my_w13.grad.double(), ref_w13.grad[sl], **tol)
    torch.testing.assert_close(my_w2.grad.double(), ref_w2.grad[sl], **tol)
    ref_y = experts_dense(xs[rank].double(), idx, w.detach().double(), w13.double(), w2.double())
    torch.testing.assert_close(y.double(), ref_y, **tol)
    owner = [i // E_local for i in idxs]
    if backend == "pipelined":
        # a row per token and rank holding one of its experts, there (with its k expert ids
        # and weights, fp32) and back; backward the same rows, the weights' gradients back
        def rows(src, dst):
            return int((owner[src] == dst).any(1).sum())
        rows_in = sum(rows(r, rank) for r in range(world) if r != rank)
        rows_out = sum(rows(rank, d) for d in range(world) if d != rank)
        assert counter.total() == (rows_in + rows_out) * H * 4 + rows_in * 2 * k * 4, counter.by_op()
        assert backward.total() == (rows_in + rows_out) * H * 4 + rows_out * k * 4, backward.by_op()
        return True
    # exactly the routed copies, there (into our experts) and back (our tokens' results)
    copies_in = sum(int((owner[r] == rank).sum()) for r in range(world) if r != rank)
    copies_out = int((owner[rank] != rank).sum())
    assert counter.total() == (copies_in + copies_out) * H * 4, (counter.by_op(), copies_in, copies_out)
    assert backward.by_op() == counter.by_op()  # the output gradients, there and back
    return True


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_pipelined_swiglu_steps_match_the_unfused_ops(backend):
    """The pipelined backend's SwiGLU in the GEMM epilogue (grouped_mm's triton backend)
    and the unfused ops it falls back to (its reference backend, where Triton cannot run):
    the activation, the kept products and SwiGLU's backward, an empty group included."""
    torch.manual_seed(0)
    x, dy = torch.randn(30, 16), torch.randn(30, 16)
    w13, w2 = torch.randn(3, 24, 16), torch.randn(3, 16, 12)
    offs = torch.tensor([7, 7, 30], dtype=torch.int32)
    h13 = grouped_product(x, w13.transpose(1, 2), offs)
    grad_act = grouped_product(dy, w2, offs)
    act, kept = torch.full((30, 12), float("nan")), torch.full((30, 24), float("nan"))
    grouped_swiglu(x, w13, offs, act, kept, backend=backend)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept.double(), h13, **tol)
    torch.testing.assert_close(act.double(), swiglu(h13), **tol)
    dh13 = grouped_swiglu_vjp(dy, w2, offs, h13.float(), backend=backend)
    torch.testing.assert_close(dh13.double(), torch.func.vjp(swiglu, h13)[1](grad_act)[0], **tol)


def _blocks_by_loop(table, rank, local):
    """One view's row blocks, written out by hand: own rank's first, then rank + 1, ...;
    received rows are source-major, expert-sorted within."""
    world = table.shape[0]
    mine = slice(rank * local, (rank + 1) * local)
    blocks = []
    for src in ((rank + step) % world for step in range(world)):
        for e in range(local):
            rows = int(table[src, rank * local + e])
            staged = int(table[src, :rank * local + e].sum())
            received = int(table[:src, mine].sum() + table[src, rank * local:rank * local + e].sum())
            if rows:
                blocks.append([src, e, staged, received, rows])
    return blocks


@pytest.mark.parametrize("world, local", [(4, 1), (3, 2), (1, 3)])
def test_groups_match_a_loop_and_join_one_experts_sources(world, local):
    """The fused GEMMs' row blocks of every view (one pass for all) against a loop; their runs
    are maximal: with one expert per rank a view's rows are one run (rank 0) or two (the
    sources after it, then those before)."""
    g = torch.Generator().manual_seed(world * local)
    for _ in range(10):
        table = torch.randint(0, 3, (world, world * local), generator=g)
        blocks, runs, per_view, runs_per_view = first_gemm_blocks(table, list(range(world)), local)
        first_block = 0
        for rank, (n, _) in enumerate(zip(per_view, runs_per_view)):
            assert blocks[first_block:first_block + n].tolist() == _blocks_by_loop(table, rank, local)
            first_block += n
        views = np.split(runs, np.cumsum(runs_per_view)[:-1])
        for view, blocks_of_view in zip(views, np.split(blocks, np.cumsum(per_view)[:-1])):
            assert view[:, 1].sum() == len(blocks_of_view)
            assert view[:, 2].sum() == blocks_of_view[:, 4].sum()
        if local == 1 and (table > 0).all():
            assert runs_per_view == [1] + [2] * (world - 1)


@pytest.mark.parametrize("grouped_backend", ["", "reference"], ids=["triton", "reference"])
def test_weight_grads_sum_every_sources_rows(grouped_backend):
    """The expert weights' gradients over source-major received rows: one k-grouped launch
    summing each expert's segments of every source (Triton), or a grouped_mm per source
    (reference); a source with no rows and an expert with none at all included."""
    recv = torch.tensor([[3, 0, 5], [0, 0, 0], [7, 0, 1]])  # [source, local expert]
    plan = ExchangePlan.from_counts(None, 0, recv, recv, torch.device("cpu"))
    rows, H, I = int(recv.sum()), 8, 6
    torch.manual_seed(0)
    x, act, dy, dh13 = (torch.randn(rows, n) for n in (H, I, H, 2 * I))
    w13, w2 = torch.randn(3, 2 * I, H), torch.randn(3, H, I)
    with env(FUSEDPAR_BACKEND=grouped_backend):
        dw13, dw2 = weight_grads((True, True), w13, w2, plan, x, act, dy, dh13)
    expert = torch.repeat_interleave(torch.arange(3).repeat(3), recv.flatten())
    for e in range(3):
        mine = expert == e
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dw13[e].double(), dh13[mine].double().t() @ x[mine].double(), **tol)
        torch.testing.assert_close(dw2[e].double(), dy[mine].double().t() @ act[mine].double(), **tol)


@pytest.mark.parametrize("backend", ["fused", "pipelined", "reference"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_experts_matches_dense_loop(pools, world, backend):
    # odd sizes: 13 tokens, H=8, I=6; top-2 of 2 experts per rank
    assert pools(world).run(_check_experts, 13, 8, 6, 2, 2, backend, False) == [True] * world


@pytest.mark.parametrize("world", [2, 4])
def test_fused_with_one_expert_per_rank(pools, world):
    """One expert per rank: a rank's received rows of its expert are contiguous across
    sources, so the fused GEMMs' tiles hold several sources' rows (forward and backward;
    the interpreter's 32-row tiles over 13-row blocks)."""
    assert pools(world).run(_check_experts, 13, 8, 6, 2, 1, "fused", False) == [True] * world


@pytest.mark.parametrize("world", [1, 2, 4])
def test_padded_moe_experts_matches_dense_loop(pools, world):
    """max_tokens_per_rank (above T: the padding is real) gives the same outputs, gradients
    and bytes; the backend is chosen by default."""
    assert pools(world).run(_check_experts, 13, 8, 6, 2, 2, None, False, 16) == [True] * world


def test_pipelined_with_empty_experts_and_sources(pools):
    assert pools(4).run(_check_experts, 5, 8, 6, 2, 1, "pipelined", True) == [True] * 4


def test_pipelined_sends_a_token_once_per_rank(pools):
    """Top-4 of 4 experts per rank: most tokens have several experts on one rank, and a
    token's row goes there once (the bytes checked in ``_check_experts``)."""
    assert pools(2).run(_check_experts, 13, 8, 6, 4, 4, "pipelined", False) == [True] * 2


def _check_fused_results_outlive_the_next_call():
    """The fused forward reads its results straight from the symmetric buffer's region 2
    where they are weighted and summed at once (no autograd, or no gradient for the
    weights), and copies them out where autograd saves them for topk_weights' gradient: a
    second call on the group, which rewrites region 2, leaves the first call's gradient
    right, and so does x's (autograd saves no results when only x needs one)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    w13, w2 = torch.randn(2 * world, 12, 8) / 4, torch.randn(2 * world, 8, 6) / 4
    mine = slice(2 * rank, 2 * rank + 2)
    calls = []
    for call in range(3):
        torch.manual_seed(10 * call + rank)  # rank- and call-encoded tokens and routes
        x = torch.randn(7, 8) + rank
        idx, w, _ = topk_route(torch.randn(7, 2 * world), 2)
        calls.append((x, idx, w))
    (x, idx, w), later, unweighted = calls
    tol = dict(rtol=1e-5, atol=1e-5)
    for leaf in ("topk_weights", "x"):  # what needs a gradient
        x, w = x.detach().requires_grad_(leaf == "x"), w.detach().requires_grad_(leaf != "x")
        y = moe_experts(x, idx, w, w13[mine], w2[mine], backend="fused")
        moe_experts(*later, w13[mine], w2[mine], backend="fused")  # rewrites region 2
        (y * torch.arange(8.0)).sum().backward()
        ref_x, ref_w = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        ref = experts_dense(ref_x, idx, ref_w, w13.double(), w2.double())
        (ref * torch.arange(8.0, dtype=torch.float64)).sum().backward()
        torch.testing.assert_close(y.detach().double(), ref.detach(), **tol)
        got, want = (x.grad, ref_x.grad) if leaf == "x" else (w.grad, ref_w.grad)
        torch.testing.assert_close(got.double(), want, **tol)
    with torch.no_grad():
        y_no_grad = moe_experts(*unweighted, w13[mine], w2[mine], backend="fused")
    x3, idx3, w3 = unweighted
    torch.testing.assert_close(y_no_grad.double(), experts_dense(x3.double(), idx3, w3.double(),
                                                                 w13.double(), w2.double()), **tol)
    return True


def test_fused_results_outlive_the_next_call(pools):
    assert pools(2).run(_check_fused_results_outlive_the_next_call) == [True] * 2


def _check_dropped_copies():
    """Copies dropped by a capacity (-1 ids), a token with all of them dropped included:
    the pipelined and fused backends' outputs and gradients are the reference backend's."""
    rank = dist.get_rank()
    torch.manual_seed(rank)
    x, w = torch.randn(9, 8), torch.rand(9, 3)
    idx = torch.randint(0, 4 * dist.get_world_size(), (9, 3))
    idx[::2, 1], idx[3] = -1, -1
    torch.manual_seed(0)
    w13, w2 = torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    results = []
    for backend in ("reference", "pipelined", "fused"):
        leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
        y = moe_experts(leaves[0], idx, *leaves[1:], backend=backend)
        (y * torch.arange(8.0)).sum().backward()
        results.append([y.detach()] + [t.grad for t in leaves])
    for result in results[1:]:
        for got, want in zip(result, results[0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert result[0][3].abs().sum() == 0  # every copy of token 3 dropped
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_dropped_copies(pools, world):
    assert pools(world).run(_check_dropped_copies) == [True] * world


def _chosen():
    args = (torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1),
            torch.zeros(1, 6, 4), torch.zeros(1, 4, 3), resolve_group(None))
    call, padded = ExpertsCall(*args), ExpertsCall(*args, max_tokens_per_rank=2)
    with env(FUSEDPAR_BACKEND="reference"):
        forced = DISPATCHER.select(call).name
    return DISPATCHER.select(call).name, forced, DISPATCHER.select(padded).name


def test_backend_selection(pools):
    assert pools(2).run(_chosen) == [("pipelined", "reference", "reference")] * 2


def _errors():
    x, w = torch.zeros(4, 3), torch.ones(4, 2)
    idx = torch.zeros(4, 2, dtype=torch.long)
    return capture_errors({
        "weights_shape": lambda: moe_experts(x, idx, w, torch.zeros(1, 4, 5), torch.zeros(1, 3, 2)),
        "dtype": lambda: moe_experts(x, idx, w, torch.zeros(1, 4, 3).half(), torch.zeros(1, 3, 2)),
        # raised before any exchange, not by a grouped GEMM after the dispatch
        "float64": lambda: moe_experts(x.double(), idx, w, torch.zeros(1, 4, 3).double(),
                                       torch.zeros(1, 3, 2).double(), backend="pipelined"),
        # one rank's bad ids, each backend: every rank raises (none waits for that rank)
        **{f"expert_range_{backend}": lambda backend=backend: moe_experts(
            x, idx + 2 * dist.get_rank(), w, torch.zeros(1, 4, 3), torch.zeros(1, 3, 2),
            backend=backend) for backend in ("fused", "pipelined", "reference")},
        "backend": lambda: moe_experts(x, idx, w, torch.zeros(1, 4, 3), torch.zeros(1, 3, 2),
                                       backend="nope"),
        "padded_pipelined": lambda: moe_experts(x, idx, w, torch.zeros(1, 4, 3), torch.zeros(1, 3, 2),
                                                backend="pipelined", max_tokens_per_rank=4),
        # a failed exchange retires its group's buffer: a group of its own
        "too_many_tokens": lambda: moe_experts(x, idx, w, torch.zeros(1, 4, 3), torch.zeros(1, 3, 2),
                                               subgroup(), max_tokens_per_rank=3),
    })


def test_bad_inputs_raise_clear_errors(pools):
    for rank, rank_errors in enumerate(pools(2).run(_errors)):
        assert "do not fit" in rank_errors["weights_shape"][1]
        assert "cast them to one dtype" in rank_errors["dtype"][1]
        kind, message = rank_errors["float64"]
        assert kind == "TypeError" and "moe_experts: x, w13 and w2 are torch.float64" in message
        for backend in ("fused", "pipelined", "reference"):
            kind, message = rank_errors[f"expert_range_{backend}"]
            assert kind == "ValueError" and "rank 1's topk_idx holds expert ids outside [0, 2)" in message
            assert ("(its ids span [2, 2])" in message) == (rank == 1), message
        assert "does not exist" in rank_errors["backend"][1]
        assert "reference backend keeps them on the device" in rank_errors["padded_pipelined"][1]
        assert "max_tokens_per_rank=3 is too small" in rank_errors["too_many_tokens"][1]


# one expert per rank with skewed routing: rank 0's expert gets every source's rows, one run
# (tiles holding several sources' rows), the others none
@pytest.mark.parametrize("backend, world, k, skew, E_local", [
    ("fused", 4, 2, False, 2), ("fused", 3, 1, True, 2), ("fused", 4, 1, True, 1),
    ("reference", 4, 2, False, 2)])
def test_loopback_matches_dense_loop(backend, world, k, skew, E_local):
    T, H, I = 5, 8, 6
    E = E_local * world
    torch.manual_seed(1)
    w13, w2 = torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4
    xs = [torch.randn(T + r, H) for r in range(world)]  # T differs by rank
    routes = [topk_route(torch.randn(T + r, E) + (20 * torch.eye(E)[0] if skew else 0), k)
              for r in range(world)]
    with fusedpar.comm.count_bytes() as counter:
        ys = moe_experts_loopback(xs, [i for i, _, _ in routes], [w for _, w, _ in routes],
                                  list(w13.chunk(world)), list(w2.chunk(world)), backend=backend)
    for x, (idx, w, _), y in zip(xs, routes, ys):
        ref = experts_dense(x.double(), idx, w.double(), w13.double(), w2.double())
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    crossing = sum(int((idx // E_local != r).sum()) for r, (idx, _, _) in enumerate(routes))
    # each crossing copy there and back (reference: the counts' all_gather is not rows)
    rows = sum(n for (op, _), n in counter.by_op().items() if op != "all_gather")
    assert rows == 2 * crossing * H * 4, counter.by_op()


@pytest.mark.parametrize("seed", range(6))
def test_fused_loopback_over_random_routings(seed):
    """Seeded random cases of what the row-block tables must get right: 1 to 5 ranks, 1 to
    4 experts per rank, ranks without tokens, dropped copies (-1 ids), routing skewed onto
    one expert, hidden and intermediate sizes that fit no tile; outputs and bytes (the
    crossing copies that are not dropped, there and back)."""
    rnd = np.random.default_rng(seed)
    world, local = int(rnd.integers(1, 6)), int(rnd.integers(1, 5))
    E, k = world * local, int(rnd.integers(1, min(world * local, 4) + 1))
    H, I = int(rnd.choice([3, 17, 40])), int(rnd.choice([5, 17]))
    tokens = [int(t) for t in rnd.choice([0, 1, 7, 40], world)]
    tokens[int(rnd.integers(world))] = 40  # some tokens somewhere
    torch.manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4
    xs, idxs, weights = [torch.randn(t, H) for t in tokens], [], []
    for t in tokens:
        logits = torch.randn(t, E) + (20 * torch.eye(E)[int(rnd.integers(E))] if seed % 2 else 0)
        idx, w, _ = topk_route(logits, k)
        idxs.append(torch.where(torch.rand(idx.shape) < 0.25, -1, idx))
        weights.append(w)
    with fusedpar.comm.count_bytes() as counter:
        ys = moe_experts_loopback(xs, idxs, weights, list(w13.chunk(world)), list(w2.chunk(world)))
    for x, idx, w, y in zip(xs, idxs, weights, ys):
        ref = experts_dense(x.double(), idx, w.double(), w13.double(), w2.double())
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    crossing = sum(int(((idx >= 0) & (idx // local != r)).sum()) for r, idx in enumerate(idxs))
    assert counter.total() == 2 * crossing * H * 4, (counter.by_op(), crossing)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_loopback_flags_a_rank_with_expert_ids_out_of_range(backend):
    """Checked on the device, read with the routing counts: the error names the rank and its
    ids' span (-1, a dropped copy, is allowed)."""
    xs = [torch.randn(3, 8) for _ in range(2)]
    idxs = [torch.tensor([[0, -1], [1, 2], [3, 0]]), torch.tensor([[0, 1], [4, 2], [3, -1]])]
    weights = [torch.ones(3, 2)] * 2
    w13s, w2s = [torch.randn(2, 12, 8)] * 2, [torch.randn(2, 8, 6)] * 2
    with pytest.raises(ValueError, match=r"rank 1's topk_idx holds expert ids outside \[0, 4\) "
                                         r"\(its ids span \[-1, 4\]\)"):
        moe_experts_loopback(xs, idxs, weights, w13s, w2s, backend=backend)


def _fused_with_a_stalled_peer(T):
    """Rank 1 takes part in every collective, then stalls for 2T before staging its copies:
    rank 0's pull GEMM gives up on it after T; rank 1 then waits in vain for rank 0's results."""
    group = subgroup()  # a failed call retires its buffer: a group of its own
    torch.manual_seed(0)
    x, w13, w2 = torch.randn(5, 8), torch.randn(2, 12, 8), torch.randn(2, 8, 6)
    idx, w, _ = topk_route(torch.randn(5, 4), 2)
    stage = protocol.stage
    if dist.get_rank() == 1:
        protocol.stage = lambda *args, **kwargs: (time.sleep(2 * T), stage(*args, **kwargs))[1]
    start = time.monotonic()
    try:
        with env(FUSEDPAR_TIMEOUT=T):
            moe_experts(x, idx, w, w13, w2, group, backend="fused")
        return None
    except fusedpar.FusedparTimeoutError as e:
        return time.monotonic() - start, str(e)
    finally:
        protocol.stage = stage


def test_fused_a_stalled_peer_fails_within_the_timeout(pools):
    T = 1.5
    (elapsed, error), other = pools(2).run(_fused_with_a_stalled_peer, T)
    assert T <= elapsed <= 1.5 * T + 3 and "READY[1]" in error, (elapsed, error)
    assert other is not None and "READY[0]" in other[1], other  # no hang on the other side either


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("world, E_local", [(4, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_loopback_bf16_on_gpu(backend, world, E_local):
    """The compiled kernels (GPU configs): bf16 within 2x the error of plain torch in bf16.
    With one expert per rank the fused GEMMs' 128-row tiles hold two sources' rows; W=8 with
    one expert per rank is the layout of bench_moe's Mixtral case."""
    T, H, I, k = 300, 256, 192, 2
    E = E_local * world
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=g, device="cuda") * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g, device="cuda") * I ** -0.5
    xs = [torch.randn(T, H, generator=g, device="cuda") for _ in range(world)]
    routes = [topk_route(torch.randn(T, E, generator=g, device="cuda"), k) for _ in range(world)]
    ys = moe_experts_loopback([x.bfloat16() for x in xs], [i for i, _, _ in routes],
                              [w.bfloat16() for _, w, _ in routes], list(w13.bfloat16().chunk(world)),
                              list(w2.bfloat16().chunk(world)), backend=backend)
    for x, (idx, w, _), y in zip(xs, routes, ys):
        exact = experts_dense(x.double(), idx, w.double(), w13.double(), w2.double())
        torch_bf16 = experts_dense(x.bfloat16(), idx, w.bfloat16(), w13.bfloat16(), w2.bfloat16())
        assert (y.double() - exact).abs().max() <= 2 * (torch_bf16.double() - exact).abs().max()


def _syncs(fn) -> int:
    """Host syncs of one warm call of ``fn`` (torch's sync debug mode counts them)."""
    fn()  # compiles, allocates the buffers
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _loopback_syncs(world: int) -> int:
    """Host syncs of one warm fused loopback call."""
    T, H, I, E_local, k = 64, 128, 64, 2, 2
    g = torch.Generator(device="cuda").manual_seed(world)
    w13 = torch.randn(world * E_local, 2 * I, H, generator=g, device="cuda").bfloat16()
    w2 = torch.randn(world * E_local, H, I, generator=g, device="cuda").bfloat16()
    xs = [torch.randn(T, H, generator=g, device="cuda").bfloat16() for _ in range(world)]
    routes = [topk_route(torch.randn(T, world * E_local, generator=g, device="cuda"), k)
              for _ in range(world)]
    args = (xs, [i for i, _, _ in routes], [w.bfloat16() for _, w, _ in routes],
            list(w13.chunk(world)), list(w2.chunk(world)))
    return _syncs(lambda: moe_experts_loopback(*args, backend="fused"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_loopback_reads_the_host_once_per_call_on_gpu():
    """One host sync per call, the routing table's read, whatever the number of rank views:
    none per view (a pageable host-to-device copy there waited for the previous view's GEMM)."""
    assert {world: _loopback_syncs(world) for world in (2, 4)} == {2: 1, 4: 1}


def _group_forward_syncs() -> dict:
    """Host syncs of a warm forward per backend on a one-rank NCCL-only group (whose small
    host-side collectives run on the GPU)."""
    group = dist.new_group([dist.get_rank()], backend="nccl")
    T, H, I, E, k = 64, 128, 64, 4, 2
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    w13 = torch.randn(E, 2 * I, H, generator=g, device="cuda").bfloat16()
    w2 = torch.randn(E, H, I, generator=g, device="cuda").bfloat16()
    idx, w, _ = topk_route(torch.randn(T, E, generator=g, device="cuda"), k)
    return {backend: _syncs(lambda backend=backend: moe_experts(x, idx, w.bfloat16(), w13, w2, group, backend=backend))
            for backend in ("pipelined", "fused")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_forward_reads_the_host_twice(pools):
    """The agreement check's all-gather and the routing counts: topk_idx itself is never read
    on the host (its ids are flagged on the device, with the counts)."""
    assert pools(1).run(_group_forward_syncs) == [{"pipelined": 2, "fused": 2}]


def _gpu_forward_backward(backend, device="cuda"):
    """One rank on a GPU: a backend with SwiGLU in its GEMM epilogues (fused: on torch
    symmetric memory) in bf16 (the forward keeping the gate/up products for autograd, the
    backward's vector-Jacobian product) against the dense loop in fp64; the relative
    errors of y and of every gradient."""
    torch.manual_seed(0)
    T, H, I, E, k = 300, 256, 192, 4, 2  # I = 1.5 blocks: a gate tile reads up's columns
    x = torch.randn(T, H, device=device).bfloat16().requires_grad_()
    w13 = (torch.randn(E, 2 * I, H, device=device) * H ** -0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device=device) * I ** -0.5).bfloat16().requires_grad_()
    idx, w, _ = topk_route(torch.randn(T, E, device=device), k)
    w = w.bfloat16().requires_grad_()
    y = moe_experts(x, idx, w, w13, w2, backend=backend)
    dy = torch.randn_like(y)
    y.backward(dy)
    def dense(dtype):  # y and the gradients of the dense loop in dtype
        ref = [t.detach().to(dtype).requires_grad_() for t in (x, w, w13, w2)]
        ref_y = experts_dense(ref[0], idx, *ref[1:])
        ref_y.backward(dy.to(dtype))
        return [ref_y] + [r.grad for r in ref]

    exact = dense(torch.float64)

    def errors(results):
        return [float((got.double() - want).norm() / want.norm()) for got, want in zip(results, exact)]

    return errors([y, x.grad, w.grad, w13.grad, w2.grad]), errors(dense(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["fused", "pipelined"])
def test_gpu_forward_and_backward_in_bf16(pools, backend):
    """y, dx, dweights, dw13, dw2: within twice the error of plain torch in bf16."""
    ((ours, torch_bf16),) = pools(1).run(_gpu_forward_backward, backend)
    assert all(o <= 2 * t + 1e-3 for o, t in zip(ours, torch_bf16)), (ours, torch_bf16)


def _every_backend_on_an_nccl_only_group():
    """A group with NCCL alone (``init_process_group("nccl")``) takes CUDA tensors only: the
    small host-side collectives (the agreement checks, the symmetric-memory rendezvous and
    placement checks, the padded capacity check) must run there too. fp32 errors per
    backend against the fp64 dense loop."""
    group = dist.new_group([dist.get_rank()], backend="nccl")
    torch.manual_seed(0)
    T, H, I, E, k = 64, 32, 48, 4, 2
    x = torch.randn(T, H, device="cuda")
    w13, w2 = torch.randn(E, 2 * I, H, device="cuda") / 4, torch.randn(E, H, I, device="cuda") / 4
    idx, w, _ = topk_route(torch.randn(T, E, device="cuda"), k)
    want = experts_dense(x.double(), idx, w.double(), w13.double(), w2.double())
    errors = {}
    for backend, max_tokens in (("reference", None), ("reference", T), ("pipelined", None),
                                ("fused", None)):
        y = moe_experts(x, idx, w, w13, w2, group, backend=backend, max_tokens_per_rank=max_tokens)
        errors[f"{backend} M={max_tokens}"] = float((y.double() - want).norm() / want.norm())
    return errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_every_backend_runs_on_an_nccl_only_group(pools):
    (errors,) = pools(1).run(_every_backend_on_an_nccl_only_group)
    assert all(e < 1e-5 for e in errors.values()), errors


# ---- float8 experts: fp8 dispatch and scaled grouped GEMMs ------------------------------------------


def _float8_world(T, H, I, k, E, world, seed=0):
    """Every rank's tokens, routing, weights and output gradient (every rank rebuilds them):
    small integers and quarters, so the fp8 casts (power-of-2 scales) and the fp32 sums of
    the GEMMs and of the combine are exact."""
    g = torch.Generator().manual_seed(seed)
    ints = lambda *shape, lim=3: torch.randint(-lim, lim + 1, shape, generator=g).float()  # noqa: E731
    w13, w2 = ints(E, 2 * I, H, lim=2), ints(E, H, I, lim=2)
    xs = [ints(T, H) + r for r in range(world)]  # rank r's rows carry r
    idxs = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) for _ in range(world)]
    ws = [(torch.randint(1, 5, (T, k), generator=g) / 4) for _ in range(world)]
    grads = [ints(T, H) for _ in range(world)]
    return w13, w2, xs, idxs, ws, grads


def _float8_copy(x_row, w13_e, w2_e):
    """One copy's expert output under the rowwise recipe's forward, in plain torch (fp64 of
    the casts' exact values; ``float8_scales.quantize`` is torchao's cast, checked there)."""
    def deq(t):
        data, scale = float8_scales.quantize(t, torch.float8_e4m3fn, -1, True)
        return data.double() * scale.double()
    h13 = (deq(x_row[None]) @ deq(w13_e).t()).float()  # w13_e's rows are b's columns
    return (deq(swiglu(h13)) @ deq(w2_e).t()).float()[0]


def _float8_dense(w13, w2, xs, idxs, ws, E_local, recipe):
    """Every expert's copies in one process, in recv_x's (expert, source, token) order,
    through ``float8_grouped_mm`` on its reference backend (a ``torch._scaled_mm`` per group;
    checked bitwise against torchao's recipe in test_scaled_grouped_mm): every rank's outputs."""
    world = len(xs)
    outs = [torch.zeros_like(x) for x in xs]
    for r in range(world):
        rows, dest, offs = [], [], []
        for e in range(r * E_local, (r + 1) * E_local):
            for s in range(world):
                for t, j in (idxs[s] == e).nonzero().tolist():
                    rows.append(xs[s][t])
                    dest.append((s, t, j))
            offs.append(len(rows))
        x_rows = torch.stack(rows) if rows else xs[0].new_zeros(0, xs[0].shape[1])
        offs = torch.tensor(offs, dtype=torch.int32)
        sl = slice(r * E_local, (r + 1) * E_local)
        gemm = partial(float8_grouped_mm, offs=offs, recipe=recipe, out_dtype=torch.float32, backend="reference")
        y = gemm(swiglu(gemm(x_rows, w13[sl].transpose(1, 2))), w2[sl].transpose(1, 2))
        for i, (s, t, j) in enumerate(dest):
            outs[s] = outs[s].index_add(0, torch.tensor([t]), (ws[s][t, j] * y[i])[None])
    return outs


def _check_float8_experts(T, H, I, k, E_local, recipe):
    rank, world = dist.get_rank(), dist.get_world_size()
    E = E_local * world
    w13, w2, xs, idxs, ws, grads = _float8_world(T, H, I, k, E, world)
    sl = slice(rank * E_local, (rank + 1) * E_local)
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    my_w13, my_w2 = w13[sl].clone().requires_grad_(), w2[sl].clone().requires_grad_()
    with fusedpar.comm.count_bytes() as counter:
        y = moe_experts(x, idxs[rank], w, my_w13, my_w2, float8=recipe, backend="reference")
    y.backward(grads[rank])
    # forward: each copy through the recipe's casts in plain torch, weighted and summed
    want = torch.stack([sum(ws[rank][t, j] * _float8_copy(xs[rank][t], w13[e], w2[e])
                            for j, e in enumerate(idxs[rank][t].tolist())) for t in range(T)])
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    # backward: the whole layer in one process through float8_grouped_mm
    ref_w13, ref_w2 = w13.clone().requires_grad_(), w2.clone().requires_grad_()
    ref_xs = [t.clone().requires_grad_() for t in xs]
    ref_ws = [t.clone().requires_grad_() for t in ws]
    outs = _float8_dense(ref_w13, ref_w2, ref_xs, idxs, ref_ws, E_local, recipe)
    sum((o * g).sum() for o, g in zip(outs, grads)).backward()
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, outs[rank], **tol)
    torch.testing.assert_close(x.grad, ref_xs[rank].grad, **tol)
    torch.testing.assert_close(w.grad, ref_ws[rank].grad, **tol)
    torch.testing.assert_close(my_w13.grad, ref_w13.grad[sl], **tol)
    torch.testing.assert_close(my_w2.grad, ref_w2.grad[sl], **tol)
    # fp8 there (H bytes and a 4-byte scale a copy), the outputs back in fp32
    owner = [i // E_local for i in idxs]
    copies_in = sum(int((owner[r] == rank).sum()) for r in range(world) if r != rank)
    copies_out = int((owner[rank] != rank).sum())
    assert counter.by_op() == {("moe_dispatch", "reference"): copies_in * (H + 4),
                               ("moe_combine", "reference"): copies_out * H * 4}
    return True


def _float8_cases(cases):
    for case in cases:
        _check_float8_experts(*case)
    return True


# (T, H, I, k, E_local, recipe); odd T, an expert with no copies likely at k=1
@pytest.mark.parametrize("world, cases", [(2, [(7, 16, 8, 2, 2, "rowwise"), (5, 16, 8, 1, 3, "rowwise_with_gw_hp")]),
                                          (4, [(5, 16, 8, 2, 1, "rowwise")])])
def test_float8_experts_match_the_recipe(pools, world, cases):
    assert pools(world).run(_float8_cases, cases) == [True] * world


def _float8_run(backend, recipe, E_local, w13, w2, x, idx, w, grad):
    """This rank's y and the gradients of x, w, w13 and w2 from ``moe_experts(...,
    float8=recipe, backend=backend)``."""
    rank = dist.get_rank()
    sl = slice(rank * E_local, (rank + 1) * E_local)
    leaves = [t.clone().requires_grad_() for t in (x, w, w13[sl], w2[sl])]
    y = moe_experts(leaves[0], idx, leaves[1], *leaves[2:], float8=recipe, backend=backend)
    y.backward(grad)
    return [y.detach()] + [t.grad for t in leaves]


def _check_float8_backend(backend, T, H, I, k, E_local, recipe):
    """The pipelined or fused backend's fp8 path against the reference backend's, bitwise: y
    and the gradients of x, the routing weights, w13 and w2, on ``_float8_world``'s data
    (rank-dependent tokens; each row is cast and multiplied as the reference does, the
    weight gradients run over every source's rows in the reference's order, and each
    token's sums of its copies are exact). The fused backend's SwiGLU runs in its GEMM's
    epilogue (Triton's sigmoid, not torch's silu: fp32 ulps apart, which the fp8 casts of
    its output round away on these data; bf16 rounds both alike), so only the
    high-precision weight gradient of ``rowwise_with_gw_hp``, ``act``ᵀ @ dy, differs, by
    those ulps. Symmetric buffers poisoned first."""
    rank, world = dist.get_rank(), dist.get_world_size()
    w13, w2, xs, idxs, ws, grads = _float8_world(T, H, I, k, E_local * world, world)
    case = (recipe, E_local, w13, w2, xs[rank], idxs[rank], ws[rank], grads[rank])
    poison_symmetric(resolve_group(None), 4 * T * k * H * 4)
    with poisoned_allocations():
        ours = _float8_run(backend, *case)
    want = _float8_run("reference", *case)
    for name, got, ref in zip(["y", "x.grad", "w.grad", "w13.grad", "w2.grad"], ours, want):
        hp_act = backend == "fused" and recipe == "rowwise_with_gw_hp" and name == "w2.grad"
        torch.testing.assert_close(got, ref, rtol=1e-5 if hp_act else 0, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return True


def _check_float8_pipelined_bytes(T, H, k, E_local):
    """bf16 tokens, forward only: the pipelined backend moves each (token, rank) row there
    as fp8 bytes and its scale, its result back in bf16 and the routing (2k fp32 a row) as
    the bf16 op does: the lower bound; the rows there at most 0.55x the bf16 op's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    w13, w2, xs, idxs, ws, _ = _float8_world(T, H, 8, k, E_local * world, world, seed=1)
    sl = slice(rank * E_local, (rank + 1) * E_local)
    args = (xs[rank].bfloat16(), idxs[rank], ws[rank], w13[sl].bfloat16(), w2[sl].bfloat16())
    moved = {}
    for float8 in (None, "rowwise"):
        with torch.no_grad(), fusedpar.comm.count_bytes() as counter:
            moe_experts(*args, float8=float8, backend="pipelined")
        moved[float8] = counter.total()
    held = [torch.stack([(i // E_local == d).any(1) for d in range(world)]).sum(1) for i in idxs]
    rows_in = sum(int(held[r][rank]) for r in range(world) if r != rank)
    rows_out = sum(int(held[rank][d]) for d in range(world) if d != rank)
    there, back, routing = rows_in * (H + 4), rows_out * H * 2, rows_in * 2 * k * 4
    assert moved["rowwise"] == there + back + routing, (moved, there, back, routing)
    # the same rows back and routing; only the rows there shrink, to at most 0.55x
    assert moved[None] - moved["rowwise"] == rows_in * 2 * H - there, moved
    assert there <= 0.55 * rows_in * 2 * H
    return moved


def _check_float8_fused_bytes(T, H, k):
    """bf16 tokens, forward only, one expert per rank (a token's copies on k ranks): the
    fused backend moves each copy there as fp8 bytes and its scale (H + 4 bytes), its
    result back in bf16, the same rows as the pipelined backend without its routing (2k
    fp32 a row; the fused backend's rows are sorted by expert before they travel), the
    lower bound of both; the rows there shrink as the pipelined ones do."""
    rank, world = dist.get_rank(), dist.get_world_size()
    w13, w2, xs, idxs, ws, _ = _float8_world(T, H, 8, k, world, world, seed=1)
    args = (xs[rank].bfloat16(), idxs[rank], ws[rank], w13[rank:rank + 1].bfloat16(), w2[rank:rank + 1].bfloat16())
    moved = {}
    for backend, float8 in (("fused", None), ("fused", "rowwise"), ("pipelined", "rowwise")):
        with torch.no_grad(), fusedpar.comm.count_bytes() as counter:
            moe_experts(*args, float8=float8, backend=backend)
        moved[backend, float8] = counter.total()
    copies_in = sum(int((idxs[r] == rank).sum()) for r in range(world) if r != rank)
    copies_out = int((idxs[rank] != rank).sum())
    there, back = copies_in * (H + 4), copies_out * H * 2
    assert moved["fused", "rowwise"] == there + back, (moved, there, back)
    assert moved["pipelined", "rowwise"] == there + back + copies_in * 2 * k * 4, moved
    assert moved["fused", None] - moved["fused", "rowwise"] == copies_in * 2 * H - there, moved
    return {float8: moved["fused", float8] for float8 in (None, "rowwise")}


def _float8_backend_cases(backend, cases):
    for case in cases:
        _check_float8_backend(backend, *case)
    if backend == "fused":
        return _check_float8_fused_bytes(9, 64, 2)
    return _check_float8_pipelined_bytes(9, 64, 2, 1)


# (T, H, I, k, E_local, recipe); odd T; the tokens carry their rank; I = 16 at W = 4: the fused
# push reads 16-byte fp8 act rows (TMA descriptors), at I = 8 pointer loads
@pytest.mark.parametrize("backend", ["pipelined", "fused"])
@pytest.mark.parametrize("world, cases", [(2, [(7, 16, 8, 2, 2, "rowwise"), (5, 16, 8, 2, 1, "rowwise_with_gw_hp")]),
                                          (4, [(5, 16, 16, 2, 1, "rowwise")])])
def test_float8_backend_matches_the_reference_backend(pools, world, cases, backend):
    moved = pools(world).run(_float8_backend_cases, backend, cases)
    assert all(m["rowwise"] < m[None] for m in moved), moved


def _gpu_float8_backends(recipe):
    """One rank on a GPU, bf16, through the compiled kernels (the fused backend's fp8 SwiGLU
    gather of rows that carry their scales, its fp8 push GEMMs): each backend's y and
    gradients relative to the reference backend's (the same casts; the GEMMs' fp32 sums
    may run in other orders)."""
    torch.manual_seed(0)
    T, H, I, E, k = 301, 256, 192, 4, 2
    x = torch.randn(T, H, device="cuda").bfloat16()
    w13 = (torch.randn(E, 2 * I, H, device="cuda") * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda") * I ** -0.5).bfloat16()
    idx, w, _ = topk_route(torch.randn(T, E, device="cuda"), k)
    grad = torch.randn(T, H, device="cuda").bfloat16()
    runs = {backend: _float8_run(backend, recipe, E, w13, w2, x, idx, w.bfloat16(), grad)
            for backend in ("reference", "pipelined", "fused")}
    return {backend: [float((o.double() - r.double()).norm() / r.double().norm())
                      for o, r in zip(results, runs["reference"])] for backend, results in runs.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_gpu_float8_backends_match_the_reference(pools, recipe):
    """y, dx, dweights, dw13, dw2 of the pipelined and fused fp8 paths within bf16 and fp8
    rounding of the reference backend's."""
    (errors,) = pools(1).run(_gpu_float8_backends, recipe)
    assert all(e < 1e-2 for e in errors["fused"] + errors["pipelined"]), errors


def _float8_errors():
    x, idx, w = torch.zeros(4, 16), torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    w13, w2 = torch.zeros(1, 16, 16), torch.zeros(1, 16, 8)
    return capture_errors({
        "tensorwise": lambda: moe_experts(x, idx, w, w13, w2, float8="tensorwise"),
        "fp16": lambda: moe_experts(x.half(), idx, w, w13.half(), w2.half(), float8="rowwise"),
        # the fused first GEMM reads each row's fp32 scale in place: H a multiple of 4
        "fused_h": lambda: moe_experts(x[:, :6], idx, w, w13[..., :6], w2[:, :6], float8="rowwise",
                                       backend="fused"),
        "padded": lambda: moe_experts(x, idx, w, w13, w2, float8="rowwise", max_tokens_per_rank=4),
    })


def test_float8_experts_errors(pools):
    errors = pools(2).run(_float8_errors)[0]
    assert "float8='tensorwise' casts the input with one scale per tensor" in errors["tensorwise"][1]
    assert "takes bf16 or fp32" in errors["fp16"][1]
    assert "needs H a multiple of 4, got H=6" in errors["fused_h"][1]
    assert "use backend='pipelined' or 'reference'" in errors["fused_h"][1]
    assert "float8 experts take no max_tokens_per_rank" in errors["padded"][1]
