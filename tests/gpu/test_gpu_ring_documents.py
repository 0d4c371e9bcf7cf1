"""ring_attention with packed documents each sharded zigzag (``layout="zigzag_docs"``) on
one GPU shared by W=2 ranks (gloo world, tests/gpu/conftest.py): the triton ring (the flash
kernels per block with its diagonal offset, K/V copies cut to the queries' documents) and
the pipelined ring, bf16, forward and backward, within the peers' rule against fp64
attention of each document alone; the triton ring's forward moves exactly the K/V rows its
queries see in their documents. Skipped without a GPU."""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.parallel import sequence_shard
from tests.ops.attention_cases import assert_peers_rule, reference_results, visible_keys
from tests.ops.collective_cases import subgroup
from tests.ops.test_ring_attention import seen_key_rows

pytestmark = [pytest.mark.gpu, pytest.mark.multirank, pytest.mark.timeout(600)]

H, H_KV, D = 4, 2, 72
LENGTHS = [148, 12, 40]  # multiples of 2W = 4: chunks of 37 (several GPU tiles), 3 and 10 rows


def _ring_documents(backend, causal, window):
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    ends = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    s, cu = ends[-1], torch.tensor(ends, dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(1, s, h, D, generator=g).bfloat16() for h in (H, H_KV, H_KV)]
    dout = torch.randn(1, s, H, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(1, H, s, generator=g, dtype=torch.float64)
    mask = dict(scale=D ** -0.5, causal=causal, window=window)
    dims = (1, 2, 1, 1, 1)  # out, lse, dq, dk, dv: the sequence dim

    def per_document(dtype):  # reference_results of each document alone, concatenated
        parts = [reference_results([t[:, a:z] for t in full], dtype, dout[:, a:z], dlse[:, :, a:z], **mask)
                 for a, z in zip(ends, ends[1:])]
        return [torch.cat(p, dim) for p, dim in zip(zip(*parts), dims)]

    def shard(x, dim):
        return sequence_shard(x, dim, rank, world, layout="zigzag_docs", cu_seqlens=cu)

    exact, low = per_document(torch.float64), per_document(torch.bfloat16)
    mine = [shard(t, 1).to(dev).requires_grad_() for t in full]
    with fusedpar.comm.count_bytes() as forward:
        out, lse = fusedpar.ops.ring_attention_with_lse(
            *mine, subgroup(), causal=causal, window_size=window, layout="zigzag_docs",
            cu_seqlens=cu.to(dev), backend=backend)
        torch.cuda.synchronize()
    torch.autograd.backward((out, lse), (shard(dout, 1).to(dev, torch.bfloat16),
                                         shard(dlse, 2).to(dev, torch.float32)))
    where = (backend, causal, window, rank)
    for name, got, lo, ex, dim in zip(["out", "lse", "dq", "dk", "dv"],
                                      [out, lse] + [t.grad for t in mine], low, exact, dims):
        assert_peers_rule(f"{name} {where}", got.detach().cpu(), shard(lo, dim), shard(ex, dim),
                          2 if name in ("out", "lse") else 3)
    if backend == "triton":
        same_doc = torch.zeros(s, s, dtype=torch.bool)
        for a, z in zip(ends, ends[1:]):
            same_doc[a:z, a:z] = True
        rows = seen_key_rows(world, rank, "zigzag_docs", s // world,
                             same_doc & visible_keys(s, s, causal, window), list(zip(ends, ends[1:])))
        assert forward.total() == rows * 2 * H_KV * D * 2, (where, forward.total(), rows)
    return True


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (29, -1)), (False, (-1, -1))],
                         ids=["causal", "sliding", "full"])
@pytest.mark.parametrize("backend", ["triton", "pipelined"])
def test_gpu_ring_attention_documents_zigzag_each(gpu_pools, backend, causal, window):
    assert gpu_pools(2).run(_ring_documents, backend, causal, window) == [True, True]
