import glob
import os
import stat

import pytest
import torch
import torch.distributed as dist
import triton

from fusedpar import FusedparError, FusedparTimeoutError
from fusedpar.comm import get_buffer, get_loopback_buffers, layout, symmetric
from fusedpar.kernels import signal
from tests.dist_pool import leftover_shm
from tests.ops.collective_cases import env

pytestmark = [pytest.mark.timeout(120)]


def _shm_lifecycle():
    """Segments are 0600 files, unlinked as soon as every peer mapped them; peers see writes."""
    modes = []
    real_unlink = os.unlink

    def recording_unlink(path):
        modes.append(stat.S_IMODE(os.stat(path).st_mode))
        real_unlink(path)

    os.unlink = recording_unlink
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        buf = get_buffer(group, 1000, torch.device("cpu"))
    finally:
        os.unlink = real_unlink
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has unlinked its own segment
    left = glob.glob(f"/dev/shm/{symmetric.shm_job_prefix()}*")
    buf.data(torch.int64, 4).copy_(torch.arange(4) + 100 * rank)
    dist.barrier()
    seen = [buf.data(torch.int64, 4, rank=r).tolist() for r in range(world)]
    same_addresses = buf.pad_table.tolist() == [s.data_ptr() for s in buf.segments]
    grown = get_buffer(group, buf.capacity + 1, torch.device("cpu"))
    return {"modes": modes, "left": left, "seen": seen, "capacity": buf.capacity,
            "same_addresses": same_addresses, "grown": grown.capacity, "backend": buf.backend}


def test_shm_segments_are_private_unlinked_and_shared(pools):
    results = pools(2).run(_shm_lifecycle)
    for r in results:
        assert r["modes"] == [0o600] and r["left"] == [] and r["same_addresses"]
        assert r["seen"] == [[0, 1, 2, 3], [100, 101, 102, 103]]
        assert r["backend"] == "shm" and r["capacity"] >= 1000 and r["grown"] > r["capacity"]
    assert not leftover_shm()


def _peer_lags():
    """Rank 0 waits (bounded) for a DONE flag rank 1 never raises."""
    group = dist.new_group(list(range(dist.get_world_size())))
    buf = get_buffer(group, 64, torch.device("cpu"))
    dist.barrier()
    if dist.get_rank() == 1:
        return None
    buf.pad()[layout.EPOCH] = 1  # this rank's first call: rank 1 never finishes reading it
    with env(FUSEDPAR_TIMEOUT=0.5):
        try:
            buf.wait_done_on_host()
        except FusedparTimeoutError as e:
            return str(e)
    return "returned"


def test_host_wait_is_bounded_and_names_the_flag(pools):
    message = pools(2).run(_peer_lags)[0]
    assert "DONE[1]" in message and "epoch 1" in message


def test_loopback_views_share_segments_and_keep_their_own_rank():
    views = get_loopback_buffers(3, 100, torch.device("cpu"))
    assert [v.rank for v in views] == [0, 1, 2]
    assert all(v.pad_table.tolist() == views[0].pad_table.tolist() for v in views)
    views[2].data(torch.float32, 2).fill_(5.0)
    assert views[0].data(torch.float32, 2, rank=2).tolist() == [5.0, 5.0]
    assert get_loopback_buffers(3, 100, torch.device("cpu"))[1] is views[1]  # cached


def test_buffer_refuses_out_of_range_views_and_non_loopback_rank_views():
    view = get_loopback_buffers(2, 16, torch.device("cpu"))[0]
    with pytest.raises(FusedparError, match="bytes, .* needed"):
        view.data(torch.float32, view.capacity)
    shm_like = symmetric.SymmetricBuffer([torch.zeros(layout.PAD_BYTES + 64, dtype=torch.uint8)],
                                         0, "shm", "g")
    with pytest.raises(FusedparError, match="loopback"):
        shm_like.as_rank(0)


def test_buffer_refuses_segments_whose_data_is_not_16_byte_aligned():
    """The kernels read and write data regions 16 bytes at a time (``signal.data_ptr`` tells
    the compiler so): a segment breaking that must fail here, not as a misaligned access."""
    storage = torch.zeros(layout.PAD_BYTES + 128, dtype=torch.uint8)
    offset = -storage.data_ptr() % 16  # the first 16-byte boundary
    aligned, shifted = storage[offset:offset + layout.PAD_BYTES + 64], \
        storage[offset + 4:offset + 4 + layout.PAD_BYTES + 64]
    symmetric.SymmetricBuffer([aligned, aligned], 0, "shm", "g")
    with pytest.raises(FusedparError, match=r"ranks \[1\] of group 'g' do not start on a 16-byte"):
        symmetric.SymmetricBuffer([aligned, shifted], 0, "shm", "g")


@triton.jit
def _record_kernel(pad_table, rank, code, src, epoch):
    signal.record_failure(signal.pad_ptr(pad_table, rank), code, src, epoch)


def record(buf, code, src, epoch):
    """What a kernel's failed wait does: ``record_failure`` in this rank's pad."""
    _record_kernel[(1,)](buf.pad_table, buf.rank, code, src, epoch)


def test_a_failure_a_kernel_records_reaches_the_host_mirror_and_raises_once():
    """record_failure writes STATUS and the host's status mirror (``layout.MIRROR``): the
    call raises at its end on CPU (the kernels have run), then the buffer refuses work. Only
    the first failure is kept."""
    buf = symmetric.SymmetricBuffer([torch.zeros(layout.PAD_BYTES + 64, dtype=torch.uint8)] * 2,
                                    0, "shm", "g")
    buf.next_epoch()
    record(buf, layout.TIMEOUT_READY, 1, 1)
    record(buf, layout.TIMEOUT_DONE, 1, 1)  # not the first: ignored
    assert buf._status[:3].tolist() == [layout.TIMEOUT_READY, 1, 1]
    assert buf.pad()[layout.STATUS : layout.STATUS + 3].tolist() == [layout.TIMEOUT_READY, 1, 1]
    with pytest.raises(FusedparTimeoutError, match=r"all_gather: rank 0 .* READY\[1\] \(rank 1\)"):
        buf.finish("all_gather")
    with pytest.raises(FusedparError, match="unusable after an earlier failure"):
        buf.next_epoch()


def test_loopback_views_have_a_status_mirror_each():
    """One process plays every rank of a loopback buffer: a failure of rank 1 is rank 1's."""
    views = symmetric.SymmetricBuffer([torch.zeros(layout.PAD_BYTES + 64, dtype=torch.uint8)
                                       for _ in range(3)], 0, "loopback", "loopback3")
    views = [views.as_rank(r) for r in range(3)]
    record(views[1], layout.META_MISMATCH, 2, 5)
    assert [v._status[0] for v in views] == [0, layout.META_MISMATCH, 0]


def test_a_call_that_raised_midway_leaves_the_buffer_unusable():
    buf = symmetric.SymmetricBuffer([torch.zeros(layout.PAD_BYTES + 64, dtype=torch.uint8)] * 2,
                                    0, "shm", "g")
    buf.next_epoch()
    buf.finish("all_gather")
    buf.next_epoch()  # ... and an exception before finish
    with pytest.raises(FusedparError, match="epoch 2 raised before it finished"):
        buf.next_epoch()
    with pytest.raises(FusedparError, match="unusable after an earlier failure"):
        buf.next_epoch()


def test_every_call_advances_the_device_epoch_once_and_takes_offsets():
    """Epochs live on the device: a call returns the offset 0 its kernels take, and the EPOCH
    word goes up by one per call, by an add ``next_epoch`` enqueues or, when the call's first
    kernel does it (``kernel_advances``), by that kernel. The host counts eager calls."""
    buf = symmetric.SymmetricBuffer([torch.zeros(layout.PAD_BYTES + 64, dtype=torch.uint8)] * 2,
                                    0, "shm", "g")
    word = lambda: int(buf.pad()[layout.EPOCH])  # noqa: E731

    def call(**kwargs):
        epoch = buf.next_epoch(**kwargs)
        buf.finish("op")
        return epoch, word()

    assert [call(), call(graphable=True)] == [(0, 1), (0, 2)]
    assert call(kernel_advances=True) == (0, 2)  # no kernel ran: the word stays
    assert buf.epoch == 3


def test_under_capture_only_graphable_calls_run_and_nothing_is_read_back(monkeypatch):
    """What a CUDA-graph capture does to a buffer (capture faked on CPU): a call that reads
    host values a replay would freeze is refused; a graphable one runs, marks the buffer as
    captured (kept until released if replaced) and its description unrecorded; the host
    reads no status back, a later ``synchronize`` raises what a replay recorded."""
    buf = symmetric.SymmetricBuffer([torch.zeros(layout.PAD_BYTES + 64, dtype=torch.uint8)] * 2,
                                    0, "shm", "g")
    buf.next_epoch()
    buf.finish("all_gather")
    monkeypatch.setattr(symmetric, "capturing", lambda device: True)
    with pytest.raises(FusedparError, match="cannot be captured in a CUDA graph.*all_gather_matmul"):
        buf.next_epoch()
    assert not buf.in_call and not buf.captured
    assert buf.next_epoch(graphable=True) == 0 and buf.captured
    assert int(buf.pad()[layout.EPOCH]) == 2
    buf.publish(symmetric.describe_words(0, torch.float32, (4, 8), 0))
    assert int(buf.pad()[layout.DESC]) == symmetric.UNRECORDED
    buf._ops[2] = "moe_dispatch"
    record(buf, layout.META_MISMATCH, 1, 2)
    buf._cuda = True  # a CUDA buffer: finish reads nothing back
    buf.finish("moe_dispatch")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with pytest.raises(ValueError, match="moe_dispatch: rank 0 and rank 1 .* inputs not recorded"):
        buf.synchronize()


def test_a_description_is_copied_only_when_it_changes_and_always_after_a_capture(monkeypatch):
    """Calls of one shape in a row copy their ``DESC`` words once (a host-to-device copy per
    call costs the host, and from pageable memory waits for the stream); a changed shape is
    copied. After a CUDA-graph capture (faked on CPU), whose replays mark the words
    unrecorded behind the host's back, every eager call copies them again."""
    buf = symmetric.SymmetricBuffer([torch.zeros(layout.PAD_BYTES + 64, dtype=torch.uint8)] * 2,
                                    0, "shm", "g")
    staged = []
    real = symmetric.host_words
    monkeypatch.setattr(symmetric, "host_words", lambda words, device: staged.append(words) or
                        real(words, device))
    desc = lambda shape: symmetric.describe_words(0, torch.float32, shape, 0)
    words = lambda: buf.pad()[layout.DESC : layout.DESC + layout.DESC_WORDS].tolist()
    for shape in [(4, 8), (4, 8), (4, 8), (5, 8), (5, 8), (4, 8)]:
        buf.publish(desc(shape))
        assert words() == desc(shape)
    assert staged == [desc((4, 8)), desc((5, 8)), desc((4, 8))]

    with monkeypatch.context() as capture:
        capture.setattr(symmetric, "capturing", lambda device: True)
        buf.publish(desc((4, 8)))
    assert words()[0] == symmetric.UNRECORDED
    for _ in range(2):
        buf.publish(desc((4, 8)))
        assert words() == desc((4, 8))
        buf.pad()[layout.DESC] = symmetric.UNRECORDED  # a replay
    assert len(staged) == 5


def test_description_staging_is_pinned_for_cuda():
    """The host copy ``publish`` stages: int32, pinned where it goes to a GPU (a
    ``non_blocking`` copy from pageable memory makes the host wait for the stream)."""
    words = symmetric.describe_words(1, torch.bfloat16, (3, 5), 0)
    cpu = symmetric.host_words(words, torch.device("cpu"))
    assert cpu.dtype == torch.int32 and cpu.tolist() == words and not cpu.is_pinned()
    if torch.cuda.is_available():
        cuda = symmetric.host_words(words, torch.device("cuda"))
        assert cuda.is_pinned() and cuda.tolist() == words


def test_buffers_a_graph_may_use_stay_allocated_until_released():
    """A replay writes to the addresses it was captured with: a grown buffer a call was
    captured on is kept (not one that never was) until release_buffers(); every replaced one
    is no longer live (the plans holding it are rebuilt)."""
    cpu = torch.device("cpu")
    symmetric.release_buffers()
    plain = get_loopback_buffers(2, 1 << 20, cpu)
    kept = get_loopback_buffers(2, 2 << 20, cpu)
    for view in kept:
        view.captured = True
    get_loopback_buffers(2, 4 << 20, cpu)
    retired = symmetric._captured_retired
    assert [v.rank for v in retired] == [0, 1] and all(v in retired for v in kept)
    assert not any(v in retired for v in plain)
    assert not any(v.live for v in plain + kept)
    symmetric.release_buffers()
    assert not symmetric._captured_retired


def test_loopback_group_starts_afresh_after_a_call_that_raised_midway(monkeypatch):
    import fusedpar
    import importlib

    all_gather_ops = importlib.import_module("fusedpar.ops.all_gather")

    xs = [torch.full((3, 5), float(r)) for r in range(2)]
    fusedpar.ops.all_gather_loopback(xs, 0, backend="triton")
    views = get_loopback_buffers(2, 60, torch.device("cpu"))

    def broken_pull(*args, **kwargs):
        raise RuntimeError("pull kernel failed to compile")

    with monkeypatch.context() as patch:
        patch.setattr(all_gather_ops.DISPATCHER.backends["triton"], "pull", broken_pull)
        with pytest.raises(RuntimeError, match="compile"):
            fusedpar.ops.all_gather_loopback(xs, 0, backend="triton")
    assert all(view.in_call for view in views)
    outs = fusedpar.ops.all_gather_loopback(xs, 0, backend="triton")  # fresh buffers, no timeout
    assert get_loopback_buffers(2, 60, torch.device("cpu"))[0] is not views[0]
    assert all(torch.equal(out, torch.cat(xs)) for out in outs)


def test_fingerprints_separate_inputs():
    a = symmetric.fingerprint("all_gather", torch.float32, (4, 6), 0, "")
    assert a == symmetric.fingerprint("all_gather", torch.float32, (4, 6), 0, "")
    assert a != symmetric.fingerprint("all_gather", torch.float32, (6, 4), 0, "")
    assert a != symmetric.fingerprint("all_gather", torch.float16, (4, 6), 0, "")
    assert 0 <= a < 2**31


def _torch_symm_reasons(hosts, peer_access):
    """torch symmetric memory's verdict for a group whose ranks sit on ``hosts`` (faked), with
    ``peer_access`` for GPU pairs (faked): agreed by every rank."""
    group = dist.new_group(list(range(dist.get_world_size())))
    symmetric._peers = lambda g: [f"{h}:{r}" for r, h in enumerate(hosts)]
    torch.cuda.can_device_access_peer = lambda a, b: peer_access
    return symmetric.torch_symm_unsupported_reason(torch.device("cuda"), group)


def test_torch_symmetric_memory_needs_one_host_and_peer_access(pools):
    """A group across hosts or GPUs without peer access is refused with the reason, the same
    on every rank, so selection falls back to a backend that can serve it."""
    pool = pools(2)
    try:
        across = pool.run(_torch_symm_reasons, ["a", "b"], True)
        no_peer = pool.run(_torch_symm_reasons, ["a", "a"], False)
        fine = pool.run(_torch_symm_reasons, ["a", "a"], True)
    finally:
        pool.close()  # the workers' torch.cuda and symmetric were patched
    assert across[0] == across[1] and "rank 1" in across[0] and "on host b" in across[0]
    assert no_peer[0] == no_peer[1] and "cannot access" in no_peer[0]
    assert fine == [None, None]
