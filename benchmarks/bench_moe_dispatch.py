"""moe_dispatch + moe_combine: every rank of a W=8 expert-parallel token exchange in one
process on one GPU (loopback symmetric buffers, docs/design.md §6), with identity experts::

    dispatched = moe_dispatch_loopback(xs, topk_idxs, topk_weights, E, max_tokens_per_rank=M)
    outs = moe_combine_loopback([recv_x for recv_x, _, _ in dispatched], handles)

three ways (and ``test_loopback_float8``: the dispatch in fp8, ``float8="rowwise"``, with
its row scales, the combine in bf16):

- ``unpadded``: ``M=None``; the sizes come from the exchanged counts, read on the host
  (one small device-to-host copy per dispatch);
- ``padded``: ``M=T`` (DeepEP's low-latency layout): nothing is read on the host;
- ``padded_graph``: the padded round trip captured once in a CUDA graph and replayed (the
  buffers keep their epochs on the device; ``common.graphed``), so no kernel launch costs
  host time.

Decode-sized batches of DeepSeek-V3-like shapes: H=7168, 256 experts (32 per simulated
rank), top-8, bf16, router logits drawn at random. No target: the rows say what the graph
and the padding buy at these sizes; a profile of one call (GPU time per kernel and copy)
goes to ``results/profiles/``. Each case is checked once against ``x * sum(weights)``
before it is timed. Skips without a GPU: no number is ever printed for a machine that did
not run it.
"""

import pytest
import torch

from fusedpar.ops.moe import moe_combine_loopback, moe_dispatch_loopback, topk_route

from common import DTYPE, W_LOOPBACK, counted, gpu_profile, graphed, host_ms, name, or_skip, rel_err

OP = "moe_dispatch"
HIDDEN, EXPERTS, TOP_K = 7168, 256, 8
TOKENS = [32, 128]  # per simulated rank
MODES = ["unpadded", "padded", "padded_graph"]  # the baseline first
_medians: dict = {}


def _case(world, tokens, device, seed=0):
    """Every simulated rank's ``(x, topk_idx, topk_weights)``."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    xs, idxs, weights = [], [], []
    for _ in range(world):
        xs.append(torch.randn(tokens, HIDDEN, generator=g, device=device).to(DTYPE))
        idx, w, _ = topk_route(torch.randn(tokens, EXPERTS, generator=g, device=device), TOP_K)
        idxs.append(idx)
        weights.append(w)
    return xs, idxs, weights


def _round_trip(xs, idxs, weights, max_tokens):
    dispatched = moe_dispatch_loopback(xs, idxs, weights, EXPERTS, max_tokens_per_rank=max_tokens)
    return moe_combine_loopback([recv_x for recv_x, _, _ in dispatched], [h for _, _, h in dispatched])


def _fn(mode, case):
    tokens = case[0][0].shape[0]
    if mode == "unpadded":
        return lambda: _round_trip(*case, None)
    padded = lambda: _round_trip(*case, tokens)  # noqa: E731
    return padded if mode == "padded" else graphed(padded)


def _lower_bound(idxs, local, element_size) -> int:
    """Bytes received from peers over all simulated ranks: every copy routed to an expert of
    another rank crosses once there and once back."""
    crossing = sum(int(((idx // local != r) & (idx >= 0)).sum()) for r, idx in enumerate(idxs))
    return 2 * crossing * HIDDEN * element_size


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("mode", MODES)
def test_loopback(benchmark, gpu, gpu_times, record_row, record_profile, synced, mode, tokens):
    world = W_LOOPBACK
    case = _case(world, tokens, gpu)
    fn = _fn(mode, case)
    outs, moved = or_skip(counted, fn)
    err = max(rel_err(out, x.float() * w.sum(1, keepdim=True)) for out, x, w in zip(outs, case[0], case[2]))
    assert err < 1e-2, f"{mode}: relative error {err}"
    median, p20, p80 = gpu_times(fn)
    key = (world, tokens)
    _medians[key, mode] = median
    busy, kernels = gpu_profile(fn)
    notes = {"top_k": TOP_K, "experts": EXPERTS, "gpu_busy_ms": f"{busy:.2f}",
             "host_ms": f"{host_ms(fn):.2f}"}
    if mode != "unpadded" and (key, "unpadded") in _medians:
        notes["x_unpadded"] = f"{_medians[key, 'unpadded'] / median:.2f}"
    if mode == "padded_graph" and (key, "padded") in _medians:
        notes["x_padded"] = f"{_medians[key, 'padded'] / median:.2f}"
    shape = (world, tokens, HIDDEN)
    copies = world * tokens * TOP_K
    element_size = case[0][0].element_size()
    record_row(OP, mode, shape, DTYPE, world, median, p20, p80,
               algo_bytes=2 * copies * HIDDEN * element_size,
               bytes_moved=None if mode == "padded_graph" else moved,  # a replay runs no Python to count
               lower_bound=_lower_bound(case[1], EXPERTS // world, element_size), **notes)
    record_profile(OP, mode, shape, median, busy, kernels)
    benchmark.group = f"{OP} loopback {name(shape)}"
    benchmark.pedantic(synced(fn), rounds=10, warmup_rounds=2, iterations=1)


# ---- fp8 dispatch (issue 44): tokens as fp8 rows with their row scales, combine in bf16 ----------
FP8_MODES = ["fp8_unpadded", "fp8_padded"]


def _fp8_round_trip(xs, idxs, weights, max_tokens):
    """The dispatch in fp8 (``float8="rowwise"``: H bytes and a 4-byte scale a row), the
    identity experts' outputs (the dequantised rows, bf16) back in bf16."""
    dispatched = moe_dispatch_loopback(xs, idxs, weights, EXPERTS, max_tokens_per_rank=max_tokens,
                                       float8="rowwise")
    ys = [(data.float() * scale[..., None]).to(DTYPE) for (data, scale), _, _ in dispatched]
    return moe_combine_loopback(ys, [h for _, _, h in dispatched])


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("mode", FP8_MODES)
def test_loopback_float8(benchmark, gpu, gpu_times, record_row, synced, mode, tokens):
    world = W_LOOPBACK
    case = _case(world, tokens, gpu)
    fn = lambda: _fp8_round_trip(*case, None if mode == "fp8_unpadded" else tokens)  # noqa: E731
    outs, moved = or_skip(counted, fn)
    err = max(rel_err(out, x.float() * w.sum(1, keepdim=True)) for out, x, w in zip(outs, case[0], case[2]))
    assert err < 5e-2, f"{mode}: relative error {err} (beyond e4m3 rounding)"
    median, p20, p80 = gpu_times(fn)
    key = (world, tokens)
    notes = {"top_k": TOP_K, "experts": EXPERTS, "host_ms": f"{host_ms(fn):.2f}"}
    bf16 = "unpadded" if mode == "fp8_unpadded" else "padded"
    if (key, bf16) in _medians:
        notes[f"x_{bf16}_bf16"] = f"{_medians[key, bf16] / median:.2f}"
    shape = (world, tokens, HIDDEN)
    crossing = _lower_bound(case[1], EXPERTS // world, 1) // (2 * HIDDEN)  # copies crossing ranks
    record_row(OP, mode, shape, torch.float8_e4m3fn, world, median, p20, p80,
               algo_bytes=world * tokens * TOP_K * (HIDDEN + 4 + 2 * HIDDEN), bytes_moved=moved,
               lower_bound=crossing * (HIDDEN + 4 + 2 * HIDDEN), **notes)  # fp8 + scale there, bf16 back
    benchmark.group = f"{OP} loopback {name(shape)}"
    benchmark.pedantic(synced(fn), rounds=10, warmup_rounds=2, iterations=1)
