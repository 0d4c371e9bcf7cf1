"""Backend selection shared by every op (docs/design.md §2).

An op lists its backends in priority order; each says why it cannot take a call
(``not_supported_reasons``). On CPU the first with no reasons runs; on a GPU, where a call
type has a ``bucket()``, the one ``tuning.choose`` picks among them (measured, the default
table, else the priority order). ``backend=`` forces one (and fails loudly if it refuses);
``FUSEDPAR_BACKEND`` forces one for every op that has it (a name that no op has is an error).
Reasons depend only on what is identical on every rank (device type, dtype, shape, group,
installed extensions; collective checks are agreed and cached per group), and a tuned
choice is agreed by the group, so every rank picks the same backend; the choice is cached
per (op, group, device type, dtype) and, where tuned, device and shape bucket.

What a backend implements depends on its op's kind (every backend of one op is of one kind):

- :class:`RunBackend`: ``run(call)`` returns the op's result (the collectives, the fused
  matmuls, grouped_mm, moe_experts);
- :class:`AttentionBackend`: ``forward(call)`` returns ``(out, lse)`` and
  ``backward(call, out, lse, dout, dlse)`` the input gradients (flash_attention,
  ring_attention: the op's autograd calls the backward of the backend that ran forward;
  ``dlse`` None when the lse has no gradient);
- :class:`ExchangeBackend`: ``run(call)`` returns ``(rows, handle)`` and
  ``combine(y, handle)`` sends rows back (moe_dispatch / moe_combine: the handle carries
  the backend's layout from one to the other);
- :class:`LoopbackBackend`, besides its kind: ``run_views(bufs, ...)`` runs every rank's
  part in one process over loopback buffers (what the ``*_loopback`` functions call); the
  symmetric-memory collectives get ``run`` and ``run_views`` from
  ``protocol.SymmetricBackend`` and implement ``pull``.
"""

from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

import torch

from ..comm import settings, symmetric
from ..comm.symmetric import capturing
from ..errors import BackendNotSupportedError, FusedparError
from . import registry, tuning


class Backend:
    """One way to run an op. Subclasses set ``name`` and implement the methods of their
    op's kind (the protocols below); ``not_supported_reasons`` says why a call cannot run
    here (empty: it can). ``plan(call)``: what runs every call of ``call``'s signature
    (``Plans``): by default ``run`` on a call made around the call's tensors."""

    name = ""

    def not_supported_reasons(self, call) -> list[str]:
        return []

    def plan(self, call):
        make = call.maker()
        return lambda *tensors: self.run(make(*tensors))


class Plans:
    """An op's plans by signature key (shapes, strides, dtypes, device, group, arguments),
    so that a call of a signature seen before does no check, no dispatch and no host-side
    setup: ``get(key)`` (None: ``make`` one). A plan is a callable taking the call's tensors;
    one that holds a symmetric buffer follows it when it grows (``symmetric.follow``). All
    are dropped when the settings are read again (``settings.refresh``) or the buffers
    released (``comm.release_buffers``); at most ``MAX`` are kept (varying shapes make new
    keys)."""

    MAX = 256

    def __init__(self, op: str):
        self.op = op
        self._plans: dict = {}
        self._version = None

    def get(self, key):
        version = (settings.get().version, symmetric.generation)
        if self._version != version:
            self._plans.clear()
            self._version = version
        return self._plans.get(key)

    def make(self, key, device: torch.device, build):
        """``build()``'s plan for ``key``, kept. Making one runs checks, may agree on a
        backend across ranks and allocates: never while a CUDA graph is captured."""
        if capturing(device):
            raise FusedparError(
                f"fusedpar.{self.op}: the first call of this signature (shapes, strides, dtypes, "
                "arguments) is being captured in a CUDA graph, but it checks its inputs, may agree "
                "with the other ranks and allocates; run one eager call of it before capturing")
        if len(self._plans) >= self.MAX:
            self._plans.clear()
        plan = self._plans[key] = build()
        return plan


@runtime_checkable
class RunBackend(Protocol):
    def run(self, call): ...


@runtime_checkable
class AttentionBackend(Protocol):
    def forward(self, call): ...

    def backward(self, call, out, lse, dout, dlse): ...


@runtime_checkable
class ExchangeBackend(Protocol):
    def run(self, call): ...

    def combine(self, y, handle): ...


@runtime_checkable
class LoopbackBackend(Protocol):
    def run_views(self, bufs, *args): ...


def kind(backend: Backend) -> type:
    """The protocol ``backend`` implements (the most specific of the three kinds)."""
    for protocol in (AttentionBackend, ExchangeBackend, RunBackend):
        if isinstance(backend, protocol):
            return protocol
    raise TypeError(f"backend {backend.name!r} ({type(backend).__name__}) implements none of "
                    "run, forward/backward, run/combine")


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` as torch's matmul and attention see them: inside a ``torch.autocast``
    region of their device type, fp32/fp16/bf16 tensors are cast to its dtype (so fp32
    weights meet the bf16 activations of the ops before; the casts are differentiable);
    outside one, or fp64, unchanged (so are non-tensors: the op's checks name them). The
    matmul and attention ops call this first, then run under ``autocast_off``."""
    kind = _autocast_device(tensors[0])
    if kind is None or not torch.is_autocast_enabled(kind):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in tensors)


_NO_CONTEXT = contextlib.nullcontext()


def autocast_off(t: torch.Tensor):
    """A region where autocast is off on ``t``'s device: an op's own math (the reference
    backends' fp32 accumulation) keeps the dtypes it chose. Where autocast is off already,
    no region at all (entering torch.autocast costs a few dozen Python calls)."""
    kind = _autocast_device(t)
    if kind is None or not torch.is_autocast_enabled(kind):
        return _NO_CONTEXT
    return torch.autocast(kind, enabled=False)


def _autocast_device(t) -> str | None:
    kind = t.device.type if isinstance(t, torch.Tensor) else None
    return kind if kind in ("cuda", "cpu") else None


def known_backends() -> list[str]:
    """Every backend name of every registered op (what ``FUSEDPAR_BACKEND`` may name)."""
    return registry.backend_names()


def check_backend_name(name: str | None, what: str = "backend") -> None:
    """Fail at once on a backend name that no op has (a typo would otherwise surface only at
    the first call, or never)."""
    if name and name not in known_backends():
        raise BackendNotSupportedError(
            f"{what}={name!r} names no fusedpar backend; choose one of {known_backends()}")


class Dispatcher:
    """An op's backends in priority order: ``select(call)`` runs the first that takes the
    call, or the one ``backend=`` / ``FUSEDPAR_BACKEND`` forces."""

    def __init__(self, op: str, backends: list[Backend]):
        kinds = sorted({kind(b).__name__ for b in backends})
        if len(kinds) != 1:
            raise TypeError(f"fusedpar.{op}: its backends must all be of one kind, got {kinds}")
        self.op = op
        self.backends = {b.name: b for b in backends}
        self._cache: dict[tuple, Backend] = {}

    @property
    def names(self) -> list[str]:
        return list(self.backends)

    def carry(self, name: str) -> str:
        """``name`` if this op has that backend, else "" (auto): how a backward pass passes
        its forward op's backend on to another op."""
        return name if name in self.backends else ""

    def forced_name(self, requested: str) -> str:
        if requested:
            if requested not in self.backends:
                raise BackendNotSupportedError(
                    f"fusedpar.{self.op}: backend={requested!r} does not exist; "
                    f"choose one of {self.names}"
                )
            return requested
        env = settings.get().backend
        check_backend_name(env, "FUSEDPAR_BACKEND")
        return env if env in self.backends else ""

    def select(self, call, requested: str = "") -> Backend:
        forced = self.forced_name(requested)
        key = (call.cache_key(), forced,
               (str(tuning.tensor(call).device), call.bucket()) if tuning.applies(call) else None)
        if key not in self._cache:
            self._cache[key] = self._choose(call, forced)
        return self._cache[key]

    def _choose(self, call, forced: str) -> Backend:
        if forced:
            reasons = self.backends[forced].not_supported_reasons(call)
            if reasons:
                raise BackendNotSupportedError(
                    f"fusedpar.{self.op}: backend {forced!r} was forced but cannot run "
                    f"{call.describe()}: " + "; ".join(reasons)
                )
            return self.backends[forced]
        rejected, available = [], []
        tuned = tuning.applies(call)
        for backend in self.backends.values():
            reasons = backend.not_supported_reasons(call)
            if not reasons and not tuned:
                return backend  # untuned: the priority order
            if not reasons:
                available.append(backend.name)
            else:
                rejected.append(f"  {backend.name}: " + "; ".join(reasons))
        if available:
            return self.backends[tuning.choose(self, call, available)]
        raise BackendNotSupportedError(
            f"fusedpar.{self.op}: no backend can run {call.describe()}:\n" + "\n".join(rejected)
        )

    def availability(self, call) -> dict[str, list[str]]:
        """Every backend's reasons for ``call`` (empty list = available); for ``fusedpar info``."""
        return {name: b.not_supported_reasons(call) for name, b in self.backends.items()}
