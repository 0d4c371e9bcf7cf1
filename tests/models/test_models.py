"""fusedpar's own models, built on the forward pieces of ``fusedpar.parallel.forward``:
the Llama-style model computes what transformers' LlamaForCausalLM computes from the same
weights, and the Mixtral-style loss is the cross-entropy plus the mean layer aux loss."""

import pytest
import torch

from fusedpar.models import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from fusedpar.parallel.decoder import causal_lm_loss


def test_llama_equals_hugging_face_llama():
    transformers = pytest.importorskip("transformers")
    config = LlamaConfig(vocab_size=61, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2,
                         intermediate_size=40)
    ours = LlamaForCausalLM(config, seed=3)  # both norms and rotary compute in fp32
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=61, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=40, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, attn_implementation="sdpa", use_cache=False))
    hf.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(0, 61, (3, 11), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, :4] = -100
    got, want = ours(ids, labels=labels), hf(input_ids=ids, labels=labels)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, causal_lm_loss(got.logits, labels))


def test_mixtral_loss_adds_the_mean_layer_aux_loss():
    config = MixtralConfig(num_layers=3, router_aux_loss_coef=0.25)
    model = MixtralForCausalLM(config, seed=1)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    aux = []
    hooks = [layer.mlp.register_forward_hook(lambda m, a, out: aux.append(out[1]))
             for layer in model.model.layers]
    out = model(ids, labels=ids)
    for hook in hooks:
        hook.remove()
    assert len(aux) == 3
    torch.testing.assert_close(out.aux_loss, torch.stack(aux).mean())
    torch.testing.assert_close(out.loss, causal_lm_loss(out.logits, ids) + 0.25 * out.aux_loss)


@pytest.mark.parametrize("device", ["meta", None])
def test_tied_embeddings_stay_tied_on_meta_and_after_to_empty(device):
    config = LlamaConfig(tie_embeddings=True)
    model = LlamaForCausalLM(config, device=device)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = LlamaForCausalLM(LlamaConfig(), device=device)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert model.num_parameters() == untied.num_parameters() - config.vocab_size * config.hidden_size
    model.to_empty(device="cpu")  # gives each module a new Parameter: tie again, as HF asks
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
