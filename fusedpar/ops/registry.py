"""Every op, declared once: ``register(DISPATCHER, functions, ...)`` at the end of its module.

``fusedpar.ops`` exports the registered functions, ``fusedpar info`` evaluates each op's
example call, ``fusedpar check`` runs each op's check cases, ``FUSEDPAR_BACKEND`` is checked
against the registered backend names, and the tests take backend names from here. Adding
an op is its module, one line in ``fusedpar/ops/__init__.py``'s ``OP_MODULES``, its tests
and its benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # backend.py imports this module: no import back at run time
    from .backend import Dispatcher

EXAMPLE_WORLD = 4  # the world size of the example calls (loopback, group=None)


@dataclass(frozen=True)
class OpSpec:
    """What the rest of fusedpar needs to know about one op.

    ``dispatcher``: its backends in priority order (``dispatcher.op`` is the op's name, that
    of ``torch.ops.fusedpar.<name>`` where it is a custom op). ``functions``: the public
    functions ``fusedpar.ops`` exports (the op, its ``*_loopback`` variant, ...).
    ``example(device)``: a small float32 call object as a loopback of ``EXAMPLE_WORLD``
    ranks, for ``fusedpar info``; None where a call needs a process group. ``oracle``: the
    backend that is the docstring's plain-torch code, the truth the others are checked
    against; None where the op has none (its tests compare with plain torch directly).
    ``checks``: the module holding the op's ``fusedpar check`` cases (its ``CASES``, a list
    of ``fusedpar.testing.cases.Case``), named rather than imported so that ops never
    import test code; "" for none.
    """

    dispatcher: Dispatcher
    functions: tuple[Callable, ...]
    example: Callable | None = None
    oracle: str | None = "reference"
    checks: str = ""

    @property
    def name(self) -> str:
        return self.dispatcher.op

    @property
    def backends(self) -> list[str]:
        """The backend names, in the dispatcher's priority order."""
        return self.dispatcher.names


_SPECS: dict[str, OpSpec] = {}


def register(dispatcher: Dispatcher, functions, *, example: Callable | None = None,
             oracle: str | None = "reference", checks: str = "") -> OpSpec:
    """Declare an op (see :class:`OpSpec` for the arguments); returns its spec."""
    spec = OpSpec(dispatcher, tuple(functions), example, oracle, checks)
    if spec.name in _SPECS:
        raise ValueError(f"fusedpar op {spec.name!r} is registered twice; each op module "
                         "calls register() once for its dispatcher")
    if oracle is not None and oracle not in spec.backends:
        raise ValueError(f"fusedpar.{spec.name}: oracle={oracle!r} is not one of its backends "
                         f"{spec.backends}; name one of them or pass None")
    taken = {f.__name__: s.name for s in _SPECS.values() for f in s.functions}
    clashes = sorted(f.__name__ for f in spec.functions if f.__name__ in taken)
    if clashes:
        raise ValueError(f"fusedpar.{spec.name}: functions {clashes} are already exported by "
                         f"{sorted({taken[n] for n in clashes})}; give them other names")
    _SPECS[spec.name] = spec
    return spec


def specs() -> list[OpSpec]:
    """Every registered op, in the order of registration."""
    return list(_SPECS.values())


def get(name: str) -> OpSpec:
    """The spec of op ``name``; a clear error for a name no op has."""
    if name not in _SPECS:
        raise KeyError(f"no fusedpar op is named {name!r}; registered: {sorted(_SPECS)}")
    return _SPECS[name]


def backend_names() -> list[str]:
    """Every backend name of every registered op, sorted (what ``FUSEDPAR_BACKEND`` and
    ``fusedpar check --backends`` may name)."""
    return sorted({name for spec in _SPECS.values() for name in spec.backends})
