"""``fusedpar.parallelize`` on 4 CPU ranks against the single-process model: the loss and
every gradient after one step and the loss after 3 AdamW steps (fp32: rtol 1e-5, atol
1e-6), for fusedpar's own Llama and tiny Hugging Face models built from a config.
One pool run checks several configs (spawn and warm-up are paid once). fusedpar's ops run
their reference backends (the fused ones are tested op by op in tests/ops) except in the
dp_shard=4 config, where FSDP2's collectives run on the backends fusedpar picks."""

import copy
import inspect
import math

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.parallel import ParallelConfig, get_submesh
from tests.parallel.parallel_cases import (assert_matches, batches, full, make_model, parallel_run,
                                           reference_backends, reference_run)

pytest.importorskip("transformers")  # the HF cases; the test dependencies include it

def _fsdp_lower_bound(model, world: int) -> dict[str, int]:
    """Bytes per step of ZeRO-3 over ``world`` ranks: every unit's shard all-gathered in
    forward, the non-root units' again in backward, every gradient reduce-scattered once
    (fp32); a shard is dim 0 padded to a multiple of ``world``."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    owned, gathered, scattered = set(), 0, 0
    for unit in reversed(units):  # innermost first: a parameter belongs to its innermost unit
        shard = 0
        for p in unit.parameters():
            if id(p) in owned:
                continue
            owned.add(id(p))
            shard += math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) * 4
        gathered += shard * (1 if unit is model else 2)
        scattered += shard
    return {"all_gather": (world - 1) * gathered, "reduce_scatter": (world - 1) * scattered}


#: bf16 parameters (FSDP2 param_dtype) with fp32 gradient reduction, against the fp32 single
#: process: every loss within BF16_LOSS_RTOL relative, every gradient within BF16_GRAD_RTOL
#: of its largest element (bf16 keeps 8 bits of mantissa: ~0.4% per rounding).
BF16_LOSS_RTOL, BF16_GRAD_RTOL = 2e-3, 5e-2  # measured: 1.9e-4, 1.6e-2


def _assert_bf16_bound(got, want, what: str) -> None:
    (losses, grads), (ref_losses, ref_grads) = got, want
    loss_err = ((torch.stack(losses) - torch.stack(ref_losses)).abs() / torch.stack(ref_losses).abs()).max()
    assert loss_err <= BF16_LOSS_RTOL, f"{what}: loss relative error {float(loss_err):.2e}"
    for name, g in ref_grads.items():
        err = float((grads[name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err <= BF16_GRAD_RTOL, f"{what}: grad of {name}: error {err:.2e} of its max"


def _check_dense(kind: str, configs: list[dict]) -> bool:
    """Each config against the single process; an ``activation_checkpointing=True`` entry
    also bit for bit against the entry before it (the same config without). fusedpar's
    ops run their reference backends except in an entry with ``fused_backends=True``."""
    torch.set_num_threads(1)
    data = batches()
    model = make_model(kind)
    want = reference_run(model, data)
    losses, previous = {}, None
    for extra in configs:
        options = dict(extra)
        checkpointing = options.pop("activation_checkpointing", False)
        fused = options.pop("fused_backends", False)
        cfg = ParallelConfig(**options)
        with reference_backends(not fused):
            par = fusedpar.parallelize(copy.deepcopy(model), cfg, activation_checkpointing=checkpointing)
            # no **kwargs: HF's Trainer scales the loss for gradient accumulation itself
            assert all(p.kind != p.VAR_KEYWORD for p in inspect.signature(par.forward).parameters.values())
            dp_group = get_submesh(par.fusedpar_mesh, "dp").get_group()
            counters = []
            got = parallel_run(par, data, dp_group, counters)
        if cfg.fsdp_comm == "fusedpar" and cfg.dp_shard == dist.get_world_size() and cfg.ep == 1:
            by_op = {op: n for (op, _), n in counters[0].by_op().items()}
            assert by_op == _fsdp_lower_bound(par, cfg.dp_shard), by_op  # one step, nothing else
        if cfg.param_dtype == "bfloat16":
            _assert_bf16_bound(got, want, f"{kind} {extra}")
            continue
        assert_matches(got, want, f"{kind} {extra}")
        if checkpointing:  # recomputation changes nothing
            assert all(torch.equal(a, b) for a, b in zip(got[0], previous[0])), f"{kind} {extra}: losses"
            for name, g in got[1].items():
                assert torch.equal(g, previous[1][name]), f"{kind} {extra}: grad of {name}"
        previous = got
        losses[str(extra)] = torch.stack(got[0])
    first = next(iter(losses.values()))
    for name, curve in losses.items():  # fusedpar's FSDP collectives and torch's agree
        torch.testing.assert_close(curve, first, rtol=1e-5, atol=1e-6, msg=name)
    return True


@pytest.mark.timeout(600)
def test_own_llama_matches_single_process(pools):
    configs = [dict(dp_shard=4, fused_backends=True), dict(dp_shard=4, fsdp_comm="torch"),
               dict(tp=2, dp_shard=2),
               dict(tp=2, dp_shard=2, activation_checkpointing=True),
               dict(tp=2, dp_shard=2, param_dtype="bfloat16"), dict(dp_replicate=2, dp_shard=2)]
    assert pools(4).run(_check_dense, "llama", configs, timeout=500) == [True] * 4


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, configs", [
    ("hf-llama", [dict(tp=2, dp_shard=2), dict(cp=2, dp_shard=2)]),
    ("hf-llama-eager", [dict(dp_shard=4), dict(tp=2, dp_shard=2)]),
    ("hf-qwen2", [dict(tp=2, dp_shard=2)]),
    ("hf-mixtral", [dict(dp_shard=4, ep=2), dict(tp=2, dp_shard=2, ep=4)]),
    ("hf-qwen2-moe", [dict(dp_shard=4, ep=2), dict(tp=2, dp_shard=2)]),
    ("hf-olmoe", [dict(dp_shard=4, ep=4)]),
    # GPT-2: Conv1D projections, the fused q/k/v split over tp, learned positions, a tied head
    ("hf-gpt2", [dict(dp_shard=4), dict(tp=2, dp_shard=2),
                 dict(tp=2, dp_shard=2, activation_checkpointing=True), dict(cp=2, dp_shard=2),
                 dict(dp_replicate=2, dp_shard=2)]),
    ("hf-qwen3-moe", [dict(dp_shard=4, ep=2), dict(dp_shard=4, ep=2, activation_checkpointing=True),
                      dict(cp=2, dp_shard=2, ep=2), dict(tp=2, dp_shard=2, ep=2)]),
    ("hf-deepseek-v3", [dict(dp_shard=4), dict(dp_shard=4, ep=4)]),
    # scaled tied embeddings, soft-capped logits and attention, sliding-window layers (under
    # cp: the ring's window and softcap, 16 tokens against a window of 8)
    ("hf-gemma2", [dict(dp_shard=4), dict(tp=2, dp_shard=2), dict(cp=2, dp_shard=2)]),
    ("hf-mistral", [dict(cp=2, dp_shard=2)]),
])
def test_hugging_face_models_match_single_process(pools, kind, configs):
    assert pools(4).run(_check_dense, kind, configs, timeout=500) == [True] * 4


@pytest.mark.timeout(600)
def test_context_parallel_matches_single_process(pools):
    configs = [dict(cp=2, dp_shard=2), dict(tp=2, cp=2)]
    assert pools(4).run(_check_dense, "llama", configs, timeout=500) == [True] * 4


@pytest.mark.timeout(600)
def test_expert_parallel_matches_single_process(pools):
    """ep borrows its ranks from dp_shard (x cp x tp): ep=2 (experts FSDP-sharded over
    efsdp=2), ep=4, ep=2 with cp=2; and dp_shard=4 alone. With tp=2 the MoE blocks run on
    sequence shards: their experts whole on every rank (ep=1), or split over ep=2 (inside
    each tp pair) or ep=4 (across them). The load-balancing loss is the whole batch's in
    every config."""
    configs = [dict(dp_shard=4), dict(dp_shard=4, ep=2), dict(dp_shard=4, ep=4),
               dict(cp=2, dp_shard=2, ep=2), dict(tp=2, dp_shard=2), dict(tp=2, dp_shard=2, ep=2),
               dict(tp=2, cp=2, ep=4)]
    assert pools(4).run(_check_dense, "mixtral", configs, timeout=500) == [True] * 4


def _compiled_matches_eager(kind: str, config: dict) -> bool:
    """torch.compile over a parallelized model (FSDP2 hooks, ep exchanges run eagerly between
    graphs): the loss and every gradient of one step equal the eager model's."""
    from fusedpar.parallel import shard_batch

    torch.set_num_threads(1)
    torch._dynamo.reset()
    model = make_model(kind)
    with reference_backends():
        results = []
        for compiled in (False, True):
            par = fusedpar.parallelize(copy.deepcopy(model), config)
            ids, labels, _ = shard_batch(batches(steps=1)[0], par.fusedpar_mesh)
            fn = torch.compile(par, backend="aot_eager") if compiled else par
            loss = fn(input_ids=ids, labels=labels).loss
            loss.backward()
            results.append((loss.detach(), {n: full(p.grad) for n, p in par.named_parameters()}))
    (loss, grads), (want_loss, want_grads) = results[1], results[0]
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)
    return True


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, config", [("mixtral", dict(dp_shard=4, ep=2)),
                                          ("hf-qwen3-moe", dict(dp_shard=4, ep=2))])
def test_torch_compile_of_a_parallelized_moe_model(pools, kind, config):
    assert pools(4).run(_compiled_matches_eager, kind, config, timeout=500) == [True] * 4


def _packed_matches_single_process(kind: str, configs: list[dict], packed=True) -> bool:
    """Rows packing documents (``packed`` as ``batches`` takes it; position_ids restart at
    each): the HF model attends to each document alone; so must the parallelized one (HF's
    own mask for its layers; under cp the documents' cu_seqlens on the ring)."""
    torch.set_num_threads(1)
    data = batches(packed=packed)
    model = make_model(kind)
    want = reference_run(model, data)
    for config in configs:
        with reference_backends():
            par = fusedpar.parallelize(copy.deepcopy(model), config)
            got = parallel_run(par, data, get_submesh(par.fusedpar_mesh, "dp").get_group())
        assert_matches(got, want, f"{kind} {config} packed")
    return True


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, configs, packed", [
    ("hf-llama", [dict(tp=2, dp_shard=2)], True), ("hf-llama-eager", [dict(dp_shard=4)], True),
    ("hf-qwen3-moe", [dict(dp_shard=4, ep=2)], True),
    # two packed rows per data-parallel rank, run as one row of their documents (across the
    # zigzag chunks): dp rank 0's row zigzag as a whole, dp rank 1's documents all multiples
    # of 2 cp, each zigzag
    ("hf-llama", [dict(cp=2, dp_shard=2)], ((5, 7, 4), (12, 4), (8, 8), (4, 12)))])
def test_packed_sequences_attend_per_document(pools, kind, configs, packed):
    assert pools(4).run(_packed_matches_single_process, kind, configs, packed,
                        timeout=500) == [True] * 4


# ---- invalid configs: a clear error before any communication -------------------------------


class _NoCommunication:
    """Inside: creating a process group (meshes) or running any collective (c10d,
    functional collectives, fusedpar's ops) raises instead."""

    def __enter__(self):
        from torch.distributed import distributed_c10d
        from torch.utils._python_dispatch import TorchDispatchMode

        def refuse(*args, **kwargs):
            raise AssertionError("communication started before the config error")

        class Refuse(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional", "fusedpar"):
                    refuse()
                return func(*args, **(kwargs or {}))

        self.saved = distributed_c10d._new_process_group_helper
        distributed_c10d._new_process_group_helper = refuse
        self.mode = Refuse()
        self.mode.__enter__()

    def __exit__(self, *exc):
        from torch.distributed import distributed_c10d

        self.mode.__exit__(*exc)
        distributed_c10d._new_process_group_helper = self.saved


def _invalid_configs() -> dict:
    from fusedpar.models import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
    from tests.ops.collective_cases import capture_errors
    from tests.parallel.parallel_cases import TINY

    torch.set_num_threads(1)
    llama, mixtral, mla = make_model("llama"), make_model("mixtral"), make_model("hf-deepseek-v3")

    class OwnAuxLoss(type(make_model("hf-qwen3-moe"))):  # its module has no Mixtral-style loss
        pass

    own_aux = OwnAuxLoss(make_model("hf-qwen3-moe").config)
    import transformers

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, attn_implementation="sdpa")
    scaled_logits = transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=16.0))
    scaled_embedding = transformers.GemmaForCausalLM(transformers.GemmaConfig(**common, head_dim=8,
                                                                              pad_token_id=None))
    per_layer_rope = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**common, "attn_implementation": "eager"}, head_dim=8))  # rotary_emb wants a layer type
    six_heads = LlamaForCausalLM(LlamaConfig(**{**TINY, "hidden_size": 48, "num_heads": 6,
                                                "num_kv_heads": 6}))
    six_experts = MixtralForCausalLM(MixtralConfig(**TINY, num_experts=6, top_k=2))
    cp_model = fusedpar.parallelize(copy.deepcopy(llama), {"cp": 2, "dp_shard": 2}, backend="reference")
    cases = {
        "product": (llama, {"tp": 2, "dp_shard": 3}),
        "ep_fits": (mixtral, {"dp_shard": 4, "ep": 3}),
        "heads": (six_heads, {"tp": 4}),
        "kv_heads": (llama, {"tp": 4}),
        "experts": (six_experts, {"dp_shard": 4, "ep": 4}),
        "ep_dense": (llama, {"dp_shard": 4, "ep": 2}),
        "mla_cp": (mla, {"cp": 2, "dp_shard": 2}),
        "own_aux": (own_aux, {"dp_shard": 4}),
        "outer_forward": (scaled_logits, {"dp_shard": 4}),
        "cannot_run": (per_layer_rope, {"dp_shard": 4}),
    }
    calls = {name: (lambda m=m, c=c: fusedpar.parallelize(copy.deepcopy(m), c))
             for name, (m, c) in cases.items()}
    ids, ids8 = torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)
    calls["sequence_cp"] = lambda: cp_model(input_ids=ids, labels=ids)
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[1, 5:] = 0
    calls["padding"] = lambda: cp_model(input_ids=ids8, labels=ids8, attention_mask=padded)
    calls["loss_kwargs"] = lambda: cp_model(input_ids=ids8, labels=ids8, num_items_in_batch=9)
    windowed = fusedpar.parallelize(make_model("hf-mistral"), {"dp_shard": 4}, backend="reference")
    calls["window_fits"] = lambda: windowed(input_ids=ids8, labels=ids8)  # runs: 8 <= the window
    long_ids = torch.zeros(2, 9, dtype=torch.long)
    calls["window"] = lambda: windowed(input_ids=long_ids, labels=long_ids)
    fits = calls.pop("window_fits")
    with _NoCommunication():
        errors = capture_errors(calls)
    fits()
    # Gemma scales inside embed_tokens (the parallelized forward keeps that), which a
    # vocab-parallel embedding would drop: refused when tp converts it (meshes exist by then)
    errors.update(capture_errors({"tp_scaled_embedding": lambda: fusedpar.parallelize(
        scaled_embedding, {"tp": 2, "dp_shard": 2})}))
    hf = fusedpar.parallelize(make_model("hf-llama"), {"dp_shard": 4}, backend="reference")
    errors.update(capture_errors({"generate": lambda: hf.generate(torch.zeros(1, 4, dtype=torch.long))}))
    dist.barrier()  # every rank is still in step
    return errors


@pytest.mark.timeout(300)
def test_invalid_configs_fail_before_any_communication(pools):
    expected = {
        "product": "dp_replicate(1) * dp_shard(3) * cp(1) * tp(2) = 6 but world_size is 4",
        "ep_fits": "ep=3 does not divide dp_shard(4) * cp(1) * tp(1) = 4",
        "heads": "attention heads 6 is not divisible by tp=4",
        "kv_heads": "KV heads 2 is not divisible by tp=4",
        "experts": "6 experts are not divisible by ep=4",
        "ep_dense": "ep=2 but the model has no MoE blocks",
        "mla_cp": "cp=2: tensor and context parallelism split Llama-style attention (q/k/v/o "
                  "projections, an int head_dim), and this model's is not (self_attn.k_proj is not "
                  "a linear layer",
        "own_aux": "config.output_router_logits=True, and OwnAuxLoss's load-balancing loss is not "
                   "the Mixtral / Switch one the parallelized forward reproduces",
        "sequence_cp": "sequence length 6 is not divisible by 2*cp = 4",
        "padding": "attention_mask masks some positions",
        "window": "sequence length 9 exceeds the model's sliding window 8 (config.sliding_window)",
        "outer_forward": "GraniteForCausalLM is not a supported model (its forward changes lm_head's logits",
        "tp_scaled_embedding": "GemmaTextScaledWordEmbedding.forward does more than look rows up",
        "cannot_run": "Gemma3ForCausalLM is not a supported model (running its forward and the "
                      "parallelized one without its layers failed",
        "loss_kwargs": "parallelized forward takes input_ids, labels, position_ids, attention_mask; "
                       "got 0 positional and num_items_in_batch keyword arguments",
        "generate": "Gather the weights into the plain model and generate with that",
    }
    for errors in pools(4).run(_invalid_configs, timeout=250):
        for name, fragment in expected.items():
            assert errors[name] is not None, f"{name}: no error"
            kind, message = errors[name]
            assert kind in ("ParallelConfigError", "ValueError", "TypeError", "NotImplementedError") \
                and fragment in message, (name, errors[name])


# ---- torch without FSDP2's custom collectives (torch 2.11, the GPU image) -------------------


def _without_custom_comms() -> list[str]:
    """Parallelize with FSDPModule.set_custom_all_gather / set_custom_reduce_scatter taken
    away: FSDP keeps torch's collectives (fusedpar's ops move nothing), the loss is the
    single process's, and rank 0 prints one notice."""
    import warnings

    from torch.distributed.fsdp import FSDPModule

    from fusedpar.comm import count_bytes

    torch.set_num_threads(1)
    data = batches(steps=1)
    model = make_model("llama")
    want = reference_run(model, data)[0][0]
    saved = {n: FSDPModule.__dict__[n] for n in ("set_custom_all_gather", "set_custom_reduce_scatter")}
    try:
        for name in saved:
            delattr(FSDPModule, name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            par = fusedpar.parallelize(copy.deepcopy(model), {"dp_shard": 2})
    finally:
        for name, method in saved.items():
            setattr(FSDPModule, name, method)
    ids, labels, _ = fusedpar.parallel.shard_batch(data[0], par.fusedpar_mesh)
    with count_bytes() as counter:
        loss = par(input_ids=ids, labels=labels).loss
        loss.backward()
    assert counter.by_op() == {}, counter.by_op()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / 2, want, rtol=1e-5, atol=1e-6)
    return [str(w.message) for w in caught if "fusedpar" in str(w.message)]


@pytest.mark.timeout(300)
def test_torch_without_custom_fsdp_collectives_falls_back_with_a_notice(pools):
    notices = pools(2).run(_without_custom_comms, timeout=250)
    assert len(notices[0]) == 1 and "FSDP uses torch's own collectives" in notices[0][0], notices
    assert notices[1] == [], notices


def test_forward_backward_on_a_plain_model_is_forward_then_backward():
    """One process, no parallelize: the loss and every gradient of
    ``model(ids, labels=ids).loss.backward()``; a forward without a loss is refused."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    model, plain = make_model("llama"), make_model("llama")
    loss = fusedpar.forward_backward(model, ids, ids)
    want = plain(ids, labels=ids).loss
    want.backward()
    assert not loss.requires_grad and torch.equal(loss, want.detach())
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name

    class LogitsOnly(torch.nn.Module):
        def forward(self, input_ids, labels=None, position_ids=None):
            return model(input_ids, position_ids=position_ids)  # labels dropped: no loss

    with pytest.raises(TypeError, match="LogitsOnly's forward returned no loss"):
        fusedpar.forward_backward(LogitsOnly(), ids, ids)
