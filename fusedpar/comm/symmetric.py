"""Symmetric memory: a buffer on every rank of a group that every peer can address.

Each rank's segment is ``[signal pad | data]`` (see ``layout``). Kernels get int64 tables
of the segments' addresses *as mapped in this process* and cast them to typed pointers.

Backends:
- ``shm``: CPU processes on one host. ``/dev/shm`` files (mode 0600) mapped with
  ``torch.from_file``; names exchanged through the group; unlinked as soon as every peer
  has mapped them, so a crash leaves nothing behind.
- ``torch``: CUDA ``torch.distributed._symmetric_memory`` (NVLink peers).
- ``loopback``: one process holds all W segments on one device (single-GPU benchmarks
  and tests of the protocol); ``as_rank(r)`` gives rank r's view.
"""

from __future__ import annotations

import copy
import os
import secrets
import socket
import time
import zlib

import torch
import torch.distributed as dist

from ..errors import FusedparError, FusedparTimeoutError
from . import layout

SHM_DIR = "/dev/shm"
SHM_PREFIX = "fusedpar_"
_MIN_BYTES = 1 << 20

# Seconds one poll of a flag takes, to turn a timeout into an iteration cap. The Triton
# interpreter polls through Python (~290 us on 2 idle cores; the op layer measures it on
# first use, see ops._collective.calibrate_polls); a GPU's system-scope atomic ~1 us.
POLL_SECONDS = {"cpu": 290e-6, "cuda": 1e-6}


def timeout_seconds() -> float:
    """Every wait on a peer gives up after this long (``FUSEDPAR_TIMEOUT``, default 60 s)."""
    return float(os.environ.get("FUSEDPAR_TIMEOUT", "60"))


def fingerprint(*parts) -> int:
    """A 31-bit digest of an op's inputs, compared across ranks through ``layout.META``."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


class SymmetricBuffer:
    """One rank's handle on a group's symmetric segments.

    ``pad_table[r]`` / ``data_table[r]`` hold the addresses of rank r's signal pad and data
    region. ``epoch`` counts the collective calls made on this buffer; it is the same on
    every rank because every rank calls the same ops in the same order.
    """

    def __init__(self, segments, rank, backend, group_name, keepalive=None):
        self.segments = segments  # uint8, one per rank, as addressable from this process
        self.rank = rank
        self.world_size = len(segments)
        self.backend = backend
        self.group_name = group_name
        self.device = segments[0].device
        self.capacity = segments[0].numel() - layout.PAD_BYTES
        self.pad_table = torch.tensor(
            [s.data_ptr() for s in segments], dtype=torch.int64, device=self.device
        )
        self.epoch = 0
        self.failure: str | None = None
        self._keepalive = keepalive  # torch symm_mem handle: owns the mappings
        self._pending_status = None  # (event, pinned host copy) on CUDA

    @property
    def max_spins(self) -> int:
        """The iteration cap of every kernel-side wait: about ``timeout_seconds()``."""
        poll = POLL_SECONDS["cpu" if self.device.type == "cpu" else "cuda"]
        return max(1, int(timeout_seconds() / poll))

    # ---- views ----------------------------------------------------------------------
    def pad(self, rank: int | None = None) -> torch.Tensor:
        seg = self.segments[self.rank if rank is None else rank]
        return seg[: layout.PAD_BYTES].view(torch.int32)

    def data(self, dtype: torch.dtype, numel: int, rank: int | None = None) -> torch.Tensor:
        """The first ``numel`` elements of a rank's data region, as a flat ``dtype`` tensor."""
        nbytes = numel * dtype.itemsize
        if nbytes > self.capacity:
            raise FusedparError(
                f"symmetric buffer of group {self.group_name!r} holds {self.capacity} bytes, "
                f"{nbytes} needed; get it with get_buffer(group, nbytes)"
            )
        seg = self.segments[self.rank if rank is None else rank]
        return seg[layout.PAD_BYTES : layout.PAD_BYTES + nbytes].view(dtype)

    def as_rank(self, rank: int) -> "SymmetricBuffer":
        """Rank ``rank``'s view of a loopback buffer (one process plays every rank)."""
        if self.backend != "loopback":
            raise FusedparError("as_rank() is only meaningful for a loopback buffer")
        view = copy.copy(self)
        view.rank = rank
        return view

    # ---- protocol -------------------------------------------------------------------
    def next_epoch(self) -> int:
        self._check_pending()
        if self.failure:
            raise FusedparError(
                f"symmetric buffer of group {self.group_name!r} is unusable after an earlier "
                f"failure ({self.failure}); re-create the process group"
            )
        self.epoch += 1
        if self.epoch >= 2**31 - 1:
            raise FusedparError("epoch counter exhausted; re-create the process group")
        return self.epoch

    def finish(self, op: str) -> None:
        """Surface a timeout or mismatch the kernels recorded in this rank's status words.

        On CPU the kernels have already run, so this checks at once. On CUDA it starts an
        asynchronous copy and the next call (or ``synchronize``) checks it: no host sync on
        the hot path.
        """
        status = self.pad()[layout.STATUS : layout.STATUS + 3]
        if self.device.type == "cpu":
            self._raise_if_failed(op, status.tolist())
            return
        host = torch.empty(3, dtype=torch.int32, pin_memory=True)
        host.copy_(status, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending_status = (op, event, host)

    def synchronize(self) -> None:
        """Wait for the last call and raise what it recorded (CUDA; a no-op on CPU)."""
        if self._pending_status is not None:
            self._pending_status[1].synchronize()
        self._check_pending()

    def _check_pending(self) -> None:
        if self._pending_status is None:
            return
        op, event, host = self._pending_status
        if event.query():
            self._pending_status = None
            self._raise_if_failed(op, host.tolist())

    def _raise_if_failed(self, op: str, status: list[int]) -> None:
        code, src, epoch = status
        if code == layout.OK:
            return
        if code == layout.META_MISMATCH:
            self.failure = f"{op}: inputs differ across ranks"
            raise ValueError(
                f"fusedpar.{op}: rank {self.rank} and rank {src} of group {self.group_name!r} "
                "passed different inputs (shape, dtype, dim or op differ); every rank must call "
                "the op with the same shape and dtype"
            )
        flag = {layout.TIMEOUT_READY: "READY", layout.TIMEOUT_DONE: "DONE"}.get(code, str(code))
        self.failure = f"{op}: timed out waiting for rank {src}"
        raise FusedparTimeoutError(
            f"fusedpar.{op}: rank {self.rank} of group {self.group_name!r} timed out after "
            f"~{timeout_seconds():g} s waiting for flag {flag}[{src}] (rank {src}) to reach "
            f"epoch {epoch}: rank {src} died, stalled, or did not call the op "
            "(raise FUSEDPAR_TIMEOUT if it is just slow)"
        )

    def wait_done_on_host(self) -> None:
        """Block until every peer has finished reading this rank's data (bounded)."""
        if self.epoch == 0:
            return
        deadline = time.monotonic() + timeout_seconds()
        done = self.pad()[layout.DONE : layout.DONE + self.world_size]
        while True:
            lagging = [r for r, e in enumerate(done.tolist()) if r != self.rank and e < self.epoch]
            if not lagging:
                return
            if time.monotonic() > deadline:
                raise FusedparTimeoutError(
                    f"rank {self.rank} of group {self.group_name!r} timed out waiting for flag "
                    f"DONE[{lagging[0]}] to reach epoch {self.epoch}"
                )
            time.sleep(1e-3)


# ---- allocation ---------------------------------------------------------------------


def shm_job_prefix(parent_pid: int | None = None) -> str:
    """``/dev/shm`` name prefix of this job's segments: torchrun's run id, else the pid of
    the process that spawned the ranks (so a test or launcher can clean up after its own)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{parent_pid or os.getppid()}"
    return f"{SHM_PREFIX}{job}_"


def _shm_segments(group, nbytes: int):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    name = f"{shm_job_prefix()}{secrets.token_hex(6)}_{rank}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)  # a new file reads as zeros: every flag starts at epoch 0
    finally:
        os.close(fd)
    try:
        names = [None] * world
        dist.all_gather_object(names, name, group=group)
        segments = [
            torch.from_file(os.path.join(SHM_DIR, n), shared=True, size=nbytes, dtype=torch.uint8)
            for n in names
        ]
        dist.barrier(group=group)  # every rank has mapped every segment
    finally:
        os.unlink(path)  # the mappings stay valid; nothing is left on a crash
    return segments


def _torch_segments(group, nbytes: int, device):
    import torch.distributed._symmetric_memory as symm_mem

    t = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    t.zero_()
    handle = symm_mem.rendezvous(t, group.group_name)
    segments = [
        t if r == handle.rank else handle.get_buffer(r, (nbytes,), torch.uint8)
        for r in range(handle.world_size)
    ]
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # no peer signals into a pad before it is zeroed
    return segments, (t, handle)


_same_host: dict[str, bool] = {}


def shm_unsupported_reason(group) -> str | None:
    """Why the ``shm`` backend cannot serve ``group`` (collective; agreed and cached per group)."""
    name = group.group_name
    if name not in _same_host:
        hosts = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _same_host[name] = len(set(hosts)) == 1
    if not _same_host[name]:
        return "shm symmetric memory needs every rank of the group on one host"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    return None


def torch_symm_unsupported_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "torch symmetric memory needs CUDA tensors"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch.distributed._symmetric_memory unavailable: {e}"
    return None


_buffers: dict[tuple, SymmetricBuffer] = {}


def _round_capacity(nbytes: int) -> int:
    want = max(nbytes, int(os.environ.get("FUSEDPAR_SYMM_BYTES", _MIN_BYTES)))
    return 1 << (want - 1).bit_length()


def get_buffer(group, nbytes: int, device: torch.device) -> SymmetricBuffer:
    """The group's symmetric buffer on ``device``, holding at least ``nbytes`` of data.

    Allocated on first use and grown (collectively: every rank asks for the same size)
    when a call needs more; never allocated during CUDA-graph capture.
    """
    key = (group.group_name, device.type, device.index)
    buf = _buffers.get(key)
    if buf is not None and buf.capacity >= nbytes:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise FusedparError(
            f"symmetric buffer of group {group.group_name!r} must grow to {nbytes} bytes during "
            "CUDA-graph capture; run one eager step first or set FUSEDPAR_SYMM_BYTES"
        )
    if buf is not None:
        buf.synchronize()
        buf.wait_done_on_host()  # peers no longer read the old segments
    size = layout.PAD_BYTES + _round_capacity(nbytes)
    rank = dist.get_rank(group)
    if device.type == "cpu":
        new = SymmetricBuffer(_shm_segments(group, size), rank, "shm", group.group_name)
    else:
        segments, keep = _torch_segments(group, size, device)
        new = SymmetricBuffer(segments, rank, "torch", group.group_name, keepalive=keep)
    _buffers[key] = new
    return new


_loopbacks: dict[tuple, list[SymmetricBuffer]] = {}


def get_loopback_buffers(world_size: int, nbytes: int, device: torch.device) -> list[SymmetricBuffer]:
    """All ``world_size`` segments in this process, as one view per simulated rank."""
    key = (world_size, device.type, device.index)
    views = _loopbacks.get(key)
    if views is None or views[0].capacity < nbytes:
        for view in views or ():
            view.synchronize()
        size = layout.PAD_BYTES + _round_capacity(nbytes)
        segments = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(world_size)]
        buf = SymmetricBuffer(segments, 0, "loopback", f"loopback{world_size}")
        views = [buf.as_rank(r) for r in range(world_size)]
        _loopbacks[key] = views
    return views


def release_buffers() -> None:
    """Drop every cached buffer (e.g. before destroying the process groups)."""
    for buf in [*_buffers.values(), *(v for views in _loopbacks.values() for v in views)]:
        buf.synchronize()
    _buffers.clear()
    _loopbacks.clear()
