"""Checkpoints of parallelized models with ``torch.distributed.checkpoint`` (DCP).

Plain-PyTorch equivalent::

    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
        get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=path)                  # save()
    dcp.load(state, checkpoint_id=path)                  # load(): then set_*_state_dict

Every parameter of a parallelized model is a DTensor (TP layers on the ``tp`` axis, FSDP2
over ``dp_shard_cp``), so DCP stores global tensors with their placements and loads them
into any other config or world size (e.g. saved at tp=2 x dp_shard=2 on 4 ranks, loaded
at dp_shard=2 on 2 ranks). :func:`full_state_dict` gathers the unsharded tensors under
the model's own names, which load into the plain (Hugging Face) model.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["full_state_dict", "load", "save"]


def _states(model: nn.Module, optimizer):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         extra: dict | None = None) -> None:
    """Save the model (and optimizer) state to the directory ``path`` (every rank calls
    it; each writes its shards). ``extra``: more stateful entries (e.g. ``{"step": t}`` as a
    tensor) saved alongside."""
    import torch.distributed.checkpoint as dcp

    state = _states(model, optimizer)
    state.update(extra or {})
    dcp.save(state, checkpoint_id=str(path))


def load(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         extra: dict | None = None) -> None:
    """Load what :func:`save` wrote into ``model`` (and ``optimizer``), resharding to this
    model's layout; ``extra`` entries are filled in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _states(model, optimizer)
    state.update(extra or {})
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def full_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict`` of a parallelized model, under its own parameter names
    (plain tensors, on every rank; on the CPU when ``cpu``), e.g. for
    ``transformers.LlamaForCausalLM(config).load_state_dict(full_state_dict(model))``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to("cpu" if cpu else v.device)
            for k, v in state.items()}
