"""fusedpar.nn.moe: MoEBlock (single process), ExpertParallelMoE and ExpertParallelExperts (ep ranks)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from fusedpar.nn.moe import MoEBlock
from tests.ops.collective_cases import requires_cuda

pytestmark = [pytest.mark.timeout(300)]


def _hf_style_forward(block, x):
    """Hugging Face MixtralSparseMoeBlock's arithmetic, written out independently."""
    h = x.reshape(-1, x.shape[-1])
    logits = F.linear(h, block.router.weight)
    probs = logits.softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    top, idx = probs.topk(block.top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    y = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(block.top_k):
            e = idx[t, j]
            gate, up = (block.w13[e] @ h[t]).chunk(2)
            y[t] += (block.w2[e] @ (F.silu(gate) * up)) * top[t, j]
    counts = torch.bincount(idx.reshape(-1), minlength=block.num_experts).double()
    aux = block.num_experts * (counts / h.shape[0] * probs.double().mean(0)).sum()
    return y.view(x.shape), aux


def test_moe_block_matches_per_token_loop():
    torch.manual_seed(0)
    block = MoEBlock(12, 10, num_experts=4, top_k=2, dtype=torch.float64)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    y, aux = block(x)
    ref_y, ref_aux = _hf_style_forward(block, x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(aux.double(), ref_aux, rtol=1e-6, atol=1e-6)
    (y.sum() + aux).backward()
    assert all(p.grad is not None for p in (block.router.weight, block.w13, block.w2))


def test_moe_block_contract_and_errors():
    block = MoEBlock(8, 6, num_experts=4, top_k=1)
    assert tuple(block.w13.shape) == (4, 12, 8) and tuple(block.w2.shape) == (4, 8, 6)
    assert (block.num_experts, block.top_k) == (4, 1)
    assert tuple(block.router.weight.shape) == (4, 8) and block.router.bias is None
    with pytest.raises(ValueError, match="hidden size 7"):
        block(torch.randn(3, 7))
    with pytest.raises(ValueError, match="top_k=5"):
        MoEBlock(8, 6, num_experts=4, top_k=5)


# ---- ExpertParallelMoE on ep ranks ---------------------------------------------------------


def _check_ep_reproduces_block(E, k, max_tokens=None):
    import torch.distributed as dist

    from fusedpar.nn.moe import ExpertParallelMoE

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same block and every rank's tokens on every rank
    block = MoEBlock(8, 6, num_experts=E, top_k=k)
    xs = [torch.randn(2, 3, 8) for _ in range(world)]
    ep = ExpertParallelMoE.from_module(block, dist.group.WORLD, max_tokens_per_rank=max_tokens)
    x = xs[rank].clone().requires_grad_()
    y, aux = ep(x)
    # FSDP2 shards this module on its own and warns about a view output (an in-place
    # update of a view would lose its backward hook): the output is not one
    assert y.shape == x.shape and y._base is None
    ((y ** 2).sum() + aux).backward()
    for xr in xs:  # the single-process block over every rank's tokens, losses summed
        ref_y, ref_aux = block(xr)
        ((ref_y ** 2).sum() + ref_aux).backward()
    ref_y, ref_aux = block(xs[rank])
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, ref_y, **tol)
    torch.testing.assert_close(aux, ref_aux, **tol)
    local = slice(rank * ep.num_local_experts, (rank + 1) * ep.num_local_experts)
    # DTensor Shard(0) of the global experts: the unparallelized name, shape and gradient
    assert ep.w13.shape == block.w13.shape and ep.w13.placements == (Shard(0),)
    torch.testing.assert_close(ep.w13.grad.to_local(), block.w13.grad[local], **tol)
    torch.testing.assert_close(ep.w2.grad.full_tensor(), block.w2.grad, **tol)
    router_grad = ep.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # replicated router: data-parallel sum
    torch.testing.assert_close(router_grad, block.router.weight.grad, **tol)
    ref_x = xs[rank].clone().requires_grad_()
    ref_y, ref_aux = block(ref_x)
    ((ref_y ** 2).sum() + ref_aux).backward()
    torch.testing.assert_close(x.grad, ref_x.grad, **tol)
    return True


@pytest.mark.parametrize("max_tokens", [None, 7], ids=["unpadded", "max_tokens_per_rank"])
@pytest.mark.parametrize("world, E, k", [(1, 4, 2), (2, 4, 1), (4, 8, 2)])
def test_expert_parallel_reproduces_single_process_block(pools, world, E, k, max_tokens):
    assert pools(world).run(_check_ep_reproduces_block, E, k, max_tokens) == [True] * world


def _check_errors():
    import torch.distributed as dist

    from fusedpar.nn.moe import ExpertParallelMoE
    from tests.ops.collective_cases import capture_errors

    ep = ExpertParallelMoE(8, 6, 4, 2, dist.group.WORLD)
    return capture_errors({
        "divisible": lambda: ExpertParallelMoE(8, 6, 3, 1, dist.group.WORLD),
        "top_k": lambda: ExpertParallelMoE(8, 6, 4, 5, dist.group.WORLD),
        "hidden": lambda: ep(torch.randn(3, 7)),
        "not_moe": lambda: ExpertParallelMoE.from_module(torch.nn.Linear(3, 3), dist.group.WORLD),
    })


def test_expert_parallel_errors(pools):
    for errors in pools(2).run(_check_errors):
        assert "num_experts=3 is not divisible by the ep group size 2" in errors["divisible"][1]
        assert "top_k=5" in errors["top_k"][1]
        assert "hidden size 7" in errors["hidden"][1]
        assert "neither a fusedpar MoEBlock" in errors["not_moe"][1]


def _compiled(fn, graphs: list):
    """``torch.compile(fn)`` through aot_eager (forward and backward traced), recording
    every graph dynamo hands it."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, inputs)

    return torch.compile(fn, backend=backend)


def _check_compile(backend: str, dispatch_backend: str):
    """torch.compile over ExpertParallelMoE (``backend`` runs moe_experts) and over the
    unfused moe_dispatch (``dispatch_backend``) -> grouped_mm -> moe_combine sequence: the
    exchange runs eagerly between compiled graphs, outputs and every gradient equal the
    eager ones."""
    import torch.distributed as dist

    import fusedpar
    from fusedpar.nn.linear import local
    from fusedpar.nn.moe import ExpertParallelMoE
    from tests.ops.collective_cases import env

    torch._dynamo.reset()
    rank, group = dist.get_rank(), dist.group.WORLD
    torch.manual_seed(0)
    ep = ExpertParallelMoE.from_module(MoEBlock(8, 6, num_experts=4, top_k=2), group)
    params = [ep.router.weight, ep.w13, ep.w2]
    x = (torch.randn(5, 8, generator=torch.Generator().manual_seed(rank)) + rank).requires_grad_()

    def step(fn):
        y, aux = fn(x)
        return (y, aux, *torch.autograd.grad((y ** 2).sum() + aux, [x, *params]))

    graphs = []
    with env(FUSEDPAR_BACKEND=backend):
        eager, compiled = step(ep), step(_compiled(ep, graphs))
    assert graphs, "dynamo compiled nothing"
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(local(got), local(want), rtol=1e-6, atol=1e-6)

    w13 = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(9)).requires_grad_()
    idx = torch.randint(0, 4, (5, 2), generator=torch.Generator().manual_seed(rank))

    def unfused(x, w13):
        recv_x, per_expert, handle = fusedpar.ops.moe_dispatch(x, idx, torch.ones(5, 2), 4, group,
                                                               backend=dispatch_backend)
        offs = per_expert.cumsum(0).to(torch.int32)
        return fusedpar.ops.moe_combine(fusedpar.ops.grouped_mm(recv_x, w13.transpose(1, 2), offs), handle)

    outs = []
    for fn in (unfused, _compiled(unfused, graphs)):
        y = fn(x, w13)
        outs.append((y, *torch.autograd.grad(y.square().sum(), [x, w13])))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    return True


@pytest.mark.parametrize("backend, dispatch_backend", [("reference", "reference"),
                                                       ("pipelined", "triton"), ("fused", "triton")])
def test_torch_compile_runs_the_exchange_eagerly(pools, backend, dispatch_backend):
    assert pools(2).run(_check_compile, backend, dispatch_backend) == [True, True]


def _hf_block(kind: str):
    """A tiny Hugging Face MoE block (transformers 5), seeded, with weights large enough to
    route unevenly: "mixtral", "qwen3-moe" (top-k weights not renormalized), "olmoe",
    "qwen2-moe" (a gated shared expert), "deepseek-v3" (sigmoid group-limited routing,
    scaled weights, a shared expert), "gpt-oss" (biased, transposed, clamped experts)."""
    import transformers as T

    common = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
    configs = {
        "mixtral": lambda: T.MixtralConfig(**common, intermediate_size=8, num_local_experts=4,
                                           num_experts_per_tok=2, router_jitter_noise=0.0),
        "qwen3-moe": lambda: T.Qwen3MoeConfig(**common, moe_intermediate_size=8, num_experts=4,
                                              num_experts_per_tok=2, norm_topk_prob=False),
        "olmoe": lambda: T.OlmoeConfig(**common, intermediate_size=8, num_experts=4,
                                       num_experts_per_tok=2),
        "qwen2-moe": lambda: T.Qwen2MoeConfig(**common, moe_intermediate_size=8,
                                              shared_expert_intermediate_size=8, num_experts=4,
                                              num_experts_per_tok=2),
        "deepseek-v3": lambda: T.DeepseekV3Config(
            **common, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=None,
            kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=4),
        "gpt-oss": lambda: T.GptOssConfig(**common, intermediate_size=8, num_local_experts=4,
                                          num_experts_per_tok=2),
    }
    blocks = {"mixtral": T.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock,
              "qwen3-moe": T.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
              "olmoe": T.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock,
              "qwen2-moe": T.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock,
              "deepseek-v3": T.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE,
              "gpt-oss": T.models.gpt_oss.modeling_gpt_oss.GptOssMLP}
    torch.manual_seed(0)
    block = blocks[kind](configs[kind]()).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block


def _hf_output(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def _check_hf_conversion(kind: str, whole: bool):
    """``kind``'s block on every rank; ``whole``: ExpertParallelMoE.from_module must keep its
    outputs. Always: swapping in ExpertParallelExperts keeps its outputs, its parameter
    names and global shapes (the block keeps its router and shared experts)."""
    import torch.distributed as dist

    from fusedpar.nn.moe import ExpertParallelExperts, ExpertParallelMoE

    hf = _hf_block(kind)
    xs = [torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(r))
          for r in range(dist.get_world_size())]
    x = xs[dist.get_rank()]
    expected = _hf_output(hf, x)
    if whole:
        y, _ = ExpertParallelMoE.from_module(hf, dist.group.WORLD)(x)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    names = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    hf.experts = ExpertParallelExperts.from_module(hf, dist.group.WORLD)
    assert {n: tuple(p.shape) for n, p in hf.named_parameters()} == names
    torch.testing.assert_close(_hf_output(hf, x), expected, rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("kind, whole", [("mixtral", True), ("qwen3-moe", True), ("olmoe", True),
                                         ("qwen2-moe", False), ("deepseek-v3", False)])
def test_hugging_face_block_conversion(pools, kind, whole):
    pytest.importorskip("transformers")
    assert pools(2).run(_check_hf_conversion, kind, whole) == [True, True]


def _hf_refusals():
    import torch.distributed as dist

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from fusedpar.nn.moe import ExpertParallelExperts, ExpertParallelMoE
    from tests.ops.collective_cases import capture_errors

    group = dist.group.WORLD
    sigmoid = _hf_block("deepseek-v3")
    del sigmoid.shared_experts  # left: the router, which only running it tells apart
    jitter = _hf_block("mixtral")
    jitter.jitter_noise = 0.1
    split = _hf_block("mixtral")
    split.experts._is_expert_parallel = True  # what transformers' own expert parallelism sets
    sharded = _hf_block("mixtral")  # e.g. FSDP applied first
    sharded.experts.gate_up_proj = torch.nn.Parameter(DTensor.from_local(
        sharded.experts.gate_up_proj.detach(), init_device_mesh("cpu", (1,)), [Replicate()]))
    return capture_errors({
        "shared": lambda: ExpertParallelMoE.from_module(_hf_block("qwen2-moe"), group),
        "shared_deepseek": lambda: ExpertParallelMoE.from_module(_hf_block("deepseek-v3"), group),
        "sigmoid": lambda: ExpertParallelMoE.from_module(sigmoid, group),
        "jitter": lambda: ExpertParallelMoE.from_module(jitter, group),
        "gpt_oss": lambda: ExpertParallelMoE.from_module(_hf_block("gpt-oss"), group),
        "gpt_oss_experts": lambda: ExpertParallelExperts.from_module(_hf_block("gpt-oss"), group),
        "already_split": lambda: ExpertParallelExperts.from_module(split, group),
        "dtensor": lambda: ExpertParallelMoE.from_module(sharded, group),
        "twice": lambda: ExpertParallelMoE.from_module(
            ExpertParallelMoE.from_module(_hf_block("mixtral"), group), group),
    })


def test_hugging_face_blocks_it_cannot_reproduce_are_refused(pools):
    """What ExpertParallelMoE would drop or change is an error naming it and the way out
    (ExpertParallelExperts keeps the block's router); experts fusedpar does not compute are
    refused by both conversions."""
    pytest.importorskip("transformers")
    errors, = pools(1).run(_hf_refusals)
    assert {case: error and error[0] for case, error in errors.items()} == {
        **dict.fromkeys(errors, "ValueError"), "twice": "TypeError"}, errors
    keep_router = "block.experts = ExpertParallelExperts.from_module(block, group)"
    assert "shared_expert, shared_expert_gate" in errors["shared"][1] and keep_router in errors["shared"][1]
    assert "shared_experts" in errors["shared_deepseek"][1]
    assert "DeepseekV3TopkRouter does not route as fusedpar's topk_route" in errors["sigmoid"][1]
    assert keep_router in errors["sigmoid"][1]
    assert "jitter_noise=0.1" in errors["jitter"][1]
    for case, api in (("gpt_oss", "ExpertParallelMoE"), ("gpt_oss_experts", "ExpertParallelExperts")):
        assert errors[case][1].startswith(f"{api}.from_module: GptOssExperts (has_bias=True"), errors[case]
        assert "is_transposed=True" in errors[case][1]
    for case in ("already_split", "dtensor"):
        assert "MixtralExperts's weights are already split" in errors[case][1], errors[case]
    assert errors["twice"] == ("TypeError", "ExpertParallelMoE.from_module: the block is already "
                                            "expert-parallel")


def _gpu_graph_moe_block(T, H, I, E, k):
    """ExpertParallelMoE with max_tokens_per_rank on one rank (torch symmetric memory):
    forward and backward captured in one CUDA graph and replayed with new tokens; every
    replay matches the single-process MoEBlock eagerly."""
    import torch.distributed as dist

    from fusedpar.nn.moe import ExpertParallelMoE
    from tests.ops.collective_cases import captured

    torch.manual_seed(0)
    block = MoEBlock(H, I, num_experts=E, top_k=k, device="cuda")
    ep = ExpertParallelMoE.from_module(block, dist.group.WORLD, max_tokens_per_rank=T)
    x = torch.randn(T, H, device="cuda").requires_grad_()
    params = [ep.router.weight, ep.w13, ep.w2]

    def step():
        y, aux = ep(x)
        return (y, aux, *torch.autograd.grad((y ** 2).sum() + aux, [x, *params]))

    graph, outputs = captured(step)
    results = []
    for seed in range(1, 4):
        with torch.no_grad():
            x.copy_(torch.randn(T, H, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        ref_x = x.detach().clone().requires_grad_()
        ref_y, ref_aux = block(ref_x)
        ref_params = [block.router.weight, block.w13, block.w2]
        expected = (ref_y, ref_aux, *torch.autograd.grad((ref_y ** 2).sum() + ref_aux, [ref_x, *ref_params]))
        got = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in outputs]
        results.append(all(torch.allclose(g, e, rtol=1e-4, atol=1e-4) for g, e in zip(got, expected)))
    return results


@requires_cuda
def test_gpu_cuda_graph_captures_the_padded_expert_parallel_block(pools):
    assert pools(1).run(_gpu_graph_moe_block, 24, 16, 8, 4, 2) == [[True] * 3]
