"""train_step: one training step (forward, backward, ``optimizer.step()``, ``zero_grad()``) of
a ~1B Llama on ONE GPU, fusedpar next to plain torch (docs/design.md §6).

The model: ``fusedpar.models.LlamaForCausalLM`` shaped as Llama-3.2-1B (hidden 2048, 16 layers,
32 heads, 8 KV heads, intermediate 8192, vocabulary 128256, tied embeddings, rope theta 5e5):
1,235,814,400 parameters, weights drawn N(0, 0.02) (Hugging Face's ``initializer_range``; the
first loss is about ln 128256 = 11.8). One sequence of 4096 tokens per step (``BATCH x SEQ``),
random tokens, labels = inputs.

Precision: fp32 master weights with bf16 compute through FSDP2's ``MixedPrecisionPolicy(
param_dtype=bfloat16, reduce_dtype=float32)`` (torchtitan's recipe, and ``fusedpar train``'s
``--param-dtype bfloat16``), AdamW (``fused=True``, as torchtitan) on the fp32 parameters: the
way plain-torch users train in bf16 without losing small updates. Memory: 16 bytes per
parameter of model state (fp32 weights, gradients, AdamW's two moments) = 19.8 GB, plus the
bf16 copies of one FSDP unit, ~10 GB of activations and ~7 GB of fp32 logits and their gradient
at 128k vocabulary; ``fusedpar plan`` puts the peak at 31 GiB (one 80 GB H100 holds it; two
sequences: 45 GiB). One sequence keeps each case short in ``.ci/gpu all``'s headline stage;
a second would add nothing but time to the comparison (the same kernels, twice as long).

Rows (``test_step``, one GPU on a one-rank group: conftest's ``one_rank_group``), in order:

- ``torch`` (the baseline): the plain model, ``fully_shard`` on each decoder layer and the root
  (world 1), SDPA attention (the model's own core), eager;
- ``auto``: ``fusedpar.parallelize(model, {"dp_shard_size": -1, "param_dtype": "bfloat16",
  "reduce_dtype": "float32"})``, every op's backend left to the dispatcher: what a user
  gets. Target (targets.py): >= 1.0x the ``torch`` row within noise (``AUTO_TARGET``, judged
  by conftest's ``record_row`` and report.py). At world 1 FSDP2 (torch >= 2.9) runs no
  collective at all, so no fusedpar op runs in this step (``fusedpar_ops=none`` in its notes:
  the ops fusedpar's byte counters saw; checked on CPU by ``test_steps_on_cpu``): the row
  prices ``parallelize``'s own forward (the batch checks, the mean loss over the global
  batch) against the plain model's, i.e. that fusedpar costs nothing where it has nothing
  to fuse;
- ``float8.tensorwise``, ``float8.rowwise``: the auto case with ``"float8": recipe``
  (fusedpar's float8 training through torchao's recipes, eager: torchao's casts unfused, as
  ``fusedpar train --float8`` runs them); target (issue 45): >= 1.2x the ``torch`` row's
  tokens/s (``x_torch``, a target line; skipped where torchao is not installed);
- ``torch.compile``: the plain model with each decoder layer compiled before ``fully_shard``
  (``layer.compile(fullgraph=True)``, torchtitan's way: one graph serves all 16 layers), the
  embedding, head and loss eager; no target (``x_torch``: its speed-up over the torch row);
- ``float8.tensorwise.compile``, ``float8.rowwise.compile``: the float8 cases with each decoder
  layer compiled after ``parallelize`` (torchao's and torchtitan's float8 runs compile: eager
  runs every amax and cast as kernels of their own, and torchao's users measured eager float8
  slower than bf16, pytorch/ao#685); target: >= 1.2x the ``torch.compile`` row (``x_compiled``:
  bf16 against float8, both compiled).

Times: CUDA events after warm-up (``gpu_times``: do_bench with ``TIMING``; two checked steps
run first, each loss finite); a step includes ``optimizer.step()`` and ``zero_grad()``. Each
row notes ``tokens_per_s``; ``tflops``, the model FLOPs per second: ``6 x P x tokens`` (P: every
parameter but the embedding table, whose lookup multiplies nothing; the tied head counts, as
its matmul runs: ``flop_params``) plus causal attention's ``6 x layers x B x S^2 x heads x
head_dim`` (forward 2 B S^2 H D, half the full scores, backward twice that; ``step_flops``);
``mfu_pct``: that over the device's dense bf16 datasheet peak (``peak_tflops``: H100 SXM and
H200 989 TFLOP/s, n/a for a GPU not in ``PEAK_BF16_TFLOPS``); ``pct_roofline``: over the
session's measured ``matmul_roofline``; ``gpu_busy_ms``, ``host_ms`` (a step's GPU busy time and
host time, as the other suites), ``peak_mem_gib`` (``max_memory_allocated``) and the first
``loss``. ``gbps`` is the fp32 parameters' bytes (what AdamW rewrites once a step) over the
median: not a link's bandwidth. A profile of one step goes to ``results/profiles/``. Without a
GPU the rows skip: no number is ever invented.

GPU time per case (estimates; not yet run on a GPU): building and sharding the model on the GPU ~1
s, the first steps (cuBLAS, SDPA, AdamW's state) ~2-3 s, then ~25 steps of ~75 ms (34 TFLOP each)
for the timing, profile, host time and pytest-benchmark's rounds, and the profile's processing:
~6-10 s for each of ``torch``, ``auto`` and the eager float8 rows, which are in ``.ci/gpu
all``'s headline stage (``HEADLINE``, after the fused ops). Each compiled row adds Inductor's
compile of one layer's forward and backward, ~30-60 s on a fresh cache: they run in the
``bench`` stage (60 s for every remaining row, 45 s a test), which they may not reach or may
exceed; every row with no such limit: ``.ci/gpu bench -k bench_train`` (~3-4 minutes).

``test_steps_on_cpu`` (CPU, no timing, a few seconds): every case's build and step code (but
rowwise's on torch 2.11, whose CPU ``_scaled_mm`` takes no rowwise scales) at a tiny size on a
one-rank gloo group: the losses finite, falling, and the same in every case (float8 within its
rounding; compiled float8 as eager float8); the compiled layers share one graph (Dynamo's
``eager`` backend there: no C++ or Triton codegen on CPU).
"""

import contextlib
import dataclasses
import gc
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.models import LlamaConfig, LlamaForCausalLM

from common import AUTO, DTYPE, counted, gpu_profile, host_ms, name, or_skip

OP = "train_step"
BASELINE, COMPILED = "torch", "torch.compile"
# fusedpar's float8 training (config key "float8", torchao's recipes), eager like the auto row,
# and with each decoder layer compiled after parallelize (torchao and torchtitan compile float8:
# Inductor fuses the amax and cast kernels that eager runs one by one)
FLOAT8 = {"float8.tensorwise": "tensorwise", "float8.rowwise": "rowwise"}
FLOAT8_COMPILED = {"float8.tensorwise.compile": "tensorwise", "float8.rowwise.compile": "rowwise"}
RECIPES = {**FLOAT8, **FLOAT8_COMPILED}  # every float8 row's recipe
COMPILES = {COMPILED, *FLOAT8_COMPILED}  # the rows whose layers are compiled
FLOAT8_TARGET = 1.2  # issue 45: float8 at least 1.2x bf16 tokens/s at 1B+ parameters
# the baselines first: the others' ratios are to them (compiled float8's to torch.compile's)
BACKENDS = [BASELINE, AUTO, *FLOAT8, COMPILED, *FLOAT8_COMPILED]
CONFIG = LlamaConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                     intermediate_size=8192, max_seq_len=4096, rope_theta=500000.0, tie_embeddings=True)
BATCH, SEQ = 1, 4096
SHAPE = (BATCH, SEQ, CONFIG.hidden_size, CONFIG.num_layers)
INIT_STD = 0.02
LR = 3e-4
# FSDP2's mixed precision, as fusedpar's config keys (the plain cases: the same policy)
MIXED = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
CHECKED_STEPS = 2  # run (and their losses checked) before the timing
TIMING = {"warmup_ms": 1, "rep_ms": 600}  # do_bench: ~8 timed steps of ~75 ms after its estimate
# dense bf16 tensor-core TFLOP/s by device name (datasheets), the first name found in
# torch.cuda.get_device_name() (so "H100 PCIe" before "H100"; GH200 has H200's)
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("H800", 989.0), ("A100", 312.0), ("A800", 312.0), ("B200", 2250.0))
_medians: dict[str, float] = {}


# ---- the cases (CPU too) ------------------------------------------------------------------------


def flop_params(config: LlamaConfig) -> int:
    """The parameters whose matmuls a token runs: each layer's projections and norms, the final
    norm and the head (counted tied or not); not the embedding table (a lookup)."""
    h, d = config.hidden_size, config.head_dim
    attention = h * d * 2 * (config.num_heads + config.num_kv_heads)  # q and o; k and v
    layer = attention + 3 * h * config.intermediate_size + 2 * h
    return config.num_layers * layer + h + config.vocab_size * h


def total_params(config: LlamaConfig) -> int:
    """The model's parameters (a tied head shares the embedding table's)."""
    return flop_params(config) + (0 if config.tie_embeddings else config.vocab_size * config.hidden_size)


def step_flops(config: LlamaConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (forward and backward, no recomputation)."""
    dense = 6 * flop_params(config) * batch * seq
    attention = 6 * config.num_layers * batch * seq * seq * config.num_heads * config.head_dim
    return float(dense + attention)


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 datasheet peak of the named GPU (``PEAK_BF16_TFLOPS``), None if unknown."""
    return next((tflops for part, tflops in PEAK_BF16_TFLOPS if part.lower() in device_name.lower()),
                None)


def build(backend: str, config: LlamaConfig, device: torch.device, *, compiler: str = "inductor",
          seed: int = 0):
    """``(model, optimizer)`` of one case (``BACKENDS``) on the default process group (one
    rank): the model built on ``device`` itself, its weights N(0, INIT_STD), then parallelized
    by fusedpar (``AUTO``) or ``fully_shard`` per layer and root with the same mixed precision
    (``COMPILED``: each layer compiled by ``compiler`` first); AdamW on its parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device(device):  # no fp32 copy of 1.2B parameters on the host
        model = LlamaForCausalLM(config, device=device, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, INIT_STD)
    if backend == AUTO or backend in RECIPES:
        model = fusedpar.parallelize(model, {"dp_shard_size": -1, **MIXED, "float8": RECIPES.get(backend)},
                                     device_type=device.type)
        if backend in FLOAT8_COMPILED:  # after parallelize: a user's order (test_float8's too)
            for layer in model.model.layers:
                layer.compile(backend=compiler, fullgraph=True)
    else:
        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(**{k: getattr(torch, v) for k, v in MIXED.items()})
        for layer in model.model.layers:
            if backend == COMPILED:
                layer.compile(backend=compiler, fullgraph=True)
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True)


def tokens(config: LlamaConfig, batch: int, seq: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(config.vocab_size, (batch, seq), generator=g, device=device)


def make_step(model, optimizer, input_ids):
    """One training step on ``input_ids`` (labels = inputs); returns the loss (no host read)."""
    def step():
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()
    return step


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def release() -> None:
    """Free what an earlier case left on the GPU: a failed case's model lives on in the
    traceback pytest keeps for post-mortems (``sys.last_traceback``)."""
    for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
        vars(sys).pop(attr, None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- timing, one GPU ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_step(benchmark, one_rank_group, gpu_times, record_row, record_profile, report_target, synced,
              matmul_roofline, backend):
    device = torch.device("cuda", torch.cuda.current_device())
    if backend in RECIPES:
        pytest.importorskip("torchao", reason="float8 training needs torchao (the fp8 extra)")
    release()
    torch.cuda.reset_peak_memory_stats(device)
    graphs = compiled_graphs()
    try:
        model, optimizer = build(backend, CONFIG, device)
        step = make_step(model, optimizer, tokens(CONFIG, BATCH, SEQ, device))
        with fusedpar.comm.count_bytes() as counter:  # which fusedpar ops ran (world 1: no bytes)
            losses = [or_skip(counted, step)[0].item() for _ in range(CHECKED_STEPS)]
        assert all(map(math.isfinite, losses)), f"{backend}: losses {losses}"
        median, p20, p80 = gpu_times(step, **TIMING)
        busy, kernels = gpu_profile(step)
        host = host_ms(step, repeats=3)
        peak_mem = torch.cuda.max_memory_allocated(device) / 2**30
        graphs = compiled_graphs() - graphs
        benchmark.pedantic(synced(step), rounds=3, warmup_rounds=0, iterations=1)
    finally:
        model = optimizer = step = None
        if backend in COMPILES:
            torch._dynamo.reset()
        release()
    _medians[backend] = median
    tflops = step_flops(CONFIG, BATCH, SEQ) / (median * 1e-3) / 1e12
    peak = peak_tflops(torch.cuda.get_device_name(device))
    notes = {"tokens_per_s": f"{BATCH * SEQ / (median * 1e-3):.0f}", "tflops": f"{tflops:.1f}",
             "mfu_pct": f"{100 * tflops / peak:.1f}" if peak else "n/a",
             "peak_tflops": f"{peak:.0f}" if peak else "n/a",
             "pct_roofline": f"{100 * tflops / matmul_roofline:.1f}",
             "roofline_tflops": f"{matmul_roofline:.1f}", "params_m": f"{total_params(CONFIG) / 1e6:.0f}",
             "gpu_busy_ms": f"{busy:.2f}", "host_ms": f"{host:.2f}", "peak_mem_gib": f"{peak_mem:.1f}",
             "loss": f"{losses[0]:.3f}"}
    bf16 = COMPILED if backend in FLOAT8_COMPILED else BASELINE  # float8 against bf16, compiled or not
    if backend in RECIPES and bf16 in _medians:
        key = "x_compiled" if bf16 == COMPILED else "x_torch"
        notes[key] = f"{_medians[bf16] / median:.3f}"
        met = "MET" if _medians[bf16] / median >= FLOAT8_TARGET else "MISSED"
        report_target(f"{OP} {name(SHAPE)} {backend}: {notes[key]}x {bf16} (target {FLOAT8_TARGET}x: {met})")
    if backend == AUTO:
        notes["fusedpar_ops"] = " ".join(f"{op}:{b}" for op, b in sorted(counter.by_op())) or "none"
    if backend in COMPILES:
        notes["graphs"] = graphs  # Dynamo's: one serves every layer
        if BASELINE in _medians:
            notes["x_torch"] = f"{_medians[BASELINE] / median:.3f}"
            report_target(f"{OP} {name(SHAPE)} {backend}: {notes['x_torch']}x {BASELINE} (no target)")
    # the auto row is judged against the torch row by record_row (targets.AUTO_TARGET)
    record_row(OP, backend, SHAPE, DTYPE, 1, median, p20, p80,
               algo_bytes=4 * total_params(CONFIG), **notes)
    record_profile(OP, backend, SHAPE, median, busy, kernels)
    benchmark.group = f"{OP} {name(SHAPE)} bf16 one GPU"
    benchmark.extra_info.update(notes)


# ---- the step code on CPU (no timing) --------------------------------------------------------------

TINY = LlamaConfig(tie_embeddings=True)  # 2 layers, hidden 64, vocabulary 128


@contextlib.contextmanager
def one_rank_cpu_group():
    """The default process group of this process alone: the one there is (one rank), else a
    gloo group made here and destroyed after."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a one-rank check: run it without torchrun")
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_steps_on_cpu():
    """``build`` and ``make_step`` of every case at a tiny size on CPU: three steps on one
    batch, the losses finite and falling, the same in every case (the same weights and maths),
    no fusedpar op in the parallelized step (FSDP2 skips its collectives at world 1), the
    compiled layers sharing one graph; and the FLOP count's parameters are the model's."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        pytest.skip("a one-rank check: run it without torchrun")
    from fusedpar.ops.float8_scales import CPU_SCALED_MM_TAKES_ROWS

    device = torch.device("cpu")
    ids = tokens(TINY, 2, 32, device)
    losses, ops = {}, {}
    # torch 2.11's CPU _scaled_mm takes no rowwise scales: parallelize refuses rowwise there
    cases = [b for b in BACKENDS if CPU_SCALED_MM_TAKES_ROWS or RECIPES.get(b) != "rowwise"]
    try:
        with one_rank_cpu_group():
            for backend in cases:
                graphs = compiled_graphs()
                model, optimizer = build(backend, TINY, device, compiler="eager")
                step = make_step(model, optimizer, ids)
                with fusedpar.comm.count_bytes() as counter:
                    losses[backend] = [step().item() for _ in range(3)]
                ops[backend] = counter.by_op()
                if backend in COMPILES:
                    assert compiled_graphs() - graphs == 1, f"{backend}: the layers do not share a graph"
                model = optimizer = step = None
    finally:
        torch._dynamo.reset()
    for backend, values in losses.items():
        assert all(map(math.isfinite, values)) and values[-1] < values[0], (backend, values)
        # float8 rounds every linear's operands to 3 mantissa bits: close, not equal
        assert values == pytest.approx(losses[BASELINE], rel=3e-2 if backend in RECIPES else 1e-3), losses
    for backend in FLOAT8_COMPILED.keys() & losses.keys():  # compiling changes no number
        assert losses[backend] == pytest.approx(losses[backend.removesuffix(".compile")], rel=1e-5), losses
    for backend in RECIPES.keys() & ops.keys():
        assert ops[backend] == {}, f"fusedpar ops ran in the one-rank float8 step: {ops[backend]}"
    assert ops[AUTO] == {}, f"fusedpar ops ran in the one-rank step: {ops[AUTO]}"
    for config in (TINY, dataclasses.replace(TINY, tie_embeddings=False)):
        plain = LlamaForCausalLM(config, seed=0)
        assert flop_params(config) == sum(p.numel() for n, p in plain.named_parameters(remove_duplicate=False)
                                          if n != "model.embed_tokens.weight")
        assert total_params(config) == plain.num_parameters()
    assert total_params(CONFIG) == flop_params(CONFIG) == 1_235_814_400  # Llama-3.2-1B's count


def test_peak_by_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA GH200 480GB") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("Some GPU") is None
