"""``fusedpar train`` (what ``./dev demo`` runs): train a small model for a few steps on
synthetic token data, parallelized by ``fusedpar.parallelize``, then train the same model
in one process from the same seed and say how close the loss curves are.

Plain-PyTorch equivalent of one rank's job (the single-process run is the same without
``parallelize`` and with the whole batch)::

    model = LlamaForCausalLM(LlamaConfig(), seed=seed)          # or MixtralForCausalLM (--moe)
    model = fusedpar.parallelize(model, ParallelConfig(...))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        input_ids = synthetic_batch(seed, step)[this data-parallel rank's rows]
        model(input_ids, labels=input_ids).loss.backward()
        opt.step(); opt.zero_grad()

Without a GPU it spawns ``--world-size`` CPU ranks (gloo); under ``torchrun`` each rank
uses its GPU (NCCL). The config comes from flags or a YAML/JSON file (``--config``) with
fusedpar's names or Axolotl's keys; flags win over the file.

A real run: ``--model PATH`` (a Hugging Face folder) and ``--data PATH`` (:mod:`.inputs`)
instead of the demo model and synthetic tokens; ``--save DIR`` crash-safe checkpoints in
``DIR/step-<n>`` (``--save-every``, ``--keep``, ``--async-save``), ``--resume auto|DIR``
(model, optimizer, step, RNG); ``--on-nonfinite``. What would fail on every rank (a wrong
folder, out-of-vocabulary tokens, an unwritable ``--save``) is refused before any starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import time

import torch

import fusedpar
from fusedpar.cli import bounds, inputs, launch, preflight
from fusedpar.models import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from fusedpar.nn.linear import local
from fusedpar.parallel import forward_backward
from fusedpar.parallel.config import FLOAT8_RECIPES, KEY_ALIASES as PARALLEL_KEYS

DEFAULT_WORLD = 4
#: The demo: tensor parallelism with sequence parallelism inside data-parallel sharding;
#: for the MoE model (whose experts have no tensor parallelism) expert parallelism.
DEFAULT_PARALLEL = {"tp": 2, "dp_shard": -1}
DEFAULT_PARALLEL_MOE = {"ep": 2, "dp_shard": -1}


@dataclasses.dataclass
class TrainConfig:
    """What to train and for how long. ``batch_size`` is the global batch (every
    data-parallel rank takes its rows of it, so the single-process run sees the same data)."""

    steps: int = 20
    batch_size: int = 8
    seq_len: int = 32
    lr: float = 1e-2
    seed: int = 0
    moe: bool = False
    model: str | None = None  # a Hugging Face model folder (else fusedpar's demo model)
    data: str | None = None  # a token file or a datasets.save_to_disk folder (else synthetic)
    data_dtype: str = "uint16"


#: Training keys a config file may use -> our field (ours and Axolotl's names).
TRAIN_KEYS = {
    "steps": "steps", "max_steps": "steps",
    "batch_size": "batch_size",
    "seq_len": "seq_len", "sequence_len": "seq_len",
    "lr": "lr", "learning_rate": "lr",
    "seed": "seed",
    "moe": "moe",
}
#: Flags that set ParallelConfig fields (its degrees and FSDP options).
DEGREES = ("pp", "dp_replicate", "dp_shard", "tp", "cp", "ep")
PARALLEL_FLAGS = (*DEGREES, "param_dtype", "fsdp_comm", "pp_schedule", "float8")
DEGREE_HELP = {
    "dp_shard": "FSDP degree (-1: the remaining ranks, the default)",
    "dp_replicate": "HSDP replicas (-1: the remaining ranks)",
    "pp": "pipeline stages (the outermost axis; the schedule runs each step's forward and backward)",
    "tp": "tensor (+ sequence) parallel degree; with no degree given anywhere the run is "
          "tp=2 x dp_shard (--moe: ep=2 x dp_shard)",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", aliases=["demo"],
        help="train a small Llama-style (or --moe Mixtral-style) model on synthetic tokens, "
             "parallelized, and compare with one process; or a real run: --model, --data, "
             "--save, --resume")
    launch.add_launch_arguments(p, default_world=DEFAULT_WORLD, default_timeout=600.0)
    p.add_argument("--config", metavar="FILE",
                   help="YAML or JSON file: parallel degrees (dp_shard, tp, ... or Axolotl's "
                        "dp_shard_size, tensor_parallel_size, ...) and training keys "
                        f"({', '.join(sorted(TRAIN_KEYS))}); flags win over the file")
    add_parallel_arguments(p)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 20)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 32)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-2)")
    p.add_argument("--seed", type=int, default=None, help="model and data seed (default 0)")
    p.add_argument("--moe", action="store_true", default=None,
                   help="the Mixtral-style model (MoE MLPs) instead of the Llama-style one")
    p.add_argument("--model", metavar="PATH", default=None,
                   help="a Hugging Face model folder (config.json; with weights: fine-tune "
                        "them, without: train from scratch) of a family parallelize supports")
    p.add_argument("--data", metavar="PATH", default=None,
                   help="token ids: a flat file (nanoGPT's train.bin) or a datasets.save_to_disk "
                        "folder with an input_ids column (default: synthetic tokens)")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default=None,
                   help="the token file's integer type (default uint16, as nanoGPT writes)")
    p.add_argument("--save", metavar="DIR",
                   help="checkpoint into DIR/step-<n> (torch.distributed.checkpoint: model, "
                        "optimizer, step, RNG), crash-safe, after the last step and every "
                        "--save-every steps")
    p.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="with --save: also checkpoint after every N steps")
    p.add_argument("--keep", type=int, default=None, metavar="K",
                   help="with --save: keep only the newest K complete checkpoints")
    p.add_argument("--async-save", action="store_true",
                   help="with --save: write each checkpoint in the background while training "
                        "goes on (a copy of the state in CPU memory; DCP's async_save)")
    p.add_argument("--resume", metavar="auto|DIR",
                   help="continue from a checkpoint up to --steps: DIR one that --save wrote "
                        "(a step-<n> folder, or the --save folder: its newest), auto the newest "
                        "in --save's folder (none yet: start at step 0)")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                   help="a NaN or Inf loss stops the run (default) naming the step, or skips "
                        "that step's update")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the single-process run at the end")
    p.add_argument("--metrics", metavar="FILE",
                   help="write the run's numbers (losses, bytes, ...) as JSON")


def add_parallel_arguments(p) -> None:
    """The flags of ``PARALLEL_FLAGS`` (``fusedpar train`` and ``fusedpar tune --model``)."""
    for name in DEGREES:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, dest=name,
                       help=DEGREE_HELP.get(name, f"degree of the {name} axis"))
    p.add_argument("--schedule", dest="pp_schedule", default=None,
                   choices=("gpipe", "1f1b", "interleaved", "zbv"),
                   help="pipeline schedule with --pp (default 1f1b; interleaved runs 2 stages "
                        "per rank; zbv is refused: see fusedpar.parallel.pipeline)")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=None,
                   help="FSDP's mixed-precision compute dtype (default: the parameters', "
                        "float32); gradients are reduced in float32")
    p.add_argument("--fsdp-comm", choices=("fusedpar", "torch"), default=None,
                   help="FSDP's all-gather / reduce-scatter on fusedpar's ops (default) or "
                        "torch's collectives")
    p.add_argument("--float8", choices=FLOAT8_RECIPES, default=None,
                   help="float8 training with torchao's recipe (pip install 'fusedpar[fp8]'): "
                        "linears compute in fp8 and FSDP all-gathers their weights in fp8, tp "
                        "gathers fp8 inputs (FSDP, tp and pp so far; without degrees the demo "
                        "runs FSDP over every rank)")


# ---- configuration ----------------------------------------------------------------------


def load_config_file(path: str) -> dict:
    """A YAML (needs PyYAML: ``pip install 'fusedpar[train]'``) or JSON mapping."""
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        try:
            import yaml
        except ImportError:
            raise SystemExit(f"fusedpar train: reading {path} needs PyYAML: pip install "
                             "'fusedpar[train]' (or give the config as JSON)") from None
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise SystemExit(f"fusedpar train: {path} must hold a mapping of keys to values, "
                         f"got {type(data).__name__}")
    return data


def split_config(data: dict) -> tuple[dict, dict, list[str]]:
    """``(parallel keys, training fields, ignored keys)`` of a config mapping.

    Parallel keys go to ``ParallelConfig.from_dict`` as they are (it knows the aliases and
    rejects conflicts); keys we do not use (an Axolotl file has many) are ignored and
    listed, unless they look like a misspelling of one we use, which is an error.
    """
    parallel, train, ignored = {}, {}, []
    for key, value in data.items():
        if key in PARALLEL_KEYS:
            parallel[key] = value
        elif key in TRAIN_KEYS:
            field = TRAIN_KEYS[key]
            if field in train and train[field] != value:
                raise SystemExit(f"fusedpar train: {field} is given twice with different "
                                 f"values ({value!r} as {key}); keep one of them")
            train[field] = value
        else:
            close = difflib.get_close_matches(str(key), [*PARALLEL_KEYS, *TRAIN_KEYS], n=1,
                                              cutoff=0.85)
            if close:
                raise SystemExit(f"fusedpar train: unknown config key {key!r}: did you mean "
                                 f"{close[0]!r}?")
            ignored.append(str(key))
    return parallel, train, ignored


def resolve(args, world: int) -> tuple[fusedpar.ParallelConfig, TrainConfig, list[str]]:
    """The run's parallel and training config from the file and the flags (flags win);
    with no degree given anywhere, the demo's ``tp=2`` x ``dp_shard`` (the rest), or for
    ``moe`` ``ep=2`` with ``dp_shard`` over every rank."""
    parallel_keys, train_fields, ignored = split_config(
        load_config_file(args.config) if args.config else {})
    for field in TrainConfig.__dataclass_fields__:
        if getattr(args, field) is not None:
            train_fields[field] = getattr(args, field)
    tcfg = TrainConfig(**train_fields)
    base = fusedpar.ParallelConfig.from_dict(parallel_keys)
    flags = {name: getattr(args, name) for name in PARALLEL_FLAGS if getattr(args, name) is not None}
    given = {PARALLEL_KEYS[k] for k, v in parallel_keys.items() if v is not None} | set(flags)
    if not given & set(DEGREES):
        default = DEFAULT_PARALLEL_MOE if tcfg.moe else DEFAULT_PARALLEL
        if flags.get("float8") or base.float8:  # FSDP over every rank: its all-gathers move fp8
            default = {"dp_shard": -1}
        base = dataclasses.replace(base, **default)
    pcfg = dataclasses.replace(base, **flags).validate(world)
    if tcfg.model:
        if tcfg.moe:
            raise SystemExit("fusedpar train: --moe picks fusedpar's demo MoE model; with --model "
                             "the folder's config.json says what the model is: drop --moe")
        tcfg.model = os.path.abspath(tcfg.model)
    if tcfg.data:
        tcfg.data = os.path.abspath(tcfg.data)
    for field in ("steps", "batch_size", "seq_len"):
        if getattr(tcfg, field) < 1:
            raise SystemExit(f"fusedpar train: {field}={getattr(tcfg, field)} must be at least 1")
    if tcfg.batch_size % pcfg.dp:
        raise SystemExit(f"fusedpar train: batch_size={tcfg.batch_size} is not divisible by the "
                         f"data-parallel degree dp_replicate*dp_shard={pcfg.dp}: choose a "
                         f"multiple of {pcfg.dp}")
    return pcfg, tcfg, ignored


def model_config(tcfg: TrainConfig):
    if tcfg.model:
        return inputs.hf_config(tcfg.model)
    return MixtralConfig() if tcfg.moe else LlamaConfig()


def model_name(tcfg: TrainConfig) -> str:
    if tcfg.model:
        return f"{type(model_config(tcfg)).__name__.removesuffix('Config')} (from {tcfg.model})"
    return "Mixtral-style MoE" if tcfg.moe else "Llama-style"


def build_model(tcfg: TrainConfig, device, config=None) -> torch.nn.Module:
    """fusedpar's Llama (Mixtral for a ``MixtralConfig``) of ``config``, by default the
    demo's (``model_config``), initialized from ``tcfg.seed``; with ``tcfg.model`` (and no
    ``config``) that folder's Hugging Face model."""
    if tcfg.model and config is None:
        return inputs.load_model(tcfg.model, tcfg.seed, device)
    config = config or model_config(tcfg)
    cls = MixtralForCausalLM if isinstance(config, MixtralConfig) else LlamaForCausalLM
    return cls(config, device=device, seed=tcfg.seed)


def parallel_model(tcfg: TrainConfig, pcfg: fusedpar.ParallelConfig, device, config=None):
    """``build_model`` parallelized as each rank of a run builds it. The mesh is on the
    ranks' device: CPU ranks on a machine with a GPU (--device cpu, or fewer GPUs than
    ranks) would otherwise get a CUDA mesh."""
    return fusedpar.parallelize(build_model(tcfg, device, config), pcfg,
                                device_type=torch.device(device).type)


def single_process_model(tcfg: TrainConfig, pcfg: fusedpar.ParallelConfig, device):
    """``build_model`` as one process trains it for the comparison: under float8 converted
    as ``parallelize`` converts it (torchao's ``Float8Linear``, the same recipe and layers),
    so the loss curves compare float8 with float8."""
    model = build_model(tcfg, device)
    if pcfg.float8 is not None:
        from fusedpar.parallel import find_adapter, float8

        one = fusedpar.ParallelConfig(float8=pcfg.float8, float8_include=pcfg.float8_include,
                                      float8_exclude=pcfg.float8_exclude).validate(1)
        adapter = find_adapter(model)
        float8.convert(model, adapter.head(model), adapter.layout(model).layers, one,
                       activation_checkpointing=False, device_type=torch.device(device).type)
    return model


def synthetic_batch(tcfg: TrainConfig, vocab: int, step: int) -> torch.Tensor:
    """The global batch of ``step``: each row counts through the vocabulary from a random
    start with a random stride in 1..3 (learnable, so the loss falls), from ``(seed, step)``
    alone, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(tcfg.seed * 1_000_003 + step)
    start = torch.randint(vocab, (tcfg.batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (tcfg.batch_size, 1), generator=g)
    return (start + stride * torch.arange(tcfg.seq_len)) % vocab


# ---- the ranks --------------------------------------------------------------------------


def state_bytes(model, optimizer) -> dict:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards)."""
    def size(t):
        t = local(t)
        return t.numel() * t.element_size()

    params = list(model.parameters())
    return {"params": sum(size(p) for p in params),
            "grads": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(v) for state in optimizer.state.values()
                             for v in state.values() if isinstance(v, torch.Tensor))}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


class Progress:
    """One line per step on rank 0: redrawn in place (``\\r``) on a terminal, a new line
    otherwise (logs, pipes)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stdout.isatty()

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        width = 24
        done = int(width * (step + 1) / self.total)
        line = f"[{'#' * done}{'.' * (width - done)}] step {step + 1}/{self.total}  {text}"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)

    def close(self) -> None:
        if self.tty:
            print(flush=True)


def train_step(model, optimizer, input_ids: torch.Tensor, memory: dict | None = None,
               on_nonfinite: str = "stop"):
    """One AdamW step on the causal-LM loss of ``input_ids`` (the labels are the inputs;
    the model shifts them); returns the loss (the global batch's mean token loss).
    ``memory`` (a dict) receives :func:`state_bytes` while the gradients still exist. A NaN
    or Inf loss (the same on every rank) raises ``FloatingPointError``, or with
    ``on_nonfinite="skip"`` leaves the parameters and the optimizer as they were."""
    loss = forward_backward(model, input_ids, input_ids)
    if not torch.isfinite(loss):
        optimizer.zero_grad()
        if on_nonfinite != "skip":
            raise FloatingPointError(f"the loss is {float(loss)}")
        return loss
    optimizer.step()
    if memory is not None:
        memory.update(state_bytes(model, optimizer))
    optimizer.zero_grad()
    return loss


def rng_states(rank: int, device) -> dict[str, torch.Tensor]:
    """This rank's random-number generator states, as checkpoint entries of its own."""
    out = {f"rng/{rank}/cpu": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        out[f"rng/{rank}/cuda"] = torch.cuda.get_rng_state(device)
    return out


def resume(path: str, model, optimizer, rank: int, device) -> int:
    """Load the checkpoint ``path`` (DCP reshards it to this run's layout) and this rank's
    RNG states when it has them (saved at the same world size); returns its step."""
    import torch.distributed.checkpoint as dcp

    from fusedpar.parallel import checkpoint

    saved = set(dcp.FileSystemReader(checkpoint.readable(path)).read_metadata().state_dict_metadata)
    rng = {k: v.clone() for k, v in rng_states(rank, device).items() if k in saved}
    extra = {"step": torch.zeros((), dtype=torch.int64), **rng}
    checkpoint.load(path, model, optimizer, extra=extra)
    for key in rng:
        if key.endswith("/cuda"):
            torch.cuda.set_rng_state(extra[key], device)
        else:
            torch.set_rng_state(extra[key])
    return int(extra["step"])


def save_step(folder: str, done: int, model, optimizer, rank: int, device, keep: int | None,
              async_save: bool = False):
    """Checkpoint after ``done`` steps into ``folder/step-<done>``; returns ``finish()``,
    which waits for the write (``async_save``: DCP writes in the background meanwhile), then
    (rank 0) deletes all but the newest ``keep``, and returns the path. A failed write names
    the newest complete checkpoint left."""
    from torch.distributed.checkpoint.api import CheckpointException

    from fusedpar.parallel import checkpoint

    path = checkpoint.step_path(folder, done)

    def failed(e: BaseException) -> RuntimeError:
        kept = checkpoint.complete_steps(folder)
        return RuntimeError(f"saving step {done} into {path} failed ({_cause(e)}); the newest "
                            f"complete checkpoint is {kept[-1][1] if kept else 'none'}: make room "
                            "there and rerun with --resume auto")

    try:
        pending = checkpoint.save(path, model, optimizer, async_save=async_save,
                                  extra={"step": torch.tensor(done), **rng_states(rank, device)})
    except (Exception, CheckpointException) as e:
        raise failed(e) from e

    def finish() -> str:
        try:
            if pending is not None:
                pending.wait()
        except (Exception, CheckpointException) as e:
            raise failed(e) from e
        if rank == 0 and keep:
            checkpoint.prune(folder, keep)
        return path

    return finish


def _cause(e: BaseException) -> str:
    """The first underlying error of ``e`` (DCP's ``CheckpointException`` holds one per rank)."""
    failures = getattr(e, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    return f"{type(e).__name__}: {e}"


def train_rank(group, device, spec: dict) -> dict:
    """One rank's part (run by :mod:`fusedpar.cli.launch`): the parallel run and, on rank 0,
    the single-process run. Rank 0's result is the report's data."""
    import torch.distributed as dist

    pcfg = fusedpar.ParallelConfig(**spec["parallel"])
    tcfg = TrainConfig(**spec["train"])
    rank = dist.get_rank(group)
    vocab = model_config(tcfg).vocab_size
    model = parallel_model(tcfg, pcfg, device)
    global_batch = (inputs.Batches(inputs.open_data(tcfg.data, tcfg.data_dtype), tcfg.batch_size,
                                   tcfg.seq_len) if tcfg.data
                    else lambda step: synthetic_batch(tcfg, vocab, step))

    def batches(step):  # this data-parallel rank's rows of the global batch
        return fusedpar.parallel.shard_batch(global_batch(step), model.fusedpar_mesh).to(device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr)
    first = 0
    if spec.get("resume"):
        first = resume(spec["resume"], model, optimizer, rank, device)
        if first >= tcfg.steps:
            raise ValueError(f"the checkpoint in {spec['resume']} is at step {first}: ask for "
                             f"more steps (--steps > {first}) to continue")

    # pp: FSDP gathers a stage's units per microbatch, which these bounds do not count
    static = bounds.static_bounds(model, pcfg, tcfg.batch_size, tcfg.seq_len) if pcfg.pp == 1 else {}
    routed = bounds.RoutedRows(model, pcfg.param_dtype)
    progress = Progress(tcfg.steps, enabled=rank == 0)
    tokens = tcfg.batch_size * tcfg.seq_len
    record = {"losses": [], "seconds": [], "comm": [], "skipped": [], "saved": []}
    every = spec.get("save_every") or tcfg.steps
    saving = None  # finishes the last checkpoint (save_step)
    for step in range(first, tcfg.steps):
        start = time.perf_counter()
        mem = {}
        if torch.device(device).type == "cuda":  # the peak of the last step is reported
            torch.cuda.reset_peak_memory_stats()
        routed.start()
        with fusedpar.comm.count_bytes() as counter:
            try:
                loss = train_step(model, optimizer, batches(step), mem, spec.get("on_nonfinite", "stop"))
            except FloatingPointError as e:
                raise FloatingPointError(f"step {step + 1}, rank {rank}: {e}; the run stops here "
                                         "(--on-nonfinite skip skips such steps)") from None
        elapsed = time.perf_counter() - start
        record["losses"].append(float(loss))  # the global batch's: the same on every rank
        record["seconds"].append(elapsed)
        if not torch.isfinite(loss):
            record["skipped"].append(step + 1)
        comm = {op: 0 for op in static}
        for (op, _), n in counter.by_op().items():
            comm[op] = comm.get(op, 0) + n
        record["comm"].append(comm)
        moe = routed.bounds(set(comm)) if pcfg.pp == 1 else {}  # the last step's are reported
        record["lower_bounds"] = {**static, **{op: bound for op, (bound, _) in moe.items()}}
        record["per_copy_bytes"] = {op: copies for op, (_, copies) in moe.items()}
        record["state_bytes"] = mem or record.get("state_bytes", {})
        record["peak_bytes"] = (torch.cuda.max_memory_allocated() if torch.device(device).type == "cuda"
                                else None)
        note = "  (not finite: step skipped)" if step + 1 in record["skipped"] else ""
        progress.update(step, f"loss {record['losses'][-1]:.4f}  {tokens / elapsed:,.0f} tok/s  "
                              f"params+grads+optimizer {_fmt_bytes(sum(record['state_bytes'].values()))}"
                              f"/rank{note}")
        if spec.get("save") and ((step + 1) % every == 0 or step + 1 == tcfg.steps):
            if saving is not None:  # the previous one's background write
                record["saved"].append(saving())
            saving = save_step(spec["save"], step + 1, model, optimizer, rank, device,
                               spec.get("keep"), spec.get("async_save", False))
            if not spec.get("async_save"):  # written: prune now
                record["saved"].append(saving())
                saving = None
    if saving is not None:
        record["saved"].append(saving())
    progress.close()
    result = {"first_step": first, **record,
              "parameters": sum(p.numel() for p in build_model(tcfg, "meta").parameters())}
    if rank == 0 and spec["compare"]:
        print("single-process run of the same seed ...", flush=True)
        single = single_process_model(tcfg, pcfg, device)
        opt = torch.optim.AdamW(single.parameters(), lr=tcfg.lr)
        ref = [float(train_step(single, opt, global_batch(step).to(device)))
               for step in range(tcfg.steps)]
        result["reference_losses"] = ref[first:]
    return result


# ---- the command ------------------------------------------------------------------------


def max_rel_diff(losses: list[float], reference: list[float]) -> float:
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)), default=0.0)


def planned_peak(pcfg: fusedpar.ParallelConfig, tcfg: TrainConfig, cuda: bool) -> int | None:
    """The peak ``fusedpar.plan`` estimates for this run (``max_memory_allocated``'s):
    fp32 parameters, ``param_dtype`` compute; on CPU ranks torch's single-tensor AdamW and
    gloo's synchronous collectives (one FSDP unit unsharded at a time); with pp, the run's
    microbatches and schedule and rank 0's (the measured) first stage (None for a schedule
    the planner does not model)."""
    from fusedpar.plan import Candidate, Training, model_spec
    from fusedpar.plan.memory import PLANNED_SCHEDULES, stage_memories

    cand = Candidate.from_config(pcfg)
    micro = None
    if pcfg.pp > 1:
        if pcfg.pp_schedule not in PLANNED_SCHEDULES or pcfg.pp_stages_per_rank > 1:
            return None
        micro = tcfg.batch_size // pcfg.dp // (pcfg.pp_microbatches or pcfg.pp_stages)
    train = Training(seq_len=tcfg.seq_len, global_batch=tcfg.batch_size, micro_batch=micro,
                     compute_dtype=pcfg.param_dtype or "float32", foreach=cuda,
                     units_in_flight=2 if cuda else 1, fsdp_comm=pcfg.fsdp_comm,
                     pp_schedule=pcfg.pp_schedule if pcfg.pp > 1 else "1F1B",
                     float8=pcfg.float8, float8_all_gather=pcfg.float8_all_gather)
    stages = stage_memories(model_spec(model_config(tcfg)), cand, train)
    return stages["first" if pcfg.pp > 1 else "all"].peak


def report(result: dict, pcfg: fusedpar.ParallelConfig, tcfg: TrainConfig) -> list[str]:
    """The lines printed after the progress bar."""
    lines = []
    comm, lower = result["comm"][-1], result["lower_bounds"]
    per_copy = result["per_copy_bytes"]
    lines.append("communication per step (the last one): bytes rank 0 received through "
                 "fusedpar's ops, and the lower bound")
    if comm:
        width = max(len(k) for k in comm)
        for op, n in sorted(comm.items()):
            bound = lower.get(op)
            line = f"  {op:<{width}}  {n:>12,} B   lower bound " + (
                f"{bound:>12,} B   ratio {n / bound:.2f}" if bound else "-")
            if op in per_copy:
                line += f"   (a row per routed copy: {per_copy[op]:,} B)"
            lines.append(line)
    else:
        lines.append("  none (every collective ran on torch's)")
    mem = result["state_bytes"]
    lines.append(f"model: {result['parameters']:,} parameters; memory per rank: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in mem.items()))
    measured = result.get("peak_bytes")
    planned = planned_peak(pcfg, tcfg, measured is not None)
    lines.append(f"peak memory per rank: planned "
                 f"{_fmt_bytes(planned) if planned is not None else f'n/a ({pcfg.pp_schedule} not modelled)'} "
                 "(fusedpar.plan), measured " + (_fmt_bytes(measured) if measured is not None else
                                                  "n/a (CPU ranks: no allocator statistics)"))
    losses = result["losses"]
    lines.append(f"loss: {losses[0]:.4f} at step {result['first_step'] + 1} -> {losses[-1]:.4f} "
                 f"at step {tcfg.steps}")
    ref = result.get("reference_losses")
    if ref is not None:
        note = (f" (the parallel run computes in {pcfg.param_dtype}, the single process in "
                "float32)" if pcfg.param_dtype not in (None, "float32") else "")
        lines.append(f"loss curve vs one process, same seed: max relative difference "
                     f"{max_rel_diff(losses, ref):.2e} over {len(losses)} steps" + note)
    return lines


def _usage_problem(args) -> str | None:
    """Flags that make no sense together."""
    if args.save_every is not None and args.save_every < 1 or args.keep is not None and args.keep < 1:
        return "--save-every and --keep must be at least 1"
    if not args.save and (args.save_every or args.keep or args.async_save or args.resume == "auto"):
        return ("--save-every, --keep, --async-save and --resume auto act on the --save folder: "
                "give --save DIR")
    return None


def resume_path(resume: str | None, save: str | None) -> tuple[str | None, str | None]:
    """``(the checkpoint --resume names, a problem)``: ``auto`` the newest complete one in
    ``save`` (None while there is none); a ``--save`` folder its newest; a folder that a
    crashed save left incomplete is a problem."""
    from fusedpar.parallel import checkpoint

    if not resume:
        return None, None
    folder = save if resume == "auto" else os.path.abspath(resume)
    steps = checkpoint.complete_steps(folder)
    if steps:
        return steps[-1][1], None
    if resume == "auto":
        return None, None
    if os.path.isdir(folder) and any(os.scandir(folder)):
        try:
            checkpoint.readable(folder)
        except checkpoint.IncompleteCheckpointError as e:
            return None, f"--resume {resume}: {e}"
    return folder, None


def save_problem(folder: str, tcfg: TrainConfig) -> str | None:
    """Why ``--save folder`` would fail at the first checkpoint: not writable (a probe
    write), or less free space than one checkpoint (fp32 weights and two AdamW moments)."""
    import shutil

    probe = os.path.join(folder, f".fusedpar-probe-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(bytes(1 << 16))
            f.flush()
            os.fsync(f.fileno())
        os.unlink(probe)
    except OSError as e:
        return f"--save {folder}: cannot write there ({type(e).__name__}: {e}); choose a folder you can write"
    need = 12 * sum(p.numel() for p in build_model(tcfg, "meta").parameters())
    free = shutil.disk_usage(folder).free
    if free < need:
        return (f"--save {folder}: one checkpoint needs about {_fmt_bytes(need)} and only "
                f"{_fmt_bytes(free)} is free there; make room or choose another folder")
    return None


def run_spec(args, pcfg: fusedpar.ParallelConfig, tcfg: TrainConfig, resume: str | None) -> dict:
    """What every rank's :func:`train_rank` is given (JSON-able)."""
    return {"parallel": dataclasses.asdict(pcfg), "train": dataclasses.asdict(tcfg),
            "save": args.save and os.path.abspath(args.save), "save_every": args.save_every,
            "keep": args.keep, "async_save": args.async_save, "resume": resume,
            "on_nonfinite": args.on_nonfinite,
            "compare": not args.no_compare}


def run(args, parser) -> int:
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    usage = _usage_problem(args)
    if usage:
        parser.error(usage)
    torchrun = launch.under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (args.world_size or DEFAULT_WORLD)
    try:
        pcfg, tcfg, ignored = resolve(args, world)
    except fusedpar.ParallelConfigError as e:
        print(f"fusedpar train: {e}", file=sys.stderr)
        return 2
    save = args.save and os.path.abspath(args.save)
    resume, problem = resume_path(args.resume, save)
    spec = run_spec(args, pcfg, tcfg, resume)
    # what would fail on every rank after the model is built fails here, once
    problem = (problem or preflight.backend_problem()
               or (tcfg.model and inputs.model_problem(tcfg.model))
               or (tcfg.data and inputs.data_problem(tcfg.data, tcfg.data_dtype,
                                                     model_config(tcfg).vocab_size,
                                                     tcfg.batch_size, tcfg.seq_len))
               or (resume and preflight.resume_problem(resume, tcfg, build_model, model_name))
               or (save and save_problem(save, tcfg)))
    if problem:
        print(f"fusedpar train: {problem}", file=sys.stderr)
        return 2
    header = [f"fusedpar train: {model_name(tcfg)} model, {pcfg}, {tcfg.steps} steps of "
              f"{tcfg.batch_size} x {tcfg.seq_len} tokens "
              f"({f'from {tcfg.data}' if tcfg.data else 'synthetic'}), seed {tcfg.seed}"]
    if ignored:
        header.append(f"  (config keys not used by fusedpar train, ignored: {', '.join(ignored)})")
    if args.resume:
        header.append(f"  resuming from {resume}" if resume else
                      f"  --resume auto: no checkpoint in {save} yet, starting at step 0")
    if torchrun:
        import torch.distributed as dist

        with launch.torchrun_rank(args.timeout) as (device, backend):
            if dist.get_rank() == 0:
                print("\n".join(header) + f"\n  torchrun, {backend}", flush=True)
            result = train_rank(dist.group.WORLD, device, spec)
            if dist.get_rank() != 0:
                return 0
    else:
        device = launch.pick_device(args.device, world, parser)
        print("\n".join(header) + f"\n  {world} spawned processes, "
              f"{'nccl' if device == 'cuda' else 'gloo'}", flush=True)
        result, error = launch.spawn(train_rank, spec, world, device, args.timeout, "train",
                                     interpret=False)
        if error is not None:
            print(f"fusedpar train: {error}", file=sys.stderr, flush=True)
            return 130 if error == "interrupted" else 1
    print("\n".join(report(result, pcfg, tcfg)), flush=True)
    if args.metrics:
        with open(args.metrics, "w") as f:
            json.dump({"parallel": spec["parallel"], "train": spec["train"], **result}, f)
    return 0
