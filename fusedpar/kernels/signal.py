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

Epochs live on the device: every call adds one to this rank's ``EPOCH`` word before its
other kernels read it (its first kernel does: ``stage_kernel``), and the ops pass an
``epoch`` argument ``<= 0`` that is relative (``call_epoch``): 0 for the call's epoch, -1 for
the previous one. So a call replayed from a CUDA graph gets a new epoch with no host
involvement. (A positive ``epoch`` is absolute: kernel tests drive flags directly.)

A kernel whose end needs every program finished (raise a flag after all reads, NaN-fill a
failed call's outputs) takes a ticket: each program counts itself in a pad word and the last
one does the closing work (``end_call``); no program ever waits for another of its launch.
"""

import functools
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
MIRROR = tl.constexpr(layout.MIRROR)
STAGE_TICKET = tl.constexpr(layout.STAGE_TICKET)
END_TICKET = tl.constexpr(layout.END_TICKET)
TIMEOUT_READY = tl.constexpr(layout.TIMEOUT_READY)
TIMEOUT_DONE = tl.constexpr(layout.TIMEOUT_DONE)
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
    """Record ``[code, src, epoch]`` in this rank's STATUS words unless a failure is there, and
    in the host's status mirror (``layout.MIRROR``) where there is one."""
    if tl.atomic_cas(my_pad + STATUS, 0, code, sem="relaxed", scope="sys") == 0:
        tl.store(my_pad + STATUS + 1, src)
        tl.store(my_pad + STATUS + 2, epoch)
        host = tl.load((my_pad + MIRROR).to(tl.pointer_type(tl.int64)), volatile=True)
        if host != 0:
            # plain stores: atomics on host memory are not atomic over PCIe; the code last
            mirror = host.to(tl.pointer_type(tl.int32))
            tl.store(mirror + 1, src)
            tl.store(mirror + 2, epoch)
            tl.debug_barrier()
            tl.store(mirror, code)


@triton.jit
def wait_word(my_pad, word, target, src, epoch, timeout_ns, code):
    """Wait until ``my_pad[word] >= target`` during the call of ``epoch`` (what the
    interpreter's deadline is compared with); return whether it got there (False on any
    failure; a timeout records ``[code, src, target]``)."""
    status = my_pad + STATUS
    start = clock_start()
    value = tl.atomic_add(my_pad + word, 0, sem="acquire", scope="sys")
    failed = tl.atomic_add(status, 0, sem="relaxed", scope="sys")
    while (value < target) & (failed == 0):
        if time_is_up(my_pad, start, epoch, timeout_ns):
            record_failure(my_pad, code, src, target)
        value = tl.atomic_add(my_pad + word, 0, sem="acquire", scope="sys")
        failed = tl.atomic_add(status, 0, sem="relaxed", scope="sys")
    return (value >= target) & (failed == 0)


@triton.jit
def wait_flag(my_pad, word, src, epoch, timeout_ns, code):
    """Wait until ``my_pad[word] >= epoch``; return whether it did (False on any failure)."""
    return wait_word(my_pad, word, epoch, src, epoch, timeout_ns, code)


@triton.jit
def wait_peers(my_pad, word_base, rank, world_size, target, epoch, timeout_ns, code):
    """``wait_word`` on ``word_base + src`` for every peer ``src``; whether all got there."""
    ok = tl.full([], 1, tl.int1)
    for src in range(0, world_size):
        if src != rank:
            ok = ok & wait_word(my_pad, word_base + src, target, src, epoch, timeout_ns, code)
    return ok


@triton.jit
def raise_in_peers(pad_table, word_base, rank, world_size, epoch):
    """``peer_pad[word_base + rank] = epoch`` in every peer's pad, with release semantics:
    what this program saw and wrote before is visible first."""
    for peer in range(0, world_size):
        if peer != rank:
            tl.atomic_xchg(pad_ptr(pad_table, peer) + word_base + rank, epoch, sem="release", scope="sys")


@triton.jit
def last_program(my_pad, word):
    """Count this program as finished in ``my_pad[word]``; True for the last one, which sets
    the counter back to 0 for the next launch. Every thread's memory operations before it
    (its tile's loads and stores) happen before the count, and through the acq_rel chain on
    the counter before whatever the last program does next."""
    tl.debug_barrier()
    ticket = tl.atomic_add(my_pad + word, 1, sem="acq_rel", scope="sys")
    last = ticket == tl.num_programs(0) - 1
    if last:
        tl.atomic_xchg(my_pad + word, 0, sem="relaxed", scope="sys")
    return last


@triton.jit
def nan_fill(out_ptr, numel, BLOCK: tl.constexpr):
    """``out[:numel] = NaN`` by this program alone (a failed call's outputs: rare)."""
    offsets = tl.arange(0, BLOCK)
    for start in range(0, tl.cast(numel, tl.int64), BLOCK):  # int64: 2^31 elements must not wrap
        idx = start + offsets
        tl.store(out_ptr + idx, float("nan"), mask=idx < numel)


@triton.jit
def end_call(pad_table, rank, world_size, epoch, out_ptr, out_numel, out2_ptr, out2_numel,
             POISON: tl.constexpr, SIGNAL_DONE: tl.constexpr, RAISE_GATHERED: tl.constexpr):
    """Every program of a call's closing kernel calls this last. The last one to finish:
    ``POISON``: NaN-fills the outputs (``out_numel`` and ``out2_numel`` elements, either may
    be 0) if this rank recorded a failure, so a failed call's results never pass for
    results whenever the host learns of it; ``RAISE_GATHERED``: sets every ``GATHERED``
    flag (the gathered rows are all here); ``SIGNAL_DONE``: raises ``DONE[rank]`` in every
    peer's pad (it read their data) to the call's epoch. ``epoch``: the kernel's argument,
    resolved here (``call_epoch``) rather than kept in a register across the kernel's loop.
    ``out_numel`` and ``out2_numel``: kernel arguments too, for the same reason."""
    my_pad = pad_ptr(pad_table, rank)
    if last_program(my_pad, END_TICKET):
        if POISON:
            if tl.load(my_pad + STATUS, volatile=True) != 0:
                nan_fill(out_ptr, out_numel, 1024)
                nan_fill(out2_ptr, out2_numel, 1024)
        if RAISE_GATHERED:
            for src in range(0, world_size):
                tl.store(my_pad + GATHERED + src, 1)
        if SIGNAL_DONE:
            raise_in_peers(pad_table, DONE, rank, world_size, call_epoch(pad_table, rank, epoch))


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
    raise_in_peers(pad_table, word_base, rank, world_size, epoch)


# elements a stage program copies per step: 16 per thread of 8 warps (two 16-byte vectors
# at 2-byte dtypes)
STAGE_BLOCK = 4096
STAGE_WARPS = 8


@triton.jit(do_not_specialize=["rank", "world_size", "meta", "timeout_ns"])
def stage_kernel(x_ptr, dst_ptr, out_ptr, pad_table, rank, world_size, meta, timeout_ns, numel,
                 BLOCK: tl.constexpr, COPY_OUT: tl.constexpr, GATHER: tl.constexpr):
    """The first kernel of a call, at epoch = this rank's EPOCH + 1. Every program waits until
    every peer's DONE flag is at the last epoch (nobody still reads our data region), then
    copies its blocks of ``x`` (``numel`` contiguous elements) to ``dst`` (in our data region)
    and, ``COPY_OUT``, to ``out``. The last program to finish publishes ``meta``, (``GATHER``)
    sets our GATHERED flags to 0 but our own to 1 (our rows are in place), stores the epoch
    in EPOCH and raises READY in every peer's pad."""
    my_pad = pad_ptr(pad_table, rank)
    epoch = tl.load(my_pad + EPOCH, volatile=True) + 1
    if wait_peers(my_pad, DONE, rank, world_size, epoch - 1, epoch, timeout_ns, TIMEOUT_DONE):
        n = tl.cast(numel, tl.int64)  # 2^31 elements or more must not wrap
        offsets = tl.arange(0, BLOCK)
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
            idx = start + offsets
            inside = idx < n
            vals = tl.load(x_ptr + idx, mask=inside)
            tl.store(dst_ptr + idx, vals, mask=inside)
            if COPY_OUT:
                tl.store(out_ptr + idx, vals, mask=inside)
    if last_program(my_pad, STAGE_TICKET):
        if meta >= 0:
            tl.atomic_xchg(my_pad + META, meta, sem="relaxed", scope="sys")
        if GATHER:
            for src in range(0, world_size):
                tl.store(my_pad + GATHERED + src, (src == rank).to(tl.int32))
        tl.atomic_xchg(my_pad + EPOCH, epoch, sem="relaxed", scope="sys")
        raise_in_peers(pad_table, READY, rank, world_size, epoch)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` on the host: ``triton.cdiv`` is a constexpr function in triton 3.8,
    several times the cost of this, on every launch."""
    return -(-a // b)


# A kernel that spins on flags gets at most this many programs per SM and loops over its
# work, so its spinning programs never fill the GPU: a peer whose flag depends on other work
# (another stream, NCCL) still finds SMs. In the interpreter (no SMs) a small fixed number.
PROGRAMS_PER_SM = 4
INTERPRETER_PROGRAMS = 8


_sm_counts: dict = {}


def sm_count(device: torch.device) -> int | None:
    """The SM count of a CUDA device (asked at its first launch, never at import; kept);
    None when the kernels run in the interpreter."""
    if not COMPILED or device.type != "cuda":
        return None
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[device]


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
    return (spinning_grid(cdiv(numel, POISON_BLOCK), sms),)


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


@functools.lru_cache(maxsize=256)
def stage_grid(numel: int, sms: int | None) -> tuple[int]:
    """``stage_kernel``'s grid for ``numel`` elements (kept: every call of a shape asks): it
    waits, so ``spinning_grid``-capped (peers' DONE needs none of its SMs)."""
    return (spinning_grid(cdiv(numel, STAGE_BLOCK), sms),)


def stage(x: torch.Tensor, dst: torch.Tensor, pad_table: torch.Tensor, rank: int, world_size: int,
          meta: int, timeout_ns: int, *, out: torch.Tensor | None = None, gather: bool = False,
          sms: int | None = None) -> None:
    """Begin a call (``stage_kernel``): ``dst`` (this rank's data region, or rows of it) and,
    given, ``out`` get ``x``'s elements (all three contiguous, ``dst`` and ``out`` at least as
    long as ``x``) once every peer is done with the last call; then READY. ``meta`` < 0:
    publish none. ``sms``: the GPU's SM count (``sm_count``; None in the interpreter)."""
    stage_kernel[stage_grid(x.numel(), sms)](x, dst, x if out is None else out, pad_table, rank, world_size, meta,
                       timeout_ns, x.numel(), BLOCK=STAGE_BLOCK, COPY_OUT=out is not None,
                       GATHER=gather, num_warps=STAGE_WARPS)


AOT_EXAMPLES = [
    (wait_flags_kernel,
     {"pad_table": "*i64", "word_base": "i32", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "timeout_ns": "i64", "code": "i32", "meta": "i32", "only": "i32"}, {}, {"num_warps": 4}),
    (signal_peers_kernel,
     {"pad_table": "*i64", "word_base": "i32", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "meta": "i32"}, {}, {"num_warps": 4}),
    *[(poison_if_failed_kernel, {"my_pad": "*i32", "out_ptr": f"*{t}", "n": "i32"},
       {"BLOCK": POISON_BLOCK}, {"num_warps": 4}) for t in ("bf16", "fp32")],
    # the collectives' staging (every dtype all_gather takes), all_gather_matmul's and
    # all_gather_scaled_matmul's (with the gathered flags; returning A_gathered: COPY_OUT)
    *[(stage_kernel,
       {"x_ptr": f"*{t}", "dst_ptr": f"*{t}", "out_ptr": f"*{t}", "pad_table": "*i64", "rank": "i32",
        "world_size": "i32", "meta": "i32", "timeout_ns": "i64", "numel": "i32"},
       {"BLOCK": STAGE_BLOCK, "COPY_OUT": copy_out, "GATHER": gather}, {"num_warps": STAGE_WARPS})
      for t, variants in (("bf16", ((False, False), (False, True), (True, True))),
                          ("fp16", ((False, False),)), ("i64", ((False, False),)),
                          # i32: also all_gather_scaled_matmul's words of fp8 rows (and row scales)
                          ("i32", ((False, False), (False, True), (True, True))),
                          ("fp32", ((False, False), (False, True), (True, True))))
      for copy_out, gather in variants],
]
