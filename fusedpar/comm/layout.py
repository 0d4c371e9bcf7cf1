"""Signal-pad layout shared by every symmetric-memory kernel (Triton and CUDA).

Each rank's symmetric segment is ``[pad: PAD_BYTES][data: nbytes]``. The pad is an int32
array with fixed word offsets, so kernels need no world-size arithmetic to find a flag:

- ``READY + src``: the epoch whose input ``src`` has staged in its data region. Written by
  ``src`` into every peer's pad (release); read by the owner (acquire).
- ``DONE + src``: the epoch up to which ``src`` has finished reading its peers' data. The
  owner waits for it before overwriting its data region in the next epoch.
- ``META``: a 31-bit fingerprint of the owner's input (op, dtype, shape) for the staged
  epoch; a reader compares it with its own to catch inputs that differ across ranks.
- ``STATUS .. STATUS+3``: local only: ``[code, src, epoch, 0]`` of the first failure.
- ``DEADLINE``: local only: the epoch whose call has run out of time. The Triton interpreter
  has no clock, so a host watchdog thread writes it when ``FUSEDPAR_TIMEOUT`` has passed since
  the call began; a wait that sees it give up. (Compiled kernels read ``%globaltimer``.)
- ``EPOCH``: local only: the epoch of this rank's latest call. Every call adds one to it on
  the device before its other kernels run (its first kernel does, or ``next_epoch``), and the
  kernels read an ``epoch`` argument ``<= 0`` as ``EPOCH + epoch``: a call replayed from a
  CUDA graph takes a new epoch with no host involvement.
- ``MIRROR``: local only: int64 (two words), the address of this rank's host-side status
  mirror (pinned host memory on CUDA), or 0; whoever records a failure in STATUS copies it
  there, so the host learns of it without a device-to-host copy or an event per call.
- ``STAGE_TICKET``, ``END_TICKET``: local only: counters of a kernel's finished programs;
  the last one (``ticket == programs - 1``) does the kernel's closing work (raise a flag,
  NaN-fill a failed call's outputs) and sets the counter back to 0.
- ``DESC .. DESC+DESC_WORDS``: the owner's input description for the staged epoch
  (``[op, dtype, ndim, dim, shape...]``, written by the host with ``META``), read only to
  say *what* differed after a fingerprint mismatch.
- ``GATHERED + src``: local only: 1 once this call's shard of ``src`` is in this rank's
  gathered rows (fused all-gather + matmul; written by ``stream_write_value32`` on a copy
  engine, so the GEMM never gives up an SM to a flag kernel). The call's first kernel sets
  them back to 0: the value is the same at every call, so a CUDA-graph replay renews it.
- ``CHUNK_TILES + chunk``: local only: output tiles of ``chunk`` finished in this call
  (fused matmul + reduce-scatter: the tile that completes a chunk raises its flag and sets
  the counter back to 0).

``csrc/kernels/symm_collectives.cu`` repeats these numbers; a test keeps them equal.
"""

MAX_WORLD = 256
READY = 0
DONE = MAX_WORLD
META = 2 * MAX_WORLD
STATUS = 2 * MAX_WORLD + 4
DEADLINE = 2 * MAX_WORLD + 8
EPOCH = 2 * MAX_WORLD + 12
DESC = 2 * MAX_WORLD + 16
DESC_WORDS = 16
MIRROR = 2 * MAX_WORLD + 48
STAGE_TICKET = 2 * MAX_WORLD + 52
END_TICKET = 2 * MAX_WORLD + 53
GATHERED = 3 * MAX_WORLD
CHUNK_TILES = 4 * MAX_WORLD
PAD_WORDS = 2048
PAD_BYTES = 4 * PAD_WORDS

# STATUS[0] codes
OK = 0
TIMEOUT_READY = 1
TIMEOUT_DONE = 2
META_MISMATCH = 3
CAPACITY_EXCEEDED = 4  # moe_dispatch: a routing count above max_tokens_per_rank
