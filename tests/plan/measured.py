"""Rank-side part of the planner's validation: train the small fusedpar models for two steps
under a parallel config and measure, on the second step, this rank's bytes of parameters,
gradients and optimizer state (exactly, from the local shards) and the peak
(``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, torch's tracker, which
follows every tensor allocation on CPU ranks too)."""

from __future__ import annotations

import torch

import fusedpar
from fusedpar.models import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from fusedpar.nn.linear import local
from fusedpar.parallel import forward_backward, shard_batch
from fusedpar.nn import ContextParallelAttention
from tests.parallel.parallel_cases import reference_backends

SIZES = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=128)
MOE = dict(num_experts=4, top_k=2)
SEQ, BATCH = 64, 8


def model_config(kind: str):
    return MixtralConfig(**SIZES, **MOE) if kind == "mixtral" else LlamaConfig(**SIZES)


def _bytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def _receive_buffers(pipeline) -> int:
    """Bytes of the pipeline schedule's receive buffers (a stage's input and its output's
    gradient, one per microbatch): allocated in the first step and kept, so outside the
    tracker's view but part of every moment's memory."""
    stage = pipeline.schedule._stage
    infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
    # getattr: the first stage's inputs are placeholders without one (torch 2.11)
    return _bytes(info.buffer for chunk in infos for info in chunk if getattr(info, "buffer", None) is not None)


def measure(kind: str, parallel: dict, activation_checkpointing: bool) -> dict:
    """This rank's bytes; ``stage``: ``"first"`` / ``"last"`` (the pipeline stage it runs,
    with ``pp > 1``) or ``"all"``."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.nn.modules.module import register_module_forward_pre_hook

    torch.manual_seed(0)
    cls = MixtralForCausalLM if kind == "mixtral" else LlamaForCausalLM
    with reference_backends():
        model = fusedpar.parallelize(cls(model_config(kind)), parallel, device_type="cpu",
                                     activation_checkpointing=activation_checkpointing)
        for module in model.modules():  # ring attention has no reference backend: the
            if isinstance(module, ContextParallelAttention):  # interpreted triton ring under
                module.backend = "pipelined"  # FSDPMemTracker's dispatch mode took minutes
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        ids = shard_batch(tokens, model.fusedpar_mesh)
        pipeline = getattr(model, "_fusedpar_pipeline", None)
        found = {}

        def step():
            forward_backward(model, ids, ids)
            found["grads"] = _bytes(p.grad for p in model.parameters() if p.grad is not None)
            optimizer.step()
            optimizer.zero_grad()

        step()  # the optimizer state exists from here on, as in every later step
        root = model if pipeline is None else pipeline.roots[0]  # pp: this rank's stage
        tracker = FSDPMemTracker(root, optimizer)
        # FSDPMemTracker refuses a second top-level forward of its root within one tracked
        # region (its per-module statistics), and a schedule runs one per microbatch: clear
        # those statistics before each, as its error message advises (``reset_mod_stats``);
        # the peak is kept apart from them. A global hook registered before the tracker's
        # own runs before it.
        hook = register_module_forward_pre_hook(
            lambda module, args: tracker.reset_mod_stats() if module is root else None)
        try:
            with tracker:
                step()
        finally:
            hook.remove()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    stage = "all"
    if pipeline is not None:
        peak += _receive_buffers(pipeline)
        stage = "first" if pipeline.has_first else "last"
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": _bytes(model.parameters()), "grads": found["grads"], "optimizer": _bytes(states),
            "peak": peak, "stage": stage}


def measure_all(cases: list[tuple[str, dict, bool]]) -> list[dict]:
    """:func:`measure` of each case, in one task (one pool round trip)."""
    return [measure(*case) for case in cases]
