"""moe_experts: every rank of a W=8 expert-parallel SwiGLU MLP in one process on one GPU
(loopback symmetric buffers, docs/design.md §6): fusedpar's fused expert MLP next to the
unfused sequence a user would write from fusedpar's pieces::

    dispatched = moe_dispatch_loopback(xs, topk_idxs, topk_weights, E)
    ys = [grouped_mm(swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs)), w2.transpose(1, 2), offs)
          for (recv_x, tokens_per_expert, _), w13, w2 in ...]   # offs = tokens_per_expert.cumsum(0)
    outs = moe_combine_loopback(ys, handles)

Mixtral-8x7B-like shapes: H=4096, I=14336, 8 experts (one per simulated rank), top-2,
2048 tokens per rank, bf16, router logits drawn at random (nearly uniform routing).
TFLOP/s counts ``2 * 3 * H * I`` per routed copy. Target (recorded, never asserted): the
fused backend >= 1.15x the unfused sequence. Each case is checked once against the dense
expert loop in fp32 before it is timed. Skips without a GPU: no number is ever printed for
a machine that did not run it. The loopback runs the fused backend's GPU path: the copy
engine brings each source's rows once (bytes_moved = lower bound) while the first grouped
GEMM starts on the rows already there and applies SwiGLU in its epilogue.

``test_train_step_one_rank``: forward + backward on a one-rank group (4096 tokens, 8 experts
of the same size, top-2): each backend's compute in training, no communication; recorded
in ``moe_experts_train.csv`` without a target.

``test_loopback_volume`` (no timing; CPU too, W=4): the rows crossing ranks are exactly
the routed copies whose expert lives on another rank, there and back (the lower bound).
"""

import pytest
import torch

import fusedpar
from fusedpar.ops.moe import experts_dense, swiglu, topk_route

from common import DTYPE, W_LOOPBACK, busy_ms, counted, gpu_busy_ms, host_ms, name, or_skip, rel_err

OP = "moe_experts"
TOKENS, HIDDEN, INTERMEDIATE, TOP_K = 2048, 4096, 14336, 2  # per simulated rank; Mixtral 8x7B
EXPERTS_PER_RANK = 1
BACKENDS = ["unfused", "fused"]  # the baseline first
TARGET = 1.15
_medians: dict = {}


def _case(world, tokens, hidden, inter, local, k, dtype, device, seed=0):
    """Every simulated rank's ``(x, topk_idx, topk_weights)`` and its experts' weights."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    experts = local * world
    xs, idxs, weights = [], [], []
    for _ in range(world):
        xs.append(torch.randn(tokens, hidden, generator=g, device=device).to(dtype))
        idx, w, _ = topk_route(torch.randn(tokens, experts, generator=g, device=device), k)
        idxs.append(idx)
        weights.append(w.to(dtype))
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=device) * hidden ** -0.5)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=device) * inter ** -0.5)
    return xs, idxs, weights, list(w13.to(dtype).chunk(world)), list(w2.to(dtype).chunk(world))


def _unfused(xs, idxs, weights, w13s, w2s):
    dispatched = fusedpar.ops.moe.moe_dispatch_loopback(xs, idxs, weights, w13s[0].shape[0] * len(xs))
    ys = []
    for (recv_x, tokens_per_expert, _), w13, w2 in zip(dispatched, w13s, w2s):
        offs = tokens_per_expert.cumsum(0).to(torch.int32)
        h = swiglu(fusedpar.ops.grouped_mm(recv_x, w13.transpose(1, 2), offs))
        ys.append(fusedpar.ops.grouped_mm(h, w2.transpose(1, 2), offs))
    return fusedpar.ops.moe.moe_combine_loopback(ys, [handle for _, _, handle in dispatched])


def _fn(backend, case):
    if backend == "unfused":
        return lambda: _unfused(*case)
    return lambda: fusedpar.ops.moe_experts_loopback(*case, backend=backend)


def _lower_bound(idxs, local, hidden, element_size) -> int:
    """Bytes received from peers over all simulated ranks: every copy routed to an expert of
    another rank crosses once there and once back."""
    crossing = sum(int(((idx // local != r) & (idx >= 0)).sum()) for r, idx in enumerate(idxs))
    return 2 * crossing * hidden * element_size


def _check(outs, case) -> float:
    xs, idxs, weights, w13s, w2s = case
    w13, w2 = torch.cat(w13s).float(), torch.cat(w2s).float()
    return max(rel_err(out, experts_dense(x.float(), idx, w.float(), w13, w2))
               for out, x, idx, w in zip(outs, xs, idxs, weights))


@pytest.mark.parametrize("backend", BACKENDS)
def test_loopback(benchmark, gpu, gpu_times, record_row, report_target, synced, backend):
    world = W_LOOPBACK
    case = _case(world, TOKENS, HIDDEN, INTERMEDIATE, EXPERTS_PER_RANK, TOP_K, DTYPE, gpu)
    fn = _fn(backend, case)
    outs, moved = or_skip(counted, fn)
    err = _check(outs, case)
    assert err < 2e-2, f"{backend}: relative error {err}"
    median, p20, p80 = gpu_times(fn)
    copies = world * TOKENS * TOP_K
    tflops = 2 * 3 * HIDDEN * INTERMEDIATE * copies / (median * 1e-3) / 1e12
    _medians[backend] = median
    notes = {"tflops": f"{tflops:.1f}", "top_k": TOP_K, "experts": world * EXPERTS_PER_RANK,
             "gpu_busy_ms": f"{gpu_busy_ms(fn):.2f}", "host_ms": f"{host_ms(fn):.2f}"}
    if backend != "unfused" and "unfused" in _medians:
        speedup = _medians["unfused"] / median
        notes["x_unfused"] = f"{speedup:.2f}"
        report_target(f"moe_experts loopback W={world}: {backend} {speedup:.2f}x unfused "
                      f"(target >= {TARGET}x)")
    shape = (world, TOKENS, HIDDEN, INTERMEDIATE)
    lower_bound = _lower_bound(case[1], EXPERTS_PER_RANK, HIDDEN, outs[0].element_size())
    record_row(OP, backend, shape, DTYPE, world, median, p20, p80,
               algo_bytes=2 * copies * HIDDEN * outs[0].element_size(),
               bytes_moved=moved, lower_bound=lower_bound, **notes)
    benchmark.group = f"{OP} loopback {name(shape)}"
    benchmark.extra_info.update(tflops=tflops)
    benchmark.pedantic(synced(fn), rounds=10, warmup_rounds=2, iterations=1)


# ---- training, one rank ----------------------------------------------------------------------

TRAIN_TOKENS, TRAIN_EXPERTS = 4096, 8  # one rank holding 8 experts: ~1,024 rows per expert
TRAIN_BACKENDS = ["reference", "pipelined", "fused"]  # the baseline first


@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
def test_train_step_one_rank(benchmark, one_rank_group, gpu_times, synced, record_row, backend):
    """Forward + backward of ``moe_experts`` on a one-rank group (ep=1): nothing crosses
    ranks, so the rows price each backend's compute in training, the part the loopback rows
    (forward only) leave out: the fused backend's SwiGLU epilogues (the forward keeping the
    gate/up products, the backward's vector-Jacobian product) against ``grouped_mm`` +
    torch's swiglu and autograd (reference, pipelined). Recorded, no target. y and dx are
    checked against the fp32 dense loop before timing."""
    device = torch.device("cuda", torch.cuda.current_device())
    (x,), (idx,), (w,), (w13,), (w2,) = _case(1, TRAIN_TOKENS, HIDDEN, INTERMEDIATE, TRAIN_EXPERTS,
                                               TOP_K, DTYPE, device)
    x, w, w13, w2 = (t.detach().requires_grad_() for t in (x, w, w13, w2))
    dy = torch.randn_like(x)

    def step():
        y = fusedpar.ops.moe_experts(x, idx, w, w13, w2, one_rank_group, backend=backend)
        return y, torch.autograd.grad(y, (x, w, w13, w2), dy)

    (y, (dx, *_)), _ = or_skip(counted, step)
    ref = [t.detach().float().requires_grad_() for t in (x, w, w13, w2)]
    ref_y = experts_dense(ref[0], idx, *ref[1:])
    (ref_dx,) = torch.autograd.grad(ref_y, ref[0], dy.float())
    errors = rel_err(y, ref_y.detach()), rel_err(dx, ref_dx)
    assert max(errors) < 2e-2, f"{backend}: relative errors of y and dx {errors}"
    median, p20, p80 = gpu_times(step)
    copies = TRAIN_TOKENS * TOP_K
    tflops = 3 * 2 * 3 * HIDDEN * INTERMEDIATE * copies / (median * 1e-3) / 1e12
    _medians[f"train {backend}"] = median
    notes = {"mode": "train_one_rank", "tflops": f"{tflops:.1f}", "top_k": TOP_K,
             "experts": TRAIN_EXPERTS, "gpu_busy_ms": f"{gpu_busy_ms(step):.2f}",
             "host_ms": f"{host_ms(step):.2f}"}
    if backend != "reference" and "train reference" in _medians:
        notes["x_reference"] = f"{_medians['train reference'] / median:.2f}"
    shape = (1, TRAIN_TOKENS, HIDDEN, INTERMEDIATE)
    record_row(f"{OP}_train", backend, shape, DTYPE, 1, median, p20, p80,
               algo_bytes=2 * copies * HIDDEN * x.element_size(), **notes)
    benchmark.group = f"{OP} train one rank {name(shape)}"
    benchmark.extra_info.update(tflops=tflops)
    benchmark.pedantic(synced(step), rounds=10, warmup_rounds=2, iterations=1)


# ---- communication volume (no timing; CPU too) -----------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_loopback_volume(local_device, backend):
    """Tiny fp32 case: outputs match the dense loop and the rows counted crossing ranks
    (there and back; the counts table is not rows) are the lower bound."""
    world, local = 4, 2  # W=8 costs 30 s in the Triton interpreter
    case = _case(world, 3, 16, 8, local, 2, torch.float32, local_device, seed=1)
    with fusedpar.comm.count_bytes() as counter:
        outs, _ = or_skip(counted, _fn(backend, case))
    assert _check(outs, case) < 1e-5
    rows = sum(n for (op, _), n in counter.by_op().items() if op != "all_gather")  # not the counts
    assert rows == _lower_bound(case[1], local, 16, 4), counter.by_op()


def test_busy_ms_counts_overlaps_once_and_gaps_not_at_all():
    """The arithmetic behind the rows' gpu_busy_ms: a side stream's copies under a GEMM count
    once, the host's gaps between kernels not at all."""
    assert busy_ms([(0, 1000), (500, 1500), (3000, 3500), (100, 200)]) == 2.0
    assert busy_ms([]) == 0
