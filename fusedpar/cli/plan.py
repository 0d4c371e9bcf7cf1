"""``fusedpar plan``: which parallel config fits and trains fastest (:func:`fusedpar.plan.plan`).

    python -m fusedpar plan --model config.json --gpus 8 --nodes 2 --gpu-mem 80GiB \\
        --seq 8192 --global-batch 256 [--float8 rowwise] [--json] [--plot plan.png]

prints the configs that fit, fastest first, with each one's memory per GPU, then the ones
that do not fit and by how much. ``--model``: a Hugging Face ``config.json`` of any family
``parallelize`` has an adapter for (its ``model_type``, read by that adapter:
``fusedpar.parallel.adapters.adapter_for_config``), a JSON file of fusedpar's ``LlamaConfig`` /
``MixtralConfig`` fields, or ``llama`` / ``mixtral`` (fusedpar's small demo models).
``--float8 RECIPE``: float8 training (``ParallelConfig.float8``): fp8 FSDP all-gathers, the
fp8 GEMM peak and the fp8 weights in memory (:mod:`fusedpar.plan.float8`); the header says
what it assumed; ``--dry-run`` then fakes the float8 model (needs torchao).
"""

from __future__ import annotations

import json
import sys

from fusedpar.parallel.config import FLOAT8_RECIPES
from fusedpar.plan import plan as make_plan
from fusedpar.plan.memory import PLANNED_SCHEDULES

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="memory per GPU and step time of every parallel config; "
                                     "which fit, fastest first")
    p.add_argument("--model", required=True,
                   help="config JSON (Hugging Face or fusedpar fields), or llama / mixtral")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpu", default="H100", help="GPU kind: H100, H200, A100 (default H100)")
    p.add_argument("--gpu-mem", default=None, help="memory per GPU, e.g. 80GiB (default: the GPU's)")
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per forward on a data-parallel rank (default: all of its share; "
                        "pipeline configs need at least pp micro-batches, so give one to see them)")
    p.add_argument("--param-dtype", choices=DTYPES, default="float32",
                   help="parameters, gradients, optimizer state (default float32)")
    p.add_argument("--compute-dtype", choices=DTYPES, default="bfloat16",
                   help="FSDP's mixed-precision compute dtype (default bfloat16)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw")
    p.add_argument("--ac", choices=("both", "on", "off"), default="both",
                   help="activation checkpointing per block (default: try both)")
    p.add_argument("--pp-schedule", choices=PLANNED_SCHEDULES, default="1F1B",
                   help="pipeline schedule of the pp > 1 configs (default 1F1B)")
    p.add_argument("--float8", choices=FLOAT8_RECIPES, default=None,
                   help="plan float8 training with torchao's recipe: fp8 FSDP all-gathers, the "
                        "fp8 GEMM peak, fp8 weights in memory")
    p.add_argument("--no-float8-all-gather", dest="float8_all_gather", action="store_false",
                   help="with --float8: FSDP all-gathers the weights in the compute dtype")
    p.add_argument("--unfused", action="store_true",
                   help="time TP/CP/EP communication as not overlapped with compute")
    p.add_argument("--limit", type=int, default=None, help="rows per table (default all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--dry-run", metavar="CONFIG", action="append", default=[],
                   help="also run the real parallelized model under fake tensors on one CPU "
                        "process for this config, e.g. tp=2,dp_shard=-1 (ParallelConfig keys; "
                        "add ,ac for activation checkpointing); repeatable")
    p.add_argument("--plot", metavar="PNG", help="write a stacked-bar plot of memory per GPU "
                                                 "(needs matplotlib: pip install 'fusedpar[bench]')")


def _model(name: str):
    from fusedpar.models import LlamaConfig, MixtralConfig

    return {"llama": LlamaConfig, "mixtral": MixtralConfig}.get(name, lambda: name)()


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _parse_config(text: str) -> tuple[dict, bool]:
    """``"tp=2,dp_shard=-1,ac"`` -> ``({"tp": 2, "dp_shard": -1}, True)``."""
    keys, ac = {}, False
    for part in filter(None, text.split(",")):
        if part.strip() == "ac":
            ac = True
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--dry-run {text!r}: write KEY=VALUE pairs such as tp=2,dp_shard=-1 (and ac)")
        keys[key.strip()] = int(value)
    return keys, ac


def _dry_run_model(model: str, spec, fusedpar_config):
    """What the dry run builds: the Hugging Face config of a ``config.json`` naming its
    ``model_type`` (any family fusedpar's adapters know; needs transformers), else fusedpar's
    Llama / Mixtral of the planned sizes."""
    if model.endswith(".json"):
        with open(model) as f:
            data = json.load(f)
        if "model_type" in data:
            import transformers

            return transformers.AutoConfig.for_model(**data)
    return fusedpar_config(spec)


def dry_runs(args, result) -> list[str]:
    """One line per ``--dry-run`` config: the fake run's peak next to the formula's."""
    from fusedpar.parallel.config import ParallelConfig
    from fusedpar.plan import Candidate, Training, estimate_memory
    from fusedpar.plan.dry_run import dry_run, fusedpar_config

    config = _dry_run_model(args.model, result.model, fusedpar_config)
    world, lines = args.gpus * args.nodes, ["", "dry runs (fake tensors, one CPU process; rank 0):"]
    for text in args.dry_run:
        keys, ac = _parse_config(text)
        pcfg = ParallelConfig.from_dict({**keys, "param_dtype": args.compute_dtype, "float8": args.float8,
                                         "float8_all_gather": args.float8_all_gather}).validate(world)
        micro = args.micro_batch or 1
        got = dry_run(config, pcfg, world, seq_len=args.seq, micro_batch=micro, activation_checkpointing=ac)
        cand = Candidate.from_config(pcfg, activation_checkpointing=ac)
        planned = estimate_memory(result.model, cand, Training(
            seq_len=args.seq, global_batch=micro * cand.dp, param_dtype=args.param_dtype,
            compute_dtype=args.compute_dtype, optimizer="adamw", foreach=False, units_in_flight=1,
            float8=args.float8, float8_all_gather=args.float8_all_gather)).peak
        lines.append(f"  {cand.name:<26} peak {_size(got.peak)} (formula, one FSDP unit in flight: "
                     f"{_size(planned)}); params {_size(got.params)}, grads {_size(got.grads)}, "
                     f"optimizer {_size(got.optimizer)}; {got.seconds:.0f} s")
    if args.float8 == "tensorwise" and args.float8_all_gather:
        lines.append("  (tensorwise: the dry run's tracker counts torchao's fp8 all-gather outputs "
                     "saved for backward as activations, though FSDP frees them after each "
                     "forward, as on real tensors (tests/plan/test_plan_float8.py): its peak is "
                     "high, as if every layer's gathered weights were held through the backward)")
    return lines


def run(args) -> int:
    try:
        result = make_plan(
            _model(args.model), args.gpus * args.nodes, args.gpu_mem, seq_len=args.seq,
            global_batch=args.global_batch, micro_batch=args.micro_batch,
            param_dtype=args.param_dtype, compute_dtype=args.compute_dtype,
            optimizer=args.optimizer, activation_checkpointing={"both": None, "on": True, "off": False}[args.ac],
            gpu=args.gpu, nodes=args.nodes, fused=not args.unfused, pp_schedule=args.pp_schedule,
            float8=args.float8, float8_all_gather=args.float8_all_gather)
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"fusedpar plan: {e}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result.table(args.limit))
    if args.dry_run:
        try:
            print("\n".join(dry_runs(args, result)), file=sys.stderr if args.json else sys.stdout)
        except (ValueError, TypeError) as e:
            print(f"fusedpar plan: {e}", file=sys.stderr)
            return 2
    if args.plot:
        try:
            result.plot(args.plot, limit=args.limit or 24)
        except ImportError as e:
            print(f"fusedpar plan: no plot written: {e}", file=sys.stderr)
        else:
            print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
