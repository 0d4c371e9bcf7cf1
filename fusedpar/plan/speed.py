"""Estimated step time of one config, and the device it runs on.

The model (a roofline, per rank, summed over the step):

- **compute** = training FLOPs / world / the device's peak matmul rate. FLOPs per token:
  ``6 x active parameters`` (forward 2, backward 4) plus causal attention
  ``6 x layers x seq x q_dim`` (``12 x .. / 2``); activation checkpointing adds one forward
  (``x 4/3``). The peak is the best measured matmul of this device where one exists
  (package data ``measured.json``, made from ``benchmarks/results`` by ``benchmarks/report.py``), else the datasheet's dense bf16 rate, labelled as such.
  No efficiency factor below 1: the estimate is a lower bound, meant for ranking.
  With ``float8`` the converted linears' GEMMs (:mod:`fusedpar.plan.float8`; all three of
  forward, input gradient and weight gradient, ``rowwise_with_gw_hp`` the first two) run at
  the fp8 peak: a measured fp8 matmul (``measured.json``'s ``float8_matmul_peaks``) where
  one exists, else twice the bf16 peak (H100 / H200 datasheets: dense fp8 is 2x bf16),
  labelled as assumed; A100 has no fp8 GEMM.
- **communication per axis**, ring algorithms, bytes this rank sends at the link's bandwidth
  (an axis whose ranks sit inside one node uses NVLink, else the network; ``tp`` is
  innermost, then ``cp``, ``dp_shard``, ``dp_replicate``, ``pp``):
  FSDP all-gathers each block twice (float8: the converted weights in fp8) and
  reduce-scatters its gradients once per micro-batch; HSDP/DDP all-reduce the gradients; TP/SP all-gathers and reduce-scatters
  ``[tokens, hidden]`` four times per block forward and backward (float8: the two gathers
  in fp8, the two reduce-scatters in float32 partials); CP passes K/V around the
  ring (forward once, backward K/V and their gradients); EP dispatches and combines each
  routed copy forward and backward; PP sends each micro-batch's activations and gradients.
- **exposed** communication: FSDP's gathers and the data-parallel reductions overlap the
  blocks' compute (exposed: what exceeds it, plus one block's gather that nothing hides);
  fusedpar's fused ops overlap TP with the GEMMs they feed, the CP ring with attention and
  the EP exchange with the grouped GEMMs (exposed: what exceeds that compute); without
  fusion (``fused=False``) TP, CP and EP communication is all exposed.
- **pipeline bubble**: 1F1B stretches compute by ``(m + pp - 1) / m`` for ``m`` micro-batches.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

from .float8 import converted, fsdp_all_gather_bytes
from .memory import Candidate, Training, dtype_bytes, micro_batches
from .model import ModelSpec, parameter_shapes

__all__ = ["DEVICES", "Device", "StepTime", "estimate_step_time", "measured_peak_tflops"]

GB = 1e9
GiB = 1 << 30

#: Datasheet values (dense bf16 TFLOP/s, memory, NVLink bandwidth per direction, dense fp8
#: over bf16 GEMM rate: 0 where there is no fp8 GEMM): NVIDIA's H100 SXM / H200 / A100 SXM
#: specifications. Network default: one 400 Gb/s NIC per GPU (50 GB/s).
_DATASHEET = {
    "H100": dict(memory=80 * GiB, tflops=989.0, nvlink=450.0, fp8=2.0),
    "H200": dict(memory=141 * GiB, tflops=989.0, nvlink=450.0, fp8=2.0),
    "A100": dict(memory=80 * GiB, tflops=312.0, nvlink=300.0, fp8=0.0),
}


@dataclasses.dataclass(frozen=True)
class Device:
    """One GPU kind and the cluster around it.

    ``peak_tflops`` and ``peak_source`` (where the number comes from: a benchmark row or
    the datasheet); ``nvlink_gbps`` / ``network_gbps``: bytes per second one GPU sends
    inside a node / across nodes (GB/s); ``context_bytes``: the CUDA context and library
    workspaces; ``fragmentation``: the allocator's reserve over the peak, as a fraction;
    ``symmetric``: fusedpar's fused backends (symmetric memory) run here;
    ``fp8_peak_tflops`` / ``fp8_peak_source``: the fp8 GEMM rate (0: none) and where it comes
    from.
    """

    name: str
    memory: int
    peak_tflops: float
    peak_source: str
    gpus_per_node: int = 8
    nvlink_gbps: float = 450.0
    network_gbps: float = 50.0
    context_bytes: int = GiB
    fragmentation: float = 0.05
    symmetric: bool = True
    fp8_peak_tflops: float = 0.0
    fp8_peak_source: str = "no fp8 GEMM"

    def reserve(self, peak: int) -> int:
        """Bytes the GPU needs beyond the allocated peak: context + fragmentation (stated
        defaults, override per cluster)."""
        return int(self.context_bytes + self.fragmentation * peak)

    @classmethod
    def named(cls, name: str = "H100", memory: int | None = None, **overrides) -> Device:
        """A datasheet device (``"H100"``, ``"H200"``, ``"A100"``), its peak replaced by the
        best measured matmul of that GPU when one exists (:func:`measured_peak_tflops`)."""
        key = next((k for k in _DATASHEET if k.lower() in name.lower()), None)
        if key is None:
            raise ValueError(f"unknown GPU {name!r}: choose one of {sorted(_DATASHEET)} or build "
                             "Device(...) with its numbers")
        sheet = _DATASHEET[key]
        measured = measured_peak_tflops(key)
        peak, source = ((measured[0], f"measured: {measured[1]}") if measured else
                        (sheet["tflops"], f"{key} datasheet dense bf16 (no benchmark row)"))
        fp8 = measured_peak_tflops(key, "float8_matmul_peaks")
        fp8_peak, fp8_source = ((fp8[0], f"measured: {fp8[1]}") if fp8 else
                                (sheet["fp8"] * peak, f"assumed: {sheet['fp8']:g}x the bf16 peak, the {key} "
                                 "datasheet ratio; no fp8 matmul measured") if sheet["fp8"] else
                                (0.0, f"{key} has no fp8 GEMM"))
        fields = dict(name=key, memory=memory or sheet["memory"], peak_tflops=peak, peak_source=source,
                      nvlink_gbps=sheet["nvlink"], fp8_peak_tflops=fp8_peak, fp8_peak_source=fp8_source)
        fields.update(overrides)
        return cls(**fields)


def measured_peak_tflops(gpu: str, kind: str = "matmul_peaks") -> tuple[float, str] | None:
    """``(tflops, source)`` of the fastest measured matmul of a device whose name contains
    ``gpu``, or None: the package data ``fusedpar/plan/measured.json``, which
    ``benchmarks/report.py`` regenerates from the committed ``matmul_roofline`` rows (so an
    installed wheel and a checkout plan the same). ``kind``: ``"matmul_peaks"`` (bf16) or
    ``"float8_matmul_peaks"`` (fp8 GEMMs; absent until measured)."""
    facts = json.loads(resources.files(__package__).joinpath("measured.json").read_text())
    rows = [r for r in facts.get(kind, []) if gpu.lower() in r["device"].lower()]
    best = max(rows, key=lambda r: r["tflops"], default=None)
    return None if best is None else (best["tflops"], best["source"])


DEVICES = tuple(_DATASHEET)


@dataclasses.dataclass
class StepTime:
    """Seconds per step: ``compute`` (with the pipeline bubble), the communication of each
    axis (``comm``) and the part of it nothing hides (``exposed``); ``total`` = compute +
    every exposed part. ``all_gather_bytes``: what one rank receives through FSDP's
    all-gathers per step (:func:`fusedpar.plan.float8.fsdp_all_gather_bytes` per micro-batch)."""

    compute: float
    bubble: float
    comm: dict[str, float]
    exposed: dict[str, float]
    all_gather_bytes: int = 0

    @property
    def total(self) -> float:
        return self.compute + sum(self.exposed.values())


def training_flops(spec: ModelSpec, train: Training, activation_checkpointing: bool) -> tuple[float, float]:
    """FLOPs of one step over the whole global batch: ``(all, the part in fp8 GEMMs)``."""
    tokens = train.global_batch * train.seq_len
    attention = 6 * spec.layers * train.seq_len * spec.q_dim  # causal: half of 12 L s d
    per_token = 6 * spec.active_parameters() + attention
    fp8 = converted(spec) if train.float8 else set()
    gemms = 4 if train.float8 == "rowwise_with_gw_hp" else 6  # its weight gradient in high precision
    fp8_per_token = gemms * sum(t.numel for t in parameter_shapes(spec, 1, 1) if t.name in fp8)
    scale = 4 / 3 if activation_checkpointing else 1
    return per_token * tokens * scale, fp8_per_token * tokens * scale


def _bandwidth(cand: Candidate, axis: str, device: Device, nodes: int) -> float:
    """Bytes/s of ``axis``'s links: NVLink if its ranks share a node, else the network. A
    group spans its own size times every axis inside it (``tp`` innermost, then ``cp``,
    ``dp_shard``, ``dp_replicate``, ``pp``; ``ep`` borrows the innermost ranks)."""
    span = {"tp": cand.tp, "ep": cand.ep, "cp": cand.tp * cand.cp,
            "dp_shard": cand.tp * cand.cp * cand.dp_shard,
            "dp_replicate": cand.tp * cand.cp * cand.dp, "pp": cand.world}[axis]
    one_node = nodes == 1 or span <= device.gpus_per_node
    return (device.nvlink_gbps if one_node else device.network_gbps) * GB


def estimate_step_time(spec: ModelSpec, cand: Candidate, train: Training, device: Device,
                       nodes: int = 1, fused: bool = True) -> StepTime:
    """:class:`StepTime` of ``cand`` (see the module docstring for the model)."""
    c, r = dtype_bytes(train.compute_dtype), dtype_bytes(train.reduce_dtype)
    micro, count = micro_batches(cand, train)
    flops, fp8_flops = training_flops(spec, train, cand.activation_checkpointing)
    if train.float8 and not device.fp8_peak_tflops:
        raise ValueError(f"float8={train.float8!r} on {device.name}: {device.fp8_peak_source} "
                         "(torch._scaled_mm needs sm_89 or later); plan it for H100 or H200, or "
                         "give Device(fp8_peak_tflops=...)")
    peak = device.peak_tflops * 1e12
    compute_plain = (flops - fp8_flops) / cand.world / peak
    if fp8_flops:
        compute_plain += fp8_flops / cand.world / (device.fp8_peak_tflops * 1e12)
    bubble = (count + cand.pp - 1) / count if cand.pp > 1 else 1.0
    compute = compute_plain * bubble
    tokens = micro * train.seq_len // cand.cp  # per rank per forward
    layers = -(-spec.layers // cand.pp)
    shapes = parameter_shapes(spec, cand.tp, cand.ep)
    stage_params = sum(t.numel * layers // spec.layers if t.stage == "layer" else t.numel for t in shapes)
    gathered = fsdp_all_gather_bytes(spec, cand, train, c, layers)  # per micro-batch
    experts = sum(t.numel for t in shapes if t.unit == "experts") * layers // spec.layers
    comm, exposed = {}, {}
    bw = lambda axis: _bandwidth(cand, axis, device, nodes)  # noqa: E731
    ring = lambda n: (n - 1) / n  # noqa: E731 - the fraction a rank sends in a ring collective
    if cand.fsdp > 1 or (cand.ep > 1 and cand.efsdp > 1):
        # all-gather forward and backward, reduce-scatter the gradients: per micro-batch
        fsdp_bytes = count * (gathered + stage_params * r * ring(cand.fsdp))
        comm["fsdp"] = fsdp_bytes / bw("dp_shard")
        first_unit = gathered / 2 / max(layers, 1) / bw("dp_shard")
        exposed["fsdp"] = max(0.0, comm["fsdp"] - compute_plain) + first_unit
    if cand.dp_replicate > 1:
        shard = (stage_params - experts) / cand.fsdp + experts / max(cand.efsdp, 1)
        comm["dp_replicate"] = 2 * shard * r * ring(cand.dp_replicate) / bw("dp_replicate")
        exposed["dp_replicate"] = max(0.0, comm["dp_replicate"] - compute_plain * 2 / 3)
    # one micro-batch's causal attention FLOPs on this rank (forward + backward)
    attention_flops = 6 * layers * tokens * train.seq_len * spec.q_dim / cand.tp
    if cand.tp > 1:
        per_elem = 4 * 1 + 4 * 4 if train.float8 else 8 * c  # fp8 gathers, float32 partials
        tp_bytes = count * layers * per_elem * tokens * spec.hidden * ring(cand.tp)
        comm["tp"] = tp_bytes / bw("tp")
        gemm = compute_plain - count * attention_flops / peak
        exposed["tp"] = max(0.0, comm["tp"] - gemm) if fused else comm["tp"]
    if cand.cp > 1:
        kv = 2 * tokens * spec.kv_dim // cand.tp * c
        cp_bytes = count * layers * 3 * kv * (cand.cp - 1)
        comm["cp"] = cp_bytes / bw("cp")
        exposed["cp"] = max(0.0, comm["cp"] - count * attention_flops / peak) if fused else comm["cp"]
    if cand.ep > 1:
        rows = (tokens // cand.tp) * spec.top_k * train.capacity_factor
        ep_bytes = count * layers * 4 * rows * spec.hidden * c * ring(cand.ep)
        comm["ep"] = ep_bytes / bw("ep")
        expert_flops = count * layers * 6 * rows * 3 * spec.hidden * spec.expert_intermediate
        exposed["ep"] = max(0.0, comm["ep"] - expert_flops / peak) if fused else comm["ep"]
    if cand.pp > 1:
        comm["pp"] = count * 2 * tokens * spec.hidden * c / bw("pp")
        exposed["pp"] = comm["pp"] / count  # the first micro-batch's sends wait; later ones overlap
    return StepTime(compute=compute, bubble=bubble, comm=comm, exposed=exposed, all_gather_bytes=count * gathered)
