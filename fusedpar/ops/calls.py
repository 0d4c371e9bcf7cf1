"""The call types the ops share (one rank's arguments, how they describe themselves to
the symmetric-memory protocol) and their input checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import symmetric
from .tuning import pow2

GATHER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)
REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MATMUL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
REDUCE_OPS = ("sum", "avg")

@dataclass
class CollectiveCall:
    """One rank's call of a collective; ``group`` is None for a loopback call."""

    op: str
    x: torch.Tensor
    dim: int
    world_size: int
    group: dist.ProcessGroup | None = None
    reduce_op: str = ""

    def cache_key(self) -> tuple:
        name = self.group.group_name if self.group is not None else f"loopback{self.world_size}"
        return (name, self.x.device.type, self.x.dtype)

    def maker(self):
        """A function of this call's tensors that makes calls like this one, keeping none of
        its tensors (what a plan holds: ``backend.Plans``)."""
        op, dim, world, group, reduce_op = self.op, self.dim, self.world_size, self.group, self.reduce_op
        return lambda x: CollectiveCall(op, x, dim, world, group, reduce_op)

    def describe(self) -> str:
        return (f"x of shape {tuple(self.x.shape)} {self.x.dtype} on {self.x.device.type}, "
                f"dim={self.dim}, world size {self.world_size}")

    def bucket(self) -> tuple:
        """The tuning bucket (``tuning``): this rank's input elements, a power of two."""
        return (pow2(self.x.numel()),)

    @property
    def outer(self) -> int:
        return math.prod(self.x.shape[: self.dim])

    def fingerprint(self) -> int:
        return symmetric.fingerprint(self.op, self.x.dtype, tuple(self.x.shape), self.dim,
                                     self.reduce_op)

    def description(self) -> list[int]:
        """What ``layout.DESC`` publishes: enough to say which shape or dtype differed."""
        return symmetric.describe_words(0, self.x.dtype, tuple(self.x.shape), self.dim)


def check_dim(op: str, x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fusedpar.{op}: x must be a Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"fusedpar.{op}: x is a 0-d tensor; give it at least one dimension")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"fusedpar.{op}: dim={dim} is out of range for x with {x.dim()} dims")
    return dim % x.dim()


def check_scatter(op: str, reduce_op: str, op_arg: str, tensor: str, size: int, dim: int,
                  dim_arg: str, world: int) -> None:
    """A reduce-scatter's ``reduce_op`` is known and ``tensor.shape[dim]`` splits into W."""
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"fusedpar.{op}: {op_arg}={reduce_op!r}; supported: {', '.join(REDUCE_OPS)}")
    if size % world:
        raise ValueError(
            f"fusedpar.{op}: {tensor}.shape[{dim}] = {size} is not divisible by the world size "
            f"{world}; pad {dim_arg} {dim} to a multiple of {world}"
        )


def check_dtype(op: str, x: torch.Tensor, allowed, name: str = "x") -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"fusedpar.{op}: {name} has dtype {x.dtype}; supported: {names}")


class MatmulCall(CollectiveCall):
    """A call of a fused matmul op: ``x`` is A (or A_shard), ``dim`` the gathered or
    scattered dim, ``bs`` the B matrices."""

    def __init__(self, op, a, dim, world_size, group, bs, return_a=True, reduce_op=""):
        super().__init__(op, a, dim, world_size, group, reduce_op)
        self.bs, self.return_a = list(bs), return_a

    def maker(self):
        op, dim, world, group, return_a, reduce_op = (self.op, self.dim, self.world_size, self.group,
                                                      self.return_a, self.reduce_op)
        return lambda a, bs: MatmulCall(op, a, dim, world, group, bs, return_a, reduce_op)

    def fingerprint(self) -> int:
        return symmetric.fingerprint(self.op, self.x.dtype, tuple(self.x.shape), self.dim,
                                       self.reduce_op, [tuple(b.shape) for b in self.bs])

    def description(self) -> list[int]:
        # A's shape: what usually differs (B shapes are in the fingerprint too)
        return symmetric.describe_words(1, self.x.dtype, tuple(self.x.shape), self.dim)

    def bucket(self) -> tuple:
        """The tuning bucket: the product's ``M, K, N`` (all_gather_matmul: of A gathered;
        N: every B's columns) as powers of two, and whether ``dim`` is A's last."""
        m, k = math.prod(self.x.shape[:-1]), self.x.shape[-1]
        if self.op == "all_gather_matmul":
            m, k = (m, k * self.world_size) if self.last_dim else (m * self.world_size, k)
        return (pow2(m), pow2(k), pow2(sum(b.shape[1] for b in self.bs)), int(self.last_dim))

    def describe(self) -> str:
        return (f"A of shape {tuple(self.x.shape)} {self.x.dtype} on {self.x.device.type}, "
                f"B shapes {[tuple(b.shape) for b in self.bs]}, dim={self.dim}, "
                f"world size {self.world_size}")

    def rows(self) -> torch.Tensor:
        """A with ``dim`` moved first, as a ``[rows, K]`` matrix (a copy only if needed)."""
        return self.x.movedim(self.dim, 0).flatten(0, -2)  # not reshape(-1, K): K may be 0

    @property
    def last_dim(self) -> bool:
        """Whether ``dim`` is A's last: all_gather_matmul then gathers K (a K-sharded A),
        matmul_reduce_scatter scatters the output's columns."""
        return self.dim == self.x.dim() - 1

    def unflatten(self, t: torch.Tensor, world: int) -> torch.Tensor:
        """Undo ``rows()`` for a result whose rows are ``world`` blocks, one per rank,
        contiguous: a layer's output is often a model's (FSDP2 warns about a module that
        returns a view, whose in-place use would skip its pre-backward hook)."""
        moved = t.view(moved_shape(self.x.shape, self.dim, world, t.shape[-1]))
        return moved.movedim(0, self.dim).contiguous()


def moved_shape(shape, dim: int, world: int, n: int) -> tuple:
    """The gathered rows' shape with ``dim`` first: ``shape`` with ``dim`` moved to the front
    and grown ``world`` times, its last size ``n``."""
    lead = [shape[dim]] + [s for i, s in enumerate(shape[:-1]) if i != dim]
    return (world * lead[0], *lead[1:], n)


def check_matmul_inputs(op: str, a: torch.Tensor, bs, dim: int, dim_name: str,
                        dtypes=MATMUL_DTYPES, k: int | None = None) -> int:
    """Shapes, dtypes and devices of A and the Bs; returns ``dim`` made non-negative. ``k``:
    the Bs' rows (default A's last size; a K-sharded gather multiplies W times as many).
    Every dtype torch multiplies is accepted here (the plain-torch backends take them all,
    e.g. float64 for gradcheck); the fused backends say which they support."""
    if not isinstance(a, torch.Tensor) or a.dim() not in (2, 3):
        raise ValueError(f"fusedpar.{op}: A must be a 2-D or 3-D tensor, got "
                         f"{tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__}")
    if not -a.dim() <= dim < a.dim():
        raise ValueError(f"fusedpar.{op}: {dim_name}={dim} is not a dim of A (0..{a.dim() - 1}, "
                         f"or -{a.dim()}..-1); A has shape {tuple(a.shape)}")
    if len(bs) == 0:
        raise ValueError(f"fusedpar.{op}: Bs is empty; pass at least one [K, N] matrix")
    check_dtype(op, a, dtypes, "A")
    k = a.shape[-1] if k is None else k
    for i, b in enumerate(bs):
        if b.dim() != 2:
            raise ValueError(f"fusedpar.{op}: B{f'[{i}]' if len(bs) > 1 else ''} must be 2-D "
                             f"[K, N], got shape {tuple(b.shape)}")
        if b.shape[0] != k:
            what = f"A.shape[-1] = {k}" if k == a.shape[-1] else \
                f"A gathered along K has {k} columns ({a.shape[-1]} per rank)"
            raise ValueError(f"fusedpar.{op}: K mismatch: {what} but "
                             f"B{f'[{i}]' if len(bs) > 1 else ''}.shape[0] = {b.shape[0]}")
        if b.dtype != a.dtype:
            raise TypeError(f"fusedpar.{op}: A is {a.dtype} but B{f'[{i}]' if len(bs) > 1 else ''} "
                            f"is {b.dtype}; cast them to one dtype")
        if b.device != a.device:
            raise ValueError(f"fusedpar.{op}: A is on {a.device} but B is on {b.device}")
    return dim % a.dim()
