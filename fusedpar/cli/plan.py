"""``fusedpar plan``: which parallel config fits and trains fastest (:func:`fusedpar.plan.plan`).

    python -m fusedpar plan --model config.json --gpus 8 --nodes 2 --gpu-mem 80GiB \\
        --seq 8192 --global-batch 256 [--json] [--plot plan.png]

prints the configs that fit, fastest first, with each one's memory per GPU, then the ones
that do not fit and by how much. ``--model``: a Hugging Face ``config.json`` (Llama, Qwen2,
Mistral, Mixtral, Qwen-MoE, GPT-2 keys), a JSON file of fusedpar's ``LlamaConfig`` /
``MixtralConfig`` fields, or ``llama`` / ``mixtral`` (fusedpar's small demo models).
"""

from __future__ import annotations

import sys

from fusedpar.plan import plan as make_plan

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
                   help="sequences per forward on a data-parallel rank (default: all of its share)")
    p.add_argument("--param-dtype", choices=DTYPES, default="float32",
                   help="parameters, gradients, optimizer state (default float32)")
    p.add_argument("--compute-dtype", choices=DTYPES, default="bfloat16",
                   help="FSDP's mixed-precision compute dtype (default bfloat16)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw")
    p.add_argument("--ac", choices=("both", "on", "off"), default="both",
                   help="activation checkpointing per block (default: try both)")
    p.add_argument("--unfused", action="store_true",
                   help="time TP/CP/EP communication as not overlapped with compute")
    p.add_argument("--limit", type=int, default=None, help="rows per table (default all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", metavar="PNG", help="write a stacked-bar plot of memory per GPU "
                                                 "(needs matplotlib: pip install 'fusedpar[bench]')")


def _model(name: str):
    from fusedpar.models import LlamaConfig, MixtralConfig

    return {"llama": LlamaConfig, "mixtral": MixtralConfig}.get(name, lambda: name)()


def run(args) -> int:
    try:
        result = make_plan(
            _model(args.model), args.gpus * args.nodes, args.gpu_mem, seq_len=args.seq,
            global_batch=args.global_batch, micro_batch=args.micro_batch,
            param_dtype=args.param_dtype, compute_dtype=args.compute_dtype,
            optimizer=args.optimizer, activation_checkpointing={"both": None, "on": True, "off": False}[args.ac],
            gpu=args.gpu, nodes=args.nodes, fused=not args.unfused)
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"fusedpar plan: {e}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result.table(args.limit))
    if args.plot:
        try:
            result.plot(args.plot, limit=args.limit or 24)
        except ImportError as e:
            print(f"fusedpar plan: no plot written: {e}", file=sys.stderr)
        else:
            print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
