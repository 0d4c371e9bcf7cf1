"""What a ``fusedpar check`` case is, and how results are compared.

An op's check module (``register(..., checks="<module>")``) defines ``cases(world)``: the
op's :class:`Case` objects for a world of ``world`` ranks. ``fusedpar check`` runs every
case of every registered op on every backend available, in the case's ``dtypes``, through
the op's public function on a process group and, where the op has one, its ``*_loopback``
variant: bit for bit, or within the case's ``atol`` (forward and backward against float64
plain torch).
"""

from __future__ import annotations

import math

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Case:
    """One input shape of op ``op`` (``label`` tells it apart in the report, ``salt`` varies
    the data). Subclasses implement the methods below; rank ``r``'s inputs must encode
    ``r`` and give a result that is exact in every dtype of ``DTYPES``."""

    op: str
    label: str
    # True: the distributed result is compared with the op's oracle backend on the same
    # group; False: with :meth:`expected` (plain torch, every rank's inputs)
    against_oracle_backend = False
    #: the dtypes the case runs in
    dtypes: tuple = DTYPES
    #: 0: bit for bit; else the largest |error| allowed in every tensor of the result (then
    #: a dict ``{what: tensor}``, e.g. the output and each input's gradient)
    atol: float = 0.0

    def title(self) -> str:
        """The op the report names (a dispatcher may serve several: moe_dispatch / moe_combine)."""
        return self.op

    def compare(self, actual, expected) -> tuple[bool, float | None, str | None]:
        """``(correct, max |error|, where the worst one is)``; the last two None when bit
        for bit."""
        if not self.atol:
            return same(actual, expected), None, None
        err, worst = max((max_abs_diff(actual[k], e), k) for k, e in expected.items())
        return err <= self.atol, err, worst

    def shape(self) -> str:
        """The input shape(s), as the report shows them."""
        raise NotImplementedError

    def inputs(self, dtype: torch.dtype, world: int, device) -> list:
        """Every rank's arguments (a tuple per rank)."""
        raise NotImplementedError

    def call(self, args, group, backend: str):
        """Run the op on ``group`` with ``backend`` (one rank's ``args``)."""
        raise NotImplementedError

    def availability_call(self, args, world: int, group):
        """The call object the op's dispatcher judges (``group`` None: a loopback call)."""
        raise NotImplementedError

    def expected(self, inputs: list, dtype: torch.dtype) -> list:
        """Every rank's result, from every rank's inputs, in plain torch."""
        raise NotImplementedError

    def lower_bound(self, args, world: int) -> int:
        """The bytes a rank must receive for this call (0: a local op, no bytes to move)."""
        raise NotImplementedError

    def how(self) -> str:
        """One line for the report's legend: what is compared and the lower bound ("" for
        the cases the legend already explains)."""
        return ""

    def loopback_backends(self) -> list[str]:
        """The backends the op's loopback variant takes ([] where it has none)."""
        return []

    def loopback(self, inputs: list, backend: str) -> list:
        """Every rank's result through the op's loopback variant (one process)."""
        raise NotImplementedError


def same(actual, expected) -> bool:
    """Bit for bit: tensors (dtype, shape and values), or equal-length lists / tuples of
    them (all_gather_matmul's ``(A_gathered, [outs])``)."""
    if isinstance(expected, torch.Tensor):
        return (isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
                and actual.shape == expected.shape and torch.equal(actual, expected))
    return (isinstance(actual, (list, tuple)) and len(actual) == len(expected)
            and all(same(a, e) for a, e in zip(actual, expected)))


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| in float64; inf for a shape mismatch or a NaN."""
    if actual.shape != expected.shape:
        return math.inf
    diff = (actual.double() - expected.double()).abs()
    return float(torch.nan_to_num(diff, nan=math.inf).max()) if diff.numel() else 0.0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
