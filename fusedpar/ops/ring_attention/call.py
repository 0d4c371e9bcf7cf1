"""One rank's ring_attention call (``RingCall``), the layouts and the input checks, shared
by the op and every backend kind."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm import symmetric
from ..backend import Backend
from ..flash_attention import check_attention_inputs, check_cu_seqlens, host_list
from .blocks import RingBlock, rank_chunks, ring_blocks

OP = "ring_attention"
LAYOUTS = ("zigzag", "contiguous", "zigzag_docs")


class RingCall:
    """One rank's call: this rank's ``q [B, S_local, H, D]``, ``k``/``v [B, S_local, H_kv, D]``;
    ``group`` None: a loopback call of ``world_size`` simulated ranks."""

    op = OP

    def __init__(self, q, k, v, group, causal: bool, scale: float, layout: str, world_size: int = 0,
                 cu_seqlens: torch.Tensor | None = None, lse_grad: bool = False,
                 window: tuple[int, int] = (-1, -1), softcap: float = 0.0, *,
                 rank: int | None = None, documents: list[tuple[int, int]] | None = None):
        self.q, self.k, self.v, self.group = q, k, v, group
        self.x = q  # what protocol.raise_on_mismatch reads
        self.causal, self.scale, self.layout = causal, scale, layout
        self.window, self.softcap = tuple(window), softcap
        if group is not None and not world_size:
            world_size = dist.get_world_size(group)
        self.world_size = world_size
        if rank is None:
            rank = dist.get_rank(group) if group is not None else 0
        self.rank = rank
        self.cu_seqlens = cu_seqlens
        self.lse_grad = lse_grad  # a backward call whose lse has a gradient
        # documents of the global sequence (packed with cu_seqlens), as [start, end) ranges
        if documents is None:
            ends = host_list(cu_seqlens) if cu_seqlens is not None else [0, world_size * q.shape[1]]
            documents = list(zip(ends, ends[1:]))
        self.documents = documents

    def maker(self):
        """A function of ``(q, k, v, cu_seqlens)`` making calls like this one (a plan's,
        ``backend.Plans``): the group, rank, mask and documents kept (a plan's key holds the
        documents' values), none of the tensors."""
        group, causal, scale, layout, world = self.group, self.causal, self.scale, self.layout, self.world_size
        lse_grad, window, softcap, rank, documents = (self.lse_grad, self.window, self.softcap,
                                                      self.rank, self.documents)
        return lambda q, k, v, cu_seqlens: RingCall(q, k, v, group, causal, scale, layout, world,
                                                    cu_seqlens, lse_grad, window, softcap,
                                                    rank=rank, documents=documents)

    def cache_key(self) -> tuple:
        name = self.group.group_name if self.group is not None else f"loopback{self.world_size}"
        return (name, self.q.device.type, self.q.dtype, self.q.shape[2], self.k.shape[2],
                self.q.shape[3], self.layout, self.cu_seqlens is not None, self.lse_grad,
                self.window != (-1, -1), self.softcap > 0)

    def describe(self) -> str:
        return (f"q {tuple(self.q.shape)}, k/v {tuple(self.k.shape)} {self.q.dtype} on "
                f"{self.q.device.type}, layout {self.layout!r}, world size {self.world_size}")

    def fingerprint(self) -> int:
        return symmetric.fingerprint(OP, self.q.dtype, tuple(self.q.shape), tuple(self.k.shape),
                                     self.causal, self.layout, self.documents, self.window,
                                     self.softcap)

    def description(self) -> list[int]:
        """For mismatch errors: q's shape and the K/V head count, the sequence dim."""
        return symmetric.describe_words(7, self.q.dtype, (*self.q.shape, self.k.shape[2]), 1)

    @property
    def local(self) -> str:
        """The flash_attention backend of the blocks: the kernel on GPU, the reference math
        on CPU (the interpreter is a test tool); the same on every rank."""
        return "triton" if self.q.device.type == "cuda" else "reference"

    def blocks(self, src: int, rank: int | None = None) -> list[RingBlock]:
        """The blocks of ``rank``'s (default: this rank's) queries against ``src``'s K/V
        (``blocks.ring_blocks``); empty when no query sees any of its keys."""
        rank = self.rank if rank is None else rank
        return ring_blocks(self.layout, self.world_size, rank, src, self.q.shape[1], self.causal,
                           self.window, self.packed_documents)

    @property
    def packed_documents(self) -> list[tuple[int, int]] | None:
        return self.documents if self.cu_seqlens is not None else None

    def block_mask(self, block: RingBlock) -> dict:
        """``attend_block``'s mask of ``block`` on tensors sliced to its rows and keys."""
        return dict(window=block.window, softcap=self.softcap, diag_offset=block.sliced_diag())

    def whole_mask(self) -> dict:
        """``attend_block``'s mask of the whole sequence in global order."""
        return dict(window=self.window, softcap=self.softcap)

    def chunks(self) -> list[tuple[int, int, int]]:
        """``(local start, global start, length)`` of this rank's chunks."""
        return rank_chunks(self.layout, self.world_size, self.rank, self.q.shape[1],
                           self.packed_documents)

    def positions(self, device) -> torch.Tensor:
        """``layout_positions`` of this call."""
        return layout_positions(self.layout, self.world_size, self.q.shape[1],
                                self.packed_documents, device)

    def to_global(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The rank-order concatenation of every rank's part (along ``dim``) in global order."""
        return x.index_select(dim, self.positions(x.device).argsort())

    def to_rank_order(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of ``to_global``."""
        return x.index_select(dim, self.positions(x.device))


def layout_positions(layout: str, world: int, seqlen: int, documents=None, device=None) -> torch.Tensor:
    """The global position (int64) of each row of the rank-order concatenation of every
    rank's ``seqlen`` rows in ``layout`` (``documents``: ``zigzag_docs``' ``[start, end)``
    ranges); ``gathered.index_select(dim, positions.argsort())`` is the global order."""
    return torch.cat([torch.arange(start, start + n, device=device) for rank in range(world)
                      for _, start, n in rank_chunks(layout, world, rank, seqlen, documents)])


def check_ring_inputs(op: str, q, k, v, layout: str, world: int, cu_seqlens=None) -> None:
    check_attention_inputs(op, q, k, v)
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"fusedpar.{op}: with cu_seqlens (packed documents) the batch must be "
                             f"1 (the pack), got B={q.shape[0]}")
        check_cu_seqlens(op, cu_seqlens, world * q.shape[1], q.device,
                         "the global sequence (W * S_local) has ")
    if layout not in LAYOUTS:
        raise ValueError(f"fusedpar.{op}: layout={layout!r}; choose one of {LAYOUTS}")
    if layout == "zigzag_docs":
        check_documents(op, cu_seqlens, world)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"fusedpar.{op}: q has S_local={q.shape[1]} but k/v have {k.shape[1]}; "
                         "every rank holds the same positions of q, k and v")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(
            f"fusedpar.{op}: layout 'zigzag' needs the global sequence length W*S_local = "
            f"{world * q.shape[1]} divisible by 2W = {2 * world}, i.e. an even S_local (got "
            f"{q.shape[1]}); pad the sequence to a multiple of {2 * world} or use "
            "layout='contiguous'"
        )


def check_documents(op: str, cu_seqlens, world: int) -> None:
    """``layout="zigzag_docs"``'s needs: ``cu_seqlens`` (checked by the caller otherwise), and
    every document a multiple of ``2W`` long (cut into ``2W`` equal chunks)."""
    if cu_seqlens is None:
        raise ValueError(f"fusedpar.{op}: layout='zigzag_docs' shards each packed document; pass "
                         "cu_seqlens (the documents' cumulative ends over the global sequence), "
                         "or use layout='zigzag' for one sequence")
    odd = _uneven_documents(cu_seqlens, world)
    if odd:
        shown = ", ".join(f"document {i}: {n}" for i, n in odd[:4]) + (", ..." if len(odd) > 4 else "")
        raise ValueError(f"fusedpar.{op}: layout='zigzag_docs' cuts every document into 2W = "
                         f"{2 * world} equal chunks, but cu_seqlens has document lengths that are "
                         f"not multiples of {2 * world} ({shown}); pad each document to a multiple "
                         f"of {2 * world}, or use layout='zigzag' (the whole packed row zigzag)")


def packed_layout(cu_seqlens: torch.Tensor, world: int) -> str:
    """The zigzag layout for a packed row: ``"zigzag_docs"`` when every document of
    ``cu_seqlens`` is a multiple of ``2W`` long (each document's causal work balanced over
    the ranks), else ``"zigzag"`` (the whole row; the same results, balanced over the row)."""
    return "zigzag" if _uneven_documents(cu_seqlens, world) else "zigzag_docs"


def _uneven_documents(cu_seqlens: torch.Tensor, world: int) -> list[tuple[int, int]]:
    """``(index, length)`` of the documents of ``cu_seqlens`` not a multiple of ``2W`` long."""
    ends = host_list(cu_seqlens)
    return [(i, b - a) for i, (a, b) in enumerate(zip(ends, ends[1:])) if (b - a) % (2 * world)]



def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class RingBackend(Backend):
    """A ring_attention backend. ``run(call)``, the op's forward (``out`` and ``lse``
    contiguous, as the fake's), is what ``Backend.plan``'s default plan calls."""

    def run(self, call: RingCall):
        out, lse = self.forward(call)
        return out.contiguous(), lse.contiguous()


def packed_reason(call: RingCall) -> list[str]:
    return (["packed documents (cu_seqlens) run on the triton, pipelined and allgather_kv backends"]
            if call.cu_seqlens is not None else [])

