"""The fp8 fused matmuls' rows in a real process group on one GPU: test_gpu_shared_rows.py's
harness (W=2 ranks spawned onto cuda:0, a gloo world) on bench_scaled_matmul.py's cases with
rowwise scales: fusedpar's triton ``all_gather_scaled_matmul`` / ``scaled_matmul_reduce_scatter``
next to torch's ``symm_mem.fused_all_gather_scaled_matmul`` /
``fused_scaled_matmul_reduce_scatter``, the bf16 op on the same data and the unfused gloo
all-gather (reduce-scatter) + ``torch._scaled_mm`` (the reference backend), in the same group.
A file of its own: ``.ci/gpu all``'s shared stage runs it after the bf16 rows and the graph
replays. Skipped without a GPU."""

import pytest

from tests.gpu.test_gpu_shared_rows import AG8, RS8, shared_rows

pytestmark = [pytest.mark.gpu, pytest.mark.multirank, pytest.mark.timeout(600)]


@pytest.mark.parametrize("op", [AG8, RS8])
def test_gpu_shared_fp8_matmul_rows(gpu_pools, op):
    shared_rows(gpu_pools, op)
