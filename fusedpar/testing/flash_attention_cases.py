"""``fusedpar check`` cases of the attention ops, forward and backward against float64 plain
torch (softmax is not exact in any dtype: within ``ATOL``, fp32): flash_attention on each
rank's own heads (a local op: no bytes to move), ring_attention over the whole group with
each rank its zigzag part of the sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusedpar.ops import flash_attention, ring_attention
from fusedpar.ops.flash_attention import AttentionCall
from fusedpar.ops.ring_attention import RingCall

from .cases import Case
from .parallel import CP_BATCH, CP_HEAD_DIM, CP_HEADS, CP_KV_HEADS, CP_SEQ, cp_case

ATOL = 1e-5


def _with_grads(fn, inputs, g) -> dict:
    """``fn(*leaves)`` and the gradients of ``sum(out * g)`` in each input."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out * g).sum().backward()
    return {"output": out.detach(), **{f"grad of {n}": t.grad for n, t in zip("qkv", leaves)}}


@dataclass
class FlashCase(Case):
    """Causal GQA attention of an odd length; rank r's data seeded by r."""

    op: str = "flash_attention"
    label: str = "causal, GQA"
    seq: int = 13
    dtypes = (torch.float32,)
    atol = ATOL

    def shape(self) -> str:
        return str((1, self.seq, 4, 16))

    def inputs(self, dtype, world, device) -> list:
        def rank_inputs(r):
            gen = torch.Generator().manual_seed(10 + r)
            q = torch.randn(1, self.seq, 4, 16, generator=gen, dtype=torch.float64)
            k, v = (torch.randn(1, self.seq, 2, 16, generator=gen, dtype=torch.float64) for _ in "kv")
            return q, k, v, torch.randn(q.shape, generator=gen, dtype=torch.float64)

        return [tuple(t.to(dtype).to(device) for t in rank_inputs(r)) for r in range(world)]

    def call(self, args, group, backend):
        q, k, v, g = args
        return _with_grads(lambda *t: flash_attention(*t, causal=True, backend=backend), (q, k, v), g)

    def availability_call(self, args, world, group):
        return AttentionCall(*args[:3], True, 16 ** -0.5)

    def expected(self, inputs, dtype) -> list:
        def sdpa(q, k, v):
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                 is_causal=True, enable_gqa=True)
            return out.transpose(1, 2)

        return [_with_grads(sdpa, [t.double() for t in args[:3]], args[3].double()) for args in inputs]

    def lower_bound(self, args, world) -> int:
        return 0

    def how(self) -> str:
        return (f"flash_attention: max |error| <= {ATOL:g} over the output and the q/k/v grads "
                "against float64 SDPA; a local op (nothing to move)")


@dataclass
class RingCase(Case):
    """The sequence of ``cp_case`` over the whole group, each rank its zigzag part."""

    op: str = "ring_attention"
    label: str = "zigzag, causal"
    dtypes = (torch.float32,)
    atol = ATOL

    def shape(self) -> str:
        return str((CP_BATCH, CP_SEQ, CP_HEADS, CP_HEAD_DIM))

    def inputs(self, dtype, world, device) -> list:
        return [tuple(cp_case(r, world, device)[0]) for r in range(world)]

    def call(self, args, group, backend):
        q, k, v, g = args
        return _with_grads(lambda *t: ring_attention(*t, group, causal=True, backend=backend),
                           (q, k, v), g)

    def availability_call(self, args, world, group):
        return RingCall(*args[:3], group, True, CP_HEAD_DIM ** -0.5, "zigzag")

    def expected(self, inputs, dtype) -> list:
        world = len(inputs)
        out = []
        for r in range(world):
            want = cp_case(r, world, inputs[r][0].device)[1]
            out.append(dict(zip(("output", "grad of q", "grad of k", "grad of v"), want)))
        return out

    def lower_bound(self, args, world) -> int:
        k, v = args[1], args[2]
        return 2 * (world - 1) * (k.numel() + v.numel()) * k.element_size()

    def how(self) -> str:
        return (f"ring_attention (q {CP_HEADS} / kv {CP_KV_HEADS} heads): max |error| <= {ATOL:g} "
                "over the output and the q/k/v grads against float64 SDPA of the whole sequence; "
                "lower bound 2*(W-1)*|k_local + v_local| (forward the peers' K/V, backward their "
                "partial dK/dV)")


def cases(world: int) -> list[Case]:
    return [FlashCase(), RingCase()]
