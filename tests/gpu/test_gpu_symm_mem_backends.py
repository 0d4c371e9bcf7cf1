"""The ``symm_mem`` backends of all_gather_matmul and matmul_reduce_scatter (torch's own
``torch.ops.symm_mem.fused_*`` ops) against the reference on the shared-GPU ranks
(tests/gpu/conftest.py); on CPU their reasons. Skipped without a GPU."""

import pytest
import torch
import torch.distributed as dist

from fusedpar.ops import registry
from fusedpar.ops.calls import MatmulCall
from tests.ops.collective_cases import rank_data

pytestmark = [pytest.mark.gpu, pytest.mark.multirank, pytest.mark.timeout(600)]


def test_symm_mem_backends_say_why_not_on_cpu():
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        backend = registry.get(op).dispatcher.backends["symm_mem"]
        cpu = MatmulCall(op, torch.zeros(4, 8), 0, 2, None, [torch.zeros(8, 4)])
        assert backend.not_supported_reasons(cpu) == [
            f"torch.ops.symm_mem.fused_{op} needs CUDA tensors"]


def _symm_mem_vs_reference():
    import fusedpar.ops as ops

    rank, dev = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    a = rank_data((6, 32), torch.bfloat16, rank).to(dev) / 8  # encodes the rank
    b = rank_data((32, 16), torch.bfloat16, 7).to(dev) / 8
    results = {}
    for backend in ("symm_mem", "reference"):
        gathered, (out,) = ops.all_gather_matmul(a, [b], 0, backend=backend)
        scattered = ops.matmul_reduce_scatter(out, b.t().contiguous(), "sum", 0, backend=backend)
        results[backend] = [t.float().cpu() for t in (gathered, out, scattered)]
    return [torch.allclose(x, y, rtol=2e-2, atol=2e-2)
            for x, y in zip(results["symm_mem"], results["reference"])]


def test_symm_mem_backends_equal_the_reference(gpu_pools):
    if not torch.cuda.is_available():
        pytest.skip("torch's symm_mem ops need CUDA")
    for oks in gpu_pools(2).run(_symm_mem_vs_reference):
        assert oks == [True, True, True]
