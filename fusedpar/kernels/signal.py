"""Flags in symmetric signal pads: bounded waits and release signals (layout: comm.layout).

Every wait polls with an acquire atomic at system scope and gives up after ``max_spins``
polls, recording ``[code, src, epoch]`` in the waiter's own STATUS words (first failure
wins); a wait that finds a failure already recorded gives up at once.
"""

import torch
import triton
import triton.language as tl

from ..comm import layout

READY = tl.constexpr(layout.READY)
DONE = tl.constexpr(layout.DONE)
META = tl.constexpr(layout.META)
STATUS = tl.constexpr(layout.STATUS)
PAD_BYTES = tl.constexpr(layout.PAD_BYTES)


@triton.jit
def pad_ptr(pad_table, rank):
    """Rank ``rank``'s signal pad, as an int32 pointer valid in this process."""
    return tl.load(pad_table + rank).to(tl.pointer_type(tl.int32))


@triton.jit
def data_ptr(pad_table, rank, dtype: tl.constexpr):
    """Rank ``rank``'s data region (just past its pad), as a ``dtype`` pointer."""
    return (tl.load(pad_table + rank) + PAD_BYTES).to(tl.pointer_type(dtype))


@triton.jit
def wait_flag(my_pad, word, src, epoch, max_spins, code):
    """Wait until ``my_pad[word] >= epoch``; return whether it did (False on any failure)."""
    status = my_pad + STATUS
    value = tl.atomic_add(my_pad + word, 0, sem="acquire", scope="sys")
    failed = tl.atomic_add(status, 0, sem="relaxed", scope="sys")
    spins = 0
    while (value < epoch) & (failed == 0):
        spins += 1
        if spins >= max_spins:
            if tl.atomic_cas(status, 0, code, sem="relaxed", scope="sys") == 0:
                tl.store(status + 1, src)
                tl.store(status + 2, epoch)
        value = tl.atomic_add(my_pad + word, 0, sem="acquire", scope="sys")
        failed = tl.atomic_add(status, 0, sem="relaxed", scope="sys")
    return (value >= epoch) & (failed == 0)


@triton.jit
def check_meta(pad_table, rank, src, epoch, meta):
    """Whether ``src``'s published input fingerprint equals ours (a mismatch is recorded)."""
    theirs = tl.load(pad_ptr(pad_table, src) + META, volatile=True)
    ok = theirs == meta
    if not ok:
        my_pad = pad_ptr(pad_table, rank)
        if tl.atomic_cas(my_pad + STATUS, 0, 3, sem="relaxed", scope="sys") == 0:  # META_MISMATCH
            tl.store(my_pad + STATUS + 1, src)
            tl.store(my_pad + STATUS + 2, epoch)
    return ok


@triton.jit
def wait_ready_and_match(pad_table, rank, src, epoch, meta, max_spins):
    """Wait for ``src``'s READY flag, then check its input fingerprint equals ours."""
    ok = wait_flag(pad_ptr(pad_table, rank), READY + src, src, epoch, max_spins, 1)  # TIMEOUT_READY
    if ok:
        ok = check_meta(pad_table, rank, src, epoch, meta)
    return ok


@triton.jit
def wait_flags_kernel(pad_table, word_base, rank, world_size, epoch, max_spins, code, meta):
    """One program: wait until ``pad[word_base + src] >= epoch`` for every peer ``src``;
    with ``meta >= 0`` also check each peer's published fingerprint."""
    my_pad = pad_ptr(pad_table, rank)
    for src in range(0, world_size):
        if src != rank:
            if wait_flag(my_pad, word_base + src, src, epoch, max_spins, code):
                if meta >= 0:
                    check_meta(pad_table, rank, src, epoch, meta)


@triton.jit
def signal_peers_kernel(pad_table, word_base, rank, world_size, epoch, meta):
    """One program: publish ``meta`` (if >= 0), then set ``peer_pad[word_base + rank] = epoch``
    on every peer with release semantics, so what this rank wrote before is visible first."""
    if meta >= 0:
        tl.atomic_xchg(pad_ptr(pad_table, rank) + META, meta, sem="relaxed", scope="sys")
    for peer in range(0, world_size):
        if peer != rank:
            tl.atomic_xchg(pad_ptr(pad_table, peer) + word_base + rank, epoch, sem="release", scope="sys")


def wait_flags(pad_table: torch.Tensor, word_base: int, rank: int, world_size: int, epoch: int,
               max_spins: int, code: int, meta: int = -1) -> None:
    wait_flags_kernel[(1,)](pad_table, word_base, rank, world_size, epoch, max_spins, code, meta)


def signal_peers(pad_table: torch.Tensor, word_base: int, rank: int, world_size: int, epoch: int,
                 meta: int) -> None:
    signal_peers_kernel[(1,)](pad_table, word_base, rank, world_size, epoch, meta)


AOT_EXAMPLES = [
    (wait_flags_kernel,
     {"pad_table": "*i64", "word_base": "i32", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "max_spins": "i64", "code": "i32", "meta": "i32"}, {}),
    (signal_peers_kernel,
     {"pad_table": "*i64", "word_base": "i32", "rank": "i32", "world_size": "i32", "epoch": "i32",
      "meta": "i32"}, {}),
]
