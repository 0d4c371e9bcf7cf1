"""What ``fusedpar train`` checks in the launching process, before any rank is spawned: a
mistake that would otherwise surface on every rank after the model is built, as one
traceback per rank."""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch


def backend_problem() -> str | None:
    """A ``FUSEDPAR_BACKEND`` that names no backend of any op (a typo)."""
    from fusedpar.errors import BackendNotSupportedError
    from fusedpar.ops.backend import check_backend_name

    try:
        check_backend_name(os.environ.get("FUSEDPAR_BACKEND"), "FUSEDPAR_BACKEND")
    except BackendNotSupportedError as e:
        return str(e)
    return None


def resume_problem(path: str, tcfg, build_model, model_name) -> str | None:
    """Why ``--resume path`` cannot continue this run: no checkpoint there, one of another
    model (a parameter of this run's model missing from it: what the ranks' DCP load would
    fail on), or one at a step not below ``--steps``. ``build_model(tcfg, device)`` and
    ``model_name(tcfg)`` are the command's."""
    import torch.distributed.checkpoint as dcp

    try:
        saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except (OSError, ValueError) as e:
        return (f"--resume {path}: no checkpoint there ({type(e).__name__}: {e}); give a folder "
                "that --save wrote")

    def missing(cfg) -> list[str]:  # checkpoint.save stores the model's state under "model."
        return sorted(f"model.{k}" for k in build_model(cfg, "meta").state_dict()
                      if f"model.{k}" not in saved)

    lacks = missing(tcfg)
    if lacks:
        other = dataclasses.replace(tcfg, moe=not tcfg.moe)
        hint = (f": it holds the {model_name(other)} model; resume "
                f"{'with' if other.moe else 'without'} --moe" if not missing(other) else "")
        return (f"--resume {path}: the checkpoint is not of this run's {model_name(tcfg)} model "
                f"(it lacks {lacks[0]}" + (f" and {len(lacks) - 1} more" if len(lacks) > 1 else "")
                + f"){hint}")
    if "step" in saved:
        step = torch.zeros((), dtype=torch.int64)
        with warnings.catch_warnings():  # "assuming ... a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"step": step}, checkpoint_id=path, no_dist=True)
        if int(step) >= tcfg.steps:
            return (f"--resume {path}: the checkpoint is at step {int(step)} and --steps is "
                    f"{tcfg.steps}: ask for more steps (--steps > {int(step)}) to continue")
    return None
