"""Run the real parallelized model for one training step under fake tensors and a fake
process group, in this process, for any world size, and measure its memory per rank.

Plain-PyTorch equivalent (torchtitan's memory estimation)::

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=W)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    with FakeTensorMode() as fake:
        model = model.to_empty(device="cpu")        # fake parameters: no memory
    model.tie_weights()                             # to_empty unties a tied head
    model = fusedpar.parallelize(model, parallel)   # meshes and FSDP2 over the fake group
    with fake, FSDPMemTracker(model, optimizer) as tracker:
        model(ids, labels=ids).loss.backward(); optimizer.step(); optimizer.zero_grad()
    tracker.get_tracker_snapshot("peak")

Every tensor is a ``FakeTensor`` (shapes, dtypes, no data); collectives of the fake backend
return at once, so the run shows rank 0's allocations with synchronous collectives (one FSDP
unit unsharded at a time, as gloo does: compare with ``Training(units_in_flight=1)``).
The optimizer state is created by a first, untracked ``optimizer.step()`` on zero gradients,
so the tracked step is a steady-state one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from unittest import mock

import torch

from ..comm import settings

__all__ = ["DryRun", "dry_run", "fusedpar_config", "parameter_bytes"]


@dataclasses.dataclass
class DryRun:
    """Rank 0's bytes: ``params``, ``grads`` (after backward), ``optimizer`` (local shards),
    ``peak`` (``FSDPMemTracker``'s, every category) and its ``breakdown`` by category;
    ``seconds``: the wall time of the whole dry run."""

    params: int
    grads: int
    optimizer: int
    peak: int
    breakdown: dict[str, int]
    seconds: float


def _local_bytes(tensors) -> int:
    from ..nn.linear import local

    return sum(local(t).numel() * local(t).element_size() for t in tensors)


@contextlib.contextmanager
def _fake_world(world_size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fusedpar.plan.dry_run: torch.distributed is already initialized; run the "
                           "dry run in a process of its own (it creates a fake process group)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:  # nothing touches symmetric memory
        with mock.patch.dict(os.environ, {"FUSEDPAR_BACKEND": "reference"}):
            settings.refresh()
            yield
    finally:
        settings.refresh()
        dist.destroy_process_group()


def fusedpar_config(spec):
    """The fusedpar ``LlamaConfig`` / ``MixtralConfig`` of a :class:`~fusedpar.plan.ModelSpec`
    (a Llama / Mixtral-style model: SwiGLU, RMSNorm, rotary, no biases), to dry-run a
    Hugging Face config without transformers; anything else raises ``ValueError``."""
    from ..models import LlamaConfig, MixtralConfig

    if spec.mlp != "swiglu" or spec.norm != "rms" or spec.qkv_bias or spec.linear_bias or spec.positions \
            or spec.head_dim * spec.heads != spec.hidden:
        raise ValueError(f"dry run of {spec.name}: fusedpar's models are Llama / Mixtral-style "
                         "(SwiGLU, RMSNorm, rotary, no biases, head_dim x heads = hidden); pass a "
                         "Hugging Face config object for other models (needs transformers)")
    sizes = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, num_layers=spec.layers,
                 num_heads=spec.heads, num_kv_heads=spec.kv_heads, tie_embeddings=spec.tie_embeddings)
    if spec.moe:
        return MixtralConfig(**sizes, intermediate_size=spec.expert_intermediate,
                             num_experts=spec.experts, top_k=spec.top_k)
    return LlamaConfig(**sizes, intermediate_size=spec.intermediate)


def _build(config) -> torch.nn.Module:
    """A model of ``config`` on the meta device: fusedpar's Llama / Mixtral, or a Hugging
    Face config through ``AutoModelForCausalLM.from_config``."""
    from ..models import LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    with torch.device("meta"):
        if isinstance(config, MixtralConfig):
            return MixtralForCausalLM(config)
        if hasattr(config, "to_diff_dict"):  # transformers' PretrainedConfig
            import transformers

            return transformers.AutoModelForCausalLM.from_config(config)
        return LlamaForCausalLM(config)


def _fake_parallelized(config, parallel, activation_checkpointing: bool = False):
    """``(model, fake mode)``: a model of ``config`` with fake parameters, parallelized in
    the fake world of :func:`_fake_world`."""
    import fusedpar
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _build(config)
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the meshes' small tensors are real
    with fake:
        model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied head a Parameter of its own (fusedpar and HF models)
    return fusedpar.parallelize(model, parallel, activation_checkpointing=activation_checkpointing,
                                device_type="cpu"), fake


def parameter_bytes(config, parallel, world_size: int) -> int:
    """Rank 0's parameter bytes after ``parallelize(model of config, parallel)`` over
    ``world_size`` fake ranks (no step: cheap for any family)."""
    with _fake_world(world_size):
        return _local_bytes(_fake_parallelized(config, parallel)[0].parameters())


def dry_run(config, parallel, world_size: int, *, seq_len: int, micro_batch: int = 1,
            activation_checkpointing: bool = False, foreach: bool = False) -> DryRun:
    """Parallelize a model of ``config`` (fusedpar ``LlamaConfig`` / ``MixtralConfig`` or a
    Hugging Face config) with ``parallel`` (a ``ParallelConfig`` or its dict) over
    ``world_size`` fake ranks and measure one steady-state AdamW step on ``micro_batch``
    sequences of ``seq_len`` tokens per data-parallel rank. Needs torch.distributed not to
    be initialized in this process (it creates and destroys the fake group)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from ..parallel import shard_batch

    start = time.perf_counter()
    with _fake_world(world_size):
        model, fake = _fake_parallelized(config, parallel, activation_checkpointing)
        dp = model.fusedpar_config.dp
        with fake:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
            for p in model.parameters():  # creates the optimizer state, as any earlier step would
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad()
            ids = shard_batch(torch.randint(model.lm_head.weight.shape[0], (micro_batch * dp, seq_len)),
                              model.fusedpar_mesh)
            grads = {}
            tracker = FSDPMemTracker(model, optimizer)
            with tracker:
                model(ids, labels=ids).loss.backward()
                grads["bytes"] = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
                optimizer.step()
                optimizer.zero_grad()
        snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        result = DryRun(params=_local_bytes(model.parameters()), grads=grads["bytes"],
                        optimizer=_local_bytes(states), peak=snapshot["Total"],
                        breakdown={str(getattr(k, "value", k)): v for k, v in snapshot.items()
                                   if k != "Total" and v},
                        seconds=0.0)
    result.seconds = time.perf_counter() - start
    return result
