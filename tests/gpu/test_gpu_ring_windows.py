"""ring_attention with sliding windows and softcap on one GPU shared by W=2 ranks (gloo
world, tests/gpu/conftest.py): the triton ring (windowed ring steps, exact K/V copies) and
the pipelined ring (flash kernels with each block's diagonal offset), bf16, forward and
backward, within the peers' rule against fp64 attention of the whole sequence; the triton
ring's forward moves exactly the K/V rows its queries see. Skipped without a GPU."""

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.parallel import zigzag_shard
from tests.ops.attention_cases import assert_peers_rule, reference_results, visible_keys
from tests.ops.collective_cases import subgroup
from tests.ops.test_ring_attention import seen_key_rows

pytestmark = [pytest.mark.gpu, pytest.mark.multirank, pytest.mark.timeout(600)]

B, S, H, H_KV, D = 1, 200, 4, 2, 72  # several GPU tiles per chunk; D not a power of two


def _shard(x, dim, layout, rank, world):
    return zigzag_shard(x, dim, rank, world) if layout == "zigzag" else x.chunk(world, dim)[rank]


def _ring_windows(backend, layout, causal, window, softcap):
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(B, S, h, D, generator=g).bfloat16() for h in (H, H_KV, H_KV)]
    dout = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, H, S, generator=g, dtype=torch.float64)
    mask = dict(scale=D ** -0.5, causal=causal, window=window, softcap=softcap)
    exact = reference_results(full, torch.float64, dout, dlse, **mask)
    low = reference_results(full, torch.bfloat16, dout, dlse, **mask)
    mine = [_shard(t, 1, layout, rank, world).to(dev).requires_grad_() for t in full]
    with fusedpar.comm.count_bytes() as forward:
        out, lse = fusedpar.ops.ring_attention_with_lse(
            *mine, subgroup(), causal=causal, window_size=window, softcap=softcap, layout=layout,
            backend=backend)
        torch.cuda.synchronize()
    torch.autograd.backward((out, lse), (_shard(dout, 1, layout, rank, world).to(dev, torch.bfloat16),
                                         _shard(dlse, 2, layout, rank, world).to(dev, torch.float32)))
    where = (backend, layout, causal, window, softcap, rank)
    for name, got, lo, ex, dim in zip(["out", "lse", "dq", "dk", "dv"],
                                      [out, lse] + [t.grad for t in mine], low, exact, (1, 2, 1, 1, 1)):
        assert_peers_rule(f"{name} {where}", got.detach().cpu(), _shard(lo, dim, layout, rank, world),
                          _shard(ex, dim, layout, rank, world), 2 if name in ("out", "lse") else 3)
    if backend == "triton":
        rows = seen_key_rows(world, rank, layout, S // world, visible_keys(S, S, causal, window))
        assert forward.total() == rows * 2 * H_KV * D * 2 * B, (where, forward.total(), rows)
    return True


@pytest.mark.parametrize("causal,window,softcap", [(True, (37, -1), 0.0), (False, (21, 9), 30.0)],
                         ids=["sliding", "two-sided-softcap"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("backend", ["triton", "pipelined"])
def test_gpu_ring_attention_windows_and_softcap(gpu_pools, backend, layout, causal, window, softcap):
    assert gpu_pools(2).run(_ring_windows, backend, layout, causal, window, softcap) == [True, True]
