"""ContextParallelAttention: a drop-in for SDPA over a zigzag-sharded sequence (or packed
documents, each zigzag)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedpar
from fusedpar.nn.attention import choose_backend
from fusedpar.parallel import zigzag_shard

pytestmark = [pytest.mark.timeout(300)]


def test_backend_choice_from_head_counts():
    assert choose_backend(32, 8, 8) is None  # a ring: ring_attention's first available
    assert choose_backend(32, 2, 8) == "ulysses"
    assert choose_backend(32, 2, 8, packed=True) == "allgather_kv"  # Ulysses runs no documents
    assert choose_backend(12, 1, 8) == "allgather_kv"  # 12 heads do not split over 8 ranks
    assert choose_backend(4, 2, 2) is None
    with pytest.raises(ValueError, match="backend='ring'"):
        fusedpar.nn.ContextParallelAttention(backend="ring")


def _sdpa_drop_in(heads, kv_heads):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    s = 4 * world
    full = [torch.randn(2, n, s, 8, generator=g, dtype=torch.float64) for n in (heads, kv_heads, kv_heads)]
    ref = [t.clone().requires_grad_() for t in full]
    group = heads // kv_heads
    expected = F.scaled_dot_product_attention(ref[0], ref[1].repeat_interleave(group, 1),
                                              ref[2].repeat_interleave(group, 1), is_causal=True)
    expected.sum().backward()
    local = [zigzag_shard(t, 2, rank, world).float().requires_grad_() for t in full]
    cp = fusedpar.nn.ContextParallelAttention()
    out = cp(*local)
    out.sum().backward()
    torch.testing.assert_close(out.double(), zigzag_shard(expected.detach(), 2, rank, world),
                               atol=1e-5, rtol=0)
    for t, r in zip(local, ref):
        torch.testing.assert_close(t.grad.double(), zigzag_shard(r.grad, 2, rank, world),
                                   atol=1e-4, rtol=0)
    return choose_backend(heads, kv_heads, world) or "ring"


@pytest.mark.parametrize("heads,kv_heads,backend", [(4, 2, "ring"), (2, 1, "ulysses")])
def test_matches_sdpa_on_the_full_sequence(pools, heads, kv_heads, backend):
    assert pools(2).run(_sdpa_drop_in, heads, kv_heads) == [backend] * 2


def _documents_drop_in():
    """``layout="zigzag_docs"``: packed documents each zigzag over the ranks (W = 2: lengths
    12 and 4) equal SDPA on each document alone, out and gradients; the HF attention
    function with the module's default layout takes a 1-D cu_seqlens whose documents all
    divide by 2W as sharded so (the parallelized forward's rule); a padding mask is refused."""
    from fusedpar.nn.attention import hf_context_parallel_attention, set_hf_context_parallel_group
    from fusedpar.parallel import sequence_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = [12, 4]
    cu = torch.tensor([0, 12, 16], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(1, n, 16, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2)]
    ref = [t.clone().requires_grad_() for t in full]
    expected = torch.cat([F.scaled_dot_product_attention(*(t.split(lengths, 2)[d] for t in ref),
                                                         is_causal=True, enable_gqa=True)
                          for d in range(2)], 2)
    expected.sum().backward()
    shard = lambda x: sequence_shard(x, 2, rank, world, layout="zigzag_docs", cu_seqlens=cu)  # noqa: E731
    local = [shard(t).float().requires_grad_() for t in full]
    cp = fusedpar.nn.ContextParallelAttention(backend="pipelined", layout="zigzag_docs")
    out = cp(*local, cu_seqlens=cu)
    out.sum().backward()
    torch.testing.assert_close(out.double(), shard(expected.detach()), atol=1e-5, rtol=0)
    for t, r in zip(local, ref):
        torch.testing.assert_close(t.grad.double(), shard(r.grad), atol=1e-4, rtol=0)
    set_hf_context_parallel_group(None, backend="pipelined")
    hf, _ = hf_context_parallel_attention(torch.nn.Module(), *(t.detach() for t in local), cu)
    torch.testing.assert_close(hf, out.detach().transpose(1, 2), atol=0, rtol=0)
    with pytest.raises(ValueError, match="layout 'zigzag_docs'"):
        cp.attend_padded(*local, torch.ones(1, 8, dtype=torch.bool), True, None)
    return True


def test_documents_sharded_each_zigzag(pools):
    pytest.importorskip("transformers")
    assert pools(2).run(_documents_drop_in) == [True, True]


def _tiny_llama(attn_implementation: str):
    """A two-layer Llama (GQA 4/2 heads) with seeded weights, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config).eval()


def _hf_llama(cp_size_unused=None):
    from fusedpar.nn.attention import set_hf_context_parallel_group
    from fusedpar.parallel import zigzag_positions

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _tiny_llama("eager")
    ids = torch.randint(0, 64, (1, 8 * world))
    expected = model(ids).logits
    set_hf_context_parallel_group(None, backend="pipelined")  # the kernels are tested elsewhere
    model.config._attn_implementation = "fusedpar_cp"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "fusedpar_cp"
    local_ids = zigzag_shard(ids, 1, rank, world)
    logits = model(local_ids, position_ids=zigzag_positions(ids.shape[1], rank, world)[None]).logits
    torch.testing.assert_close(logits, zigzag_shard(expected, 1, rank, world), atol=1e-4, rtol=1e-4)
    return True


def test_hugging_face_llama_with_fusedpar_cp(pools):
    pytest.importorskip("transformers")
    assert pools(2).run(_hf_llama) == [True, True]


def model_sdpa(model, ids, mask, positions):
    """The model's logits with HF's own sdpa attention on the whole sequence."""
    implementation = model.config._attn_implementation
    for config in [model.config] + [layer.self_attn.config for layer in model.model.layers]:
        config._attn_implementation = "sdpa"
    logits = model(ids, attention_mask=mask, position_ids=positions).logits
    for config in [model.config] + [layer.self_attn.config for layer in model.model.layers]:
        config._attn_implementation = implementation
    return logits


def _hf_llama_padded():
    """A padded batch (right padding, left padding, none) against HF's own sdpa attention at
    every token position; padding between tokens is refused."""
    from fusedpar.nn.attention import set_hf_context_parallel_group
    from fusedpar.parallel import zigzag_positions

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _tiny_llama("sdpa")
    s = 8 * world
    ids = torch.randint(0, 64, (3, s))
    mask = torch.ones(3, s, dtype=torch.long)
    mask[0, s - 5:] = 0  # right padding, across the zigzag chunks of several ranks
    mask[1, :3] = 0  # left padding
    positions = torch.arange(s)[None].expand(3, -1)
    expected = model_sdpa(model, ids, mask, positions)
    set_hf_context_parallel_group(None, backend="pipelined")  # the kernels are tested elsewhere
    model.config._attn_implementation = "fusedpar_cp"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "fusedpar_cp"
    shard = lambda x: zigzag_shard(x, 1, rank, world)  # noqa: E731
    local_positions = zigzag_positions(s, rank, world)[None].expand(3, -1)
    logits = model(shard(ids), attention_mask=shard(mask), position_ids=local_positions).logits
    tokens = shard(mask).bool()
    torch.testing.assert_close(logits[tokens], shard(expected)[tokens], atol=1e-4, rtol=1e-4)
    # padding only in rank 0's part: every rank still takes the same (padded) path
    mask[0] = 1
    expected = model_sdpa(model, ids, mask, positions)
    logits = model(shard(ids), attention_mask=shard(mask), position_ids=local_positions).logits
    tokens = shard(mask).bool()
    torch.testing.assert_close(logits[tokens], shard(expected)[tokens], atol=1e-4, rtol=1e-4)
    holes = mask.clone()
    holes[2, s // 2] = 0
    with pytest.raises(ValueError, match="padding between tokens"):
        model(shard(ids), attention_mask=shard(holes), position_ids=local_positions)
    return True


def test_hugging_face_padding_mask_matches_sdpa(pools):
    pytest.importorskip("transformers")
    assert pools(2).run(_hf_llama_padded) == [True, True]


def _hf_window_and_softcap():
    """A layer's sliding window (Mistral / Qwen2 / Gemma 2: each token sees the
    ``sliding_window`` keys up to itself) and softcap (Gemma 2) equal HF's eager math on the
    whole sequence (the causal mask with the window, ``softcap * tanh(scores / softcap)``),
    out and gradients; and with a padding mask (its packed path): the last token of the
    sequence (rank 0's last row in zigzag) padding, the tokens' outputs unchanged."""
    from fusedpar.nn.attention import hf_context_parallel_attention, set_hf_context_parallel_group

    rank, world = dist.get_rank(), dist.get_world_size()
    set_hf_context_parallel_group(None, backend="pipelined")
    g = torch.Generator().manual_seed(0)
    s, scale = 6 * world, 0.4
    full = [torch.randn(1, n, s, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2)]
    layer = torch.nn.Module().eval()
    padding = torch.ones(1, s // world, dtype=torch.long)
    padding[0, -1] = int(rank != 0)
    for window, softcap in ((5, None), (3, 2.0), (None, 50.0)):
        ref = [t.clone().requires_grad_() for t in full]
        scores = ref[0] @ ref[1].repeat_interleave(2, 1).transpose(-1, -2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        visible = (j <= i) & ((j > i - window) if window else True)
        expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ ref[2].repeat_interleave(2, 1)
        expected.transpose(1, 2).sum().backward()
        local = [zigzag_shard(t, 2, rank, world).float().requires_grad_() for t in full]
        out, _ = hf_context_parallel_attention(layer, *local, None, scaling=scale,
                                               sliding_window=window, softcap=softcap)
        out.sum().backward()
        where = (window, softcap)
        torch.testing.assert_close(out.double(), zigzag_shard(expected.transpose(1, 2).detach(), 1, rank, world),
                                   atol=1e-5, rtol=0, msg=str(where))
        for t, r in zip(local, ref):
            torch.testing.assert_close(t.grad.double(), zigzag_shard(r.grad, 2, rank, world),
                                       atol=1e-5, rtol=0, msg=str(where))
        padded, _ = hf_context_parallel_attention(layer, *(t.detach() for t in local), padding,
                                                  scaling=scale, sliding_window=window, softcap=softcap)
        tokens = padding[0].bool()
        torch.testing.assert_close(padded[:, tokens], out.detach()[:, tokens], atol=1e-5, rtol=0,
                                   msg=str(where))
    return True


def test_hugging_face_window_and_softcap(pools):
    pytest.importorskip("transformers")
    assert pools(2).run(_hf_window_and_softcap) == [True, True]
