"""The fallback for a model no family adapter claims: any causal LM with Llama's layout
(Mistral, a user's own Llama clone), accepted once a probe shows its forward does nothing
around the layers that the parallelized forward would not."""

from __future__ import annotations

import torch
from torch import nn

from ..decoder import run_decoder
from .base import ModelAdapter, is_hf
from .hf import HFAdapter

__all__ = ["LlamaStyleAdapter"]


class LlamaStyleAdapter(HFAdapter):
    """Matches every model (the registry tries it last); :meth:`layout` refuses one whose
    structure or outer forward differs from Llama's."""

    def __init__(self):
        # the planner reads these configs with Llama's keys
        super().__init__("any other model with Llama's layout and forward (found by structure)",
                         ("mistral",))

    def matches(self, model: nn.Module) -> bool:
        return True

    def attention_masks(self, model, input_ids, position_ids):
        return super().attention_masks(model, input_ids, position_ids) if is_hf(model) else None

    def apply_context_parallel(self, model, layers, cp_mesh) -> None:
        if not hasattr(getattr(model, "config", None), "_attn_implementation"):
            ModelAdapter.apply_context_parallel(self, model, layers, cp_mesh)
        super().apply_context_parallel(model, layers, cp_mesh)

    def forward_problems(self, model: nn.Module) -> list[str]:
        """What ``model``'s own forward does around its layers that the parallelized forward
        (embed_tokens -> layers -> norm, then lm_head) would not: scaled embeddings,
        scaled or soft-capped logits (Cohere, Granite). Found by running the model's forward
        with its layers taken out on four tokens, in eval mode and without the router aux
        loss, and comparing what reaches ``model.norm`` and what leaves ``lm_head`` with
        what the parallelized forward computes. Models on the meta device or of fake tensors
        (a dry run) are not run."""
        from torch._subclasses.fake_tensor import FakeTensor

        first = next(model.parameters(), None)
        if first is None or first.is_meta or isinstance(first, FakeTensor):
            return []
        inner, config = model.model, getattr(model, "config", None)
        layers, training = inner.layers, model.training
        router_logits = getattr(config, "output_router_logits", None)
        seen = {}
        hooks = [inner.norm.register_forward_pre_hook(lambda _, args: seen.setdefault("embedded", args[0])),
                 model.lm_head.register_forward_hook(lambda *out: seen.setdefault("logits", out[2]))]
        ids = torch.arange(4, device=first.device)[None] % model.lm_head.weight.shape[0]
        inner.layers = nn.ModuleList()
        if router_logits:
            config.output_router_logits = False
        try:
            with torch.no_grad():
                logits = model.eval()(input_ids=ids).logits
                embedded = inner.embed_tokens(ids)
                run_decoder(self, model, ids, None)  # e.g. a rotary embedding wanting a layer type
        except Exception as e:  # noqa: BLE001 - reported as the reason
            return [f"running its forward and the parallelized one without its layers failed "
                    f"({type(e).__name__}: {e})"]
        finally:
            inner.layers = layers
            model.train(training)
            for hook in hooks:
                hook.remove()
            if router_logits:
                config.output_router_logits = router_logits
        problems = []
        if "embedded" not in seen or not torch.equal(seen["embedded"], embedded):
            problems.append("its forward changes the embeddings before the first layer (scales them?)")
        if "logits" not in seen or not torch.equal(seen["logits"].float(), logits.float()):
            problems.append("its forward changes lm_head's logits (scales or caps them?)")
        return problems
