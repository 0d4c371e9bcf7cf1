"""Rank-side helpers for the parallelize / checkpoint tests: tiny seeded models, global
batches, and the single-process reference they must match."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

from fusedpar.models import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from fusedpar.models.llama import IGNORE_INDEX
from tests.ops.collective_cases import env

SEQ, GLOBAL_BATCH, STEPS, LR = 16, 4, 3, 1e-2
TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
            intermediate_size=64)


@contextlib.contextmanager
def reference_backends(on: bool = True):
    """Inside (when ``on``): every fusedpar op runs its ``reference`` backend
    (``FUSEDPAR_BACKEND``). The fused backends are tested op by op in tests/ops; under the
    Triton interpreter they would make each whole-model step cost seconds."""
    with env(FUSEDPAR_BACKEND="reference") if on else contextlib.nullcontext():
        yield


def make_model(kind: str, seed: int = 0):
    """The same seeded model on every rank: "llama", "mixtral", "hf-llama", "hf-llama-eager", "hf-qwen2",
    "hf-mixtral", "hf-mistral" (a sliding window of 8), "hf-qwen2-moe" (a gated shared expert), "hf-olmoe" and "hf-qwen3-moe" (a
    dense first layer, top-k weights not renormalized) with their router aux loss in the loss,
    "hf-deepseek-v3" (multi-head latent attention, a dense first layer, sigmoid
    group-limited routing, a shared expert), "hf-gemma2" (scaled embeddings tied to the
    head, soft-capped attention and logits, a window of 8 on every other layer; eager
    attention), "hf-gpt2" (Conv1D projections, fused q/k/v, learned positions, a tied head)."""
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY))
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**TINY, num_experts=4, top_k=2))
    import transformers

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                  attn_implementation="sdpa", use_cache=False)
    if kind == "hf-llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "hf-llama-eager":  # its attention is causal only through the mask HF builds
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{**common, "attn_implementation": "eager"}))
    if kind == "hf-qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if kind == "hf-mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2))
    if kind == "hf-mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=8))
    if kind == "hf-qwen2-moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2))
    if kind == "hf-olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **{**common, "intermediate_size": 32}, num_experts=4, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=0.5))
    if kind == "hf-qwen3-moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=False, mlp_only_layers=[0], output_router_logits=True,
            router_aux_loss_coef=0.5))
    if kind == "hf-deepseek-v3":
        return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **common, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8))
    if kind == "hf-gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **{**common, "attn_implementation": "eager"}, head_dim=8, query_pre_attn_scalar=8,
            sliding_window=8, pad_token_id=None, final_logit_softcapping=2.0,
            attn_logit_softcapping=3.0))
    if kind == "hf-gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
            use_cache=False))
    raise ValueError(kind)


#: How many labels at the start of each row of a global batch are ignored (-100): every
#: data-parallel rank's rows hold another number of valid tokens (a rank at dp=4 none), so
#: only the mean over the whole batch's valid tokens matches the single process.
IGNORED_LABELS = (0, SEQ, 5, 11)


def batches(vocab: int = 64, steps: int = STEPS, packed: bool | tuple = False):
    """``steps`` global batches ``(input_ids, labels, position_ids)``, the same on every rank,
    the labels ignored as the last entries of :data:`IGNORED_LABELS` say; ``packed``: True:
    GLOBAL_BATCH rows of two documents (position_ids restart halfway), or each row's
    document lengths (summing to SEQ)."""
    g = torch.Generator().manual_seed(1234)
    if packed is True:
        packed = ((SEQ // 2, SEQ // 2),) * GLOBAL_BATCH
    rows = len(packed) if packed else GLOBAL_BATCH
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in packed]) \
        if packed else None
    ignored = torch.arange(SEQ) < torch.tensor(IGNORED_LABELS[-rows:])[:, None]
    return [(ids, ids.masked_fill(ignored, IGNORE_INDEX), positions) for ids in
            (torch.randint(0, vocab, (rows, SEQ), generator=g) for _ in range(steps))]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clean_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _whole_batch_loss(model, batch):
    ids, labels, positions = batch
    return model(input_ids=ids, labels=labels, position_ids=positions).loss


def reference_run(model, data, loss=_whole_batch_loss):
    """The single process: loss and gradients of step 0, and the loss after every AdamW
    step, on the whole global batch (MoE models: the load-balancing loss of the whole batch
    too, which the parallelized model reproduces by summing the routing statistics).
    ``loss(model, batch)``: a step's loss, where it is not the model's own on the batch (or,
    detached, after its own backward)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads0 = [], None
    for step, batch in enumerate(data):
        step_loss = loss(model, batch)
        if step_loss.requires_grad:  # else ``loss`` ran its own backward
            step_loss.backward()
        if step == 0:
            grads0 = {clean_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}
        losses.append(step_loss.detach())
        opt.step()
        opt.zero_grad()
    return losses, grads0


def parallel_run(model, data, dp_group=None, counters: list | None = None):
    """The same on a parallelized model (pp or not: :func:`fusedpar.parallel.forward_backward`)
    fed :func:`fusedpar.parallel.shard_batch`; the loss of a step is averaged over the
    data-parallel ranks. ``counters``: a list that gets the ``fusedpar.comm`` byte counter of
    the first step's forward + backward."""
    from fusedpar.comm import count_bytes
    from fusedpar.parallel import forward_backward, shard_batch

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads0 = [], None
    dp = dist.get_world_size(dp_group)
    for step, batch in enumerate(data):
        ids, labels, positions = shard_batch(batch, model.fusedpar_mesh)
        with count_bytes() if (step == 0 and counters is not None) else contextlib.nullcontext() as c:
            loss = forward_backward(model, ids, labels, position_ids=positions,
                                    attention_mask=torch.ones_like(ids))
        if c is not None:
            counters.append(c)
        if step == 0:
            grads0 = {clean_name(n): full(p.grad).detach().clone() for n, p in model.named_parameters()}
        value = loss.clone()
        dist.all_reduce(value, group=dp_group)
        losses.append(value / dp)
        opt.step()
        opt.zero_grad()
    return losses, grads0


def train_curve(model, opt, data) -> list[float]:
    """The loss of each AdamW step of a parallelized model (pp or not:
    :func:`fusedpar.parallel.forward_backward`) on this rank's rows of each batch."""
    from fusedpar.parallel import forward_backward, shard_batch

    curve = []
    for batch in data:
        ids, labels, positions = shard_batch(batch, model.fusedpar_mesh)
        curve.append(float(forward_backward(model, ids, labels, position_ids=positions)))
        opt.step()
        opt.zero_grad()
    return curve


def assert_matches(got, want, what: str, rtol: float = 1e-5, atol: float = 1e-6):
    """Losses and every gradient (global tensors, under the unparallelized names)."""
    (losses, grads), (ref_losses, ref_grads) = got, want
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: losses: {m}")
    assert set(grads) == set(ref_grads), (what, set(grads) ^ set(ref_grads))
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{what}: grad of {name}: {m}")
