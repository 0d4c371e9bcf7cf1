"""The sizes of a model that the planner needs, from a fusedpar config, a Hugging Face
config (JSON file, dict or config object) or a model instance, read by the model family's
adapter (:func:`fusedpar.parallel.adapters.adapter_for_config`: the registry ``parallelize``
finds its adapters in), so what the planner plans ``parallelize`` runs.

Plain-PyTorch equivalent: reading ``model.config`` by hand; the planner never builds the
model (except :mod:`fusedpar.plan.dry_run`, on fake tensors).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from ..parallel.adapters import ModelSpec, adapter_for_config
from ..parallel.adapters.spec import Tensor, parameter_shapes

__all__ = ["ModelSpec", "Tensor", "model_spec", "parameter_shapes"]


def model_spec(model: Any, name: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a ``ModelSpec``, a fusedpar ``LlamaConfig`` /
    ``MixtralConfig``, a model holding one (``model.config``: fusedpar's or a Hugging Face
    ``PretrainedConfig``), a Hugging Face config mapping, or a path to a JSON file of either
    kind (fusedpar's fields or Hugging Face's ``config.json``)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, os.PathLike)):
        with open(model) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"model config {model}: expected a JSON object, got {type(data).__name__}")
        return model_spec(data, name or os.path.basename(os.fspath(model)))
    config = getattr(model, "config", model)  # an nn.Module holding its config
    if hasattr(config, "to_diff_dict") and hasattr(config, "to_dict"):  # transformers' PretrainedConfig
        config, name = config.to_dict(), name or type(config).__name__
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        config, name = dataclasses.asdict(config), name or type(config).__name__
    if isinstance(config, Mapping):
        return adapter_for_config(config).plan_spec(config, name or config.get("model_type") or "model")
    raise TypeError(f"model_spec: cannot read model sizes from {type(model).__name__}; pass a "
                    "fusedpar LlamaConfig / MixtralConfig, a Hugging Face config (or a model "
                    "holding one), a config mapping or a JSON file path")
