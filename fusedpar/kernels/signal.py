"""Flags in symmetric signal pads: bounded waits and release signals (layout: comm.layout).

Every wait polls with an acquire atomic at system scope and gives up when its time is up,
recording ``[code, src, epoch]`` in the waiter's own STATUS words (first failure wins); a
wait that finds a failure already recorded gives up at once.

Time: compiled kernels read the GPU's ``%globaltimer`` (ns) and give up ``timeout_ns``
after the wait began. The Triton interpreter has no clock (and no inline PTX), so there a
host watchdog (``SymmetricBuffer.next_epoch``) writes the call's epoch into this rank's
``DEADLINE`` word once ``FUSEDPAR_TIMEOUT`` has passed since the call began, and a wait
that sees it gives up. Either way the bound is wall-clock time, whatever a poll costs.

Every argument that changes from call to call (rank, world size, epoch, fingerprint,
timeout) is ``do_not_specialize``: one binary serves every call (an int equal to 1, or
divisible by 16, would otherwise compile a new one mid-training).

An ``epoch`` argument ``<= 0`` is relative (``call_epoch``): the call's epoch is this rank's
device-held ``EPOCH`` word plus it. That is how a call captured in a CUDA graph gets a new
epoch on each replay (``SymmetricBuffer.use_device_epochs``); the host passes 0 for the
call's epoch and -1 for the previous one.
"""

import os

import torch
import triton
import triton.language as tl

from ..comm import layout

READY = tl.constexpr(layout.READY)
DONE = tl.constexpr(layout.DONE)
META = tl.constexpr(layout.META)
STATUS = tl.constexpr(layout.STATUS)
DEADLINE = tl.constexpr(layout.DEADLINE)
EPOCH = tl.constexpr(layout.EPOCH)
GATHERED = tl.constexpr(layout.GATHERED)
PAD_BYTES = tl.constexpr(layout.PAD_BYTES)
# Whether the kernels are compiled (not interpreted): decided when they are decorated, exactly
# as triton decides to interpret them.
COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

# the per-call arguments of every kernel that waits (see the module docstring)
PER_CALL_ARGS = ["rank", "world_size", "epoch", "meta", "timeout_ns"]


@triton.jit
def pad_ptr(pad_table, rank):
    """Rank ``rank``'s signal pad, as an int32 pointer valid in this process."""
    return tl.load(pad_table + rank).to(tl.pointer_type(tl.int32))


@triton.jit
def call_epoch(pad_table, rank, epoch):
    """The epoch ``epoch`` stands for: itself, or, if ``<= 0``, rank ``rank``'s device-held
    ``EPOCH`` word plus it (see the module docstring)."""
    if epoch <= 0:
        epoch = tl.load(pad_ptr(pad_table, rank) + EPOCH, volatile=True) + epoch
    return epoch


@triton.jit
def data_ptr(pad_table, rank, dtype: tl.constexpr, mask=None):
    """Rank ``rank``'s data region (just past its pad), as a ``dtype`` pointer, known to be
    16-byte aligned (``SymmetricBuffer`` checks every segment): without that, a pointer
    loaded from memory has unknown alignment and every access through it is a scalar one.
    ``rank`` may be a tensor of ranks, ``mask`` saying which to look up (0 elsewhere)."""
    if mask is None:
        base = tl.load(pad_table + rank)
    else:
        base = tl.load(pad_table + rank, mask=mask, other=0)
    # the hint on the loaded pointer itself: an integer sum cast to a pointer becomes a
    # different op when the compiler folds it, and loses its hint
    base = tl.multiple_of(base.to(tl.pointer_type(dtype)), 16)
    return base + PAD_BYTES // (dtype.primitive_bitwidth // 8)


@triton.jit
def now_ns():
    """The GPU's global nanosecond timer (compiled kernels only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def fence_async_proxy():
    """Order the global memory this thread saw through an acquire before its later TMA loads
    (the async proxy reads memory apart from the generic loads the acquire ordered;
    sm_90, compiled kernels only: the interpreter has one proxy)."""
    if COMPILED:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def clock_start():
    """What ``time_is_up`` measures from: the timer now (compiled) or 0 (interpreter)."""
    if COMPILED:
        start = now_ns()
    else:
        start = tl.full([], 0, tl.int64)
    return start


@triton.jit
def time_is_up(my_pad, start, epoch, timeout_ns):
    """Whether this wait has run out of time (see the module docstring)."""
    if COMPILED:
        up = now_ns() - start > timeout_ns
    else:
        up = tl.atomic_add(my_pad + DEADLINE, 0, sem="relaxed", scope="sys") >= epoch
    return up


@triton.jit
def record_failure(my_pad, code, src, epoch):
    """Record ``[code, src, epoch]`` in this rank's STATUS words unless a failure is there."""
    if tl.atomic_cas(my_pad + STATUS, 0, code, sem="relaxed", scope="sys") == 0:
        tl.store(my_pad + STATUS + 1, src)
        tl.store(my_pad + STATUS + 2, epoch)


@triton.jit
def wait_flag(my_pad, word, src, epoch, timeout_ns, code):
    """Wait until ``my_pad[word] >= epoch``; return whether it did (False on any failure)."""
    status = my_pad + STATUS
    start = clock_start()
    value = tl.atomic_add(my_pad + word, 0, sem="acquire", scope="sys")
    failed = tl.atomic_add(status, 0, sem="relaxed", scope="sys")
    while (value < epoch) & (failed == 0):
        if time_is_up(my_pad, start, epoch, timeout_ns):
            record_failure(my_pad, code, src, epoch)
        value = tl.atomic_add(my_pad + word, 0, sem="acquire", scope="sys")
        failed = tl.atomic_add(status, 0, sem="relaxed", scope="sys")
    return (value >= epoch) & (failed == 0)


@triton.jit
def check_meta(pad_table, rank, src, epoch, meta):
    """Whether ``src``'s published input fingerprint equals ours (a mismatch is recorded)."""
    theirs = tl.load(pad_ptr(pad_table, src) + META, volatile=True)
    ok = theirs == meta
    if not ok:
        record_failure(pad_ptr(pad_table, rank), 3, src, epoch)  # META_MISMATCH
    return ok


@triton.jit
def wait_ready_and_match(pad_table, rank, src, epoch, meta, timeout_ns):
    """Wait for ``src``'s READY flag, then check its input fingerprint equals ours."""
    ok = wait_flag(pad_ptr(pad_table, rank), READY + src, src, epoch, timeout_ns, 1)  # TIMEOUT_READY
    if ok:
        ok = check_meta(pad_table, rank, src, epoch, meta)
    return ok


@triton.jit(do_not_specialize=["word_base", "code", "only", *PER_CALL_ARGS])
def wait_flags_kernel(pad_table, word_base, rank, world_size, epoch, timeout_ns, code, meta, only):
    """One program: wait until ``pad[word_base + src] >= epoch`` for every peer ``src``
    (``only >= 0``: for peer ``only`` alone); with ``meta >= 0`` also check each such peer's
    published fingerprint."""
    my_pad = pad_ptr(pad_table, rank)
    epoch = call_epoch(pad_table, rank, epoch)
    for src in range(0, world_size):
        if (src != rank) & ((only < 0) | (src == only)):
            if wait_flag(my_pad, word_base + src, src, epoch, timeout_ns, code):
                if meta >= 0:
                    check_meta(pad_table, rank, src, epoch, meta)


@triton.jit(do_not_specialize=["word_base", "rank", "world_size", "epoch", "meta"])
def signal_peers_kernel(pad_table, word_base, rank, world_size, epoch, meta):
    """One program: publish ``meta`` (if >= 0), then set ``peer_pad[word_base + rank] = epoch``
    on every peer with release semantics, so what this rank wrote before is visible first."""
    epoch = call_epoch(pad_table, rank, epoch)
    if meta >= 0:
        tl.atomic_xchg(pad_ptr(pad_table, rank) + META, meta, sem="relaxed", scope="sys")
    for peer in range(0, world_size):
        if peer != rank:
            tl.atomic_xchg(pad_ptr(pad_table, peer) + word_base + rank, epoch, sem="release", scope="sys")


# A kernel that spins on flags gets at most this many programs per SM and loops over its
# work, so its spinning programs never fill the GPU: a peer whose flag depends on other work
# (another stream, NCCL) still finds SMs. In the interpreter (no SMs) a small fixed number.
PROGRAMS_PER_SM = 4
INTERPRETER_PROGRAMS = 8


def sm_count(device: torch.device) -> int | None:
    """The SM count of a CUDA device (asked at launch, never at import); None when the
    kernels run in the interpreter."""
    if not COMPILED or device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def spinning_grid(work_items: int, sms: int | None) -> int:
    """Programs for a flag-spinning kernel with ``work_items`` units of work (axis 0), on a
    GPU with ``sms`` SMs (None: the interpreter)."""
    cap = INTERPRETER_PROGRAMS if sms is None else PROGRAMS_PER_SM * sms
    return max(1, min(work_items, cap))


@triton.jit
def poison_if_failed_kernel(my_pad, out_ptr, n, BLOCK: tl.constexpr):
    """If this rank's STATUS records a failure, fill ``out`` (``n`` elements) with NaN;
    otherwise every program returns after one load."""
    failed = tl.load(my_pad + STATUS, volatile=True)
    if failed != 0:
        offsets = tl.arange(0, BLOCK)
        # int64: an output of 2^31 elements or more must not wrap
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
            idx = start + offsets
            tl.store(out_ptr + idx, float("nan"), mask=idx < n)


POISON_BLOCK = 1024


def poison_grid(numel: int, sms: int | None) -> tuple[int]:
    return (spinning_grid(triton.cdiv(numel, POISON_BLOCK), sms),)


def poison_if_failed(pad: torch.Tensor, out: torch.Tensor) -> None:
    """Device-side, no host sync: NaN-fill the floating-point tensor ``out`` if this rank's
    signal pad ``pad`` (int32) records a failed wait. A failed call's outputs (and anything the
    copy engine copied without a successful wait) then never pass for results, whenever the
    host learns of the failure. The grid is capped like a spinning kernel's: the fill only
    happens on failure, so a few programs suffice."""
    if out.numel() == 0 or not out.is_floating_point():
        return
    if not out.is_contiguous():
        out.masked_fill_(pad[layout.STATUS] != 0, float("nan"))
        return
    poison_if_failed_kernel[poison_grid(out.numel(), sm_count(out.device))](pad, out, out.numel(), BLOCK=POISON_BLOCK, num_warps=4)


def wait_flags(pad_table: torch.Tensor, word_base: int, rank: int, world_size: int, epoch: int,
               timeout_ns: int, code: int, meta: int = -1, only: int = -1) -> None:
    """One one-program kernel (never holds more than one SM while it spins); ``only``: wait
    for that peer's flag alone."""
    wait_flags_kernel[(1,)](pad_table, word_base, rank, world_size, epoch, timeout_ns, code, meta, only)


def signal_peers(pad_table: torch.Tensor, word_base: int, rank: int, world_size: int, epoch: int,
                 meta: int) -> None:
    signal_peers_kernel[(1,)](pad_table, word_base, rank, world_size, epoch, meta)


AOT_EXAMPLES = [
    (wait_flags_kernel,
     {"pad_table": "*i64", "word_base": "i32", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "timeout_ns": "i64", "code": "i32", "meta": "i32", "only": "i32"}, {}, {"num_warps": 4}),
    (signal_peers_kernel,
     {"pad_table": "*i64", "word_base": "i32", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "meta": "i32"}, {}, {"num_warps": 4}),
    *[(poison_if_failed_kernel, {"my_pad": "*i32", "out_ptr": f"*{t}", "n": "i32"},
       {"BLOCK": POISON_BLOCK}, {"num_warps": 4}) for t in ("bf16", "fp32")],
]
