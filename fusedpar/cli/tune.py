"""``fusedpar tune``: measure which backend of each op is fastest on this GPU and store the
choice in the user's tuning table (``fusedpar.ops.tuning``), where ``Dispatcher.select``
finds it. Two forms:

- ``fusedpar tune OP SHAPE [SHAPE ...]``: the given shapes. They use the benchmark rows'
  notation (benchmarks/results/README.md): all_gather the per-rank shard ``RxC``,
  reduce_scatter the per-rank output, the fused matmuls ``MxKxN`` (all_gather_matmul: A
  gathered ``[M, K]``; matmul_reduce_scatter: each rank's A), flash_attention ``BxSxHxD``,
  grouped_mm ``TxKxNxE`` (groups of equal size).
- ``fusedpar tune --model MODEL [--tp N --cp N ...] --seq S --batch B``: the calls one
  training step of that model makes, parallelized as ``fusedpar train`` does (its model
  building and parallel flags): the step runs in a ``tuning.tuning_session``, so each
  distinct signature is measured at its first call (forward and backward), as
  ``FUSEDPAR_AUTOTUNE=1`` does. MODEL as ``fusedpar plan`` reads it (``model_config``).
  Give the flags the training run uses (``--param-dtype bfloat16`` for bf16 compute): the
  dtype and the shapes are part of each signature.

Run under ``torchrun --nproc-per-node N -m fusedpar tune ...`` for the collective ops and
the model form (every rank times every candidate; the slowest rank's time counts). On CPU
nothing is timed (interpreter timings mean nothing): the command refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist

import fusedpar
from fusedpar.cli import launch, train
from fusedpar.models import LlamaConfig, MixtralConfig
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
    p = sub.add_parser("tune", help="measure the fastest backend of each op on this GPU, for "
                                    "given shapes or one training step of a model, and store "
                                    "it in the tuning table")
    p.add_argument("op", nargs="?", choices=OPS, help="the shape form: the op")
    p.add_argument("shapes", nargs="*", metavar="SHAPE", help="e.g. 8192x8192x1280 (see --help)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="the shape form's tensors")
    p.add_argument("--causal", action="store_true", help="flash_attention: causal mask")
    p.add_argument("--model", help="the model form: llama / mixtral (fusedpar's demo models), "
                                    "a JSON file of LlamaConfig / MixtralConfig fields or a "
                                    "Hugging Face config.json of a Llama / Mixtral-style model")
    train.add_parallel_arguments(p)
    p.add_argument("--seq", "--seq-len", type=int, default=None, dest="seq_len",
                   help="--model: tokens per sequence (default 32)")
    p.add_argument("--batch", "--batch-size", type=int, default=None, dest="batch_size",
                   help="--model: global batch (default 8)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="--model: seconds a collective may wait (default 1800)")


def model_config(model: str):
    """The fusedpar config of ``--model``: ``llama`` / ``mixtral`` (the demo models' configs),
    a JSON file of ``LlamaConfig`` / ``MixtralConfig`` fields (with ``num_experts``: a
    Mixtral), or a Hugging Face ``config.json``: its sizes in fusedpar's model, as
    ``fusedpar plan --dry-run`` runs it (Llama / Mixtral-style models only)."""
    from fusedpar.plan import model_spec
    from fusedpar.plan.dry_run import fusedpar_config

    demo = {"llama": LlamaConfig, "mixtral": MixtralConfig}
    if model in demo:
        return demo[model]()
    with open(model) as f:
        data = json.load(f)
    if isinstance(data, dict) and "num_layers" in data and "num_heads" in data:
        return (MixtralConfig if "num_experts" in data else LlamaConfig)(**data)
    return fusedpar_config(model_spec(data, os.path.basename(model)))


def tune_model_rank(group, device, spec: dict) -> tuning.Session:
    """One rank of ``fusedpar tune --model``: ``fusedpar train``'s parallelized model of
    ``spec["model"]`` (a fusedpar config) and one training step of ``spec["train"]``'s batch
    in a ``tuning.tuning_session`` (so are the calls ``parallelize`` makes); returns the
    session: what was measured and what only one backend can run. Collective: every rank
    of ``group`` (the default group) calls it."""
    pcfg = fusedpar.ParallelConfig(**spec["parallel"])
    tcfg = train.TrainConfig(**spec["train"])
    config = spec["model"]
    with tuning.tuning_session() as session:
        model = train.parallel_model(tcfg, pcfg, device, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr)
        ids = fusedpar.parallel.shard_batch(
            train.synthetic_batch(tcfg, config.vocab_size, 0), model.fusedpar_mesh)
        train.train_step(model, optimizer, ids.to(device))
    return session


def row(key: str, entry: tuning.Entry) -> str:
    """A stored table row as printed: the signature, the choice, every candidate's time and
    why any was rejected."""
    return (f"{key}: {entry.backend}  ({entry.describe()})"
            + "".join(f"\n  {n} rejected: {r}" for n, r in entry.rejected.items()))


def rows(session: tuning.Session) -> list[str]:
    """The table rows a session stored, then the calls only one backend can take."""
    return [row(key, entry) for key, entry in sorted(session.measured.items())] + [
        f"{key}: only {name} can run it; nothing to choose" for key, name in sorted(session.single.items())]


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
    if args.model is not None:
        if args.op is not None:
            print(f"fusedpar tune: give --model or an op with shapes, not both (got {args.op})")
            return 2
        return run_model(args)
    if args.op is None or not args.shapes:
        print("fusedpar tune: give an op and its shapes (fusedpar tune grouped_mm 8192x4096x"
              "1024x8) or a model (fusedpar tune --model llama --tp 2); see fusedpar tune --help")
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
            print(row(sig.key(), entry))
    if group is None or dist.get_rank() == 0:
        print(f"stored in {tuning.cache_path()}")
    return 0


def run_model(args) -> int:
    """The model form under torchrun (see the module docstring)."""
    if not launch.under_torchrun():
        print("fusedpar tune: --model runs the parallelized model: launch it with torchrun "
              f"(torchrun --nproc-per-node N -m fusedpar tune --model {args.model} ...)")
        return 2
    if os.environ.get("FUSEDPAR_BACKEND"):
        print(f"fusedpar tune: FUSEDPAR_BACKEND={os.environ['FUSEDPAR_BACKEND']} forces a "
              "backend, so nothing would be chosen: unset it")
        return 2
    try:
        config = model_config(args.model)
        # train's run fields tune has no flag for (data, ...) keep their defaults
        unset = {f: None for f in train.TrainConfig.__dataclass_fields__ if f not in vars(args)}
        # tune's --model names a demo model (moe picks it), train's a Hugging Face folder
        options = argparse.Namespace(**{**unset, **vars(args), "model": None, "config": None,
                                        "steps": 1, "lr": None, "seed": None,
                                        "moe": isinstance(config, MixtralConfig)})
        pcfg, tcfg, _ = train.resolve(options, int(os.environ["WORLD_SIZE"]))
    except (OSError, ValueError, TypeError, KeyError, fusedpar.ParallelConfigError) as e:
        print(f"fusedpar tune: --model {args.model}: {e}")
        return 2
    spec = {"parallel": dataclasses.asdict(pcfg), "train": dataclasses.asdict(tcfg),
            "model": config}
    with launch.torchrun_rank(args.timeout) as (device, _):
        session = tune_model_rank(dist.group.WORLD, device, spec)
        if dist.get_rank() == 0:
            print(f"fusedpar tune: {args.model}, {pcfg}, one step of {tcfg.batch_size} x "
                  f"{tcfg.seq_len} tokens")
            print("\n".join(rows(session)) or "no tuned op call: every op ran untuned")
            print(f"stored in {tuning.cache_path()}")
    return 0
