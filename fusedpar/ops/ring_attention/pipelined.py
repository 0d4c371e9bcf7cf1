"""The rings of plain torch collectives: K/V (and, backward, dK/dV) passed around by async
P2P, each step's blocks attended by flash_attention's kernel (``pipelined``) or torch's
SDPA (``pipelined_sdpa``), merged in fp32."""

from __future__ import annotations

import torch

from ...comm import counters
from .. import protocol
from ..flash_attention import (DISPATCHER as FLASH_DISPATCHER, AttentionCall, attend_block,
                               attend_block_backward)
from .call import OP, RingBackend, RingCall, nbytes, packed_reason

def merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> None:
    """Fold a block's ``(out, lse)`` into the fp32 accumulators at ``rows`` (stable update:
    ``lse' = logaddexp(lse, lse_b)``, ``out' = out e^(lse - lse') + out_b e^(lse_b - lse')``)."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    keep = torch.exp(old - new).transpose(1, 2).unsqueeze(-1)
    take = torch.exp(block_lse - new).transpose(1, 2).unsqueeze(-1)
    out[:, rows] = out[:, rows] * keep + block_out.float() * take
    lse[:, :, rows] = new


def stat_rows(stat: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The ``rows`` of an lse-layout ``[B, H, S]`` tensor, or None."""
    return None if stat is None else stat[:, :, rows]


def kv_grads(dkv: torch.Tensor, dtype: torch.dtype):
    """dK, dV from a stacked ``[2, ...]`` gradient, as separate tensors (op outputs may not
    alias each other)."""
    return dkv[0].to(dtype, copy=True), dkv[1].to(dtype, copy=True)


def accumulators(q):
    b, s, h, _ = q.shape
    return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
            torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device))



class Pipelined(RingBackend):
    """W steps around the ring: the K/V block received at step s is sent on at step s+1
    while the attention of step s runs (async P2P: gloo on CPU, NCCL on GPU). Backward:
    K/V travel the ring again and each block's dK/dV accumulator travels with it, reaching
    its owner after W-1 hops; the owner's own block stays local. The accumulator travels in
    the input dtype (each rank adds its part in fp32 and rounds once per hop), so a call
    moves the lower bound (W-1) (|K/V| + |dK/dV|) of a ring. The backward passes each step
    the final out and lse of its rows (as ring-flash-attn does)."""

    name = "pipelined"

    def step(self, call: RingCall) -> str:
        """The flash_attention backend of each ring step."""
        return call.local

    def forward(self, call: RingCall):
        protocol.raise_on_mismatch(call)
        world, rank = call.world_size, call.rank
        _, left, right = protocol.ring_neighbours(call.group)
        q = call.q
        kv = torch.stack([call.k, call.v])
        bufs = [kv, torch.empty_like(kv)]
        out, lse = accumulators(q)
        for step in range(world):
            src, current = (rank - step) % world, bufs[step % 2]
            if step < world - 1:
                requests = protocol.exchange(current, bufs[(step + 1) % 2], left, right, call.group)
            for block in call.blocks(src):
                rows, keys = slice(*block.rows), slice(*block.keys)
                merge(out, lse, rows, *attend_block(q[:, rows], current[0][:, keys],
                                                    current[1][:, keys], block.causal, call.scale,
                                                    self.step(call), call.block_mask(block)))
            if step < world - 1:
                for request in requests:
                    request.wait()
        counters.record(OP, self.name, (world - 1) * nbytes(kv))
        return out.to(q.dtype), lse

    def backward(self, call: RingCall, out, lse, dout, dlse):
        world, rank = call.world_size, call.rank
        _, left, right = protocol.ring_neighbours(call.group)
        q = call.q
        kv = torch.stack([call.k, call.v])
        bufs = [kv, torch.empty_like(kv)]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        own = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        travelling = [torch.zeros_like(kv), torch.empty_like(kv)]  # accumulators of others' K/V
        grad_requests = []
        for step in range(world):
            src, current = (rank - step) % world, bufs[step % 2]
            if step < world - 1:
                kv_requests = protocol.exchange(current, bufs[(step + 1) % 2], left, right, call.group)
            for request in grad_requests:  # this step's accumulator has arrived
                request.wait()
            # the partial dK/dV of src's block, added to in fp32 (in place when fp32)
            acc = own if step == 0 else travelling[(step - 1) % 2].float()
            for block in call.blocks(src):
                rows, keys = slice(*block.rows), slice(*block.keys)
                bdq, bdk, bdv = attend_block_backward(
                    q[:, rows], current[0][:, keys], current[1][:, keys], out[:, rows],
                    lse[:, :, rows], dout[:, rows], stat_rows(dlse, rows), block.causal, call.scale,
                    self.step(call), call.block_mask(block))
                dq[:, rows] += bdq
                acc[0][:, keys] += bdk
                acc[1][:, keys] += bdv
            if step > 0:  # pass the accumulator on; receive the next (own, after the last step)
                sending = acc.to(kv.dtype)  # dK/dV travel in the input dtype, like K/V
                grad_requests = protocol.exchange(sending, travelling[step % 2], left, right, call.group)
            if step < world - 1:
                for request in kv_requests:
                    request.wait()
        for request in grad_requests:
            request.wait()
        if world > 1:
            own += travelling[(world - 1) % 2]
        counters.record(OP, self.name, 2 * (world - 1) * nbytes(kv))  # K/V, then dK/dV
        return dq.to(q.dtype), *kv_grads(own, q.dtype)


class PipelinedSdpa(Pipelined):
    """The pipelined ring with torch's attention kernel per step (flash_attention's ``sdpa``:
    flash, cuDNN or memory-efficient on CUDA, flash on CPU), merged by the same
    online-softmax rule; what ring-flash-attn and torch's ``context_parallel`` do. A backward
    whose lse has a gradient runs on another ring (torch's backward ops take none)."""

    name = "pipelined_sdpa"

    def not_supported_reasons(self, call: RingCall) -> list[str]:
        # the own (diagonal) block stands for every step: the others differ only in lengths
        block = AttentionCall(call.q, call.k, call.v, call.causal, call.scale, lse_grad=call.lse_grad,
                              window=call.window, softcap=call.softcap)
        return packed_reason(call) + FLASH_DISPATCHER.backends["sdpa"].not_supported_reasons(block)

    def step(self, call: RingCall) -> str:
        return "sdpa"

