"""FSDP2 (``fully_shard``) whose parameter all-gather and gradient reduce-scatter run on
fusedpar's ``all_gather`` / ``reduce_scatter`` ops.

Plain-PyTorch equivalent of ``shard_model(model, blocks, dp_mesh, mp_policy)``::

    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)

With ``comm="fusedpar"`` every FSDP module then gets
``set_custom_all_gather(FusedparAllGather())`` and
``set_custom_reduce_scatter(FusedparReduceScatter())`` (FSDP2's ``Comm`` hooks, present in
torch 2.11 and later): the flat all-gather / reduce-scatter buffers FSDP builds are moved by
``fusedpar.ops.all_gather`` / ``reduce_scatter`` (symmetric memory where the backend has
it, counted by ``fusedpar.comm.count_bytes``). Where the installed torch lacks the hooks,
FSDP keeps its NCCL/gloo collectives and a one-line notice says so. HSDP's all-reduce over
``dp_replicate`` stays torch's.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from .config import FSDP_COMMS

__all__ = ["FusedparAllGather", "FusedparReduceScatter", "shard_model"]

try:  # torch 2.11 and later
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - an older torch
    AllGather = ReduceScatter = object


class _Alloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class FusedparAllGather(_Alloc, AllGather):
    """FSDP2's parameter all-gather on ``fusedpar.ops.all_gather`` (synchronous: returns
    no work handle, so FSDP's wait is a no-op). One-byte buffers (float8 weights: FSDP2
    gathers fp8 alone as float8, fp8 beside other dtypes as uint8) move as int32 words,
    each rank's bytes padded to a multiple of 4 (gloo has no float8 dtype)."""

    def __init__(self, backend: str | None = None):
        self.backend = backend

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        from ..ops import all_gather

        if input_tensor.element_size() != 1:
            output_tensor.copy_(all_gather(input_tensor, 0, group, backend=self.backend))
            return None
        n = input_tensor.numel()
        words = input_tensor.new_zeros(-(-n // 4) * 4, dtype=torch.uint8)
        words[:n] = input_tensor.view(torch.uint8)
        gathered = all_gather(words.view(torch.int32), 0, group, backend=self.backend)
        output_tensor.view(torch.uint8).view(-1, n).copy_(gathered.view(torch.uint8).view(-1, words.numel())[:, :n])
        return None


class FusedparReduceScatter(_Alloc, ReduceScatter):
    """FSDP2's gradient reduce-scatter on ``fusedpar.ops.reduce_scatter`` (sum or avg)."""

    def __init__(self, backend: str | None = None):
        self.backend = backend

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        from ..ops import reduce_scatter

        names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}
        name = names.get(op)
        if name is None:
            raise ValueError(f"FusedparReduceScatter: FSDP asked for reduce op {op}; fusedpar's "
                             "reduce_scatter does sum and avg (use fsdp_comm='torch' for others)")
        output_tensor.copy_(reduce_scatter(input_tensor, name, 0, group, backend=self.backend))
        return None


def fused_comms_available() -> bool:
    """Whether this torch's FSDP2 takes custom collectives (torch 2.11 and later)."""
    from torch.distributed.fsdp import FSDPModule

    return (hasattr(FSDPModule, "set_custom_all_gather") and hasattr(FSDPModule, "set_custom_reduce_scatter")
            and AllGather is not object)


def shard_model(model: nn.Module, blocks: list[nn.Module], dp_mesh, mp_policy, *,
                comm: str = "fusedpar", backend: str | None = None,
                extra_units: list[tuple[nn.Module, object]] = ()) -> nn.Module:
    """``fully_shard`` each block, the ``extra_units`` (``(module, mesh)``: e.g. experts on
    their own mesh), then the root; with ``comm="fusedpar"`` route FSDP's collectives
    through fusedpar's ops (see the module docstring). Returns ``model``."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if comm not in FSDP_COMMS:
        raise ValueError(f"fsdp_comm={comm!r}: choose one of {FSDP_COMMS}")
    for module, mesh in extra_units:
        fully_shard(module, mesh=mesh, mp_policy=mp_policy)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
    if comm == "fusedpar":
        if not fused_comms_available():
            if dist.get_rank() == 0:
                warnings.warn(f"fusedpar: torch {torch.__version__} has no FSDPModule."
                              "set_custom_all_gather / set_custom_reduce_scatter; FSDP uses torch's "
                              "own collectives", stacklevel=2)
            return model
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(FusedparAllGather(backend))
                module.set_custom_reduce_scatter(FusedparReduceScatter(backend))
    return model
