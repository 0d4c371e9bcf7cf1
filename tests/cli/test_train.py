"""``fusedpar train`` (``./dev demo``): config parsing in-process, then the job itself on 4
spawned CPU ranks against the single-process run, and save/resume."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fusedpar
import fusedpar.models
from fusedpar.cli import build_parser, train
from tests.cli.common import run_cli
from tests.ops.collective_cases import cpu_row_scales


def _resolve(argv, world=4):
    args = build_parser().parse_args(["train", *argv])
    return train.resolve(args, world)


# ---- configuration ----------------------------------------------------------------------


def test_default_is_tp2_times_dp_shard_with_sequence_parallel():
    pcfg, tcfg, ignored = _resolve([])
    assert (pcfg.dp_replicate, pcfg.dp_shard, pcfg.cp, pcfg.tp, pcfg.ep) == (1, 2, 1, 2, 1)
    assert tcfg == train.TrainConfig() and ignored == []


def test_axolotl_yaml_keys_flags_win_and_unused_keys_are_listed(tmp_path):
    path = tmp_path / "axolotl.yaml"
    path.write_text("base_model: NousResearch/Llama-3.2-1B\n"
                    "dp_shard_size: 2\ntensor_parallel_size: 2\ncontext_parallel_size: 1\n"
                    "expert_parallel_size: 1\ndp_replicate_size: 1\n"
                    "sequence_len: 16\nlearning_rate: 0.001\nmax_steps: 7\nseed: 3\n")
    pcfg, tcfg, ignored = _resolve(["--config", str(path)])
    assert (pcfg.dp_shard, pcfg.tp) == (2, 2)
    assert (tcfg.seq_len, tcfg.lr, tcfg.steps, tcfg.seed) == (16, 0.001, 7, 3)
    assert ignored == ["base_model"]
    # flags win over the file; a degree from the file is kept unless a flag changes it
    pcfg, tcfg, _ = _resolve(["--config", str(path), "--tp", "1", "--dp-shard", "4",
                              "--steps", "2"])
    assert (pcfg.dp_shard, pcfg.tp, tcfg.steps) == (4, 1, 2)


def test_fusedpar_names_in_json_and_fsdp_options(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"dp_replicate": 2, "dp_shard": 2, "param_dtype": "bf16",
                                "fsdp_comm": "torch", "batch_size": 4, "moe": True}))
    pcfg, tcfg, _ = _resolve(["--config", str(path)])
    assert (pcfg.dp_replicate, pcfg.dp_shard, pcfg.tp) == (2, 2, 1)
    assert (pcfg.param_dtype, pcfg.fsdp_comm) == ("bfloat16", "torch")
    assert tcfg.batch_size == 4 and tcfg.moe


@pytest.mark.parametrize("text, message", [
    ("tensor_paralel_size: 2\n", "did you mean 'tensor_parallel_size'"),
    ("tp: 2\ntensor_parallel_size: 4\n", "tp is given twice with different values"),
    ("tp: 3\n", "tp=3 does not divide world_size=4"),
    ("batch_size: 5\n", "batch_size=5 is not divisible by the data-parallel degree"),
    ("steps: 0\n", "steps=0 must be at least 1"),
    ("- tp\n", "must hold a mapping"),
])
def test_bad_configs_are_clear_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises((SystemExit, fusedpar.ParallelConfigError), match=message):
        _resolve(["--config", str(path)])


def test_synthetic_batches_depend_on_seed_and_step_only():
    tcfg = train.TrainConfig(batch_size=4, seq_len=8)
    a, b = train.synthetic_batch(tcfg, 128, 5), train.synthetic_batch(tcfg, 128, 5)
    assert a.equal(b) and not a.equal(train.synthetic_batch(tcfg, 128, 6))
    stride = (a[:, 1:] - a[:, :-1]) % 128  # each row counts with one stride in 1..3
    assert ((stride == stride[:, :1]) & (stride >= 1) & (stride <= 3)).all()


# ---- the job ----------------------------------------------------------------------------

STEPS = 4


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The demo's default config (tp=2 x dp_shard=2, sequence parallel) for STEPS steps,
    saving a checkpoint every 2 steps into ``metrics["save_dir"]``."""
    folder = tmp_path_factory.mktemp("train")
    metrics = folder / "full.json"
    res = run_cli(["train", "--steps", str(STEPS), "--metrics", str(metrics),
                   "--save", str(folder / "ckpt"), "--save-every", "2"], timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    return res, {**json.loads(metrics.read_text()), "save_dir": folder / "ckpt"}


@pytest.mark.timeout(300)
def test_train_matches_one_process_with_lower_bound_bytes(full_run):
    res, m = full_run
    assert m["parallel"]["tp"] == 2 and m["parallel"]["dp_shard"] == 2
    losses, ref = m["losses"], m["reference_losses"]
    assert len(losses) == len(ref) == STEPS
    assert train.max_rel_diff(losses, ref) <= 1e-5, (losses, ref)
    assert losses[-1] < losses[0]  # it learns
    comm = m["comm"][-1]
    assert set(comm) == {"all_gather", "reduce_scatter", "all_gather_matmul",
                         "matmul_reduce_scatter"}
    assert comm == m["lower_bounds"]  # every op moved exactly its lower bound
    mem = m["state_bytes"]
    tensors = len(list(fusedpar.models.LlamaForCausalLM(fusedpar.models.LlamaConfig()).parameters()))
    # AdamW: exp_avg and exp_avg_sq shaped like the parameter shards, one fp32 step each
    assert mem["grads"] == mem["params"] > 0
    assert mem["optimizer"] == 2 * mem["params"] + 4 * tensors
    out = res.stdout
    assert f"step {STEPS}/{STEPS}" in out and "tok/s" in out and "params+grads+optimizer" in out
    assert "loss curve vs one process, same seed: max relative difference" in out
    assert "ratio 1.00" in out


@pytest.mark.timeout(300)
def test_save_then_resume_continues_with_identical_losses(full_run, tmp_path):
    """Resumed from the full run's step-2 checkpoint: the full run's last losses."""
    _, full = full_run
    metrics = tmp_path / "resumed.json"
    res = run_cli(["train", "--steps", str(STEPS), "--resume", str(full["save_dir"] / "step-2"),
                   "--no-compare", "--metrics", str(metrics)], timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    resumed = json.loads(metrics.read_text())
    assert resumed["first_step"] == 2 and resumed["losses"] == full["losses"][2:]


MOE_OPS = {"moe_experts", "moe_dispatch", "moe_combine"}


def _train_cpu_ranks_on_a_machine_with_a_gpu():
    """One spawned rank's ``train_rank`` on CPU while, as ``parallelize`` builds the mesh,
    torch reports a GPU (patched: as with ``--device cpu`` on a GPU machine)."""
    import math

    import torch
    import torch.distributed as dist

    parallelize, available = fusedpar.parallelize, torch.cuda.is_available

    def parallelize_seeing_a_gpu(*args, **kwargs):
        torch.cuda.is_available = lambda: True
        try:
            return parallelize(*args, **kwargs)
        finally:
            torch.cuda.is_available = available

    fusedpar.parallelize = parallelize_seeing_a_gpu
    try:
        pcfg, tcfg, _ = _resolve(["--tp", "1", "--dp-shard", "2", "--steps", "2", "--no-compare"],
                                 world=2)
        spec = {"parallel": dataclasses.asdict(pcfg), "train": dataclasses.asdict(tcfg),
                "save": None, "resume": None, "compare": False}
        result = train.train_rank(dist.group.WORLD, torch.device("cpu"), spec)
    finally:
        fusedpar.parallelize = parallelize
    return dist.get_rank() != 0 or all(math.isfinite(loss) for loss in result["losses"])


def test_cpu_ranks_build_a_cpu_mesh_where_a_gpu_exists(pools):
    """``fusedpar train`` on CPU ranks (``--device cpu``, or fewer GPUs than ranks) builds
    its mesh on the model's device type, not on "cuda" because torch sees a GPU."""
    assert pools(2).run(_train_cpu_ranks_on_a_machine_with_a_gpu) == [True, True]


def _check_bounds(m: dict) -> None:
    """Every op moved exactly its lower bound but the MoE exchange: unfused
    (moe_dispatch + moe_combine) a row per routed copy (counted from the routing) where a
    row per token and rank would do; pipelined (moe_experts) that row, plus a few fp32
    expert ids and weights per row (exact in tests/ops/test_moe_experts.py). Only
    ring_attention has no bound."""
    comm, lower, per_copy = m["comm"][-1], m["lower_bounds"], m["per_copy_bytes"]
    assert set(comm) - set(lower) <= {"ring_attention"}, m
    assert set(per_copy) == set(comm) & MOE_OPS, m
    for op, n in comm.items():
        if op == "moe_experts":
            assert 0 < lower[op] < n < 1.1 * lower[op], m
        elif op in per_copy:
            assert n == per_copy[op] >= lower[op] > 0, (op, m)
        elif op in lower:
            assert n == lower[op], (op, m)


@pytest.mark.timeout(300)
def test_moe_train_matches_one_process(tmp_path):
    """--moe (ep=2 x dp_shard=2): the load-balancing loss is the whole batch's on every rank
    (routing statistics summed over the data-parallel ranks), so the curve is the single
    process's to fp32 rounding (it was 2.2e-4 off with a per-rank aux loss)."""
    metrics = tmp_path / "moe.json"
    res = run_cli(["train", "--moe", "--steps", "3", "--metrics", str(metrics)], timeout=240,
                  env={"FUSEDPAR_BACKEND": "reference"})  # not the interpreted kernels: fast
    assert res.returncode == 0, res.stdout + res.stderr
    m = json.loads(metrics.read_text())
    assert m["parallel"]["ep"] == 2
    assert train.max_rel_diff(m["losses"], m["reference_losses"]) <= 1e-5, m
    assert "Warning" not in res.stderr, res.stderr  # e.g. FSDP2's about a module returning a view
    _check_bounds(m)  # the unfused exchange: moe_dispatch and moe_combine
    # two experts per rank: some tokens have both on the other rank (sent once would do)
    assert m["per_copy_bytes"]["moe_dispatch"] > m["lower_bounds"]["moe_dispatch"], m
    assert "a row per routed copy" in res.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv", [
    # MoE blocks run whole on sequence shards (no gate/up gather, no down reduce-scatter):
    # tp's fused ops move 2 L + 1 shards a step, not 4 L + 1
    ["--tp", "2", "--dp-shard", "2", "--ep", "1"],
    ["--tp", "2", "--cp", "2", "--ep", "4"],  # tp's shards of cp's; moe_experts (pipelined)
    ["--dp-replicate", "2", "--ep", "2"],  # HSDP: FSDP over dp_shard, experts over efsdp
], ids=["tp2-ep1", "tp2-cp2-ep4", "hsdp-ep2"])
def test_moe_train_moves_its_lower_bounds(tmp_path, argv):
    """Every op its lower bound (the MoE exchange a row per copy), the curve the single
    process's, no warnings."""
    metrics = tmp_path / "moe.json"
    res = run_cli(["train", "--moe", *argv, "--steps", "2", "--metrics", str(metrics)], timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    m = json.loads(metrics.read_text())
    _check_bounds(m)
    assert train.max_rel_diff(m["losses"], m["reference_losses"]) <= 1e-5, m
    assert "Warning" not in res.stderr, res.stderr
    if m["parallel"]["tp"] > 1:
        assert m["lower_bounds"]["all_gather_matmul"] > 0, m
    assert ("moe_experts" in m["comm"][-1]) == (m["parallel"]["ep"] > 1), m


def test_pp_flags_and_keys(tmp_path):
    pcfg, _, _ = _resolve(["--pp", "2", "--schedule", "gpipe"])
    assert (pcfg.pp, pcfg.pp_schedule, pcfg.dp_shard, pcfg.tp) == (2, "GPipe", 2, 1)
    path = tmp_path / "pp.json"
    path.write_text(json.dumps({"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "interleaved"}))
    pcfg, _, _ = _resolve(["--config", str(path)])
    assert (pcfg.pp, pcfg.pp_schedule, pcfg.pp_stages_per_rank) == (2, "Interleaved1F1B", 2)


@pytest.mark.timeout(300)
def test_pp_train_matches_one_process(tmp_path):
    """--pp 2 (1F1B, two microbatches per data-parallel rank) x dp_shard=2: forward_backward's
    loss is the single process's on every step."""
    metrics = tmp_path / "pp.json"
    res = run_cli(["train", "--pp", "2", "--steps", "3", "--metrics", str(metrics)], timeout=240,
                  env={"FUSEDPAR_BACKEND": "reference"})
    assert res.returncode == 0, res.stdout + res.stderr
    m = json.loads(metrics.read_text())
    assert (m["parallel"]["pp"], m["parallel"]["dp_shard"]) == (2, 2)
    assert train.max_rel_diff(m["losses"], m["reference_losses"]) <= 1e-5, m
    assert "pp=2 (1F1B)" in res.stdout


def test_float8_flag_picks_fsdp_unless_degrees_are_given(tmp_path):
    """``--float8 RECIPE`` sets the config key; without degrees the demo's tp=2 becomes FSDP
    over every rank (whose all-gathers move fp8); a config file's ``fp8: true`` does the same."""
    pcfg, _, _ = _resolve(["--float8", "rowwise"])
    assert (pcfg.float8, pcfg.tp, pcfg.dp_shard) == ("rowwise", 1, 4)
    pcfg, _, _ = _resolve(["--float8", "tensorwise", "--pp", "2"])
    assert (pcfg.float8, pcfg.pp, pcfg.tp) == ("tensorwise", 2, 1)
    path = tmp_path / "fp8.json"
    path.write_text('{"fp8": true}')
    pcfg, _, _ = _resolve(["--config", str(path)])
    assert pcfg.float8 is not None and (pcfg.tp, pcfg.dp_shard) == (1, 4)


@cpu_row_scales
def test_the_single_process_run_converts_as_the_parallel_run(tmp_path):
    """Under ``--float8`` the comparison's one process is torchao's float8 model (the same
    recipe and layers ``parallelize`` converts), not the plain fp32 one."""
    float8 = pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    pcfg, tcfg, _ = _resolve(["--float8", "rowwise"])
    single = train.single_process_model(tcfg, pcfg, "cpu")
    converted = {n: m.config for n, m in single.named_modules() if isinstance(m, Float8Linear)}
    names = {n for n, m in single.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(converted) == names - {"lm_head"}
    assert all(c == float8.Float8LinearConfig.from_recipe_name("rowwise") for c in converted.values())
    plain = train.single_process_model(tcfg, dataclasses.replace(pcfg, float8=None), "cpu")
    assert not any(isinstance(m, Float8Linear) for m in plain.modules())
