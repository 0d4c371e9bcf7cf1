"""The backends that gather instead of passing a ring: ``allgather_kv`` (every rank's K/V)
and ``ulysses`` (all-to-all heads <-> sequence)."""

from __future__ import annotations

import torch

from ...comm import counters
from .. import protocol
from ..all_gather import all_gather
from ..reduce_scatter import reduce_scatter
from ..flash_attention import attend_block, attend_block_backward, delta_of
from .blocks import band_block
from .call import OP, RingBackend, RingCall, nbytes, packed_reason
from .pipelined import accumulators, kv_grads, merge, stat_rows

def _global_kv(call: RingCall, kv: torch.Tensor) -> torch.Tensor:
    """All-gather ``[2, B, S_local, H_kv, D]`` and put the sequence in global order."""
    gathered = all_gather(kv, 2, call.group, backend=None if kv.is_cuda else "reference")
    return call.to_global(gathered, 2)


class AllGatherKV(RingBackend):
    """All-gather K/V (``fusedpar.ops.all_gather``), then attend locally: each local query
    chunk (cut at document boundaries when packed) to the part of its document before it
    (full) and to itself (causal). The choice for GQA with few KV heads, and for packed
    documents that cross ranks. Backward: gather again, reduce-scatter dK/dV."""

    name = "allgather_kv"

    def _blocks(self, call: RingCall):
        """Each local query chunk, cut at document ends, against its document's keys (in
        global order) that the window reaches: RingBlocks of local rows and global keys."""
        for first, g, n in call.chunks():  # local row first holds global position g
            for start, end in call.documents:
                lo, hi = max(start, g), min(end, g + n)  # queries of this document
                if lo < hi:
                    local = first + lo - g
                    block = band_block((local, local + hi - lo), (start, end), lo - local,
                                       call.causal, call.window)
                    if block is not None:
                        yield block

    def forward(self, call: RingCall):
        protocol.raise_on_mismatch(call)
        kv = _global_kv(call, torch.stack([call.k, call.v]))
        out, lse = accumulators(call.q)
        for block in self._blocks(call):
            rows, keys = slice(*block.rows), slice(*block.keys)
            merge(out, lse, rows, *attend_block(call.q[:, rows], kv[0][:, keys], kv[1][:, keys],
                                                block.causal, call.scale, call.local,
                                                call.block_mask(block)))
        return out.to(call.q.dtype), lse

    def backward(self, call: RingCall, out, lse, dout, dlse):
        kv = _global_kv(call, torch.stack([call.k, call.v]))
        q = call.q
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for block in self._blocks(call):
            rows, keys = slice(*block.rows), slice(*block.keys)
            bdq, bdk, bdv = attend_block_backward(q[:, rows], kv[0][:, keys], kv[1][:, keys],
                                                  out[:, rows], lse[:, :, rows], dout[:, rows],
                                                  stat_rows(dlse, rows), block.causal, call.scale,
                                                  call.local, call.block_mask(block))
            dq[:, rows] += bdq
            dkv[0][:, keys] += bdk
            dkv[1][:, keys] += bdv
        own = reduce_scatter(call.to_rank_order(dkv, 2), "sum", 2, call.group,  # to the owners
                             backend=None if q.is_cuda else "reference")
        return dq.to(q.dtype), *kv_grads(own, q.dtype)


def _to_heads(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """``[B, S_local, H, ...]`` sequence-sharded to ``[B, W*S_local, H/W, ...]`` head-sharded
    (sequence in rank order)."""
    b, s, h = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, s, world, h // world, *rest).movedim(2, 0).contiguous()
    recv = torch.empty_like(send)
    protocol.all_to_all_single(recv, send, group)
    counters.record(OP, "ulysses", (world - 1) * nbytes(send) // world)
    return recv.movedim(0, 1).reshape(b, world * s, h // world, *rest)


def _to_sequence(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """The inverse of ``_to_heads``."""
    b, total, hw = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, world, total // world, hw, *rest).movedim(1, 0).contiguous()
    recv = torch.empty_like(send)
    protocol.all_to_all_single(recv, send, group)
    counters.record(OP, "ulysses", (world - 1) * nbytes(send) // world)
    return recv.permute(1, 2, 0, *range(3, recv.dim())).reshape(b, total // world, world * hw, *rest)


class Ulysses(RingBackend):
    """All-to-all heads <-> sequence (every rank gets the whole sequence for H/W heads),
    attend locally, all-to-all back. K/V heads are replicated to W when H_kv < W."""

    name = "ulysses"

    def not_supported_reasons(self, call: RingCall) -> list[str]:
        world, heads, kv_heads = call.world_size, call.q.shape[2], call.k.shape[2]
        reasons = packed_reason(call)
        if heads % world:
            reasons.append(f"H={heads} query heads do not split over W={world} ranks (H % W != 0); "
                           "use a ring backend or a group whose size divides H")
        if kv_heads % world and world % kv_heads:
            reasons.append(f"H_kv={kv_heads} K/V heads neither split over nor replicate to "
                           f"W={world} ranks")
        return reasons

    @staticmethod
    def _heads(call: RingCall, *tensors):
        world, kv_heads = call.world_size, call.k.shape[2]
        out = []
        for i, t in enumerate(tensors):
            if i in (1, 2) and kv_heads < world:  # K/V: one replica per rank
                t = t.repeat_interleave(world // kv_heads, 2)
            out.append(call.to_global(_to_heads(t, world, call.group), 1))
        return out

    @staticmethod
    def _stat_heads(call: RingCall, stat: torch.Tensor) -> torch.Tensor:
        """An lse-layout ``[B, H, S_local]`` tensor to ``[B, H/W, S]`` in global order."""
        full = _to_heads(stat.transpose(1, 2), call.world_size, call.group)
        return call.to_global(full, 1).transpose(1, 2).contiguous()

    def forward(self, call: RingCall):
        protocol.raise_on_mismatch(call)
        world = call.world_size
        q, k, v = self._heads(call, call.q, call.k, call.v)
        out, lse = attend_block(q, k, v, call.causal, call.scale, call.local, call.whole_mask())
        out = _to_sequence(call.to_rank_order(out.to(call.q.dtype), 1), world, call.group)
        lse = _to_sequence(call.to_rank_order(lse.transpose(1, 2), 1), world, call.group)
        return out, lse.transpose(1, 2).contiguous()

    def backward(self, call: RingCall, out, lse, dout, dlse):
        world, kv_heads = call.world_size, call.k.shape[2]
        q, k, v, do = self._heads(call, call.q, call.k, call.v, dout)
        delta = self._stat_heads(call, delta_of(out, dout, dlse))  # moves far less than out
        grads = attend_block_backward(q, k, v, None, self._stat_heads(call, lse), do, None,
                                      call.causal, call.scale, call.local, call.whole_mask(), delta)
        dq, dk, dv = (_to_sequence(call.to_rank_order(g, 1), world, call.group) for g in grads)
        if kv_heads < world:  # sum the replicas' gradients
            b, s, _, d = dk.shape
            dk, dv = (g.view(b, s, kv_heads, world // kv_heads, d).sum(3) for g in (dk, dv))
        return dq, dk, dv
