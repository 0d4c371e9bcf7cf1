"""Each op's baselines and targets, as data: the suites (``bench_*.py``, common.py) note
their rows' verdicts from this table and ``report.py`` judges the committed rows by it;
``auto_verdict`` judges an ``auto`` row (what a user gets) the same way in both.

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
    # moe_experts(..., float8="rowwise") in training: each backend that takes it against the
    # reference; each row also notes its speed-up over the same backend's bf16 row (x_bf16)
    "moe_experts_train_float8": {"reference": None},
    # the fp8 grouped GEMM (issue 44): fusedpar's against torch's
    "scaled_grouped_mm": {"torch._scaled_grouped_mm": 1.0},
    # the fused matmuls' GEMMs alone, per tile candidate and the tile choice (auto):
    # cuBLAS on the same product (bench_gemm_tiles.py)
    "gemm_tiles": {"torch.matmul": 0.95},
}

# {op: {row label: the dispatcher backend it measures}}: a baseline label names the plain-torch
# backend it stands for (a loopback baseline is that backend's compute; benchmarks/defaults.py)
LABELS = {
    "all_gather": {"triton": "triton", "cuda": "cuda", "torch.cat": "reference", "nccl": "reference"},
    "reduce_scatter": {"triton": "triton", "cuda": "cuda", "torch.stack.sum": "reference",
                       "nccl": "reference"},
    "all_gather_matmul": {"triton": "triton", "pipelined": "pipelined", "torch.matmul": "reference",
                          "nccl+matmul": "reference", "symm_mem.fused_all_gather_matmul": "symm_mem"},
    "matmul_reduce_scatter": {"triton": "triton", "pipelined": "pipelined",
                              "torch.matmul": "reference", "matmul+nccl": "reference",
                              "symm_mem.fused_matmul_reduce_scatter": "symm_mem"},
    "flash_attention": {"triton": "triton", "sdpa": "sdpa", "sdpa_flash": "sdpa"},
    "grouped_mm": {"fusedpar.triton": "triton", "fusedpar.torch": "torch", "torch._grouped_mm": "torch",
                   "torch.mm loop": "reference", "fusedpar.triton masked": "triton",
                   "fusedpar.torch masked": "torch", "torch.bmm": "torch"},
    "moe_experts_train": {"reference": "reference", "pipelined": "pipelined", "fused": "fused"},
}

# {row op: the dispatcher op whose choice its rows measure}, where the two names differ
TUNES = {"moe_experts_train": "moe_experts"}

# The ``auto`` row of a case: what a user gets (``backend=None``: the dispatcher's choice by
# the tuning table, the default table or the priority order). Its target: at least
# AUTO_TARGET x the case's best (fastest) baseline within the run's noise (``auto_verdict``).
# The fused backends keep their own rows and the targets above.
AUTO = "auto"
AUTO_TARGET = 1.0
# the ops whose suites time an auto row; the loopback-only suites of moe_dispatch,
# moe_experts and ring_attention call loopback functions that make no choice
AUTO_OPS = ["all_gather", "reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter",
            "flash_attention", "grouped_mm", "moe_experts_train", "moe_experts_train_float8"]

# the op families drawn together (one plot each)
FAMILIES: dict[str, list[str]] = {
    "collectives": ["all_gather", "reduce_scatter"],
    "fused_matmul": ["all_gather_matmul", "matmul_reduce_scatter"],
    "attention": ["flash_attention", "ring_attention"],
    "moe": ["grouped_mm", "scaled_grouped_mm", "moe_dispatch", "moe_experts", "moe_experts_train",
            "moe_experts_train_float8"],
}


def target(op: str, baseline: str) -> float | None:
    """The least speed-up of ``op``'s fusedpar backends over ``baseline`` (None: no target)."""
    return BASELINES.get(op, {}).get(baseline)


def auto_verdict(auto: tuple[float, float, float], best: tuple[float, float, float],
                 same_code: bool = False) -> str:
    """An auto row's ``(median, p20, p80)`` ms against its case's best baseline's: ``met``
    (median ratio >= AUTO_TARGET), ``met within noise`` (short of it, but the baseline's p80
    over the auto row's p20 reaches it: their middle 60% overlap) or ``MISSED``.
    ``same_code``: the auto row timed the baseline's own function (``runs_baseline``), so
    their ratio is the drift between two timings of one function, not a verdict."""
    if same_code:
        return "met (the baseline's own code: the ratio is run-to-run drift)"
    if best[0] / auto[0] >= AUTO_TARGET:
        return "met"
    return "met within noise" if best[2] / auto[1] >= AUTO_TARGET else "MISSED"


def runs_baseline(op: str, notes: dict, baseline: str) -> bool:
    """Whether an auto row with these ``notes`` timed ``baseline``'s own function: a loopback
    case whose chosen backend (``chose``) the baseline stands for (``LABELS``)."""
    return notes.get("mode") == "loopback" and LABELS.get(op, {}).get(baseline) == notes.get("chose")


# Targets a row holds against itself, noted as ``<key>=<ratio>x (target <= <bound>x: met|MISSED)``
# (``row_target``; report.py shows and counts them): {key: (the ops whose rows carry it, what
# the ratio is, its bound)}
ROW_TARGETS: dict[str, tuple[tuple[str, ...], str, float]] = {
    # a loopback triton call replayed from a CUDA graph (row ``triton.graph``): no GPU idle
    "vs_gpu_busy": (("all_gather", "reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter"),
                    "a CUDA-graph replay's median / its GPU busy time", 1.15),
    # the all-gather GEMM with the peers' flags raised late (row ``triton.late_flags``)
    "gemm_late_vs_on_time": (("all_gather_matmul",),
                             "the GEMM kernel's time, peers' flags late / on time", 1.05),
}


def row_target(key: str, ratio: float) -> str:
    """The note of ``ROW_TARGETS[key]`` for ``ratio``: the ratio, its bound and the verdict."""
    bound = ROW_TARGETS[key][2]
    return f"{ratio:.3f}x (target <= {bound}x: {'met' if ratio <= bound else 'MISSED'})"


# Rows of the fused matmuls in a gloo group of ranks spawned onto one GPU (ops ``*_shared_gpu``,
# tests/gpu/test_gpu_shared_rows.py): the ranks time-slice the GPU, so no target; their own ops
# keep them out of the tuning defaults (benchmarks/defaults.py reads LABELS' ops only)
BASELINES["all_gather_matmul_shared_gpu"] = {
    "gloo+matmul": None, "triton all_gather+matmul": None, "symm_mem.fused_all_gather_matmul": None}
BASELINES["matmul_reduce_scatter_shared_gpu"] = {
    "matmul+gloo": None, "matmul+triton reduce_scatter": None,
    "symm_mem.fused_matmul_reduce_scatter": None}
BASELINES["all_gather_scaled_matmul_shared_gpu"] = {
    "symm_mem.fused_all_gather_scaled_matmul": None, "all_gather_matmul.bf16": None, "reference": None}
BASELINES["scaled_matmul_reduce_scatter_shared_gpu"] = {
    "symm_mem.fused_scaled_matmul_reduce_scatter": None, "matmul_reduce_scatter.bf16": None,
    "reference": None}

# One training step of a ~1B Llama on one GPU (bench_train.py): fusedpar.parallelize's model is
# the ``auto`` row (what a user gets; its target: AUTO_TARGET x plain torch's eager FSDP2 step,
# within noise); the plain model under torch.compile is a row of its own, not a baseline (the
# target is against eager plain torch), shown with its speed-up over it (the compiled float8 rows'
# target is against it: bench_train's FLOAT8_TARGET). No LABELS entry: the
# rows time no single op's choice, so benchmarks/defaults.py leaves them out
BASELINES["train_step"] = {"torch": None}
AUTO_OPS.append("train_step")
FAMILIES["training"] = ["train_step"]
