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

Crash safety: :func:`save` writes into the sibling folder ``.<name>.partial`` and rank 0
renames it to ``path`` once DCP has written its ``.metadata`` (last, after every rank's
shards, each file fsynced). A crash at any moment leaves the previous complete checkpoint
or the new one: while an older ``path`` is swapped out it is ``.<name>.replaced``, which
:func:`load` reads when ``path`` is missing. :func:`load` refuses a folder whose
``.metadata`` or shard files are missing. A run's periodic checkpoints are
``DIR/step-<n>`` folders (:func:`step_path`, :func:`complete_steps`, :func:`prune`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil

import torch
from torch import nn

__all__ = ["AsyncSave", "IncompleteCheckpointError", "complete_steps", "full_state_dict", "load",
           "problems", "prune", "readable", "save",
           "step_path"]

PARTIAL, REPLACED = ".partial", ".replaced"


class IncompleteCheckpointError(ValueError):
    """A folder that is not a complete checkpoint (a save that did not finish)."""


def _states(model: nn.Module, optimizer):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


class _DropSequentialCollectives(logging.Filter):
    """DTensor's "N sequential all_gather operations will be performed" when a state dict
    gathers a 2-D sharded tensor: nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential" not in str(record.msg) or "operations will be performed" not in str(record.msg)


_FILTER = _DropSequentialCollectives()


@contextlib.contextmanager
def _quiet():
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    logger.addFilter(_FILTER)
    try:
        yield
    finally:
        logger.removeFilter(_FILTER)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _sibling(path: str, suffix: str) -> str:
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}{suffix}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: str, path: str) -> None:
    """Rank 0: rename the finished ``tmp`` to ``path`` (an older ``path`` is ``.replaced``
    until the new one is in place)."""
    _fsync_dir(tmp)
    old = _sibling(path, REPLACED)
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    shutil.rmtree(old, ignore_errors=True)


class AsyncSave:
    """A save whose shards are being written in the background (``save(...,
    async_save=True)``). Every rank calls :meth:`wait` (before the next save, and before
    exiting); the checkpoint is at ``path`` when it returns."""

    def __init__(self, future, tmp: str, path: str):
        self._future, self._tmp, self.path = future, tmp, path

    def wait(self) -> str:
        if self._future is not None:
            future, self._future = self._future, None
            future.result()
            if _rank() == 0:
                _publish(self._tmp, self.path)
            _barrier()
        return self.path


#: The background saves' own gloo group, and the default group it was made in.
_ASYNC_GROUP: dict = {"world": None, "group": None}


def save(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         extra: dict | None = None, async_save: bool = False) -> AsyncSave | None:
    """Save the model (and optimizer) state to the directory ``path`` (every rank calls
    it; each writes its shards), replacing an older checkpoint there only once the new one
    is complete. ``extra``: more stateful entries (e.g. ``{"step": t}`` as a tensor) saved
    alongside. ``async_save``: copy the state to CPU memory, write it in a background
    thread (DCP's ``async_save``) and return an :class:`AsyncSave` to ``wait()`` on."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(os.fspath(path))
    tmp = _sibling(path, PARTIAL)
    if _rank() == 0:  # what a crashed save left behind
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
    _barrier()
    with _quiet():
        state = _states(model, optimizer)
    state.update(extra or {})
    if async_save:
        group = None
        if dist.is_available() and dist.is_initialized():
            if _ASYNC_GROUP["world"] is not dist.group.WORLD:  # the training keeps the default group
                _ASYNC_GROUP.update(world=dist.group.WORLD, group=dist.new_group(backend="gloo"))
            group = _ASYNC_GROUP["group"]
        future = dcp.async_save(state, checkpoint_id=tmp, process_group=group)
        return AsyncSave(getattr(future, "upload_completion", future), tmp, path)
    dcp.save(state, checkpoint_id=tmp)
    if _rank() == 0:  # DCP wrote .metadata after every rank's shards: the save is complete
        _publish(tmp, path)
    _barrier()
    return None


def problems(path) -> list[str]:
    """What keeps the folder ``path`` from being a complete checkpoint (empty: nothing):
    a missing ``.metadata`` (DCP writes it last) or shard files missing or shorter than
    the ``.metadata`` says."""
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    if not os.path.isdir(path):
        return [f"{path} does not exist"]
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return [".metadata (DCP writes it last: the save did not finish)"]
    try:
        storage = dcp.FileSystemReader(path).read_metadata().storage_data or {}
    except Exception as e:  # noqa: BLE001 - any unreadable .metadata is a broken folder
        return [f".metadata is unreadable ({type(e).__name__}: {e})"]
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    out = []
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            out.append(f"{name} (missing)")
        elif os.path.getsize(file) < size:
            out.append(f"{name} ({os.path.getsize(file)} of {size} bytes)")
    return out


def readable(path) -> str:
    """The complete checkpoint to read for ``path``: ``path`` itself, or while a save
    swapped it out, the older one (``.<name>.replaced``); else :class:`IncompleteCheckpointError`."""
    path = os.path.abspath(os.fspath(path))
    if os.path.basename(path).endswith(PARTIAL):
        raise IncompleteCheckpointError(
            f"{path} is the temporary folder of a save that did not finish: load the "
            "checkpoint beside it (its name without the leading '.' and '.partial')")
    if not os.path.exists(path) and not problems(_sibling(path, REPLACED)):
        return _sibling(path, REPLACED)
    missing = problems(path)
    if missing:
        raise IncompleteCheckpointError(
            f"{path} is not a complete checkpoint: it lacks " + ", ".join(missing[:3])
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            + "; load an older checkpoint (a save that crashed leaves the previous one whole)")
    return path


def load(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         extra: dict | None = None) -> None:
    """Load what :func:`save` wrote into ``model`` (and ``optimizer``), resharding to this
    model's layout; ``extra`` entries are filled in place. An incomplete folder raises
    :class:`IncompleteCheckpointError` naming what it lacks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = readable(path)
    with _quiet():
        state = _states(model, optimizer)
        state.update(extra or {})
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optim"])


def full_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict`` of a parallelized model, under its own parameter names
    (plain tensors, on every rank; on the CPU when ``cpu``), e.g. for
    ``transformers.LlamaForCausalLM(config).load_state_dict(full_state_dict(model))``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with _quiet():
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to("cpu" if cpu else v.device)
                for k, v in state.items()}


# ---- a run's periodic checkpoints: DIR/step-<n> -----------------------------------------

_STEP = re.compile(r"^step-(\d+)$")


def step_path(folder, step: int) -> str:
    """Where a run saving into ``folder`` keeps its checkpoint after ``step`` steps."""
    return os.path.join(os.path.abspath(os.fspath(folder)), f"step-{step}")


def complete_steps(folder) -> list[tuple[int, str]]:
    """``(step, path)`` of the complete ``step-<n>`` checkpoints in ``folder``, oldest first."""
    folder = os.fspath(folder)
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        m = _STEP.match(name)
        if m and not problems(os.path.join(folder, name)):
            found.append((int(m.group(1)), os.path.join(os.path.abspath(folder), name)))
    return sorted(found)


def prune(folder, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete ``step-<n>`` checkpoints of ``folder``
    (call it on one rank); returns the deleted paths."""
    old = [p for _, p in complete_steps(folder)[:-keep]] if keep > 0 else []
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old
