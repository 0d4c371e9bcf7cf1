"""Mixture-of-experts modules.

- :class:`MoEBlock`: a single-process Mixtral-style MoE block (router + stacked SwiGLU
  experts), the block ``fusedpar.models`` uses.
- :class:`ExpertParallelMoE`: the same block with its experts split over an ep group
  (``fusedpar.ops.moe_experts``), with ``.from_module(block, group)`` for a MoEBlock or a
  Hugging Face block routed by softmax top-k (Mixtral, Qwen3-MoE, OLMoE).
- :class:`ExpertParallelExperts`: only the stacked experts of a Hugging Face MoE block
  (``experts.gate_up_proj`` / ``down_proj``; also Qwen2-MoE and DeepSeek-V3) split over an
  ep group, so the block keeps its router, shared experts and every parameter name.

Expert weights are DTensors ``Shard(0)`` of the global ``[E, 2I, H]`` / ``[E, H, I]`` on the
ep axis (a 1-D ``DeviceMesh``), as TP layers' weights are on the tp axis: ``state_dict()``
and ``torch.distributed.checkpoint`` see the unparallelized names and shapes (and reshard
across ep degrees), FSDP2 over ``efsdp`` composes with them; compute runs on ``.to_local()``.

The load-balancing loss of a block is over the tokens of one call unless
:func:`set_aux_loss_group` names a group of ranks that split the batch: then the routing
statistics are summed over it first, so every rank gets the loss of the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..comm import resolve_group
from ..ops.moe import expert_counts, experts_dense, moe_experts, topk_route
from ..ops.moe.exchange import float8_cast
from .linear import local, tp_device_mesh


def load_balancing_loss(logits: torch.Tensor, topk_idx: torch.Tensor, group: str | None,
                        grad_scale: float = 1.0) -> torch.Tensor:
    """``topk_route``'s aux loss ``E * sum_e f_e * P_e`` with ``f`` (routed copies per
    token) and ``P`` (mean router probability) over the tokens of every rank of ``group``
    (``logits [T, E]`` / ``topk_idx [T, k]`` are this rank's). The value is the same on
    every rank; the gradient reaches this rank's probabilities only, times ``grad_scale``
    (the number of ranks whose gradients the data-parallel reduction averages, so the
    average is the single-process gradient)."""
    experts = logits.shape[-1]
    probs = (logits if logits.dtype == torch.float64 else logits.float()).softmax(dim=-1)
    counts = expert_counts(topk_idx, experts, probs.dtype)
    prob_sum = probs.sum(dim=0)
    stats = torch.cat([counts, prob_sum.detach(), prob_sum.new_full((1,), probs.shape[0])])
    stats = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(stats, "sum", group))
    tokens = stats[-1].clamp(min=1)
    mean_prob = stats[experts:2 * experts] / tokens + grad_scale * (prob_sum - prob_sum.detach()) / tokens
    return experts * (stats[:experts] / tokens * mean_prob).sum()


def set_aux_loss_group(block: nn.Module, group, grad_scale: float) -> None:
    """Make ``block`` (a :class:`MoEBlock` / :class:`ExpertParallelMoE`) return the
    load-balancing loss of the tokens of every rank of ``group`` (the data-parallel ranks
    that split a batch: the single-process loss of the whole batch) instead of its own
    tokens'; see :func:`load_balancing_loss` for ``grad_scale``."""
    block.aux_group = resolve_group(group).group_name
    block.aux_grad_scale = float(grad_scale)


def _route(block: nn.Module, flat: torch.Tensor):
    logits = block.router(flat)
    topk_idx, topk_weights, aux_loss = topk_route(logits, block.top_k, renormalize=block.renormalize)
    if block.aux_group is not None:
        aux_loss = load_balancing_loss(logits, topk_idx, block.aux_group, block.aux_grad_scale)
    return topk_idx, topk_weights, aux_loss


class MoEBlock(nn.Module):
    """Router + ``num_experts`` SwiGLU experts stored stacked, all on this process::

        logits = router(x)                                   # nn.Linear(H, E, bias=False)
        topk_idx, topk_weights, aux_loss = fusedpar.ops.topk_route(logits, top_k)
        y = sum over each token's k experts e of
                topk_weight * (silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)) @ w2[e].T

    ``w13 [E, 2I, H]``: rows ``[:I]`` the gate (w1), ``[I:]`` the up projection (w3), as
    Hugging Face's ``gate_up_proj``; ``w2 [E, H, I]`` (``down_proj``).
    ``forward(x [..., H]) -> (y [..., H], aux_loss)``; ``aux_loss`` is the unscaled
    load-balancing loss (the model multiplies it by its coefficient).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int = 2,
                 *, renormalize: bool = True, device=None, dtype=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoEBlock: top_k={top_k} must be between 1 and num_experts={num_experts}")
        factory = dict(device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.aux_group, self.aux_grad_scale = None, 1.0  # see set_aux_loss_group
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        # nn.Linear's default init, per expert (fan-in = the last dim); this rank's experts
        for w in (self.w13, self.w2):
            bound = 1 / w.shape[-1] ** 0.5
            nn.init.uniform_(local(w), -bound, bound)

    def forward(self, x: torch.Tensor):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoEBlock: x has hidden size {x.shape[-1]}, the block {self.hidden_size}")
        flat = x.reshape(-1, self.hidden_size)
        topk_idx, topk_weights, aux_loss = _route(self, flat)
        y = experts_dense(flat, topk_idx, topk_weights, self.w13, self.w2)
        return y.view(x.shape), aux_loss

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}")


class ExpertParallelMoE(nn.Module):
    """A :class:`MoEBlock` whose experts live on the ranks of an ep group; the same as
    ``MoEBlock.forward`` over every rank's tokens, with this rank's share of the output::

        topk_idx, topk_weights, aux_loss = topk_route(router(x), top_k)   # this rank's tokens
        y = moe_experts(x, topk_idx, topk_weights, w13, w2, group)

    ``w13`` / ``w2``: DTensors ``Shard(0)`` of the global ``[E, 2I, H]`` (rows ``[:I]`` gate,
    ``[I:]`` up) / ``[E, H, I]`` on the ep mesh (``group`` as a 1-D ``DeviceMesh`` or
    ``(mesh, axis)`` keeps FSDP2's 2-D composition; a process group gets a mesh of its own):
    global expert ``e`` lives on rank ``e // E_local``. The router is replicated: its gradient
    is this rank's tokens' share (sum it over the group, as data parallelism does).
    ``forward(x [..., H]) -> (y, aux_loss)`` with ``aux_loss`` over this rank's tokens (or
    see :func:`set_aux_loss_group`).

    ``max_tokens_per_rank``: at most that many tokens per rank and call (``x``'s rows); the
    exchange then keeps its sizes on the device (``moe_experts(..., max_tokens_per_rank=)``),
    so the whole block, backward included, can be captured in a CUDA graph.

    ``float8``: a rowwise recipe (``"rowwise"``, ``"rowwise_with_gw_hp"``): the experts'
    GEMMs run in fp8 and the tokens travel as fp8 rows with their scales
    (``moe_experts(..., float8=)``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int = 2,
                 group=None, *, renormalize: bool = True, max_tokens_per_rank: int | None = None,
                 float8: str | None = None, device=None, dtype=None):
        super().__init__()
        pg = resolve_group(group)
        world = dist.get_world_size(pg)
        if num_experts % world:
            raise ValueError(f"ExpertParallelMoE: num_experts={num_experts} is not divisible by the "
                             f"ep group size {world}; pick an ep size that divides it")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"ExpertParallelMoE: top_k={top_k} must be between 1 and "
                             f"num_experts={num_experts}")
        factory = dict(device=device, dtype=dtype)
        self.group_name = pg.group_name
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.max_tokens_per_rank, self.float8 = max_tokens_per_rank, _float8(float8, max_tokens_per_rank)
        self.aux_group, self.aux_grad_scale = None, 1.0  # see set_aux_loss_group
        self.num_local_experts = num_experts // world
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        local_experts = self.num_local_experts
        self.w13 = _expert_param(torch.empty(local_experts, 2 * intermediate_size, hidden_size,
                                             **factory), group)
        self.w2 = _expert_param(torch.empty(local_experts, hidden_size, intermediate_size, **factory),
                                group)
        MoEBlock.reset_parameters(self)

    @classmethod
    def from_module(cls, block: nn.Module, group=None, *, max_tokens_per_rank: int | None = None,
                    float8: str | None = None) -> "ExpertParallelMoE":
        """This rank's share of ``block``: a :class:`MoEBlock`, or a Hugging Face MoE block
        routed by softmax top-k (transformers 5, found by structure: ``gate.weight [E, H]``,
        ``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``, SiLU), such as
        ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock`` and ``OlmoeSparseMoeBlock``
        (``norm_topk_prob`` is kept). Copies the router and this rank's experts; outputs stay
        the same. A block with more than that (shared experts as in Qwen2-MoE, sigmoid or
        group-limited routing as in DeepSeek-V3, router biases, jitter) is refused: keep its
        router and split only its experts with :class:`ExpertParallelExperts`."""
        api = "ExpertParallelMoE.from_module"
        router, w13, w2, top_k, renormalize = _moe_weights(block, api)
        num_experts, two_i, hidden = w13.shape
        pg = resolve_group(group)
        out = cls(hidden, two_i // 2, num_experts, top_k, group, renormalize=renormalize,
                  max_tokens_per_rank=max_tokens_per_rank, float8=float8, device=w13.device,
                  dtype=w13.dtype)
        with torch.no_grad():
            out.router.weight.copy_(router)
            local(out.w13).copy_(w13.chunk(dist.get_world_size(pg))[dist.get_rank(pg)])
            local(out.w2).copy_(w2.chunk(dist.get_world_size(pg))[dist.get_rank(pg)])
        return out

    def forward(self, x: torch.Tensor):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"ExpertParallelMoE: x has hidden size {x.shape[-1]}, the block "
                             f"{self.hidden_size}")
        flat = x.reshape(-1, self.hidden_size)
        topk_idx, topk_weights, aux_loss = _route(self, flat)
        y = moe_experts(flat, topk_idx, topk_weights, local(self.w13), local(self.w2), self.group_name,
                        max_tokens_per_rank=self.max_tokens_per_rank, float8=self.float8)
        # not a view (y is this call's own): FSDP2, which wraps this module on its own,
        # warns about a view output, whose in-place update would lose its backward hook
        return torch.ops.aten._unsafe_view(y, x.shape), aux_loss

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts} ({self.num_local_experts} here), "
                f"top_k={self.top_k}, group={self.group_name!r}" +
                (f", max_tokens_per_rank={self.max_tokens_per_rank}" if self.max_tokens_per_rank else "") +
                (f", float8={self.float8!r}" if self.float8 else ""))


class ExpertParallelExperts(nn.Module):
    """The stacked SwiGLU experts of a Hugging Face MoE block (``block.experts``) split over
    an ep group, called as HF calls them::

        y = experts(x [T, H], top_k_index [T, k], top_k_weights [T, k])
          = moe_experts(x, top_k_index, top_k_weights, gate_up_proj, down_proj, group)

    ``gate_up_proj`` / ``down_proj``: DTensors ``Shard(0)`` of HF's global ``[E, 2I, H]`` /
    ``[E, H, I]`` on the ep mesh (see :class:`ExpertParallelMoE`), under HF's names. The
    block keeps HF's router (``gate``), which routes this rank's tokens.
    ``max_tokens_per_rank``, ``float8``: as in :class:`ExpertParallelMoE`."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, group=None, *,
                 max_tokens_per_rank: int | None = None, float8: str | None = None):
        super().__init__()
        pg = resolve_group(group)
        world = dist.get_world_size(pg)
        if gate_up_proj.shape[0] % world:
            raise ValueError(f"ExpertParallelExperts: {gate_up_proj.shape[0]} experts are not "
                             f"divisible by the ep group size {world}; pick an ep size that divides it")
        self.group_name = pg.group_name
        self.num_experts, self.max_tokens_per_rank = gate_up_proj.shape[0], max_tokens_per_rank
        self.float8 = _float8(float8, max_tokens_per_rank)
        rank = dist.get_rank(pg)
        self.gate_up_proj = _expert_param(gate_up_proj.detach().chunk(world)[rank].clone(), group)
        self.down_proj = _expert_param(down_proj.detach().chunk(world)[rank].clone(), group)

    @classmethod
    def from_module(cls, block: nn.Module, group=None, *, max_tokens_per_rank: int | None = None,
                    float8: str | None = None) -> "ExpertParallelExperts":
        """This rank's experts of a Hugging Face MoE block with stacked SwiGLU experts
        (``block.experts.gate_up_proj`` / ``down_proj``: Mixtral, Qwen2/3-MoE, OLMoE,
        DeepSeek-V3, ...); the block keeps its router, shared experts and the rest."""
        w13, w2 = _stacked_experts(block, "ExpertParallelExperts.from_module")
        return cls(w13, w2, group, max_tokens_per_rank=max_tokens_per_rank, float8=float8)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return moe_experts(hidden_states, top_k_index, top_k_weights, local(self.gate_up_proj),
                           local(self.down_proj), self.group_name,
                           max_tokens_per_rank=self.max_tokens_per_rank, float8=self.float8)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, group={self.group_name!r}"


def _float8(recipe: str | None, max_tokens_per_rank: int | None) -> str | None:
    """``recipe`` checked now rather than at the first forward (``moe_experts``' rules)."""
    if recipe is not None:
        float8_cast(recipe)  # a recipe whose input cast is not per token cannot travel
        if max_tokens_per_rank is not None:
            raise ValueError(f"float8={recipe!r} with max_tokens_per_rank={max_tokens_per_rank}: the "
                             "padded exchange has no fp8 form yet; drop one of them")
    return recipe


def _expert_param(local_experts: torch.Tensor, group) -> nn.Parameter:
    """A Parameter holding the DTensor ``Shard(0)`` with these local experts on the ep mesh."""
    device_type = local_experts.device.type if not local_experts.is_meta else \
        ("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(group, (tuple, DeviceMesh)):
        group = resolve_group(group).group_name  # a mesh is made from the group, once
    mesh = tp_device_mesh(group, device_type)
    return nn.Parameter(DTensor.from_local(local_experts, mesh, [Shard(0)], run_check=False))


#: The flags transformers (>= 5) sets on stacked experts (``use_experts_implementation``) and
#: the values of what fusedpar computes: SwiGLU, ``[gate; up]`` stacked, ``[E, out, in]``, no
#: bias, no norm after the experts.
_HF_SWIGLU_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False,
                    "is_concatenated": True, "has_post_expert_norm": False}
_KEEP_HF_ROUTER = ("keep the block's router and replace only its experts: block.experts = "
                   "ExpertParallelExperts.from_module(block, group) (fusedpar.parallelize does)")


def _stacked_experts(block: nn.Module, api: str):
    """``(w13 [E, 2I, H], w2 [E, H, I])``: the stacked SwiGLU experts of a Hugging Face MoE
    block (``experts.gate_up_proj`` / ``experts.down_proj``); anything else computed by the
    experts (biases, another activation or gating, a transposed or interleaved layout, a
    norm after them) is refused rather than dropped."""
    experts = getattr(block, "experts", None)
    w13, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (w13, w2)):
        raise TypeError(f"{api}: {type(block).__name__} is neither a fusedpar MoEBlock nor a "
                        "Hugging Face MoE block with stacked experts (transformers >= 5: "
                        "experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])")
    if getattr(experts, "_is_expert_parallel", False) or any(isinstance(t, DTensor) for t in (w13, w2)):
        raise ValueError(f"{api}: {type(experts).__name__}'s weights are already split (transformers' "
                         "expert parallelism, or FSDP / DTensor); convert the block while it holds "
                         "every expert whole (fusedpar.parallelize does this before FSDP)")
    odd = [f"{flag}={getattr(experts, flag)}" for flag, want in _HF_SWIGLU_FLAGS.items()
           if getattr(experts, flag, want) != want]
    act = getattr(experts, "act_fn", None)
    if act is not None and not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLU", "SiLUActivation"):
        odd.append(f"act_fn={type(act).__name__}")
    gating = getattr(type(experts), "_apply_gate", None)
    if gating is not None and gating.__name__ != "_default_apply_gate":
        odd.append("a gating function of its own (_apply_gate)")
    if odd:
        raise ValueError(f"{api}: {type(experts).__name__} ({', '.join(odd)}) is not what fusedpar's "
                         "experts compute: silu(gate) * up with gate_up_proj [E, 2I, H] (gate rows "
                         "first), down_proj [E, H, I] and no biases")
    num_experts, two_i, hidden = w13.shape
    if two_i % 2 or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"{api}: gate_up_proj {tuple(w13.shape)} and down_proj {tuple(w2.shape)} "
                         "do not fit [E, 2I, H] and [E, H, I]")
    return w13, w2


def _moe_weights(block: nn.Module, api: str):
    """``(router weight [E, H], w13 [E, 2I, H], w2 [E, H, I], top_k, renormalize)`` of a
    MoEBlock or of a Hugging Face block that :class:`ExpertParallelMoE` reproduces whole:
    softmax top-k routing by a bias-free router, the stacked experts, nothing else."""
    if isinstance(block, ExpertParallelMoE):
        raise TypeError(f"{api}: the block is already expert-parallel")
    if isinstance(block, MoEBlock):
        return block.router.weight, block.w13, block.w2, block.top_k, block.renormalize
    w13, w2 = _stacked_experts(block, api)
    gate = getattr(block, "gate", None)
    router = getattr(gate, "weight", None)
    if not isinstance(router, torch.Tensor) or tuple(router.shape) != (w13.shape[0], w13.shape[2]):
        raise ValueError(f"{api}: {type(block).__name__}.gate.weight must be the router [E, H] = "
                         f"{[w13.shape[0], w13.shape[2]]} of its experts, got "
                         f"{None if router is None else tuple(router.shape)}")
    extra = [name for name, _ in block.named_children() if name.startswith("shared_expert")]
    if getattr(gate, "bias", None) is not None:
        extra.append("gate.bias")
    if getattr(block, "jitter_noise", 0):
        extra.append(f"jitter_noise={block.jitter_noise} (set router_jitter_noise=0)")
    if extra:
        raise ValueError(f"{api}: {type(block).__name__} has {', '.join(extra)}, which "
                         f"ExpertParallelMoE does not compute; {_KEEP_HF_ROUTER}")
    top_k = getattr(block, "top_k", None) or getattr(gate, "top_k", None)
    if top_k is None:
        raise TypeError(f"{api}: {type(block).__name__} has no top_k attribute (block or gate)")
    # Mixtral always renormalizes; Qwen2/3-MoE and OLMoE say so in norm_topk_prob
    renormalize = bool(getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", True)))
    _check_router(gate, router, int(top_k), renormalize, api)
    return router, w13, w2, int(top_k), renormalize


def _check_router(gate: nn.Module, router: torch.Tensor, top_k: int, renormalize: bool,
                  api: str) -> None:
    """Run the Hugging Face router on a few random tokens and check that ``topk_route`` of its
    logits picks the same experts with the same weights (sigmoid or group-limited routing,
    a bias on the scores or scaled weights would not). Materialized routers returning
    ``(logits, weights, indices)`` only: a meta router cannot run."""
    if router.is_meta:
        return
    probe = torch.randn(8, router.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = gate(probe.to(router))
    if not (isinstance(out, tuple) and len(out) == 3):
        return
    logits, weights, idx = out
    want_idx, want_weights, _ = topk_route(logits.float(), top_k, renormalize=renormalize)

    def dense(i, w):  # [T, E]: each token's weight per expert, whatever the order of its k
        return torch.zeros(len(probe), router.shape[0]).scatter(1, i.long().cpu(), w.float().cpu())

    if not torch.allclose(dense(idx, weights), dense(want_idx, want_weights), rtol=1e-2, atol=1e-3):
        raise ValueError(f"{api}: {type(gate).__name__} does not route as fusedpar's topk_route "
                         f"(softmax over the E logits, top-{top_k}"
                         f"{', renormalized' if renormalize else ''}); {_KEEP_HF_ROUTER}")
