"""``fusedpar.plan``: which parallel config fits and trains fastest.

- :func:`plan` sweeps every config of a world size (DDP, FSDP, HSDP, TP, CP, EP, PP, with
  and without activation checkpointing) through closed-form memory (:mod:`.memory`) and
  step-time (:mod:`.speed`) estimates, float8 training included (:mod:`.float8`); the
  result prints as a table, JSON or a plot.
- :func:`estimate` does the same for one config; :func:`~fusedpar.plan.dry_run.dry_run`
  runs the real parallelized model under fake tensors for the configs a user picks.
"""

from .memory import Candidate, Memory, Training, estimate_memory
from .model import ModelSpec, model_spec
from .speed import Device, StepTime, estimate_step_time
from .sweep import Estimate, Plan, candidates, estimate, parse_bytes, plan

__all__ = ["Candidate", "Device", "Estimate", "Memory", "ModelSpec", "Plan", "StepTime", "Training",
           "candidates", "estimate", "estimate_memory", "estimate_step_time", "model_spec",
           "parse_bytes", "plan"]
