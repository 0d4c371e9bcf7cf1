"""A model parallelized by ``fusedpar.parallelize`` under Hugging Face's training loops:
``transformers.Trainer`` (:class:`FusedparTrainer`) and ``accelerate.Accelerator``
(:func:`prepare_accelerator`).

The model already shards itself (FSDP2 over ``dp_shard_cp``, TP/SP, CP, EP) and returns
the mean token loss of the whole global batch, so the loop must not wrap it in DDP or FSDP
again (Accelerate's DDP fails on DTensors) and must give every rank of a tp / cp group the
same batch. Plain-Accelerate equivalent of what :func:`prepare_accelerator` arranges::

    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    # (no DDP/FSDP wrapper: what transformers does for models it sharded at load time;
    # mixed precision is FSDP2's, parallelize(..., {"param_dtype": "bfloat16", ...}))
    loader = prepare_data_loader(loader, num_processes=dp, process_index=dp_rank)

Checkpoints go through ``torch.distributed.checkpoint`` (:mod:`fusedpar.parallel.checkpoint`):
every rank writes its shards, and loading reshards to any config or world size.
"""

from __future__ import annotations

import os

import torch
from torch import nn

try:
    import accelerate
    import transformers
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"fusedpar.integrations.hf needs transformers and accelerate: pip install "
                      f"'fusedpar[hf]' ({e})") from e

from ..parallel import checkpoint, get_submesh
from ..parallel.decoder import valid_labels

__all__ = ["DCP_DIR", "FusedparTrainer", "prepare_accelerator", "unparallelized"]

#: The folder inside a Trainer checkpoint that holds the DCP shards (model + optimizer).
DCP_DIR = "fusedpar_dcp"



def _mesh(model: nn.Module):
    mesh = getattr(model, "fusedpar_mesh", None)
    if mesh is None:
        raise TypeError(f"{type(model).__name__} is not parallelized: call "
                        "fusedpar.parallelize(model, config) first")
    if model.fusedpar_config.pp > 1:
        raise ValueError("fusedpar.integrations.hf: pipeline parallelism (pp > 1) runs its own "
                         "schedule, not one forward and backward per batch; use pp=1, or "
                         "train it in a loop around fusedpar.forward_backward(model, input_ids, "
                         "labels)")
    return mesh


def unparallelized(model: nn.Module) -> nn.Module:
    """The plain (unsharded) model with the parallelized model's current weights, e.g. for
    ``generate()``; every rank must call it (the weights are gathered). Same as
    ``type(model)(model.config).load_state_dict(full_state_dict(model))``."""
    _mesh(model)
    plain = type(model)(model.config)
    plain.load_state_dict(checkpoint.full_state_dict(model))
    return plain.eval()


def prepare_accelerator(accelerator: accelerate.Accelerator, model: nn.Module) -> nn.Module:
    """Ready ``accelerator`` for ``model`` (parallelized by ``fusedpar.parallelize``); call it
    before ``accelerator.prepare(model, optimizer, loader)``, which then leaves the model as
    it is. Returns the model.

    - The model keeps fusedpar's sharding: no DDP / FSDP wrapper. Mixed precision
      (``mixed_precision="bf16"``) needs the model parallelized with
      ``param_dtype="bfloat16"`` (FSDP2's policy; a ValueError otherwise).
    - Data loaders it prepares afterwards give each data-parallel rank its own batches and
      every rank of a tp / cp group the same ones (Accelerate's device-mesh sharding, over
      the model's mesh).
    - ``accelerator.clip_grad_norm_`` clips over the DTensor gradients of every mesh.
    - ``accelerator.save_state`` would write rank 0's shards only: it raises, naming
      :func:`fusedpar.parallel.checkpoint.save` / ``load``, which do.
    - ``model.generate()`` raises at once (``parallelize`` sees to it), naming :func:`unparallelized`.
    """
    mesh = _mesh(model)
    own = getattr(accelerator, "parallelism_config", None)  # accelerate >= 1.10
    if own is not None and own.total_size > 1:
        raise ValueError("prepare_accelerator: this Accelerator has a ParallelismConfig of its own "
                         f"({own.total_size} ranks); the model is "
                         "parallelized by fusedpar already: create it without one")
    cfg = model.fusedpar_config
    if accelerator.mixed_precision != "no" and cfg.param_dtype != "bfloat16":
        # fusedpar's ops turn autocast off around their own math: under tp nearly every
        # matmul would stay in float32
        raise ValueError(f"mixed precision ({accelerator.mixed_precision}): parallelize the model "
                         "with param_dtype='bfloat16' (FSDP2's mixed precision: bfloat16 compute "
                         "and communication, float32 weights and gradient reduction) instead of "
                         "Accelerate's autocast, which does not reach fusedpar's ops")
    # Accelerate's device-mesh sharding gives rank r the data index r // (tp * cp): the
    # layout of fusedpar's mesh (dp_replicate, dp_shard outermost, tp innermost)
    dp_rank = get_submesh(mesh, "dp").get_local_rank()
    if accelerator.process_index // (cfg.tp * cfg.cp) != dp_rank:
        raise RuntimeError(f"prepare_accelerator: rank {accelerator.process_index} has data-parallel "
                           f"rank {dp_rank} in the model's mesh, not process_index // (tp*cp)")
    accelerator.state.device_mesh = mesh
    accelerator.register_save_state_pre_hook(_refuse_save_state)
    return accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)


def _refuse_save_state(models, weights, output_dir):
    if any(getattr(m, "fusedpar_mesh", None) is not None for m in models):
        raise NotImplementedError(
            "accelerator.save_state writes rank 0's shards only, and the model and optimizer of "
            "a fusedpar-parallelized model are sharded over every rank: save with "
            "fusedpar.parallel.checkpoint.save(dir, model, optimizer) (every rank) and resume "
            "with fusedpar.parallel.checkpoint.load(dir, model, optimizer)")


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # under Accelerate's AcceleratedOptimizer


class FusedparTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a model parallelized by ``fusedpar.parallelize``
    (``FusedparTrainer(model=parallelized_model, args=TrainingArguments(...), ...)``), as
    one process would train the plain model on the whole global batch:

    - data: each data-parallel rank reads its own batches (``per_device_train_batch_size``
      rows), the ranks of a tp / cp group the same ones (see :func:`prepare_accelerator`);
    - gradient accumulation: the loss of each micro-batch is its token sum over every
      data-parallel rank divided by the valid labels of the whole accumulated global batch
      (Trainer's ``num_items_in_batch``), so each optimizer step's gradient is the single
      process's;
    - ``bf16=True``: needs the model parallelized with ``param_dtype="bfloat16"`` (FSDP2's
      mixed precision: bf16 compute and communication, fp32 weights and gradient reduction);
    - ``max_grad_norm``: the norm over every DTensor gradient;
    - checkpoints: ``checkpoint-N/fusedpar_dcp`` holds the model and optimizer shards
      (``torch.distributed.checkpoint``, written by every rank), which
      ``train(resume_from_checkpoint=...)`` loads, and ``save_model`` writes the gathered
      full weights in Hugging Face's format (loadable by ``from_pretrained``).
    """

    def __init__(self, model: nn.Module | None = None, *args, **kwargs):
        self._fusedpar_model = model
        _mesh(model)
        super().__init__(model, *args, **kwargs)
        # the parallelized forward returns the mean over the global micro-batch's tokens;
        # compute_loss rescales it by num_items_in_batch (not the forward's kwargs)
        self.model_accepts_loss_kwargs = True

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        prepare_accelerator(self.accelerator, self._fusedpar_model)

    def _dp_sum(self, count: torch.Tensor) -> torch.Tensor:
        """``count`` summed over the data-parallel ranks (the ranks holding other rows)."""
        import torch.distributed as dist

        mesh = self._fusedpar_model.fusedpar_mesh
        count = count.to(torch.int64).reshape(1)
        if mesh.size() > 1 and get_submesh(mesh, "dp").size() > 1:
            dist.all_reduce(count, group=get_submesh(mesh, "dp").get_group())
        return count[0]

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The accumulation window's batches and its number of valid labels over every
        data-parallel rank (each tp / cp rank holds the same rows: counted once)."""
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples or "labels" not in batch_samples[0]:
            return batch_samples, None
        local = sum(valid_labels(b["labels"][..., 1:]) for b in batch_samples)  # the causal shift
        return batch_samples, self._dp_sum(torch.as_tensor(local))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's loss (the global micro-batch's mean token loss), rescaled to its
        token sum over ``num_items_in_batch`` when given."""
        outputs = model(**inputs)
        loss = outputs.loss
        if num_items_in_batch is not None:
            loss = loss * (self._dp_sum(valid_labels(inputs["labels"][..., 1:])) / num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The full weights (gathered on every rank) in Hugging Face's format, written by
        the main process."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = checkpoint.full_state_dict(self.model)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoint.save(os.path.join(output_dir, DCP_DIR), self.model, _inner(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # the weights come with the optimizer state (_load_optimizer_and_scheduler): DCP
        # loads both into the sharded model
        if not os.path.isdir(os.path.join(resume_from_checkpoint, DCP_DIR)):
            if os.path.isdir(os.path.join(resume_from_checkpoint, f".{DCP_DIR}{checkpoint.PARTIAL}")):
                raise checkpoint.IncompleteCheckpointError(
                    f"{resume_from_checkpoint}: the run stopped while writing its {DCP_DIR}/ "
                    "(only the partial folder is there): resume from the checkpoint before it")
            raise ValueError(f"{resume_from_checkpoint} has no {DCP_DIR}/ folder: resume a "
                             "FusedparTrainer from a checkpoint a FusedparTrainer saved")

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        checkpoint.load(os.path.join(checkpoint_dir, DCP_DIR), self.model, _inner(self.optimizer))
        path = os.path.join(checkpoint_dir, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
