"""Every wait on a peer is bounded by wall-clock time (FUSEDPAR_TIMEOUT), whatever a poll of a
flag costs: a missing peer fails the others within [T, 1.5 T], a late one inside T does not,
and the first call on a new group (its rendezvous) is bounded too."""

import time

import pytest
import torch
import torch.distributed as dist
import triton

import fusedpar
from fusedpar.comm import layout, symmetric
from fusedpar.errors import FusedparError
from fusedpar.kernels import all_gather, signal
from fusedpar.ops import protocol
from tests.comm.test_symmetric import record
from tests.dist_pool import leftover_shm
from tests.ops.collective_cases import env, subgroup

pytestmark = [pytest.mark.timeout(180)]
T = 3.0


def _gather(x, group):
    return fusedpar.ops.all_gather(x, 0, group, backend="triton")


def _late_or_missing(late_by: float | None):
    """Rank 1 calls ``late_by`` seconds late (None: never); returns what rank 0 saw."""
    group = subgroup()
    x = torch.full((4, 3), float(dist.get_rank() + 1))
    _gather(x, group)  # a healthy call first: the buffer exists on every rank
    dist.barrier()
    with env(FUSEDPAR_TIMEOUT=T):
        if dist.get_rank() == 1:
            if late_by is None:
                time.sleep(2 * T)
                return None
            time.sleep(late_by)
        start = time.monotonic()
        try:
            out = _gather(x, group)
        except fusedpar.FusedparTimeoutError as e:
            return {"elapsed": time.monotonic() - start, "error": str(e)}
        return {"elapsed": time.monotonic() - start, "out": out}


def test_a_missing_peer_fails_within_the_timeout(pools):
    seen = pools(2).run(_late_or_missing, None)[0]
    assert "error" in seen, seen
    assert T <= seen["elapsed"] <= 1.5 * T, seen
    assert "READY[1]" in seen["error"] and f"~{T:g} s" in seen["error"]
    assert not leftover_shm()


def test_a_peer_late_by_half_the_timeout_does_not_trigger_it(pools):
    for seen in pools(2).run(_late_or_missing, T / 2):
        assert "out" in seen, seen
        assert torch.equal(seen["out"], torch.cat([torch.full((4, 3), 1.0), torch.full((4, 3), 2.0)]))


def _first_call_with_a_missing_peer():
    group = subgroup()  # new: its first call runs the rendezvous
    if dist.get_rank() == 1:
        time.sleep(2 * T)
        return None
    with env(FUSEDPAR_TIMEOUT=T):
        start = time.monotonic()
        try:
            _gather(torch.ones(4, 3), group)
        except fusedpar.FusedparTimeoutError as e:
            return {"elapsed": time.monotonic() - start, "error": str(e)}
    raise AssertionError("the first call returned although a peer never called it")


def test_the_rendezvous_of_a_first_call_is_bounded(pools):
    pool = pools(2)
    try:
        seen = pool.run(_first_call_with_a_missing_peer)[0]
    finally:
        pool.close()  # the abandoned group's collective leaves the ranks' gloo state behind
    assert T <= seen["elapsed"] <= 1.5 * T, seen
    assert "timed out" in seen["error"] and "symmetric-memory" in seen["error"], seen


def test_the_interpreter_watchdog_expires_a_call_and_finish_disarms_it():
    buf = symmetric.SymmetricBuffer([torch.zeros(layout.PAD_BYTES + 64, dtype=torch.uint8)] * 2,
                                    0, "shm", "g")
    with env(FUSEDPAR_TIMEOUT=0.2):
        buf.next_epoch()
        time.sleep(0.5)
        assert buf.pad()[layout.DEADLINE].item() == buf.epoch == 1  # kernels waiting now give up
        buf.finish("all_gather")  # nothing recorded: no error
        buf.next_epoch()
        buf.finish("all_gather")
        time.sleep(0.5)
        assert buf.pad()[layout.DEADLINE].item() == 1  # the second call was disarmed in time


def test_cuda_graph_capture_is_refused_with_a_clear_error(monkeypatch):
    """A call whose kernels or host code depend on host values a replay would freeze refuses
    capture before any flag is touched."""
    buf = symmetric.SymmetricBuffer([torch.zeros(layout.PAD_BYTES + 64, dtype=torch.uint8)] * 2,
                                    0, "torch", "g")
    monkeypatch.setattr(symmetric, "capturing", lambda device: True)
    with pytest.raises(FusedparError, match="cannot be captured in a CUDA graph"):
        buf.next_epoch()
    assert buf.epoch == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_poison_fills_nan_only_after_a_recorded_failure(dtype):
    pad = torch.zeros(layout.PAD_BYTES // 4, dtype=torch.int32)
    out = torch.arange(3000, dtype=dtype)  # several blocks, a ragged tail
    cols = torch.arange(12.0).view(3, 4).t()  # not contiguous
    ints = torch.arange(5)
    signal.poison_if_failed(pad, out)
    signal.poison_if_failed(pad, cols)
    assert torch.equal(out, torch.arange(3000, dtype=dtype))
    assert torch.equal(cols, torch.arange(12.0).view(3, 4).t())
    pad[layout.STATUS] = layout.TIMEOUT_READY
    for t in (out, cols, ints):
        signal.poison_if_failed(pad, t)
    assert out.isnan().all() and cols.isnan().all()
    assert torch.equal(ints, torch.arange(5))  # integers have no NaN: left alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (4 GiB)")
def test_gpu_poison_reaches_past_two_to_the_31_elements():
    """The fill's offsets are int64: the last elements of a 2^31 + 1000 element output
    (past what an int32 offset reaches) get their NaN too."""
    n = 2**31 + 1000
    out = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    pad = torch.zeros(layout.PAD_BYTES // 4, dtype=torch.int32, device="cuda")
    pad[layout.STATUS] = layout.TIMEOUT_READY
    signal.poison_if_failed(pad, out)
    assert out[:1000].isnan().all() and out[-2000:].isnan().all()
    assert int(out.isnan().sum()) == n


@triton.jit
def _spin_kernel(pad_table, word, epoch, timeout_ns):
    """Every program waits (bounded) until ``pad[word] >= epoch``."""
    signal.wait_flag(signal.pad_ptr(pad_table, 0), word, 0, epoch, timeout_ns, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_side_stream_copy_and_flag_land_while_every_sm_spins():
    """What the fused ops' producer (``protocol.gathering``) relies on: its side-stream
    copies and flag writes need no SM, so a consumer may hold every SM while it spins on the
    flags they raise. Here far more spinning programs than fit are launched (every SM full
    of them, the rest queued), then a same-device copy and the flag write after it go on
    the side stream. If that copy needs an SM, the spin times out (STATUS records it):
    the suspected cause of the loopback all_gather_matmul stall on the copy engine."""
    pad = torch.zeros(layout.PAD_BYTES // 4, dtype=torch.int32, device="cuda")
    pad_table = torch.tensor([pad.data_ptr()], dtype=torch.int64, device="cuda")
    src = torch.randn(16 << 20, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(pad.device).multi_processor_count
    _spin_kernel[(64 * sms,)](pad_table, layout.GATHERED, 1, int(5e9), num_warps=4)
    time.sleep(0.2)  # the spinning programs hold every SM by now
    with torch.cuda.stream(protocol.side_stream(pad.device)):
        dst.copy_(src)
        protocol.write_flag(pad, layout.GATHERED, 1)
    torch.cuda.synchronize()
    assert pad[layout.STATUS].item() == 0, "the spin timed out: the side-stream copy needed an SM"
    assert torch.equal(dst, src)


def test_a_failed_call_returns_nan_and_raises_at_its_end():
    """Two loopback ranks all-gather; rank 1 expects another fingerprint, so its wait fails:
    its output is NaN (what the CUDA path returns before the error is raised at the next call)
    and the call raises; rank 0's output is right."""
    segments = [torch.zeros(layout.PAD_BYTES + 1024, dtype=torch.uint8) for _ in range(2)]
    bufs = [symmetric.SymmetricBuffer(segments, r, "loopback", "poison") for r in range(2)]
    xs = [torch.full((4, 3), float(r + 1)) for r in range(2)]
    outs = []

    def pull(buf, staged, epoch):
        out = torch.zeros(2, 4, 3)
        meta = 7 + buf.rank  # rank 0 matches the published 7, rank 1 does not
        stats = protocol.stats_tensor(out.device)
        all_gather.all_gather_pull(out, staged, buf.pad_table, buf.rank, 2, epoch, meta, 1, 12,
                                   buf.timeout_ns, stats)
        outs.append(out)
        return out

    desc = symmetric.describe_words(0, torch.float32, (4, 3), 0)
    with pytest.raises(ValueError, match="rank 1 and rank 0 of group .poison. passed different"):
        protocol.run_staged("all_gather", protocol.TRITON_LAUNCHERS, bufs, xs, 7, desc, pull)
    assert torch.equal(outs[0], torch.stack(xs))
    assert outs[1].isnan().all()


def test_a_recorded_capacity_failure_raises_a_value_error_naming_the_fix():
    """What a CUDA moe_dispatch with max_tokens_per_rank raises at the next call when its
    device-side check failed (on CPU the op adds which rank and expert)."""
    buf = symmetric.SymmetricBuffer([torch.zeros(layout.PAD_BYTES + 64, dtype=torch.uint8)] * 2,
                                    0, "shm", "g")
    buf.next_epoch()
    record(buf, layout.CAPACITY_EXCEEDED, 0, 1)
    with pytest.raises(ValueError, match="above max_tokens_per_rank .* raise max_tokens_per_rank"):
        buf.finish("moe_dispatch")
    with pytest.raises(FusedparError, match="unusable after an earlier failure"):
        buf.next_epoch()


def _missing_peer_in_every_plain_torch_wait():
    """Rank 1 never calls: rank 0's waits in the backends built on torch.distributed (the
    pipelined rings' point-to-point transfers, the reference collectives) end after
    FUSEDPAR_TIMEOUT with a FusedparTimeoutError, not after the process group's 30 minutes."""
    rank = dist.get_rank()
    x = torch.ones(8, 4)
    q = torch.ones(1, 4, 2, 8)
    calls = {
        "exchange": lambda g: [w.wait() for w in protocol.exchange(x, torch.empty_like(x), 1, 1, g)],
        "all_gather_matmul pipelined": lambda g: fusedpar.ops.all_gather_matmul(
            x, [torch.ones(4, 3)], 0, g, backend="pipelined"),
        "matmul_reduce_scatter pipelined": lambda g: fusedpar.ops.matmul_reduce_scatter(
            x, torch.ones(4, 3), "sum", 0, g, backend="pipelined"),
        "ring_attention pipelined": lambda g: fusedpar.ops.ring_attention(q, q, q, g, backend="pipelined"),
        "reduce_scatter reference": lambda g: fusedpar.ops.reduce_scatter(x, "sum", 0, g, backend="reference"),
    }
    seen = {}
    for name, call in calls.items():
        group = subgroup()  # its own: rank 0's unmatched sends stay in it
        with env(FUSEDPAR_TIMEOUT=1.0):
            if rank == 1:
                time.sleep(1.5)
                continue
            start = time.monotonic()
            try:
                call(group)
                seen[name] = "returned"
            except fusedpar.FusedparTimeoutError as e:
                seen[name] = (time.monotonic() - start, str(e))
    return seen


def test_waits_on_torch_distributed_are_bounded_too(pools):
    seen = pools(2).run(_missing_peer_in_every_plain_torch_wait)[0]
    assert len(seen) == 5
    for name, result in seen.items():
        assert result != "returned", name
        elapsed, message = result
        assert elapsed < 5, (name, result)
        assert "timed out after ~1 s" in message, (name, message)
    assert "point-to-point exchange (send to rank 1, receive from rank 1)" in seen["exchange"][1]
