"""``fusedpar.plan``: which parallel config fits and trains fastest (see :func:`plan`)."""

from .memory import Candidate, Memory, Training, estimate_memory
from .model import ModelSpec, model_spec

__all__ = ["Candidate", "Memory", "ModelSpec", "Training", "estimate_memory", "model_spec"]
