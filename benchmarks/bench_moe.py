"""moe_experts: every rank of a W=8 expert-parallel SwiGLU MLP in one process on one GPU
(loopback symmetric buffers, docs/design.md §6): fusedpar's fused expert MLP next to the
unfused sequence a user would write from fusedpar's pieces::

    dispatched = moe_dispatch_loopback(xs, topk_idxs, topk_weights, E)
    ys = [grouped_mm(swiglu(grouped_mm(recv_x, w13.transpose(1, 2), offs)), w2.transpose(1, 2), offs)
          for (recv_x, tokens_per_expert, _), w13, w2 in ...]   # offs = tokens_per_expert.cumsum(0)
    outs = moe_combine_loopback(ys, handles)

Two shapes, bf16, router logits drawn at random (nearly uniform routing):
- ``mixtral`` (Mixtral 8x7B): H=4096, I=14336, 8 experts (one per simulated rank), top-2,
  2048 tokens per rank;
- ``fine`` (fine-grained experts, Qwen3-30B-A3B's layer): H=2048, I=768, 128 experts (16
  per simulated rank), top-8, 4096 tokens per rank.
TFLOP/s counts ``2 * 3 * H * I`` per routed copy. Target (recorded, never asserted): the
fused backend >= 1.15x the unfused sequence. Each row notes ``m_tiles``: the 128-row tiles
(over every simulated rank) of the first GEMM's rows, counted from the routing. The unfused
GEMMs tile each expert's rows; the fused GEMMs tile runs of rows that lie back to back:
with one expert per rank a run holds every source's rows; with several, each (source,
expert) block is its own run, and its last tile is partial. A profile of one call (GPU
time per kernel and copy) goes to ``results/profiles/``. Each case is checked once against the dense
expert loop in fp32 before it is timed. Skips without a GPU: no number is ever printed for
a machine that did not run it. The loopback runs the fused backend's GPU path: the copy
engine brings each source's rows once (bytes_moved = lower bound) while the first grouped
GEMM starts on the rows already there and applies SwiGLU in its epilogue.

``test_train_step_one_rank``: forward + backward on a one-rank group (4096 tokens, 8 experts
of the same size, top-2): each backend's compute in training, no communication; recorded
in ``moe_experts_train.csv`` without a target, and ``auto`` (what a user gets,
``backend=None``; target: the reference, the case's baseline, in targets.py). Then the same
rows with ``float8="rowwise"`` (fp8 dispatch and expert GEMMs, op ``moe_experts_train_float8``,
dtype float8_e4m3fn) for each backend that takes it (the others skip, saying why), each
noting ``x_bf16``: the same backend's bf16 row of this run over it. The loopback
rows have no auto row: ``moe_experts_loopback`` has no choice to make (without a backend it
runs ``fused``, the fused row).

``test_loopback_volume`` (no timing; CPU too, W=4): the rows crossing ranks are exactly
the routed copies whose expert lives on another rank, there and back (the lower bound).

A loopback case bounds its waits at ``LOOPBACK_TIMEOUT_S`` and raises a failed wait at the
end of its first call with every simulated rank's flags (``first_call``): a stuck flag fails
the case in seconds and says which flag, instead of running into the stage's time limit.
"""

import time

import numpy as np
import pytest
import torch

import fusedpar
from fusedpar import FusedparTimeoutError
from fusedpar.comm import get_loopback_buffers, layout, settings
from fusedpar.ops import protocol, registry
from fusedpar.ops.moe import dispatch, experts_dense, experts_fused, swiglu, topk_route
from fusedpar.ops.moe.experts_call import ExpertsCall
from fusedpar.ops.moe.experts_fused import first_gemm_blocks

from common import (AUTO, DTYPE, W_LOOPBACK, auto_choice, busy_ms, by_name, counted, gpu_profile,
                    host_ms, name, or_skip, rel_err)
from targets import BASELINES

OP = "moe_experts"
# per simulated rank: tokens, hidden, intermediate, experts, top-k
SHAPES = {"mixtral": (2048, 4096, 14336, 1, 2), "fine": (4096, 2048, 768, 16, 8)}
_, HIDDEN, INTERMEDIATE, _, TOP_K = SHAPES["mixtral"]  # the train rows' sizes
TILE_ROWS = 128  # BLOCK_M of both backends' first GEMM on sm_90 and sm_80
BACKENDS = ["unfused", "fused"]  # the baseline first
TARGET = BASELINES[OP]["unfused"]
# One process issues every simulated rank's work to one GPU in stream order, so a flag that is
# not up within seconds never will be; FUSEDPAR_TIMEOUT's default (60 s) would cost a minute
# per simulated rank before a stuck case fails.
LOOPBACK_TIMEOUT_S = 2
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


def _flags(views) -> str:
    """Each simulated rank's host epoch and the flags its signal pad holds."""
    world, lines = len(views), []
    for view in views:
        pad = view.pad().tolist()
        flags = ", ".join(f"{word} {pad[at:at + world]}" for word, at in
                          (("READY", layout.READY), ("DONE", layout.DONE), ("GATHERED", layout.GATHERED)))
        lines.append(f"rank {view.rank}: epoch {view.epoch} (EPOCH word {pad[layout.EPOCH]}), "
                     f"STATUS {pad[layout.STATUS:layout.STATUS + 3]}, {flags}")
    return "\n".join(lines)


def first_call(fn, monkeypatch):
    """``counted(fn)`` with a failed wait raised at the end of this call
    (``FUSEDPAR_SYNC_ERRORS=1``; on a GPU it would surface at the next call), the error
    followed by every simulated rank's flags (``_flags``) as the call left them."""
    views = []

    def recording(world, nbytes, device):
        views[:] = get_loopback_buffers(world, nbytes, device)
        return views[:]

    try:
        with monkeypatch.context() as patch:
            for module in (dispatch, experts_fused):
                patch.setattr(module, "get_loopback_buffers", recording)
            patch.setenv("FUSEDPAR_SYNC_ERRORS", "1")
            settings.refresh()
            try:
                return counted(fn)
            except FusedparTimeoutError as e:
                raise FusedparTimeoutError(f"{e}\nflags after the call:\n{_flags(views)}") from e
    finally:
        settings.refresh()  # the context put the environment back


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


def _m_tiles(backend, idxs, local) -> int:
    """The first GEMM's TILE_ROWS-row tiles over every simulated rank (see the docstring)."""
    world = len(idxs)
    table = torch.stack([torch.bincount(idx[idx >= 0].flatten().cpu(), minlength=world * local)
                         for idx in idxs])
    if backend == "unfused":
        rows = table.sum(0).numpy()
    else:
        rows = first_gemm_blocks(table, list(range(world)), local)[1][:, 2]
    return int(np.ceil(rows / TILE_ROWS).sum())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape_name", SHAPES)
def test_loopback(benchmark, gpu, gpu_times, record_row, record_profile, report_target, synced,
                  monkeypatch, shape_name, backend):
    world = W_LOOPBACK
    tokens, hidden, inter, local, k = SHAPES[shape_name]
    monkeypatch.setenv("FUSEDPAR_TIMEOUT", str(LOOPBACK_TIMEOUT_S))
    settings.refresh()
    case = _case(world, tokens, hidden, inter, local, k, DTYPE, gpu)
    fn = _fn(backend, case)
    outs, moved = or_skip(first_call, fn, monkeypatch)
    err = _check(outs, case)
    assert err < 2e-2, f"{backend}: relative error {err}"
    median, p20, p80 = gpu_times(fn)
    copies = world * tokens * k
    tflops = 2 * 3 * hidden * inter * copies / (median * 1e-3) / 1e12
    _medians[(shape_name, backend)] = median
    busy, kernels = gpu_profile(fn)
    notes = {"tflops": f"{tflops:.1f}", "top_k": k, "experts": world * local,
             "m_tiles": _m_tiles(backend, case[1], local), "gpu_busy_ms": f"{busy:.2f}",
             "host_ms": f"{host_ms(fn):.2f}"}
    if backend != "unfused" and (shape_name, "unfused") in _medians:
        speedup = _medians[(shape_name, "unfused")] / median
        notes["x_unfused"] = f"{speedup:.2f}"
        report_target(f"moe_experts loopback W={world} {shape_name}: {backend} {speedup:.2f}x "
                      f"unfused (target >= {TARGET}x)")
    shape = (world, tokens, hidden, inter)
    lower_bound = _lower_bound(case[1], local, hidden, outs[0].element_size())
    record_row(OP, backend, shape, DTYPE, world, median, p20, p80,
               algo_bytes=2 * copies * hidden * outs[0].element_size(),
               bytes_moved=moved, lower_bound=lower_bound, **notes)
    record_profile(OP, backend, shape, median, busy, kernels)
    benchmark.group = f"{OP} loopback {name(shape)}"
    benchmark.extra_info.update(tflops=tflops)
    benchmark.pedantic(synced(fn), rounds=10, warmup_rounds=2, iterations=1)


# ---- training, one rank ----------------------------------------------------------------------

TRAIN_TOKENS, TRAIN_EXPERTS = 4096, 8  # one rank holding 8 experts: ~1,024 rows per expert
_SPEC = registry.get(OP)
# the baseline first, what a user gets (backend=None) last
TRAIN_BACKENDS = [_SPEC.oracle, *(n for n in _SPEC.backends if n != _SPEC.oracle), AUTO]


@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
@pytest.mark.parametrize("float8", [None, "rowwise"], ids=["bf16", "float8"])  # bf16 first: fp8's baseline
def test_train_step_one_rank(benchmark, one_rank_group, gpu_times, synced, record_row,
                             record_profile, float8, backend):
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
        y = fusedpar.ops.moe_experts(x, idx, w, w13, w2, one_rank_group, float8=float8,
                                     backend=None if backend == AUTO else backend)
        return y, torch.autograd.grad(y, (x, w, w13, w2), dy)

    (y, (dx, *_)), _ = or_skip(counted, step)
    ref = [t.detach().float().requires_grad_() for t in (x, w, w13, w2)]
    ref_y = experts_dense(ref[0], idx, *ref[1:])
    (ref_dx,) = torch.autograd.grad(ref_y, ref[0], dy.float())
    errors = rel_err(y, ref_y.detach()), rel_err(dx, ref_dx)
    # fp8: the recipe's casts (e4m3, 3 mantissa bits) on top of bf16's rounding
    assert max(errors) < (2e-2 if float8 is None else 1e-1), f"{backend}: relative errors of y and dx {errors}"
    median, p20, p80 = gpu_times(step)
    copies = TRAIN_TOKENS * TOP_K
    tflops = 3 * 2 * 3 * HIDDEN * INTERMEDIATE * copies / (median * 1e-3) / 1e12
    op, key = (f"{OP}_train", "train") if float8 is None else (f"{OP}_train_float8", "train float8")
    _medians[f"{key} {backend}"] = median
    busy, kernels = gpu_profile(step)
    notes = {"mode": "train_one_rank", "tflops": f"{tflops:.1f}", "top_k": TOP_K,
             "experts": TRAIN_EXPERTS, "gpu_busy_ms": f"{busy:.2f}", "host_ms": f"{host_ms(step):.2f}"}
    if backend != "reference" and f"{key} reference" in _medians:
        notes["x_reference"] = f"{_medians[f'{key} reference'] / median:.2f}"
    if float8 is not None and f"train {backend}" in _medians:  # the bf16 row of this run
        notes["x_bf16"] = f"{_medians[f'train {backend}'] / median:.2f}"
    if backend == AUTO:
        notes["chose"] = auto_choice(OP, ExpertsCall(x, idx, w, w13, w2, one_rank_group, None, float8))
    shape = (1, TRAIN_TOKENS, HIDDEN, INTERMEDIATE)
    record_row(op, backend, shape, DTYPE if float8 is None else torch.float8_e4m3fn, 1, median, p20, p80,
               algo_bytes=2 * copies * HIDDEN * x.element_size(), **notes)
    record_profile(op, backend, shape, median, busy, kernels)
    benchmark.group = f"{OP} {key} one rank {name(shape)}"
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


def test_a_stuck_loopback_wait_fails_fast_with_every_ranks_flags(local_device, monkeypatch):
    """Simulated rank 1 never stages its rows (its READY flag stays down): the fused case
    fails within seconds, not a minute per simulated rank, naming the flag, with each
    rank's flags."""
    monkeypatch.setenv("FUSEDPAR_TIMEOUT", str(LOOPBACK_TIMEOUT_S))
    settings.refresh()
    stage = protocol.stage
    monkeypatch.setattr(protocol, "stage",
                        lambda launchers, buf, *args, **kwargs: None if buf.rank == 1
                        else stage(launchers, buf, *args, **kwargs))
    case = _case(2, 3, 16, 8, 1, 2, torch.float32, local_device, seed=1)
    start = time.monotonic()
    with pytest.raises(FusedparTimeoutError) as failure:
        first_call(_fn("fused", case), monkeypatch)
    message = str(failure.value)
    assert time.monotonic() - start < 15, message
    assert "rank 0 of group 'loopback2'" in message and "flag READY[1]" in message, message
    ranks = [line for line in message.splitlines() if line.startswith("rank ")]
    assert [line.split(":")[0] for line in ranks] == ["rank 0", "rank 1"], message
    assert "STATUS [1, 1, " in ranks[0] and "READY [" in ranks[1], message


def test_busy_ms_counts_overlaps_once_and_gaps_not_at_all():
    """The arithmetic behind the rows' gpu_busy_ms: a side stream's copies under a GEMM count
    once, the host's gaps between kernels not at all."""
    assert busy_ms([(0, 1000), (500, 1500), (3000, 3500), (100, 200)]) == 2.0
    assert busy_ms([]) == 0


def test_profile_sums_each_kernels_intervals():
    """The arithmetic behind results/profiles/: each name's intervals summed and counted
    (overlaps included), the largest total first."""
    intervals = [("gemm", 0, 1000), ("copy", 500, 1500), ("gemm", 3000, 4500), ("sum", 10, 20)]
    assert by_name(intervals) == [("gemm", 2.5, 2), ("copy", 1.0, 1), ("sum", 0.01, 1)]
    assert by_name([]) == []


def test_m_tiles_count_the_first_gemms_tiles():
    """Hand-counted: 2 ranks, one expert each, top-1; each rank routes 100 tokens to expert 0
    and 60 to expert 1. Unfused: expert 0's 200 rows are 2 tiles, expert 1's 120 one. Fused:
    rank 0 multiplies its own 100 rows, then rank 1's, which follow them (one run, 2 tiles);
    rank 1's own 60 rows lie after rank 0's 60 (source order), so its two blocks are two runs
    of one tile each."""
    idx = torch.tensor([0] * 100 + [1] * 60)[:, None]
    assert _m_tiles("unfused", [idx, idx], 1) == 3
    assert _m_tiles("fused", [idx, idx], 1) == 4
    # two experts per rank, so each (source, expert) block is its own run with its own
    # partial tile: rank 0 gets 100 + 60 rows from each source, rank 1 30 + 130
    idx = torch.tensor([0] * 100 + [1] * 60 + [2] * 30 + [3] * 130)[:, None]
    assert _m_tiles("unfused", [idx, idx], 2) == 2 + 1 + 1 + 3  # 200, 120, 60, 260 rows
    assert _m_tiles("fused", [idx, idx], 2) == 2 * (1 + 1) + 2 * (1 + 2)


def test_profile_file_lists_the_largest_kernels(record_profile, tmp_path, monkeypatch):
    monkeypatch.setitem(record_profile.__globals__, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a test GPU")
    kernels = [("gemm", 3.0, 2), ("copy", 1.0, 4), ("sum", 0.5, 1)]
    path = record_profile(OP, "fused", (8, 16), 5.0, 4.0, kernels, top=2)
    assert path == tmp_path / "profiles" / f"{OP}_fused_8x16.txt"
    lines = path.read_text().splitlines()
    assert "a test GPU" in lines[0] and "median 5.000 ms, GPU busy 4.000 ms" in lines[1]
    assert lines[3].split() == ["3.000", "2", "75.0", "gemm"]
    assert lines[4].split() == ["1.000", "4", "25.0", "copy"]
    assert lines[5].split() == ["0.500", "1", "(1", "more", "names)"]

