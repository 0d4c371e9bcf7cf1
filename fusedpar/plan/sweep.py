"""``fusedpar.plan(...)``: every parallel config of a world size, its memory per rank and
step time, the ones that fit fastest first; as a table, JSON, or a stacked-bar plot."""

from __future__ import annotations

import dataclasses
import json

from .float8 import converted
from .memory import Candidate, Memory, Training, estimate_memory, micro_batches
from .model import ModelSpec, model_spec, parameter_shapes
from .speed import Device, StepTime, estimate_step_time

__all__ = ["Estimate", "Plan", "candidates", "estimate", "parse_bytes", "plan"]

GiB = 1 << 30


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"``, ``"24GB"``, ``"512MiB"`` or a number of bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    units = {"gib": 1 << 30, "gb": 10**9, "mib": 1 << 20, "mb": 10**6, "kib": 1 << 10, "kb": 10**3, "b": 1}
    s = text.strip().lower().replace(" ", "")
    for unit, scale in units.items():
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * scale)
            except ValueError:
                break
    try:
        return int(float(s))
    except ValueError:
        raise ValueError(f"memory size {text!r}: write it as e.g. 80GiB, 24GB, 512MiB or a "
                         "number of bytes") from None


@dataclasses.dataclass
class Estimate:
    """One config: its memory per rank, its step time, whether ``total`` fits the GPU."""

    candidate: Candidate
    memory: Memory
    time: StepTime
    gpu_memory: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu_memory

    @property
    def over_by(self) -> int:
        """Bytes beyond the GPU's memory (negative: headroom)."""
        return self.memory.total - self.gpu_memory

    def to_dict(self) -> dict:
        m, t = self.memory, self.time
        return {"config": self.candidate.name, **dataclasses.asdict(self.candidate),
                "fits": self.fits, "over_by_bytes": self.over_by,
                "memory": {**m.breakdown(), "peak": m.peak, "total": m.total, "phase": m.phase,
                           "stage": m.stage},
                "fsdp_all_gather_bytes": t.all_gather_bytes, "step_seconds": t.total,
                "compute_seconds": t.compute, "bubble": t.bubble,
                "comm_seconds": t.comm, "exposed_seconds": t.exposed}


def estimate(model, candidate: Candidate, train: Training, device: Device, *, nodes: int = 1,
             fused: bool = True) -> Estimate:
    """The :class:`Estimate` of one user-picked config."""
    spec = model_spec(model)
    return Estimate(candidate, estimate_memory(spec, candidate, train, device),
                    estimate_step_time(spec, candidate, train, device, nodes, fused), device.memory)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(spec: ModelSpec, world: int, train: Training, *, gpus_per_node: int = 8,
               activation_checkpointing: bool | None = None, max_pp: int | None = None) -> list[Candidate]:
    """Every config the model and batch allow: ``pp`` dividing the layers' count sensibly,
    ``tp`` inside a node dividing the heads, KV heads, vocabulary and intermediate size, ``cp``
    with ``seq_len`` divisible by ``2 cp``, data parallelism as FSDP (``dp_shard``), DDP
    (``dp_replicate``) or HSDP (sharded inside a node, replicated across), ``ep`` dividing
    the experts (MoE models), each with and without activation checkpointing (or as
    ``activation_checkpointing`` says); float8 runs with every one of them."""
    acs = (False, True) if activation_checkpointing is None else (activation_checkpointing,)
    out = []
    axes = set(spec.axes)
    for pp in _divisors(world):
        # parallelize refuses a tied head under pp (first and last stages on other ranks)
        if pp > min(spec.layers, max_pp or spec.layers) or pp > 1 and ("pp" not in axes or spec.tie_embeddings):
            continue
        for tp in _divisors(world // pp):
            if tp > gpus_per_node or tp > 1 and "tp" not in axes or any(
                    n % tp for n in (spec.heads, spec.kv_heads, spec.vocab, spec.intermediate)):
                continue
            for cp in _divisors(world // (pp * tp)) if "cp" in axes else [1]:
                if train.seq_len % (2 * cp) or (tp > 1 and (train.seq_len // cp) % tp):
                    continue
                dp = world // (pp * tp * cp)
                shards = {dp, 1} | {s for s in _divisors(dp) if s * tp * cp == gpus_per_node}
                for shard in sorted(shards, reverse=True):
                    for ep in (_divisors(spec.experts) if spec.moe and "ep" in axes else [1]):
                        if (shard * cp * tp) % ep:
                            continue
                        for ac in acs:
                            cand = Candidate(dp_replicate=dp // shard, dp_shard=shard, cp=cp, tp=tp,
                                             ep=ep, pp=pp, activation_checkpointing=ac)
                            try:
                                micro, count = micro_batches(cand, train)
                            except ValueError:
                                continue
                            if pp > 1 and count < pp:  # fewer micro-batches than stages
                                continue
                            out.append(cand)
    return out


@dataclasses.dataclass
class Plan:
    """Every config's :class:`Estimate`: ``fits`` (fastest first) and ``misfits`` (closest
    to fitting first)."""

    model: ModelSpec
    world: int
    nodes: int
    train: Training
    device: Device
    estimates: list[Estimate]

    @property
    def fits(self) -> list[Estimate]:
        return sorted((e for e in self.estimates if e.fits), key=lambda e: e.time.total)

    @property
    def misfits(self) -> list[Estimate]:
        return sorted((e for e in self.estimates if not e.fits), key=lambda e: e.over_by)

    def find(self, name: str) -> Estimate:
        """The estimate of the config called ``name`` (e.g. ``"fsdp2"``, ``"tp2 x fsdp4 +AC"``)."""
        for e in self.estimates:
            if e.candidate.name == name:
                return e
        raise KeyError(f"no config {name!r} in this plan; it has "
                       f"{', '.join(e.candidate.name for e in self.estimates)}")

    def header(self) -> list[str]:
        t, d, m = self.train, self.device, self.model
        return [f"{m.name}: {m.num_parameters() / 1e9:.2f}B parameters"
                + (f" ({m.active_parameters() / 1e9:.2f}B active)" if m.moe else "")
                + f" on {self.world} x {d.name} ({self.nodes} node{'s' * (self.nodes > 1)}, "
                f"{d.memory / GiB:.0f} GiB each)",
                f"  seq {t.seq_len}, global batch {t.global_batch}, params {t.param_dtype}, compute "
                f"{t.compute_dtype}, reduce {t.reduce_dtype}, {t.optimizer}",
                f"  peak {d.peak_tflops:.0f} TFLOP/s ({d.peak_source}); links {d.nvlink_gbps:.0f} GB/s "
                f"inside a node, {d.network_gbps:.0f} GB/s across (defaults unless overridden)",
                f"  reserve per GPU: {d.context_bytes / GiB:.2f} GiB CUDA context + "
                f"{d.fragmentation:.0%} of the peak for fragmentation (assumed, not measured)",
                *self._float8_lines()]

    def _float8_lines(self) -> list[str]:
        """What a float8 plan assumed (:mod:`fusedpar.plan.float8`)."""
        t, m = self.train, self.model
        if not t.float8:
            return []
        shapes = parameter_shapes(m, 1, 1)
        fp8 = converted(m)
        share = sum(s.numel for s in shapes if s.name in fp8) / max(m.num_parameters(), 1)
        if not t.float8_all_gather:
            gather = f"in {t.compute_dtype} (float8_all_gather off)"
        elif t.float8 == "tensorwise":
            gather = "in fp8, 1 B an element (the scale is all-reduced beforehand, not gathered)"
        else:
            gather = ("in fp8 with a float32 scale per row, forward and again backward (decoder layers "
                      f"whose rows divide the shard degree, not with AC; else in {t.compute_dtype})")
        return [f"  float8 {t.float8}: {', '.join(sorted(fp8)) or 'no linear'} in fp8 ({share:.0%} of the "
                f"parameters; not the head, nor dims that are not multiples of 16); FSDP all-gathers them "
                f"{gather}, under tp in {t.compute_dtype} (tp's gathers move fp8 inputs)",
                f"  fp8 GEMM peak {self.device.fp8_peak_tflops:.0f} TFLOP/s ({self.device.fp8_peak_source})"
                + ("; the weight gradient in high precision" if t.float8 == "rowwise_with_gw_hp" else "")]

    def table(self, limit: int | None = None) -> str:
        """The fitting configs fastest first with their memory breakdown, then the rest
        with how much they lack."""
        lines = self.header()
        cols = ("params", "grads", "optimizer", "activations", "fsdp unsharded", "transient", "symmetric")
        head = f"  {'config':<26} {'step s':>8} {'tok/s/gpu':>10} {'total':>8}  " + " ".join(
            f"{c[:9]:>9}" for c in cols) + f" {'fsdp AG':>9}  peak at"
        tokens = self.train.global_batch * self.train.seq_len

        def row(e: Estimate) -> str:
            b = e.memory.breakdown()
            return (f"  {e.candidate.name:<26} {e.time.total:>8.3f} {tokens / e.time.total / self.world:>10,.0f} "
                    f"{_gib(e.memory.total):>8}  " + " ".join(f"{_gib(b[c]):>9}" for c in cols)
                    + f" {_gib(e.time.all_gather_bytes):>9}  {e.memory.phase}")

        fits, misfits = self.fits, self.misfits
        lines += ["", f"fits ({len(fits)}), fastest first (GiB per GPU; fsdp AG: received through "
                      "FSDP's all-gathers per step):", head]
        lines += [row(e) for e in fits[:limit]] or ["  none"]
        lines += ["", f"does not fit ({len(misfits)}), closest first:"]
        lines += [f"  {e.candidate.name:<26} needs {_gib(e.memory.total)} GiB: {_gib(e.over_by)} GiB "
                  f"over {_gib(e.gpu_memory)}" for e in misfits[:limit]] or ["  none"]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"model": dataclasses.asdict(self.model), "world": self.world, "nodes": self.nodes,
                           "train": dataclasses.asdict(self.train), "device": dataclasses.asdict(self.device),
                           "fits": [e.to_dict() for e in self.fits],
                           "misfits": [e.to_dict() for e in self.misfits]}, indent=1)

    def plot(self, path: str, limit: int = 24) -> None:
        """A stacked bar per config (fitting ones fastest first, then the closest misfits)
        of its memory per GPU, and the GPU's memory as a line. Needs matplotlib
        (``pip install 'fusedpar[bench]'``): raises ``ImportError`` saying so."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("the plot needs matplotlib: pip install 'fusedpar[bench]'") from None
        shown = (self.fits + self.misfits)[:limit]
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(shown) + 2), 5))
        bottoms = [0.0] * len(shown)
        for key in shown[0].memory.breakdown() if shown else ():
            values = [e.memory.breakdown()[key] / GiB for e in shown]
            ax.bar(range(len(shown)), values, bottom=bottoms, label=key)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.axhline(self.device.memory / GiB, color="black", linestyle="--", label="GPU memory")
        ax.set_xticks(range(len(shown)), [e.candidate.name for e in shown], rotation=60, ha="right",
                      fontsize=7)
        ax.set_ylabel("GiB per GPU")
        ax.set_title(f"{self.model.name} on {self.world} x {self.device.name}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def plan(model, world: int, gpu_memory: int | str | None = None, *, seq_len: int, global_batch: int,
         micro_batch: int | None = None, param_dtype: str = "float32", compute_dtype: str = "bfloat16",
         reduce_dtype: str = "float32", optimizer: str = "adamw",
         activation_checkpointing: bool | None = None, gpu: str = "H100", nodes: int = 1,
         fused: bool = True, device: Device | None = None, max_pp: int | None = None,
         pp_schedule: str = "1F1B", float8: str | None = None, float8_all_gather: bool = True) -> Plan:
    """Estimate every parallel config of ``world`` GPUs (``nodes`` nodes) for ``model`` (a
    fusedpar or Hugging Face config, a model holding one, a config JSON path or a
    :class:`ModelSpec`) and return the :class:`Plan`.

    ``gpu_memory`` (bytes or ``"80GiB"``; default: the GPU's) is what each GPU holds;
    ``gpu`` names the datasheet device (its peak replaced by a measured benchmark row when
    one exists), or pass ``device``. ``activation_checkpointing``: None tries both.
    ``fused``: fusedpar's fused ops hide TP / CP / EP communication behind compute.
    ``pp_schedule``: the pipeline schedule of the pp > 1 configs (``"1F1B"`` or ``"GPipe"``).
    ``float8``: a torchao recipe (``ParallelConfig.float8``) and ``float8_all_gather``
    (see :mod:`fusedpar.plan.float8`); the plan's header says what it assumed.

    Plain-PyTorch equivalent: none; torchtitan's estimator runs one config under fake
    tensors (see :func:`fusedpar.plan.dry_run`), DeepSpeed's counts model states only.
    """
    spec = model_spec(model)
    if world < 1 or nodes < 1 or world % nodes:
        raise ValueError(f"world={world} GPUs on nodes={nodes}: both positive, world a multiple of nodes")
    if device is None:
        device = Device.named(gpu, memory=None if gpu_memory is None else parse_bytes(gpu_memory),
                              gpus_per_node=world // nodes)
    elif gpu_memory is not None:
        device = dataclasses.replace(device, memory=parse_bytes(gpu_memory))
    if float8 and not converted(spec):
        raise ValueError(f"float8={float8!r}: {spec.name} has no linear layer float8 converts (nn.Linear "
                         "with dims that are multiples of 16, not the head), as parallelize would "
                         "refuse; plan it without --float8")
    train = Training(seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch,
                     param_dtype=param_dtype, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                     optimizer=optimizer, pp_schedule=pp_schedule, float8=float8,
                     float8_all_gather=float8_all_gather)
    found = candidates(spec, world, train, gpus_per_node=device.gpus_per_node,
                       activation_checkpointing=activation_checkpointing, max_pp=max_pp)
    if not found:
        raise ValueError(f"no parallel config of {world} GPUs fits global_batch={global_batch}, "
                         f"micro_batch={micro_batch}, seq_len={seq_len}: make the batch a multiple "
                         "of the data-parallel degree")
    return Plan(spec, world, nodes, train, device,
                [estimate(spec, cand, train, device, nodes=nodes, fused=fused) for cand in found])

