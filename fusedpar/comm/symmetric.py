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
import datetime
import os
import secrets
import socket
import threading
import time
import warnings
import zlib

import torch
import torch.distributed as dist

from ..errors import FusedparError, FusedparTimeoutError
from . import layout, settings
from .groups import host_collective_device

SHM_DIR = "/dev/shm"
SHM_PREFIX = "fusedpar_"
_MIN_BYTES = 1 << 20
# dist.all_gather_single replaces all_gather_into_tensor in torch 2.13+ (2.11 has only the latter)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

def timeout_seconds() -> float:
    """Every wait on a peer gives up after this long (``FUSEDPAR_TIMEOUT``, default 60 s)."""
    return settings.get().timeout_s


def fingerprint(*parts) -> int:
    """A 31-bit digest of an op's inputs, compared across ranks through ``layout.META``."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


#: Each dtype's code (its index) in ``layout.DESC`` words and in the MoE ops' agreement
#: checks; ``dtype_code`` gives -1 for any other dtype.
DTYPE_CODES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64,
               torch.float64, torch.uint8, torch.int8]


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES.index(dtype) if dtype in DTYPE_CODES else -1


def describe_words(op_code: int, dtype: torch.dtype, shape, dim: int) -> list[int]:
    """``layout.DESC`` words for an input: ``[op, dtype, ndim, dim, *shape]`` (shape cut to fit)."""
    words = [op_code, dtype_code(dtype), len(shape), dim, *shape][: layout.DESC_WORDS]
    return words + [0] * (layout.DESC_WORDS - len(words))


# ``DESC[0]`` of a call captured in a CUDA graph (see ``SymmetricBuffer.publish``)
UNRECORDED = -1


def describe_input(words: list[int]) -> str:
    """The inverse of ``describe_words`` for an error message: ``"shape (4, 8) bfloat16, dim 0"``."""
    op_code, code, ndim, dim, *shape = words
    if op_code == UNRECORDED:
        return "inputs not recorded (a call captured in a CUDA graph)"
    dtype = str(DTYPE_CODES[code]).replace("torch.", "") if 0 <= code < len(DTYPE_CODES) else "?"
    return f"shape {tuple(shape[:ndim])} {dtype}, dim {dim}"


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream of ``device`` is capturing a graph (never on CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def mismatch_message(op: str, rank: int, src: int, group_name: str, mine: list[int],
                     theirs: list[int]) -> str:
    """The error for inputs that differ across ranks, saying what each rank passed."""
    return (f"fusedpar.{op}: rank {rank} and rank {src} of group {group_name!r} passed different "
            f"inputs: rank {rank} {describe_input(mine)}, rank {src} {describe_input(theirs)}; "
            "every rank must call the op with the same shape, dtype and dim")


def host_words(words: list[int], device: torch.device) -> torch.Tensor:
    """``words`` as an int32 host tensor to copy to ``device`` without a host wait: pinned
    for a CUDA device (a ``non_blocking`` copy from pageable memory is synchronous)."""
    return torch.tensor(words, dtype=torch.int32, pin_memory=device.type == "cuda")


class _Watchdog:
    """The interpreter's clock (see ``kernels.signal``): one daemon thread for the process
    writes a call's epoch into its rank's ``DEADLINE`` word once ``FUSEDPAR_TIMEOUT`` has
    passed since the call began; a wait that sees it gives up. Arming and disarming a call
    are a dict write each (CPU only: compiled kernels read the GPU's clock)."""

    POLL_S = 0.01

    def __init__(self):
        self.armed: dict = {}  # buffer view -> (deadline, its DEADLINE word, epoch)
        self.thread: threading.Thread | None = None

    def arm(self, view, word: torch.Tensor, epoch: int, timeout_s: float) -> None:
        self.armed[view] = (time.monotonic() + timeout_s, word, epoch)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="fusedpar-watchdog", daemon=True)
            self.thread.start()

    def disarm(self, view) -> None:
        self.armed.pop(view, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            now = time.monotonic()
            for view, (deadline, word, epoch) in list(self.armed.items()):
                if now > deadline and self.armed.get(view, (None,))[0] == deadline:
                    word.fill_(epoch)
                    self.armed.pop(view, None)


_WATCHDOG = _Watchdog()
_RECENT_OPS = 64  # how many calls' op names a buffer keeps, to name the one that failed


class SymmetricBuffer:
    """One rank's handle on a group's symmetric segments.

    ``pad_table[r]`` / ``data_table[r]`` hold the addresses of rank r's signal pad and data
    region. Epochs live on the device (``layout.EPOCH``: every call adds one there), so a
    call replayed from a CUDA graph takes a new one; ``epoch`` counts this rank's eager calls
    (for messages and the interpreter's watchdog: on CPU, where nothing replays, it equals
    the device word). Failures reach the host through a status mirror the kernels write
    (``layout.MIRROR``): read at once on CPU, at the next call on CUDA.
    A buffer replaced by a larger one is no longer ``live``; ``follow`` finds its successor
    (what the ops' plans do, so a plan made before the growth stays good).
    """

    def __init__(self, segments, rank, backend, group_name, keepalive=None):
        self.segments = segments  # uint8, one per rank, as addressable from this process
        # int32 views of every rank's pad, made once: a call takes its pad a dozen times
        self._pads = [s[: layout.PAD_BYTES].view(torch.int32) for s in segments]
        self.rank = rank
        self.world_size = len(segments)
        self.backend = backend
        self.group_name = group_name
        self.device = segments[0].device
        self._cuda = self.device.type == "cuda"
        self.capacity = segments[0].numel() - layout.PAD_BYTES
        misaligned = [r for r, s in enumerate(segments) if (s.data_ptr() + layout.PAD_BYTES) % 16]
        if misaligned:  # the kernels access data regions 16 bytes at a time (signal.data_ptr)
            raise FusedparError(f"symmetric segments of ranks {misaligned} of group {group_name!r} "
                                "do not start on a 16-byte boundary")
        self.pad_table = torch.tensor(
            [s.data_ptr() for s in segments], dtype=torch.int64, device=self.device
        )
        self.epoch = 0
        self.failure: str | None = None
        self.live = True  # False once replaced or released
        self.successor: SymmetricBuffer | None = None  # the buffer that replaced it
        self.captured = False  # a call on it was captured in a CUDA graph
        self._keepalive = keepalive  # torch symm_mem handle: owns the mappings
        self._ops = [""] * _RECENT_OPS  # the op of the call at epoch e, at e % _RECENT_OPS
        self._stream = None  # (raw id, Stream) of the last call, on CUDA
        self.in_call = False  # between next_epoch and finish
        # the DESC words this pad holds (None: unknown); a graph replay writes UNRECORDED
        # there behind the host's back, so after a capture the words are always rewritten
        self._desc_words: list[int] | None = None
        self._desc_captured = False
        # the status mirror of each rank this process plays (every rank of a loopback)
        ranks = range(self.world_size) if backend == "loopback" else [rank]
        self._mirror = torch.zeros(self.world_size, 4, dtype=torch.int32, pin_memory=self._cuda)
        for r in ranks:
            address = torch.tensor([self._mirror[r].data_ptr()], dtype=torch.int64)
            self._pads[r].view(torch.int64)[layout.MIRROR // 2 : layout.MIRROR // 2 + 1].copy_(address)
        self._status = self._mirror.numpy()[rank]
        # each rank's EPOCH and DEADLINE words, made once: every call takes one of each
        self._epoch_words = [p[layout.EPOCH : layout.EPOCH + 1] for p in self._pads]
        self._deadline_words = [p[layout.DEADLINE : layout.DEADLINE + 1] for p in self._pads]

    @property
    def timeout_ns(self) -> int:
        """How long every kernel-side wait may take (``FUSEDPAR_TIMEOUT``), for the kernels'
        ``%globaltimer`` bound; the interpreter's bound is the watchdog of ``next_epoch``."""
        return settings.get().timeout_ns

    # ---- views ----------------------------------------------------------------------
    def pad(self, rank: int | None = None) -> torch.Tensor:
        return self._pads[self.rank if rank is None else rank]

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
        view._status = self._mirror.numpy()[rank]
        return view

    # ---- protocol -------------------------------------------------------------------
    def next_epoch(self, graphable: bool = False, *, kernel_advances: bool = False) -> int:
        """Start a call; returns 0, the epoch offset its kernels take (``kernels.signal``:
        0 is this call's epoch, -1 the last one's). The device's EPOCH word goes up by one
        before the call's other kernels run: ``kernel_advances`` says the call's first kernel
        does it (``signal.stage_kernel``), else this enqueues the add. On CPU this also arms
        the watchdog; ``finish`` disarms it.

        ``graphable``: nothing of the call depends on host values a replay would freeze, so
        it may be captured in a CUDA graph; any other call refuses capture."""
        capture = capturing(self.device)
        if capture:
            if not graphable:
                raise FusedparError(
                    f"this fusedpar op on symmetric memory (group {self.group_name!r}) cannot be "
                    "captured in a CUDA graph: it reads values on the host that a replay would freeze. "
                    "Graph-capturable: the triton all_gather_matmul, matmul_reduce_scatter, "
                    "all_gather and reduce_scatter, the cuda all_gather / reduce_scatter, and "
                    "moe_dispatch / moe_combine with max_tokens_per_rank; capture only the compute "
                    "around the others, or use backend='reference' / 'pipelined' inside the graph"
                )
            self.captured = True
        if self.failure:
            raise FusedparError(
                f"symmetric buffer of group {self.group_name!r} is unusable after an earlier "
                f"failure ({self.failure}); re-create the process group"
            )
        if not capture:
            if self._status[0]:  # a failure the kernels recorded since the last check
                self._raise_if_failed(None, self._status[:3].tolist())
            if self._cuda:
                self._after_last_call()
        if self.in_call:
            # an exception between next_epoch and finish: this rank's flags are a call behind
            self.failure = f"the call of epoch {self.epoch} stopped before its end"
            raise FusedparError(
                f"symmetric buffer of group {self.group_name!r}: the call of epoch {self.epoch} "
                "raised before it finished, so this rank's flags no longer agree with its peers'; "
                "re-create the process group")
        self.in_call = True
        self.epoch += 1
        if self.epoch >= 2**31 - 1:
            raise FusedparError("epoch counter exhausted; re-create the process group")
        if not kernel_advances:
            self._epoch_words[self.rank].add_(1)
        if not self._cuda:
            _WATCHDOG.arm(self, self._deadline_words[self.rank], self.epoch, settings.get().timeout_s)
        return 0

    def _after_last_call(self) -> None:
        """Make this call's stream wait (on the device) for the last call's end if that ran
        on another stream: calls take turns on the buffer. FSDP2 issues its all-gathers and
        reduce-scatters on two streams, and a call restages this rank's data region, which
        the previous call may still be reading there. One query of the current stream's id
        per call; a new stream costs a wait."""
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        if self._stream is None or raw != self._stream[0]:
            current = torch.cuda.current_stream(self.device)
            if self._stream is not None:
                current.wait_stream(self._stream[1])
            self._stream = (raw, current)

    def publish(self, desc: list[int]) -> None:
        """Write this rank's input description (``layout.DESC``) before its READY signal, so
        that peers can say what differed after a fingerprint mismatch (the kernel that raises
        READY publishes the fingerprint, ``META``). Under CUDA-graph capture the description
        is marked unrecorded instead (a copy from host memory would be read at every replay).

        The words are copied only when they differ from the last ones this pad got (calls
        of one shape in a row publish them once), and on CUDA from pinned memory: a copy
        from pageable memory makes the host wait for the stream."""
        pad = self.pad()
        if capturing(self.device):
            pad[layout.DESC : layout.DESC + 1].fill_(UNRECORDED)
            self._desc_words, self._desc_captured = None, True
            return
        if desc == self._desc_words:
            return
        pad[layout.DESC : layout.DESC + layout.DESC_WORDS].copy_(host_words(desc, self.device),
                                                                 non_blocking=True)
        if not self._desc_captured:
            self._desc_words = list(desc)

    def finish(self, op: str) -> None:
        """End a call and surface a timeout or mismatch its kernels recorded.

        On CPU the kernels have already run, so this raises at once, at the end of the failed
        call. On CUDA knowing needs a host sync, which would stall the CPU's run-ahead after
        every call; so by default the next call on this buffer (or ``synchronize``) raises,
        reading the status mirror the kernels wrote, while the failed call's outputs are NaN
        (the call's last kernel NaN-fills them on the device). ``FUSEDPAR_SYNC_ERRORS=1``
        waits here and raises at the end of the failed call (for debugging). A failure in a
        call replayed from a CUDA graph is raised the same way."""
        self.in_call = False
        self._ops[self.epoch % _RECENT_OPS] = op
        if not self._cuda:
            _WATCHDOG.disarm(self)
            if self._status[0]:
                self._raise_if_failed(op, self._status[:3].tolist())
        elif settings.get().sync_errors and not capturing(self.device):
            self.synchronize()

    def synchronize(self) -> None:
        """Wait for every call so far and raise what one recorded (CUDA; on CPU each call
        raised at its end)."""
        if not self._cuda:
            return
        torch.cuda.synchronize(self.device)
        if self._status[0] and not self.failure:
            self._raise_if_failed(None, self._status[:3].tolist())

    def _raise_if_failed(self, op: str | None, status: list[int]) -> None:
        code, src, epoch = status
        if code == layout.OK:
            return
        op = op or self._ops[epoch % _RECENT_OPS] or "symmetric-memory call"
        if code == layout.META_MISMATCH:
            self.failure = f"{op}: inputs differ across ranks"
            desc = slice(layout.DESC, layout.DESC + layout.DESC_WORDS)
            mine, theirs = self.pad()[desc].tolist(), self.pad(src)[desc].tolist()
            raise ValueError(mismatch_message(op, self.rank, src, self.group_name, mine, theirs))
        if code == layout.CAPACITY_EXCEEDED:
            self.failure = f"{op}: capacity exceeded"
            raise ValueError(
                f"fusedpar.{op}: the routing table exchanged at epoch {epoch} holds a count above "
                "max_tokens_per_rank (tokens of a rank, or copies routed to one expert) or an "
                "expert id out of range; nothing was dropped: raise max_tokens_per_rank")
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
        epoch = int(self.pad()[layout.EPOCH])  # the device's count: a sync on CUDA
        if epoch == 0:
            return
        deadline = time.monotonic() + timeout_seconds()
        done = self.pad()[layout.DONE : layout.DONE + self.world_size]
        while True:
            lagging = [r for r, e in enumerate(done.tolist()) if r != self.rank and e < epoch]
            if not lagging:
                return
            if time.monotonic() > deadline:
                raise FusedparTimeoutError(
                    f"rank {self.rank} of group {self.group_name!r} timed out waiting for flag "
                    f"DONE[{lagging[0]}] to reach epoch {epoch}"
                )
            time.sleep(1e-3)


# ---- allocation ---------------------------------------------------------------------


def shm_job_prefix(parent_pid: int | None = None) -> str:
    """``/dev/shm`` name prefix of this job's segments: torchrun's run id, else the pid of
    the process that spawned the ranks (so a test or launcher can clean up after its own)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{parent_pid or os.getppid()}"
    return f"{SHM_PREFIX}{job}_"


def bounded_wait(work, what: str, group) -> None:
    """Wait for an async collective at most ``FUSEDPAR_TIMEOUT``; a rank that never joins it
    gives a FusedparTimeoutError naming the step instead of a hang."""
    timeout = timeout_seconds()
    try:
        finished = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:  # gloo raises on timeout, as on a peer that closed its end
        raise FusedparTimeoutError(
            f"rank {dist.get_rank()} timed out after ~{timeout:g} s in {what} of group "
            f"{group.group_name!r}: a peer died, stalled or did not call the op "
            f"(raise FUSEDPAR_TIMEOUT if it is just slow) [{str(e).splitlines()[0]}]") from e
    if finished is False:
        raise FusedparTimeoutError(
            f"rank {dist.get_rank()} timed out after ~{timeout:g} s in {what} of group "
            f"{group.group_name!r}: a peer died, stalled or did not call the op")


def exchange_strings(text: str, group, what: str) -> list[str]:
    """Every rank's ``text`` (ASCII, < 256 bytes), with the bounded wait of ``bounded_wait``."""
    raw = text.encode()
    if len(raw) >= 256:
        raise FusedparError(f"{what}: {text!r} is too long to exchange")
    device = host_collective_device(group)
    mine = torch.zeros(256, dtype=torch.uint8)
    mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    world = dist.get_world_size(group)
    everyone = torch.empty(world * 256, dtype=torch.uint8, device=device)
    bounded_wait(_all_gather_single(everyone, mine.to(device), group=group, async_op=True), what, group)
    return [bytes(row[row.nonzero().flatten()].tolist()).decode()
            for row in everyone.cpu().view(world, 256)]


def _shm_segments(group, nbytes: int):
    rank = dist.get_rank(group)
    name = f"{shm_job_prefix()}{secrets.token_hex(6)}_{rank}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)  # a new file reads as zeros: every flag starts at epoch 0
    finally:
        os.close(fd)
    try:
        names = exchange_strings(name, group, "the symmetric-memory rendezvous")
        segments = [
            torch.from_file(os.path.join(SHM_DIR, n), shared=True, size=nbytes, dtype=torch.uint8)
            for n in names
        ]
        # every rank has mapped every segment
        bounded_wait(dist.barrier(group=group, async_op=True), "the symmetric-memory rendezvous", group)
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


_placement: dict[str, list[str]] = {}


def _peers(group) -> list[str]:
    """Every rank's ``"host:cuda_index"`` (collective, bounded; cached per group)."""
    name = group.group_name
    if name not in _placement:
        index = torch.cuda.current_device() if torch.cuda.is_available() else -1
        _placement[name] = exchange_strings(f"{socket.gethostname()}:{index}", group,
                                            "the symmetric-memory placement check")
    return _placement[name]


def shm_unsupported_reason(group) -> str | None:
    """Why the ``shm`` backend cannot serve ``group`` (collective; agreed and cached per group)."""
    if len({p.rsplit(":", 1)[0] for p in _peers(group)}) != 1:
        return "shm symmetric memory needs every rank of the group on one host"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    return None


_peer_access: dict[str, str | None] = {}

# torch's rendezvous accepts ranks on one GPU when this is 1 (memory handles imported between
# processes, no multicast): fusedpar follows it, for tests of the group path on one GPU
OVERLAPPING_DEVICES = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def shared_device_reason(peers: list[str], group_name: str) -> str:
    """Why ranks that share a GPU (equal ``"host:cuda_index"`` in ``peers``) cannot use torch
    symmetric memory; ``""`` where none share one, or where ``OVERLAPPING_DEVICES=1`` opts in
    (then with a warning: the processes' kernels time-slice on the GPU, so such a group
    proves correctness, not speed)."""
    ranks: dict[str, list[int]] = {}
    for r, peer in enumerate(peers):
        ranks.setdefault(peer, []).append(r)
    peer, shared = next(((p, rs) for p, rs in ranks.items() if len(rs) > 1), (None, None))
    if shared is None:
        return ""
    where = f"ranks {shared} share cuda:{peer.rsplit(':', 1)[1]}"
    if os.environ.get(OVERLAPPING_DEVICES) == "1":
        warnings.warn(f"fusedpar: {where} in group {group_name!r}: symmetric memory between processes on one GPU "
                      f"({OVERLAPPING_DEVICES}=1); their kernels time-slice, so this tests "
                      "correctness, not speed", stacklevel=3)
        return ""
    # no group name: short enough to cross exchange_strings whole
    return (f"{where}: torch symmetric memory needs one GPU per rank "
            "(torch.cuda.set_device(local_rank)), or, for tests, "
            f"{OVERLAPPING_DEVICES}=1 on every rank (with gloo: NCCL refuses it)")


def torch_symm_unsupported_reason(device: torch.device, group=None) -> str | None:
    """Why torch symmetric memory cannot serve ``group`` on ``device``: not CUDA, not
    importable, ranks on several hosts, GPUs without peer access, or ranks sharing a GPU
    without the opt-in of ``shared_device_reason``. With a group this is
    collective (every rank learns every rank's verdict, so all agree) and cached per group."""
    if device.type != "cuda":
        return "torch symmetric memory needs CUDA tensors"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch.distributed._symmetric_memory unavailable: {e}"
    if group is None:
        return None
    name = group.group_name
    if name not in _peer_access:
        peers = _peers(group)
        host, mine = peers[dist.get_rank(group)].rsplit(":", 1)
        reason = ""
        for r, peer in enumerate(peers):
            peer_host, index = peer.rsplit(":", 1)
            if peer_host != host:
                reason = f"rank {r} of group {name!r} is on host {peer_host}, not {host} (NVLink peers only)"
                break
            if index != mine and not torch.cuda.can_device_access_peer(int(mine), int(index)):
                reason = f"cuda:{mine} cannot access cuda:{index} (rank {r}) as a peer"
                break
        reason = reason or shared_device_reason(peers, name)
        verdicts = exchange_strings(reason[:255], group, "the symmetric-memory peer check")
        _peer_access[name] = next((v for v in verdicts if v), None)
    return _peer_access[name]


_buffers: dict[tuple, SymmetricBuffer] = {}


def _round_capacity(nbytes: int) -> int:
    want = max(nbytes, int(os.environ.get("FUSEDPAR_SYMM_BYTES", _MIN_BYTES)))
    return 1 << (want - 1).bit_length()


def _device_key(device: torch.device) -> tuple:
    """``cuda`` and ``cuda:<current>`` are one device: one cache entry."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device.type, device.index


def get_buffer(group, nbytes: int, device: torch.device) -> SymmetricBuffer:
    """The group's symmetric buffer on ``device``, holding at least ``nbytes`` of data.

    Allocated on first use and grown (collectively: every rank asks for the same size)
    when a call needs more; never allocated during CUDA-graph capture.
    """
    key = (group.group_name, *_device_key(device))
    buf = _buffers.get(key)
    if buf is not None and buf.capacity >= nbytes:
        return buf
    if capturing(device):
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
    _retire(buf, new)
    _buffers[key] = new
    return new


def follow(buf: SymmetricBuffer) -> SymmetricBuffer:
    """The buffer that serves ``buf``'s group now: ``buf`` while it is live, else the one
    that replaced it (a larger one: whatever fit in ``buf`` fits). A plan made before a
    growth follows it without a new plan, so a step warmed up once can be captured even
    when a later call of the step grew the buffer."""
    while not buf.live:
        if buf.successor is None:
            raise FusedparError(f"the symmetric buffer of group {buf.group_name!r} was released "
                                "(fusedpar.comm.release_buffers); its calls cannot run any more")
        buf = buf.successor
    return buf


# How many times release_buffers() ran: the ops' plans made before the last are dropped.
generation = 0

# Replaced buffers that a CUDA graph may still use: a replay writes to the addresses it was
# captured with, so their memory stays allocated until release_buffers().
_captured_retired: list[SymmetricBuffer] = []


def _retire(buf: SymmetricBuffer | None, successor: SymmetricBuffer | None) -> None:
    if buf is None:
        return
    buf.live, buf.successor = False, successor
    if buf.captured:
        _captured_retired.append(buf)


_loopbacks: dict[tuple, list[SymmetricBuffer]] = {}


def get_loopback_buffers(world_size: int, nbytes: int, device: torch.device) -> list[SymmetricBuffer]:
    """All ``world_size`` segments in this process, as one view per simulated rank. A
    loopback group has no peers to agree with, so after a failure (raised, or a call that
    stopped midway) it starts afresh instead of staying unusable."""
    key = (world_size, *_device_key(device))
    views = _loopbacks.get(key)
    broken = views is not None and any(view.failure or view.in_call for view in views)
    if views is None or broken or views[0].capacity < nbytes:
        if capturing(device):
            raise FusedparError(
                f"the loopback buffers of {world_size} ranks must be (re)made for {nbytes} bytes "
                "during CUDA-graph capture; run one eager call first or set FUSEDPAR_SYMM_BYTES")
        for view in () if broken else views or ():
            view.synchronize()
        size = layout.PAD_BYTES + _round_capacity(nbytes)
        for view in views or ():
            _retire(view, None)
        segments = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(world_size)]
        buf = SymmetricBuffer(segments, 0, "loopback", f"loopback{world_size}")
        views = [buf.as_rank(r) for r in range(world_size)]
        _loopbacks[key] = views
    return views


def release_buffers() -> None:
    """Drop every cached buffer (e.g. before destroying the process groups), and those kept
    for CUDA graphs: a graph captured with them must not be replayed after this."""
    global generation
    for buf in [*_buffers.values(), *(v for views in _loopbacks.values() for v in views)]:
        buf.synchronize()
        buf.live = False
    generation += 1
    _buffers.clear()
    _loopbacks.clear()
    _captured_retired.clear()
