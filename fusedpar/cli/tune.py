"""``fusedpar tune OP SHAPE [SHAPE ...]``: measure which backend of an op is fastest on this
GPU for the given shapes and store the choice in the user's tuning table
(``fusedpar.ops.tuning``), where ``Dispatcher.select`` finds it.

Shapes use the benchmark rows' notation (benchmarks/results/README.md): all_gather the
per-rank shard ``RxC``, reduce_scatter the per-rank output, the fused matmuls ``MxKxN``
(all_gather_matmul: A gathered ``[M, K]``; matmul_reduce_scatter: each rank's A),
flash_attention ``BxSxHxD``, grouped_mm ``TxKxNxE`` (groups of equal size). The collective
ops need ranks: run under ``torchrun --nproc-per-node N -m fusedpar tune ...`` (every rank
times every candidate; the slowest rank's time counts). On CPU nothing is timed
(interpreter timings mean nothing): the command refuses.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fusedpar.ops import registry, tuning
from fusedpar.ops.calls import CollectiveCall, MatmulCall
from fusedpar.ops.flash_attention import AttentionCall
from fusedpar.ops.grouped_mm import GroupedCall

OPS = ("all_gather", "reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter",
       "flash_attention", "grouped_mm")
NEEDS_RANKS = ("all_gather", "reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter")
SIZES = {"all_gather": 2, "reduce_scatter": 2, "all_gather_matmul": 3, "matmul_reduce_scatter": 3,
         "flash_attention": 4, "grouped_mm": 4}


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure the fastest backend of an op for given shapes on "
                                    "this GPU and store it in the tuning table")
    p.add_argument("op", choices=OPS)
    p.add_argument("shapes", nargs="+", metavar="SHAPE", help="e.g. 8192x8192x1280 (see --help)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--causal", action="store_true", help="flash_attention: causal mask")


def parse_shape(op: str, shape: str) -> list[int]:
    try:
        dims = [int(d) for d in shape.split("x")]
    except ValueError:
        dims = []
    if len(dims) != SIZES[op] or min(dims) < 1:
        raise ValueError(f"fusedpar tune: shape {shape!r} for {op}: give {SIZES[op]} positive "
                         "sizes joined by 'x' (see fusedpar tune --help)")
    return dims


def call_of(op: str, dims: list[int], world: int, group, make, causal: bool = False):
    """The call of ``op`` that the shape ``dims`` names (see the module docstring), its
    tensors made by ``make(*shape)`` (meta tensors where only the bucket is asked)."""
    if op == "all_gather":
        return CollectiveCall(op, make(*dims), 0, world, group)
    if op == "reduce_scatter":  # the shape is the per-rank output
        return CollectiveCall(op, make(dims[0] * world, *dims[1:]), 0, world, group, reduce_op="sum")
    if op in ("all_gather_matmul", "matmul_reduce_scatter"):
        m, k, n = dims
        rows = m // world if op == "all_gather_matmul" else m  # A gathered [M, K]: shards of M/W
        return MatmulCall(op, make(rows, k), 0, world, group, [make(k, n)],
                          reduce_op="sum" if op == "matmul_reduce_scatter" else "")
    if op == "flash_attention":
        q, k, v = make(*dims), make(*dims), make(*dims)
        return AttentionCall(q, k, v, causal, dims[-1] ** -0.5)
    t, k, n, e = dims
    a = make(t, k)
    offs = (torch.arange(1, e + 1) * t // e).to(torch.int32).to(a.device)  # equal groups
    return GroupedCall(a, make(e, k, n), offs)


def _init_ranks() -> tuple[int, object]:
    """``(world, group)``: torchrun's ranks (NCCL, one GPU each), else one process."""
    if "WORLD_SIZE" not in os.environ:
        return 1, None
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    return dist.get_world_size(), dist.group.WORLD


def run(args) -> int:
    if not torch.cuda.is_available():
        print("fusedpar tune: no CUDA GPU here, so nothing to time (interpreter timings mean "
              "nothing); on CPU every op runs its backends' priority order")
        return 2
    try:
        shapes = [parse_shape(args.op, s) for s in args.shapes]
    except ValueError as e:
        print(e)
        return 2
    world, group = _init_ranks()
    if args.op in NEEDS_RANKS and group is None:
        print(f"fusedpar tune: {args.op} is a collective: run it under torchrun "
              f"(torchrun --nproc-per-node N -m fusedpar tune {args.op} ...)")
        return 2
    dtype = getattr(torch, args.dtype)
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device="cuda")  # noqa: E731
    dispatcher = registry.get(args.op).dispatcher
    for dims in shapes:
        call = call_of(args.op, dims, world, group, make, args.causal)
        candidates = [n for n, reasons in dispatcher.availability(call).items() if not reasons]
        if len(candidates) < 2:
            print(f"{args.op} {'x'.join(map(str, dims))}: only {candidates} can run it; nothing to choose")
            continue
        sig = tuning.signature(args.op, call)
        entry = tuning.tune_call(dispatcher, call, candidates, sig)
        if group is None or dist.get_rank() == 0:
            print(f"{sig.key()}: {entry.backend}  ({entry.describe()})"
                  + "".join(f"\n  {n} rejected: {r}" for n, r in entry.rejected.items()))
    if group is None or dist.get_rank() == 0:
        print(f"stored in {tuning.cache_path()}")
    return 0
