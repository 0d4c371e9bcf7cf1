"""The multi-rank scenarios of ``fusedpar check``: a ``fusedpar.models`` Llama decoder layer
under ``apply_tp`` (TP=2, sequence parallel) against the block in one process, and the data
and float64 plain-torch oracles of the ring_attention and moe_experts check cases
(``flash_attention_cases``, ``moe_cases``). Each function gives the seeded data, the oracle
and the bytes a rank must receive; ``fusedpar check`` runs the ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# ---- a tensor-parallel block ------------------------------------------------------------

TP_SIZE = 2
TP_BATCH, TP_SEQ, TP_HIDDEN = 2, 8, 32
TP_HEADS, TP_KV_HEADS, TP_HEAD_DIM, TP_INTERMEDIATE = 8, 4, 4, 48
TP_ATOL = 1e-5
TP_LR = 0.1
TP_OP = f"tp={TP_SIZE} block (SP)"


def tp_data(device):
    """The seeded block (a ``fusedpar.models`` Llama decoder layer, identical on every
    rank), the rotary embeddings of the whole sequence, the input and the loss weights."""
    from fusedpar.models import LlamaConfig
    from fusedpar.models.llama import DecoderLayer, RMSNorm, RotaryEmbedding

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=TP_HIDDEN, num_heads=TP_HEADS, num_kv_heads=TP_KV_HEADS,
                         intermediate_size=TP_INTERMEDIATE)
    block = DecoderLayer(config)
    with torch.no_grad():  # norms away from 1 so that their gradients matter
        for module in block.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape))
    x = torch.randn(TP_BATCH, TP_SEQ, TP_HIDDEN)
    g = torch.randn(TP_BATCH, TP_SEQ, TP_HIDDEN)
    # the attention sees the whole sequence (q/k/v gather it), so RoPE takes every position
    rope = RotaryEmbedding(config.head_dim, config.rope_theta)(x, torch.arange(TP_SEQ)[None])
    return block.to(device), tuple(t.to(device) for t in rope), x.to(device), g.to(device)


def tp_step(block, rope, x, g):
    """Forward, backward of ``sum(y * g)``, one SGD step: (y, dx, grads, params after)."""
    x = x.detach().clone().requires_grad_()
    y = block(x, position_embeddings=rope)
    (y * g).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters()}
    torch.optim.SGD(block.parameters(), lr=TP_LR).step()
    params = {n: p.detach().clone() for n, p in block.named_parameters()}
    return y.detach(), x.grad.detach(), grads, params


def tp_full(tensors: dict) -> dict:
    """The TP layers' parameters (or gradients), DTensor shards on the tp group, as full
    tensors (a collective: every member calls it)."""
    from torch.distributed.tensor import DTensor

    return {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in tensors.items()}


def tp_lower_bound(world: int, dtype=torch.float32) -> int:
    """Bytes a rank must receive for one forward + backward of the SP block: forward, the
    q/k/v and gate/up gathers of the ``[B, S/W, H]`` input shard and the o/down
    reduce-scatters of the ``[B, S/W, H]`` output shard; backward, the transposes (two
    reduce-scatters of the gathered inputs' gradients, two gathers of the outputs')."""
    elem = torch.empty((), dtype=dtype).element_size()
    input_shard = TP_BATCH * (TP_SEQ // world) * TP_HIDDEN * elem
    output_shard = TP_BATCH * (TP_SEQ // world) * TP_HIDDEN * elem
    forward = 2 * (world - 1) * input_shard + 2 * (world - 1) * output_shard
    backward = 2 * (world - 1) * output_shard + 2 * (world - 1) * input_shard
    return forward + backward


# ---- context and expert parallelism (the registry's ring_attention / moe_experts cases) -

CP_BATCH, CP_SEQ, CP_HEADS, CP_KV_HEADS, CP_HEAD_DIM = 1, 16, 4, 2, 16
EP_TOKENS, EP_HIDDEN, EP_INTERMEDIATE, EP_EXPERTS, EP_TOPK = 6, 16, 24, 4, 2


def zigzag_part(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s zigzag part of the sequence dim 1: chunks ``rank`` and ``2W-1-rank``."""
    chunks = t.chunk(2 * world, 1)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], 1)


def cp_case(rank: int, world: int, device):
    """q, k, v and the output weights g (full, seeded), the fp64 oracle's output and
    gradients (full), and this rank's zigzag parts of the inputs."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(CP_BATCH, CP_SEQ, CP_HEADS, CP_HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(CP_BATCH, CP_SEQ, CP_KV_HEADS, CP_HEAD_DIM, generator=gen,
                        dtype=torch.float64) for _ in range(2))
    g = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.transpose(1, 2) for t in full)
    groups = CP_HEADS // CP_KV_HEADS
    out = F.scaled_dot_product_attention(qh, kh.repeat_interleave(groups, 1),
                                         vh.repeat_interleave(groups, 1), is_causal=True)
    out = out.transpose(1, 2)
    (out * g).sum().backward()
    expected = [out.detach()] + [t.grad for t in full]
    local = [zigzag_part(t, rank, world).float().to(device) for t in (q, k, v, g)]
    return local, [zigzag_part(t, rank, world) for t in expected]


def ep_case(rank: int, world: int, device):
    """Every rank's tokens and routing (seeded by rank), the experts (the same on every
    rank), the fp64 oracle's outputs and gradients, and this rank's inputs."""
    def inputs(r):
        gen = torch.Generator().manual_seed(100 + r)
        x = torch.randn(EP_TOKENS, EP_HIDDEN, generator=gen, dtype=torch.float64) + r
        idx = torch.stack([torch.randperm(EP_EXPERTS, generator=gen)[:EP_TOPK]
                           for _ in range(EP_TOKENS)])
        weights = torch.rand(EP_TOKENS, EP_TOPK, generator=gen, dtype=torch.float64).softmax(-1)
        g = torch.randn(EP_TOKENS, EP_HIDDEN, generator=gen, dtype=torch.float64)
        return x, idx, weights, g

    gen = torch.Generator().manual_seed(7)
    w13 = torch.randn(EP_EXPERTS, 2 * EP_INTERMEDIATE, EP_HIDDEN, generator=gen,
                      dtype=torch.float64) / EP_HIDDEN ** 0.5
    w2 = torch.randn(EP_EXPERTS, EP_HIDDEN, EP_INTERMEDIATE, generator=gen,
                     dtype=torch.float64) / EP_INTERMEDIATE ** 0.5
    from fusedpar.ops.moe import experts_dense

    every = [inputs(r) for r in range(world)]
    w13_full, w2_full = w13.clone().requires_grad_(), w2.clone().requires_grad_()
    x, idx, weights, g = every[rank]
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    total = 0
    for r, (xr, idxr, wr, gr) in enumerate(every):
        if r == rank:
            xr, wr = x, weights
        total = total + (experts_dense(xr, idxr, wr, w13_full, w2_full) * gr).sum()
    total.backward()
    y = experts_dense(x, idx, weights, w13_full, w2_full).detach()
    local_experts = slice(rank * EP_EXPERTS // world, (rank + 1) * EP_EXPERTS // world)
    expected = [y, x.grad, weights.grad, w13_full.grad[local_experts], w2_full.grad[local_experts]]
    local = [t.detach()[...].float().to(device) for t in (every[rank][0], every[rank][2],
                                                         w13[local_experts], w2[local_experts],
                                                         every[rank][3])]
    from fusedpar.ops.moe.routing import rows_received, rows_sent

    sent = torch.stack([rows_sent(i, EP_EXPERTS // world, world) for _, i, _, _ in every])
    incoming, outgoing = rows_received(sent, rank)  # [a row per token and rank, per copy]
    return local, idx.to(device), expected, (incoming.tolist(), outgoing.tolist())

