"""``apply_tp`` on a tiny Llama-style block (Hugging Face attribute names) against the same
block in one process and against torch DTensor's ``parallelize_module`` plan.

Every rank builds the same seeded block, input and output-gradient weights and feeds its
shard (sequence shard with SP, the whole input without). Checked: forward output, input
gradient, every parameter's full gradient (shards reassembled), the parameters after one
SGD step, a second forward after the step, a no-grad forward, and the fused collectives'
traffic (one gather per shared group).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fusedpar
from fusedpar.parallel import apply_tp
from tests.nn.tp_cases import close, tp_mesh

LR = 0.1
B, S, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2, 8, 32, 8, 4, 4, 48


# ---- a tiny Llama-style block (HF LlamaDecoderLayer names and calling conventions) -----------


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    """Causal GQA attention. ``legacy=True`` reads its head counts and width from attributes
    (older HF code); otherwise shapes come from the input and ``-1`` (current HF code), and
    q/k pass through per-head RMSNorms (Qwen3's ``q_norm``/``k_norm``: replicated weights
    acting on this rank's heads)."""

    def __init__(self, legacy: bool):
        super().__init__()
        self.legacy = legacy
        self.num_heads, self.num_key_value_heads, self.head_dim = HEADS, KV_HEADS, HEAD_DIM
        self.hidden_size = HEADS * HEAD_DIM
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=True)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=True)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=True)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=True)
        if not legacy:
            self.q_norm, self.k_norm = RMSNorm(HEAD_DIM), RMSNorm(HEAD_DIM)

    def forward(self, hidden_states):
        b, s = hidden_states.shape[:2]
        if self.legacy:
            q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim)
            k = self.k_proj(hidden_states).view(b, s, self.num_key_value_heads, self.head_dim)
            v = self.v_proj(hidden_states).view(b, s, self.num_key_value_heads, self.head_dim)
        else:
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q = self.q_norm(self.q_proj(hidden_states).view(shape))
            k = self.k_norm(self.k_proj(hidden_states).view(shape))
            v = self.v_proj(hidden_states).view(shape)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        out = out.reshape(b, s, self.hidden_size) if self.legacy else out.reshape(b, s, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, legacy: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention(legacy)
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, hidden_states):
        residual = hidden_states
        # the attention's input as a keyword, as HF's LlamaDecoderLayer passes it
        hidden_states = self.self_attn(hidden_states=self.input_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _seeded_block(legacy: bool) -> Block:
    torch.manual_seed(0)
    block = Block(legacy)
    with torch.no_grad():  # norms away from 1 so their gradients matter
        for norm in block.modules():
            if isinstance(norm, RMSNorm):
                norm.weight.copy_(1 + 0.2 * torch.randn(norm.weight.shape))
    return block


# ---- helpers (rank side) --------------------------------------------------------------------



def _full_tensors(block: nn.Module, which: str) -> dict[str, torch.Tensor]:
    """Every parameter (``which="param"``) or gradient (``"grad"``) as the full tensor of
    the single-process block (fusedpar's TP layers hold DTensors, like torch's plan)."""
    out = {}
    for name, p in block.named_parameters():
        t = (p if which == "param" else p.grad).detach()
        out[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return out


def _dtensor_block(block: Block, sp: bool) -> Block:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    out_layout = Shard(1) if sp else Replicate()
    plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
    plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=out_layout)
    plan["mlp.down_proj"] = RowwiseParallel(output_layouts=out_layout)
    if sp:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
        plan["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True)
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                         use_local_output=True)
    if not block.self_attn.legacy:  # per-head norms on this rank's heads (dim 2 of [B, S, H, D])
        for name in ("q_norm", "k_norm"):
            plan[f"self_attn.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    block = parallelize_module(block, tp_mesh(), plan)
    attn = block.self_attn
    attn.num_heads //= world
    attn.num_key_value_heads //= world
    attn.hidden_size //= world
    return block


def _run(block, x_local, g_local):
    """Forward, backward, one SGD step; returns output, input grad, full grads and params."""
    x = x_local.clone().requires_grad_()
    y = block(x)
    (y * g_local).sum().backward()
    grads = _full_tensors(block, "grad")
    torch.optim.SGD(block.parameters(), lr=LR).step()
    return y.detach(), x.grad, grads, _full_tensors(block, "param")


# ---- the per-rank check ------------------------------------------------------------------------


def _check_block(sp: bool, legacy: bool, backend: str) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _seeded_block(legacy)
    ours = apply_tp(copy.deepcopy(reference), tp_mesh(), sequence_parallel=sp, backend=backend)
    theirs = _dtensor_block(copy.deepcopy(reference), sp)
    assert ours.self_attn.num_heads == HEADS // world
    assert ours.self_attn.num_key_value_heads == KV_HEADS // world
    assert set(ours.state_dict()) == set(reference.state_dict())  # checkpoints keep their keys

    torch.manual_seed(1)
    x_full, g_full, x2_full = (torch.randn(B, S, HIDDEN) for _ in range(3))

    def local(t):
        return t.chunk(world, 1)[rank] if sp else t

    # the single process
    x_ref = x_full.clone().requires_grad_()
    y_ref = reference(x_ref)
    (y_ref * g_full).sum().backward()
    grads_ref = {n: p.grad for n, p in reference.named_parameters()}
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    params_ref = {n: p.detach() for n, p in reference.named_parameters()}

    # fusedpar: the fused ops move one shard per shared group and per row layer
    with fusedpar.comm.count_bytes() as counter:
        y, x_grad, grads, params = _run(ours, local(x_full), local(g_full))
    shard_bytes = B * (S // world) * HIDDEN * 4
    if sp:
        traffic = counter.by_op()
        forward_and_backward = 2 * (world - 1) * shard_bytes  # 2 gathers fwd, 2 in the row layers' bwd
        assert traffic[("all_gather_matmul", backend)] == 2 * forward_and_backward, traffic
        assert traffic[("matmul_reduce_scatter", backend)] == 2 * forward_and_backward, traffic
        assert counter.total() == 4 * forward_and_backward, traffic  # nothing else moved

    close(y, local(y_ref.detach()), "block output")
    close(x_grad, local(x_ref.grad), "block input grad")
    assert set(grads) == set(grads_ref)
    for name in grads_ref:
        close(grads[name], grads_ref[name], f"grad of {name}")
        close(params[name], params_ref[name], f"{name} after SGD")

    # DTensor's plan on the same weights
    y_dt, x_grad_dt, grads_dt, params_dt = _run(theirs, local(x_full), local(g_full))
    close(y, y_dt, "block output vs DTensor")
    close(x_grad, x_grad_dt, "block input grad vs DTensor")
    for name in grads_dt:
        close(grads[name], grads_dt[name], f"grad of {name} vs DTensor")
        close(params[name], params_dt[name], f"{name} after SGD vs DTensor")

    # after the step: a second forward (hooks and shared gathers hold no stale state), also
    # without grad, and on a deep copy (its hooks must serve the copy's layers)
    expected = local(reference(x2_full).detach())
    close(ours(local(x2_full)), expected, "second forward")
    with torch.no_grad():
        close(ours(local(x2_full)), expected, "no-grad forward")
    clone = copy.deepcopy(ours)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)  # the copy computes with its own weights, not the original's
    with torch.no_grad():
        reference_half = copy.deepcopy(reference)
        for p in reference_half.parameters():
            p.mul_(0.5)
    close(clone(local(x2_full)), local(reference_half(x2_full).detach()), "forward of a deep copy")
    for layer in (ours.self_attn.q_proj, ours.mlp.gate_proj):  # every precomputed output taken
        assert layer._shared_gather._stash == {}
    return True


def _check_whole_mlp() -> bool:
    """``split_mlp=False`` (an MoE block's place): the mlp stays whole and runs on this
    rank's sequence shard, so the output is the single process's shard; every gradient
    outside the mlp is the full one, the mlp's are this shard's part (summed over the ranks:
    the full one), left for the caller to reduce."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _seeded_block(True)
    ours = apply_tp(copy.deepcopy(reference), tp_mesh(), backend="reference", split_mlp=False)
    assert all(type(m) is nn.Linear for m in ours.mlp.children())
    torch.manual_seed(1)
    x_full, g_full = torch.randn(B, S, HIDDEN), torch.randn(B, S, HIDDEN)
    x_ref = x_full.clone().requires_grad_()
    (reference(x_ref) * g_full).sum().backward()
    y, x_grad, grads, _ = _run(ours, x_full.chunk(world, 1)[rank], g_full.chunk(world, 1)[rank])
    close(y, reference(x_full).detach().chunk(world, 1)[rank], "block output")
    close(x_grad, x_ref.grad.chunk(world, 1)[rank], "block input grad")
    for name, p in reference.named_parameters():
        if name.startswith("mlp."):
            dist.all_reduce(grads[name])
        close(grads[name], p.grad, f"grad of {name}")
    return True


def _check_errors() -> list[str]:
    messages = []

    class NoMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention(legacy=True)
            self.input_layernorm = RMSNorm(HIDDEN)

    odd = Block()
    odd.self_attn.num_heads = 3
    mixed = Block()  # q in float8, k and v not: they share one gather
    only_q = dict(float8=lambda layer: "rowwise" if layer is mixed.self_attn.q_proj else None)
    for make, options in ((NoMLP, {}), (lambda: odd, {}), (lambda: apply_tp(Block(), None), {}),
                          (Block, dict(sequence_parallel=False, split_mlp=False)),
                          (lambda: mixed, only_q)):
        try:
            apply_tp(make(), None, **options)
        except (TypeError, ValueError) as e:
            messages.append(str(e))
        else:
            raise AssertionError("no error")
    return messages


def _check_compiled_sp_block() -> bool:
    """A fusedpar.models Llama decoder layer under apply_tp with SP compiles with
    ``torch.compile(block, fullgraph=True)`` (torchtitan compiles per block) and gives the
    eager block's output and gradients."""
    import torch._dynamo

    from fusedpar.models import LlamaConfig, LlamaForCausalLM
    from fusedpar.nn.linear import local

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                                         num_kv_heads=2, intermediate_size=64))
    layer = model.model.layers[0]
    compiled_block = apply_tp(copy.deepcopy(layer), tp_mesh(), sequence_parallel=True, backend="reference")
    eager = apply_tp(layer, tp_mesh(), sequence_parallel=True, backend="reference")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(2, 8, 32).chunk(world, dim=1)[rank]  # this rank's sequence shard
    positions = torch.arange(8).expand(2, 8)
    rope = model.model.rotary_emb(x, positions)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_block, fullgraph=True, backend="aot_eager")
    for block, run in ((eager, eager), (compiled_block, compiled)):
        xi = x.clone().requires_grad_()
        out = run(xi, position_embeddings=rope)
        (out * out).sum().backward()
        block._result = (out.detach(), xi.grad)
    close(compiled_block._result[0], eager._result[0], "compiled forward")
    close(compiled_block._result[1], eager._result[1], "compiled input grad")
    grads = {n: p.grad for n, p in eager.named_parameters()}
    for n, p in compiled_block.named_parameters():
        close(local(p.grad), local(grads[n]), f"compiled grad of {n}")
    return True


# ---- tests --------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [True, False], ids=["sequence_parallel", "replicated"])
@pytest.mark.parametrize("world", [2, 4])
def test_apply_tp_matches_single_process_and_dtensor(pools, world, sp):
    assert pools(world).run(_check_block, sp, True, "reference") == [True] * world


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp,backend", [(True, "reference"), (True, "pipelined"), (False, None)],
                         ids=["sp-reference", "sp-pipelined", "replicated"])
def test_apply_tp_current_hf_attention(pools, sp, backend):
    """Attention that infers its head count from shapes (current HF code): it must see the
    gathered sequence, not the shard; with Qwen3-style per-head q/k norms, whose gradients
    are partial on each rank (its heads) with or without SP."""
    assert pools(2).run(_check_block, sp, False, backend) == [True] * 2


@pytest.mark.timeout(300)
def test_apply_tp_explains_what_it_expects(pools):
    no_mlp, odd_heads, twice, replicated_whole_mlp, mixed_float8 = pools(2).run(_check_errors)[0]
    assert "Llama-style decoder block" in no_mlp and "no submodule 'mlp'" in no_mlp
    assert "post_attention_layernorm" in no_mlp
    assert "self_attn.num_heads=3" in odd_heads
    assert "already a ColumnParallelLinear" in twice
    assert "split_mlp=False needs sequence_parallel=True" in replicated_whole_mlp
    assert "q_proj, k_proj, v_proj share one gather" in mixed_float8 and "all or none" in mixed_float8


@pytest.mark.timeout(300)
def test_apply_tp_leaves_an_unsplit_mlp_on_the_sequence_shard(pools):
    assert pools(2).run(_check_whole_mlp) == [True] * 2


@pytest.mark.timeout(300)
def test_sequence_parallel_block_compiles_fullgraph(pools):
    assert pools(2).run(_check_compiled_sp_block, timeout=250) == [True] * 2
