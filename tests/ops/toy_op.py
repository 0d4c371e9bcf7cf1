"""A toy op, ``toy_double(x) = 2 * x``, declared the way every fusedpar op is: its backends,
its example call and its check cases, registered in one place (the ``register`` line).
``tests/ops/test_registry.py`` checks that ``fusedpar info`` and ``fusedpar check`` pick it
up; importing this module registers it, so only subprocesses import it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.ops.backend import Backend, Dispatcher
from fusedpar.ops.registry import register
from fusedpar.testing.cases import Case

OP = "toy_double"


@dataclass
class ToyCall:
    x: torch.Tensor

    def cache_key(self) -> tuple:
        return (self.x.device.type, self.x.dtype)

    def describe(self) -> str:
        return f"x of shape {tuple(self.x.shape)} {self.x.dtype} on {self.x.device.type}"


class Reference(Backend):
    name = "reference"

    def run(self, call: ToyCall) -> torch.Tensor:
        return call.x * 2


class Toy(Backend):
    name = "toy"

    def not_supported_reasons(self, call: ToyCall) -> list[str]:
        return ["toy takes no float16"] if call.x.dtype == torch.float16 else []

    def run(self, call: ToyCall) -> torch.Tensor:
        return call.x + call.x


DISPATCHER = Dispatcher(OP, [Toy(), Reference()])


def toy_double(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``2 * x``."""
    call = ToyCall(x)
    return DISPATCHER.select(call, backend or "").run(call)


class ToyCase(Case):
    op, label = OP, "odd"

    def shape(self) -> str:
        return "(3, 5)"

    def inputs(self, dtype, world, device) -> list:
        return [((torch.arange(15.0).view(3, 5) + 16 * r).to(dtype).to(device),)
                for r in range(world)]

    def call(self, args, group, backend):
        return toy_double(args[0], backend=backend)

    def availability_call(self, args, world, group):
        return ToyCall(args[0])

    def expected(self, inputs, dtype) -> list:
        return [(x.double() * 2).to(dtype) for (x,) in inputs]

    def lower_bound(self, args, world) -> int:
        return 0


def cases(world: int) -> list[Case]:
    return [ToyCase()]


register(DISPATCHER, (toy_double,), checks=__name__,
         example=lambda device: ToyCall(torch.zeros(4, 3, device=device)))
