"""Tensor-parallel linear layers (Megatron / torch DTensor conventions) on fusedpar's fused ops.

Plain-PyTorch equivalent (W = tensor-parallel size, r = this rank, ``full`` an ``nn.Linear``)::

    # ColumnParallelLinear: this rank owns output features [r*out/W, (r+1)*out/W)
    weight = full.weight.chunk(W, 0)[r]; bias = full.bias.chunk(W, 0)[r]
    x = torch.cat(all_gather(x_shard), dim=seq_dim) if sequence_parallel else x   # replicated
    y_local = F.linear(x, weight, bias)                                 # [..., out/W]

    # RowParallelLinear: this rank owns input features [r*in/W, (r+1)*in/W)
    weight = full.weight.chunk(W, 1)[r]; bias = full.bias                # bias replicated
    partial = x_local @ weight.T                                        # x_local: [..., in/W]
    y = (reduce_scatter(partial, seq_dim) if sequence_parallel else all_reduce(partial)) + bias

Activation layout: ``[batch, seq, hidden]`` (3-D) or ``[tokens, hidden]`` (2-D). The
sequence dim is the second-to-last one (1 for 3-D, 0 for 2-D) unless ``sequence_dim`` says
otherwise (e.g. ``sequence_dim=0`` for Megatron's ``[seq, batch, hidden]``). With
``sequence_parallel=True`` activations outside the column→row region are split along that
dim (``[B, S/W, H]``); the column layer's gather is fused with its matmul
(``fusedpar.ops.all_gather_matmul``) and the row layer's reduce-scatter with its matmul
(``fusedpar.ops.matmul_reduce_scatter``).

Parameters are DTensors on the tensor-parallel axis (a 1-D ``DeviceMesh``: the one passed
as ``group``, ``mesh["tp"]`` of a named mesh, or one made from the process group): the
column layer's weight and bias ``Shard(0)``, the row layer's weight ``Shard(1)`` and bias
``Replicate()``, as torch's ``ColwiseParallel`` / ``RowwiseParallel`` leave them. So
``state_dict()``, ``torch.distributed.checkpoint`` and FSDP2's 2-D sharding see the global
parameter and its placement; the forward computes on ``.to_local()`` with the fused ops.

Gradients: a replicated tensor that feeds rank-local work (the input of a non-SP column
layer, a row layer's bias under SP, a norm's weight under SP) gets the sum of every rank's
gradient (an all-reduce in backward), so every rank ends the backward pass with the same,
complete gradient — the same numbers a single process computes. Nothing is left for
DDP/FSDP to fix over the tensor-parallel group.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..comm import resolve_group
from ..ops import all_gather_matmul, matmul_reduce_scatter
from ..ops.backend import check_backend_name
from ..ops.float8_scales import recipe as float8_recipe
from .float8_linear import column_parallel_float8_outputs, row_parallel_float8

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SharedGather",
    "sync_replicated_grads",
    "tp_device_mesh",
]


_MESHES: dict[tuple[str, str], DeviceMesh] = {}


def tp_device_mesh(group, device_type: str) -> DeviceMesh:
    """The 1-D ``DeviceMesh`` that TP parameters live on: ``group`` itself when it is a
    1-D mesh, ``mesh[axis]`` for ``(mesh, axis)`` (so FSDP2 sees a submesh of its own root
    mesh and composes 2-D), else one made once per group from the process group."""
    if isinstance(group, DeviceMesh) and group.ndim == 1:
        return group
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        resolve_group(group)  # checks the axis
        return group[0][group[1]]
    pg = resolve_group(group)
    key = (pg.group_name, device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(pg, device_type)
    return _MESHES[key]


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a DTensor (differentiable); a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


# ---- the two conjugate collectives of the tensor-parallel region -------------------------


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Out-of-place sum over the group (functional collective: traceable, any backend)."""
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (Megatron's
    ``copy_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group_name), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward sums over the group; identity backward (Megatron's
    ``reduce_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group_name):
        return _all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``x`` itself; its gradient is all-reduced over the group in backward."""
    return _CopyToTP.apply(x, group_name)


def reduce_from_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``all_reduce(x)``; the gradient passes through unchanged."""
    return _ReduceFromTP.apply(x, group_name)


# ---- layers -------------------------------------------------------------------------------


class TPLinear(nn.Module):
    """What both layers share: the group, the sizes, the sequence dim, the backend."""

    def __init__(self, in_features: int, out_features: int, group, sequence_parallel: bool,
                 sequence_dim: int | None, backend: str | None, float8: str | None = None):
        super().__init__()
        pg = resolve_group(group)
        # what the parameters' mesh is made from (a name, not the unpicklable group)
        self._group_arg = group if isinstance(group, (DeviceMesh, tuple)) else pg.group_name
        self.group_name: str = pg.group_name
        self.tp_size: int = dist.get_world_size(pg)
        self.tp_rank: int = dist.get_rank(pg)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = sequence_dim
        check_backend_name(backend)  # a typo fails here, not at the first forward
        self.backend = backend
        if float8 is not None:
            float8_recipe(float8)  # an unknown recipe fails here
            if not self.sequence_parallel:
                raise ValueError(f"{type(self).__name__}(float8={float8!r}) needs "
                                 "sequence_parallel=True: float8 runs through the fused fp8 ops, "
                                 "which gather or reduce-scatter the sequence")
        self.float8 = float8

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The tensor-parallel group (the layer keeps only its name)."""
        return resolve_group(self.group_name)

    def _param(self, local_tensor: torch.Tensor, placement: Placement, requires_grad: bool = True):
        """A Parameter holding the DTensor with this local part on the TP mesh (made for the
        tensor's device type on first use)."""
        mesh = getattr(self, "device_mesh", None)
        device_type = "cuda" if local_tensor.is_meta and torch.cuda.is_available() else \
            ("cpu" if local_tensor.is_meta else local_tensor.device.type)
        if mesh is None or mesh.device_type != device_type:
            mesh = self.device_mesh = tp_device_mesh(self._group_arg, device_type)
        dt = DTensor.from_local(local_tensor, mesh, [placement], run_check=False)
        return nn.Parameter(dt, requires_grad=requires_grad)

    def _check_divisible(self, size: int, what: str) -> None:
        if size % self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: {what}={size} is not divisible by the tensor-parallel "
                f"size {self.tp_size} (group {self.group_name!r}); every rank must own an equal "
                "shard, so pick a size that is a multiple of it"
            )

    def _seq_dim(self, x: torch.Tensor) -> int:
        if x.dim() < 2:
            raise ValueError(
                f"{type(self).__name__}(sequence_parallel=True) needs a [tokens, hidden] or "
                f"[batch, seq, hidden] input, got shape {tuple(x.shape)}"
            )
        dim = x.dim() - 2 if self.sequence_dim is None else self.sequence_dim % x.dim()
        if dim == x.dim() - 1:
            raise ValueError(f"{type(self).__name__}: sequence_dim={self.sequence_dim} is the "
                             f"hidden (last) dim of an input of shape {tuple(x.shape)}")
        return dim

    def _init_full(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``nn.Linear(in, out)``'s initial weight and bias, drawn from the same generator
        calls in the same order (so a seeded rank shards exactly what nn.Linear would hold)."""
        weight = torch.empty(self.out_features, self.in_features, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if self.bias is None:
            return weight, None
        bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
        return weight, torch.empty(self.out_features, device=device, dtype=dtype).uniform_(-bound, bound)

    def reset_parameters(self) -> None:
        """Draw ``nn.Linear``'s full initial weight/bias and keep this rank's shard. Seed
        every rank of the group identically first (replicated shards must agree); a meta
        module stays uninitialized."""
        if self.weight.is_meta:
            return
        weight, bias = self._init_full(self.weight.device, self.weight.dtype)
        with torch.no_grad():
            local(self.weight).copy_(self.shard_weight(weight))
            if self.bias is not None:
                local(self.bias).copy_(self.shard_bias(bias))

    @classmethod
    def from_linear(cls, linear: nn.Module, group=None, *, sequence_parallel: bool = False,
                    sequence_dim: int | None = None, backend: str | None = None,
                    float8: str | None = None):
        """A new layer holding this rank's shard of ``linear``'s weight (and bias), on its
        device and dtype, so ``parent.proj = cls.from_linear(parent.proj, group)`` swaps it
        in place. ``linear`` is any module with a ``weight`` ``[out, in]`` (``nn.Linear``)
        and an optional ``bias``; it is left untouched (the shard is a copy). ``float8``:
        a torchao recipe to compute in (see the layers' docstrings)."""
        weight = linear.weight
        if weight.dim() != 2:
            raise ValueError(f"{cls.__name__}.from_linear: expected a [out, in] weight, got "
                             f"shape {tuple(weight.shape)}")
        bias = getattr(linear, "bias", None)
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias is not None, group,
                    sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                    backend=backend, float8=float8, device="meta", dtype=weight.dtype)
        with torch.no_grad():
            layer.weight = layer._param(layer.shard_weight(weight.detach()).clone(),
                                        layer.WEIGHT_PLACEMENT, weight.requires_grad)
            if bias is not None:
                layer.bias = layer._param(layer.shard_bias(bias.detach()).clone(),
                                          layer.BIAS_PLACEMENT, bias.requires_grad)
        layer.train(linear.training)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}, local_weight={tuple(local(self.weight).shape)}"
                + (f", backend={self.backend!r}" if self.backend else "")
                + (f", float8={self.float8!r}" if self.float8 else ""))


class ColumnParallelLinear(TPLinear):
    """``nn.Linear(in_features, out_features)`` split by output features over ``group``;
    the same as (this rank's columns of the output)::

        x = torch.cat(all_gather(x, group), dim=seq_dim) if sequence_parallel else x
        return F.linear(x, full.weight, full.bias).chunk(W, dim=-1)[rank]

    - ``weight``: ``[out/W, in]`` (rows ``r*out/W ..`` of the full weight), ``bias``: ``[out/W]``.
    - ``sequence_parallel=False``: ``x`` is replicated ``[..., in]``; forward is a local
      matmul, backward all-reduces ``x``'s gradient over the group.
    - ``sequence_parallel=True``: ``x`` is this rank's sequence shard ``[B, S/W, in]`` (or
      ``[T/W, in]``); one ``fusedpar.ops.all_gather_matmul`` gathers it along the sequence
      dim while multiplying (``backend`` is passed to it).
    - Output: ``[..., S, out/W]`` (the full sequence, this rank's output features).
    - ``float8`` (a torchao recipe, with ``sequence_parallel=True``): the gather and matmul run
      in fp8 as torchao's ``Float8Linear`` computes (``fusedpar.ops.all_gather_scaled_matmul``:
      :func:`~fusedpar.nn.float8_linear.column_parallel_float8`), the input cast before the
      gather, so the gather moves fp8.

    Layers reading the same input (q/k/v, gate/up) can share one gather: see
    :meth:`share_gather` / :class:`SharedGather`. ``group``: ProcessGroup, 1-D DeviceMesh,
    ``(mesh, axis)``, group name or None (world). New layers are initialized like
    ``nn.Linear`` (see :meth:`reset_parameters`); :meth:`from_linear` shards an existing one.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, *,
                 sequence_parallel: bool = False, sequence_dim: int | None = None,
                 backend: str | None = None, float8: str | None = None, device=None, dtype=None):
        super().__init__(in_features, out_features, group, sequence_parallel, sequence_dim, backend,
                         float8)
        self._check_divisible(out_features, "out_features")
        self.out_features_per_rank = out_features // self.tp_size
        factory = {"device": device, "dtype": dtype}
        self.weight = self._param(torch.empty(self.out_features_per_rank, in_features, **factory),
                                  self.WEIGHT_PLACEMENT)
        self.bias = self._param(torch.empty(self.out_features_per_rank, **factory),
                                self.BIAS_PLACEMENT) if bias else None
        self._shared_gather: SharedGather | None = None
        self.reset_parameters()

    WEIGHT_PLACEMENT, BIAS_PLACEMENT = Shard(0), Shard(0)

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full ``[out, in]`` weight (a view)."""
        return full.chunk(self.tp_size, dim=0)[self.tp_rank]

    def shard_bias(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp_size, dim=0)[self.tp_rank]

    @staticmethod
    def share_gather(*layers: ColumnParallelLinear) -> SharedGather:
        """Let ``layers`` (same group, input size and settings) share one input gather;
        returns the :class:`SharedGather` (``SharedGather(*layers)``)."""
        return SharedGather(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._shared_gather is not None:
            out = self._shared_gather._take(self, x)
            if out is not None:
                return out
        return _column_outputs([self], x)[0]


class RowParallelLinear(TPLinear):
    """``nn.Linear(in_features, out_features)`` split by input features over ``group``;
    the same as::

        y = F.linear(torch.cat(all_gather(x_local, group), dim=-1), full.weight, full.bias)
        return y.chunk(W, dim=seq_dim)[rank] if sequence_parallel else y

    - ``weight``: ``[out, in/W]`` (columns ``r*in/W ..`` of the full weight); ``bias``:
      ``[out]``, replicated, added once after the reduction.
    - Input: this rank's feature shard ``[..., in/W]`` (a column layer's output).
    - ``sequence_parallel=False``: the partial products are all-reduced; the output
      ``[..., out]`` is replicated.
    - ``sequence_parallel=True``: one ``fusedpar.ops.matmul_reduce_scatter`` reduces and
      splits along the sequence dim: output ``[B, S/W, out]`` (2-D or 3-D input, sequence
      length divisible by W). Each rank adds the bias to its own tokens only, so the bias
      gradient is all-reduced over the group in backward.
    - ``float8`` (a torchao recipe, with ``sequence_parallel=True``): the matmul runs in fp8 as
      torchao's ``Float8Linear`` computes, its partials reduce-scattered in fp32
      (``fusedpar.ops.scaled_matmul_reduce_scatter``:
      :func:`~fusedpar.nn.float8_linear.row_parallel_float8`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, *,
                 sequence_parallel: bool = False, sequence_dim: int | None = None,
                 backend: str | None = None, float8: str | None = None, device=None, dtype=None):
        super().__init__(in_features, out_features, group, sequence_parallel, sequence_dim, backend,
                         float8)
        self._check_divisible(in_features, "in_features")
        self.in_features_per_rank = in_features // self.tp_size
        factory = {"device": device, "dtype": dtype}
        self.weight = self._param(torch.empty(out_features, self.in_features_per_rank, **factory),
                                  self.WEIGHT_PLACEMENT)
        self.bias = self._param(torch.empty(out_features, **factory), self.BIAS_PLACEMENT) if bias else None
        self.reset_parameters()

    WEIGHT_PLACEMENT, BIAS_PLACEMENT = Shard(1), Replicate()

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full ``[out, in]`` weight (a view)."""
        return full.chunk(self.tp_size, dim=1)[self.tp_rank]

    def shard_bias(self, full: torch.Tensor) -> torch.Tensor:
        return full  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features_per_rank:
            raise ValueError(
                f"RowParallelLinear: expected this rank's shard of the input features "
                f"[..., {self.in_features_per_rank}] (in_features={self.in_features} / tp "
                f"{self.tp_size}), got shape {tuple(x.shape)}"
            )
        weight, bias = local(self.weight), local(self.bias)
        if self.float8:
            y = row_parallel_float8(x, weight, self._seq_dim(x), self.group_name, recipe=self.float8,
                                    backend=self.backend)
            return y if bias is None else y + copy_to_tp(bias, self.group_name)
        if self.sequence_parallel:
            y = matmul_reduce_scatter(x, weight.t(), "sum", self._seq_dim(x),
                                      self.group_name, backend=self.backend)
            if bias is not None:
                y = y + copy_to_tp(bias, self.group_name)
            return y
        y = reduce_from_tp(F.linear(x, weight), self.group_name)
        return y if bias is None else y + bias


def _column_outputs(layers: list[ColumnParallelLinear], x: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's output for the input ``x`` (a sequence shard under SP, else replicated)
    with one gather / one backward all-reduce for all of them."""
    head = layers[0]
    if x.shape[-1] != head.in_features:
        raise ValueError(f"ColumnParallelLinear: expected an input [..., {head.in_features}], "
                         f"got shape {tuple(x.shape)}")
    if not head.sequence_parallel:
        x = copy_to_tp(x, head.group_name)
        return [F.linear(x, local(layer.weight), local(layer.bias)) for layer in layers]
    if head.float8:
        outs, _ = column_parallel_float8_outputs(x, [local(layer.weight) for layer in layers],
                                                 head._seq_dim(x), head.group_name, recipe=head.float8,
                                                 backend=head.backend)
    else:
        _, outs = all_gather_matmul(x, [local(layer.weight).t() for layer in layers], head._seq_dim(x),
                                    head.group_name, return_A=False, backend=head.backend)
    return [out if layer.bias is None else out + local(layer.bias) for out, layer in zip(outs, layers)]


class SharedGather:
    """Several :class:`ColumnParallelLinear` layers that read the same input, served by one
    gather (``sequence_parallel=True``: one ``all_gather_matmul`` with ``Bs = [w.T for each
    layer]``) or one backward all-reduce of the input gradient (``sequence_parallel=False``).
    The same as ``[layer(x) for layer in layers]``. Two ways to use it:

    1. Your own forward: ``q, k, v = shared(x)``.
    2. An existing module whose forward calls the layers itself (a Hugging Face attention or
       MLP): hand that forward ``shared.prepare_input(x)`` instead of ``x`` (or let
       :meth:`register_input_hook` do it). Under SP it returns the *gathered* input
       ``[B, S, H]`` (so code that reads ``hidden_states.shape`` sees the full sequence) and
       computes every layer's output in the same op; each layer, called with that tensor,
       returns its precomputed output (once; a further call computes ``F.linear`` locally,
       with the gradient still routed through the op). Without SP it returns ``x`` behind
       one ``copy_to_tp``.

    Layers must have the same group, ``in_features``, ``sequence_parallel``,
    ``sequence_dim`` and ``backend``; a layer belongs to at most one ``SharedGather``. The
    precomputed outputs are held until their layers take them (or the next
    ``prepare_input``); :meth:`clear` drops them. Not an ``nn.Module``: it owns no
    parameters and leaves the ``state_dict`` unchanged.
    """

    def __init__(self, *layers: ColumnParallelLinear):
        if not layers:
            raise ValueError("SharedGather: pass at least one ColumnParallelLinear")
        head = layers[0]
        for i, layer in enumerate(layers):
            if not isinstance(layer, ColumnParallelLinear):
                raise TypeError(f"SharedGather: layer {i} is a {type(layer).__name__}, not a "
                                "ColumnParallelLinear")
            if layer._shared_gather is not None:
                raise ValueError(f"SharedGather: layer {i} already shares a gather")
            for attr in ("group_name", "in_features", "sequence_parallel", "sequence_dim", "backend",
                         "float8"):
                if getattr(layer, attr) != getattr(head, attr):
                    raise ValueError(f"SharedGather: layer {i} has {attr}={getattr(layer, attr)!r} "
                                     f"but layer 0 has {getattr(head, attr)!r}; shared layers "
                                     "must agree")
        if len(set(map(id, layers))) != len(layers):
            raise ValueError("SharedGather: a layer is listed twice")
        self.layers = list(layers)
        # the last prepared input: layers called on it skip their own collective (kept on
        # this object, not set on the tensor, so a compiled block has no graph break; a weak
        # reference, so it is not kept alive after the step, e.g. under checkpointing)
        self._prepared: weakref.ref | None = None
        self._stash: dict[int, torch.Tensor] = {}
        for layer in layers:
            layer._shared_gather = self

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return _column_outputs(self.layers, x)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """The tensor to pass, instead of ``x``, to a forward that calls the layers on it."""
        self._prepared = None
        self.clear()
        head = self.layers[0]
        if head.sequence_parallel:
            if x.shape[-1] != head.in_features:
                raise ValueError(f"SharedGather: expected an input [..., {head.in_features}], "
                                 f"got shape {tuple(x.shape)}")
            weights = [local(layer.weight) for layer in self.layers]
            if head.float8:  # the gathered input in fp8: what a forward reads of it is its shape
                outs, gathered = column_parallel_float8_outputs(
                    x, weights, head._seq_dim(x), head.group_name, recipe=head.float8,
                    backend=head.backend, return_gathered=True)
            else:
                gathered, outs = all_gather_matmul(x, [w.t() for w in weights], head._seq_dim(x),
                                                   head.group_name, return_A=True, backend=head.backend)
            self._stash = {i: out if layer.bias is None else out + local(layer.bias)
                           for i, (out, layer) in enumerate(zip(outs, self.layers))}
            prepared = gathered
        else:
            prepared = copy_to_tp(x, head.group_name)
        self._prepared = weakref.ref(prepared)
        return prepared

    def register_input_hook(self, module: nn.Module, arg_name: str = "hidden_states"):
        """Call :meth:`prepare_input` on ``module``'s input before each forward: its first
        positional argument, else the keyword ``arg_name``. Returns the hook's handle."""

        return module.register_forward_pre_hook(_InputHook(self, arg_name), with_kwargs=True)

    def clear(self) -> None:
        """Drop the outputs that no layer has taken yet."""
        self._stash = {}

    def __getstate__(self):  # copies (deepcopy, pickle) start with nothing prepared
        return {**self.__dict__, "_prepared": None, "_stash": {}}

    def _take(self, layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor | None:
        """The layer's output for a prepared input, or None if ``x`` was not prepared here."""
        if self._prepared is None or x is not self._prepared():
            return None
        index = self.layers.index(layer)
        if index in self._stash:
            out = self._stash.pop(index)
            if not self._stash:
                self.clear()
            return out
        if layer.float8:
            raise RuntimeError("SharedGather: a float8 layer was called twice on one prepared input "
                               "(its gathered input is fp8, held for its shape); call the layers once "
                               "each, or build them without float8")
        return F.linear(x, local(layer.weight), local(layer.bias))  # x is already gathered / replicated


class _InputHook:
    """A forward pre-hook that swaps a module's input for ``shared.prepare_input(input)``.
    An object, not a closure, so ``copy.deepcopy`` of the model points the copy's hook at
    the copy's :class:`SharedGather`."""

    def __init__(self, shared: SharedGather, arg_name: str):
        self.shared, self.arg_name = shared, arg_name

    def __call__(self, module, args, kwargs):
        if args:
            return (self.shared.prepare_input(args[0]), *args[1:]), kwargs
        if self.arg_name in kwargs:
            return args, {**kwargs, self.arg_name: self.shared.prepare_input(kwargs[self.arg_name])}
        raise TypeError(f"SharedGather input hook on {type(module).__name__}: no positional "
                        f"argument and no {self.arg_name!r} keyword to gather")


# ---- replicated parameters under sequence parallelism ----------------------------------------


class _Handles:
    """What :func:`sync_replicated_grads` returns: ``remove()`` takes its hooks off again."""

    def __init__(self, handles, modules):
        self.handles, self.modules = handles, modules

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for module in self.modules:
            module._fusedpar_synced_over = None
        self.handles, self.modules = [], []


class _ParameterSwap:
    """The hooks of :func:`sync_replicated_grads` on one module: ``pre`` puts
    ``copy_to_tp(p)`` in place of each trainable parameter, ``post`` (also after a forward
    that raised) puts the Parameters back. The swapped-out Parameters live on this object,
    not in a closure's default argument: dynamo in torch 2.11 does not replay mutations of
    such a default, so a compiled block kept the swapped tensors as its parameters and its
    norms got no gradient. An object also follows ``copy.deepcopy`` of the model."""

    def __init__(self, group_name: str):
        self.group_name = group_name
        self.saved: list[dict[str, nn.Parameter]] = []

    def pre(self, module, args):
        swapped = {}
        if torch.is_grad_enabled():
            for pname, p in list(module._parameters.items()):
                if p is not None and p.requires_grad:
                    swapped[pname] = p
                    module._parameters[pname] = copy_to_tp(p, self.group_name)
        self.saved.append(swapped)

    def post(self, module, args, output):
        if self.saved:
            module._parameters.update(self.saved.pop())


def sync_replicated_grads(module: nn.Module, group=None, *, skip: tuple[nn.Module, ...] = ()) -> _Handles:
    """Make the gradients of ``module``'s parameters (and its submodules') the sum over
    ``group``, for modules whose weights are replicated but that run on different data on
    each rank — the norms of a sequence-parallel block. The same as, after every backward::

        for p in module.parameters(): dist.all_reduce(p.grad, group=group)   # this step's part

    Parameters of :class:`ColumnParallelLinear` / :class:`RowParallelLinear` submodules are
    skipped (they are shards; a row layer sums its own bias gradient under SP).

    How: a forward pre-hook hands the forward ``copy_to_tp(p)`` in place of each parameter
    ``p`` (restored by a forward hook), so the all-reduce is part of the autograd graph. It
    therefore sums only this backward's contribution (gradient accumulation and activation
    checkpointing stay correct), and it reads the parameter at call time, so it keeps
    working when the Parameter objects are replaced (``to_empty``, FSDP2's unsharded
    parameters), where tensor hooks registered on the old objects would be lost. The
    ``state_dict`` is unchanged. DDP/FSDP reduce over the data-parallel ranks only, never
    over ``group``: this is what sums over it. ``skip``: submodules left out, with theirs
    (e.g. an MoE block whose experts see every rank's tokens through the expert-parallel
    exchange). Returns a handle whose ``remove()`` undoes it.
    """
    name = resolve_group(group).group_name
    skipped = {id(sub) for part in skip for sub in part.modules()}
    handles, modules = [], []
    for sub in module.modules():
        if (isinstance(sub, TPLinear) or id(sub) in skipped
                or not any(True for _ in sub.parameters(recurse=False))):
            continue  # TP layers' parameters are shards (a row layer syncs its own bias)
        if getattr(sub, "_fusedpar_synced_over", None) is not None:
            raise ValueError(f"sync_replicated_grads: {type(sub).__name__} is already synced over "
                             f"group {sub._fusedpar_synced_over!r}")
        sub._fusedpar_synced_over = name
        swap = _ParameterSwap(name)
        handles.append(sub.register_forward_pre_hook(swap.pre))
        handles.append(sub.register_forward_hook(swap.post, always_call=True))
        modules.append(sub)
    return _Handles(handles, modules)
