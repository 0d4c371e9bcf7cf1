"""Each op's baselines and targets, as data: the suites (``bench_*.py``, common.py) note
their rows' verdicts from this table and ``report.py`` judges the committed rows by it.

``BASELINES[op]``: ``{baseline backend: the least speed-up (baseline median / fusedpar's
median) each fusedpar backend must reach over it, or None where there is no target}``, in
the order a row is compared: a case's first baseline that has a row is the one its plot
shows. Targets are recorded, never asserted. Plain data (no torch): report.py runs anywhere.
"""

BASELINES: dict[str, dict[str, float | None]] = {
    # loopback: one plain device copy / sum per simulated rank; torchrun: raw NCCL
    "all_gather": {"torch.cat": None, "nccl": None},
    "reduce_scatter": {"torch.stack.sum": None, "nccl": None},
    # loopback: the same per-rank GEMMs with the communication left out; torchrun: torch's
    # async-TP op, and the unfused collective + cuBLAS
    "all_gather_matmul": {"torch.matmul": 0.9, "symm_mem.fused_all_gather_matmul": 1.0,
                          "nccl+matmul": 1.2},
    "matmul_reduce_scatter": {"torch.matmul": 0.9, "symm_mem.fused_matmul_reduce_scatter": 1.0,
                              "matmul+nccl": 1.2},
    "flash_attention": {"sdpa_flash": 0.9},
    # monolithic attention on the whole sequence
    "ring_attention": {"monolithic": 0.85},
    # the masked layout (routing=masked) has torch.bmm over the padding and no target
    "grouped_mm": {"torch._grouped_mm": 1.0, "torch.mm loop": 1.3, "torch.bmm": None},
    "moe_dispatch": {"unpadded": None, "padded": None},
    "moe_experts": {"unfused": 1.15},
    "moe_experts_train": {"reference": None},
}

# the op families drawn together (one plot each)
FAMILIES: dict[str, list[str]] = {
    "collectives": ["all_gather", "reduce_scatter"],
    "fused_matmul": ["all_gather_matmul", "matmul_reduce_scatter"],
    "attention": ["flash_attention", "ring_attention"],
    "moe": ["grouped_mm", "moe_dispatch", "moe_experts", "moe_experts_train"],
}


def target(op: str, baseline: str) -> float | None:
    """The least speed-up of ``op``'s fusedpar backends over ``baseline`` (None: no target)."""
    return BASELINES.get(op, {}).get(baseline)
