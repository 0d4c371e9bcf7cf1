"""One ``moe_experts`` call (``ExpertsCall``) with its checks, and ``ExchangePlan``: the
rows its exchange sends to and receives from each rank, which every backend that reads the
routing counts on the host (``pipelined``, ``fused``) builds from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...comm import symmetric
from .. import protocol
from ..tuning import pow2
from .exchange import check_same_everywhere, host_to_device

OP = "moe_experts"


def check_expert_weights(op: str, x, w13, w2) -> None:
    """``w13 [E_local, 2I, H]`` and ``w2 [E_local, H, I]`` fit ``x [T, H]``: one dtype the
    expert GEMMs take, one device."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fusedpar.{op}: w13 must be [E_local, 2I, H] and w2 [E_local, H, I], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"fusedpar.{op}: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 "
                         f"{tuple(w2.shape)} do not fit: need w13 [E_local, 2I, H={x.shape[1]}] and "
                         "w2 [E_local, H, I]")
    if not x.dtype == w13.dtype == w2.dtype:
        raise TypeError(f"fusedpar.{op}: x is {x.dtype}, w13 {w13.dtype} and w2 {w2.dtype}; cast "
                        "them to one dtype")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"fusedpar.{op}: x, w13 and w2 are {x.dtype}; the expert GEMMs take "
                        "float32, float16 or bfloat16")
    if not x.device == w13.device == w2.device:
        raise ValueError(f"fusedpar.{op}: x, w13 and w2 must be on one device, got {x.device}, "
                         f"{w13.device} and {w2.device}")


@dataclass
class ExpertsCall:
    """One rank's ``moe_experts`` call, as the dispatcher and the backends see it."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    group: dist.ProcessGroup
    max_tokens_per_rank: int | None = None
    float8: str | None = None  # a float8 recipe: fp8 dispatch and expert GEMMs

    def cache_key(self) -> tuple:
        # H % 4: the fused backend's fp8 rows carry their scales after H bytes
        return (self.group.group_name, self.x.device.type, self.x.dtype,
                self.max_tokens_per_rank is None, self.float8, self.x.shape[1] % 4 == 0)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def bucket(self) -> tuple:
        """The tuning bucket (``tuning``): hidden size, intermediate size, experts per rank
        and k, as powers of two. The sizes ``agree()`` checks are the same on every rank;
        tokens are not (T may differ), and a bucket that differed between ranks would send
        one rank into the tuning agreement alone."""
        return (pow2(self.x.shape[1]), pow2(self.w13.shape[1] // 2), pow2(self.w13.shape[0]),
                pow2(self.topk_idx.shape[1]))

    def agree(self) -> tuple[int, int, int, int]:
        """Check (one tiny all-gather) that every rank passed the same sizes and dtype;
        returns ``(world, rank, experts per rank, k)``."""
        local, k = self.w13.shape[0], self.topk_idx.shape[1]
        check_same_everywhere(OP, self.group, [self.x.shape[1], k, local, self.w13.shape[1],
                                               symmetric.dtype_code(self.x.dtype)],
                              "hidden size, k, experts per rank, 2 x intermediate size, dtype")
        return dist.get_world_size(self.group), dist.get_rank(self.group), local, k

    def describe(self) -> str:
        return (f"x {tuple(self.x.shape)} {self.x.dtype} on {self.x.device.type}, topk_idx "
                f"{tuple(self.topk_idx.shape)}, w13 {tuple(self.w13.shape)}")


def host_read_reasons(call: ExpertsCall) -> list[str]:
    """Why a backend whose exchange is sized on the host cannot take ``max_tokens_per_rank``."""
    if call.max_tokens_per_rank is not None:
        return ["max_tokens_per_rank asks for no host read, and this backend reads the routing "
                "counts on the host (the reference backend keeps them on the device)"]
    return []


@dataclass
class ExchangePlan:
    """Who sends what to whom in one call: ``send[d]`` rows to rank d, ``recv[s]`` rows from
    rank s; ``copies[s]`` the copies source s's rows hold (one per row unless the rows carry
    a token for several experts), in (local expert, token) order, ``offs[s]`` their group
    ends."""

    group: dist.ProcessGroup
    rank: int
    world: int
    send: list
    recv: list
    copies: list
    offs: torch.Tensor  # int32 [W, E_local]
    segment_ends: torch.Tensor  # int32 [W * E_local]: of the (source, expert) segments of all copies
    table: torch.Tensor | None = None  # fused: every rank's copies per expert (host, [W, E])
    k: int = 0
    keep_back: bool = True  # fused: the forward's results outlive the call (autograd saves them)

    @classmethod
    def from_counts(cls, group, rank: int, send_counts: torch.Tensor, recv_counts: torch.Tensor,
                    device: torch.device, rows: tuple[list, list] | None = None):
        """``send_counts[d, e]`` copies this rank sends to rank d's expert e, ``recv_counts[s,
        e]`` it receives from rank s for its expert e (host int ``[W, E_local]``); the group
        ends go to ``device`` in one copy that does not wait for its stream. ``rows``: the
        rows sent to and received from each rank, where not a row per copy."""
        ends = host_to_device(torch.cat([recv_counts.cumsum(1).flatten(),
                                         recv_counts.flatten().cumsum(0)]).to(torch.int32), device)
        world, copies = send_counts.shape[0], recv_counts.sum(1).tolist()
        send, recv = rows or (send_counts.sum(1).tolist(), copies)
        return cls(group, rank, world, send, recv, copies, ends[:recv_counts.numel()].view(world, -1),
                   ends[recv_counts.numel():])

    def send_rows(self, dst: int) -> slice:
        start = sum(self.send[:dst])
        return slice(start, start + self.send[dst])

    def peer_rows(self) -> int:
        """Rows one exchange there and back brings this rank from the others."""
        return sum(self.recv) - self.recv[self.rank] + sum(self.send) - self.send[self.rank]

    def recv_rows(self, src: int) -> slice:
        start = sum(self.recv[:src])
        return slice(start, start + self.recv[src])

    def copy_rows(self, src: int) -> slice:
        start = sum(self.copies[:src])
        return slice(start, start + self.copies[src])

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> list:
        """Start sending ``send`` to ``dst`` and receiving ``recv`` from ``src`` (empty ones
        are skipped: both sides know the counts)."""
        ops = []
        if send.shape[0]:
            ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(self.group, dst), self.group))
        if recv.shape[0]:
            ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(self.group, src), self.group))
        return protocol.p2p(ops, self.group) if ops else []
