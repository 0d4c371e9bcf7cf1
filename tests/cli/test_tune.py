"""``fusedpar tune`` (its shapes, its model form on CPU ranks with an injected timer, its
refusal on CPU) and what ``fusedpar info`` says runs per op and why (``tuning.explain``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import pytest
import torch

import fusedpar
import fusedpar.models
from fusedpar.cli import build_parser, info, main, train, tune
from fusedpar.comm import settings
from fusedpar.ops import registry, tuning
from tests.ops.test_tuning import call, dispatcher, tuned_cpu  # noqa: F401 - the fixture


def _meta(*shape):
    return torch.empty(*shape, device="meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is CPU's")
def test_tune_refuses_on_cpu_saying_why(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDPAR_TUNE_CACHE", str(tmp_path / "tune.json"))
    assert main(["tune", "grouped_mm", "64x32x16x4"]) == 2
    assert "no CUDA GPU here, so nothing to time" in capsys.readouterr().out
    assert main(["tune", "--model", "llama", "--tp", "2", "--seq", "64"]) == 2
    assert "no CUDA GPU here, so nothing to time" in capsys.readouterr().out
    assert not (tmp_path / "tune.json").exists()


def test_tune_shapes_use_the_benchmark_notation():
    with pytest.raises(ValueError, match="give 4 positive sizes joined by 'x'"):
        tune.parse_shape("grouped_mm", "64x32x16")
    with pytest.raises(ValueError, match="'8xAx2'"):
        tune.parse_shape("all_gather", "8xAx2")
    with pytest.raises(SystemExit):
        main(["tune", "no_such_op", "8x8"])
    # all_gather_matmul MxKxN: A gathered [M, K], so each of W ranks holds M/W rows
    c = tune.call_of("all_gather_matmul", [8192, 1024, 512], 8, None, _meta)
    assert tuple(c.x.shape) == (1024, 1024) and c.bucket() == (8192, 1024, 512, 0)
    c = tune.call_of("reduce_scatter", [100, 8], 4, None, _meta)  # the per-rank output
    assert tuple(c.x.shape) == (400, 8)
    c = tune.call_of("grouped_mm", [100, 32, 16, 4], 1, None, lambda *s: torch.zeros(*s))
    assert c.offs.tolist() == [25, 50, 75, 100]
    c = tune.call_of("flash_attention", [2, 100, 8, 64], 1, None, _meta, causal=True)
    assert c.bucket() == (16, 8, 128, 128, 64, 1, 0, 0)


def test_explain_says_which_backend_runs_and_why(tuned_cpu, monkeypatch):  # noqa: F811
    monkeypatch.setattr(tuning, "TIMER", lambda name, fn: pytest.fail("explain timed"))
    d = dispatcher()
    assert tuning.explain(d, call()) == ("fast", "untuned: the priority order")
    sig = tuning.signature("tuning_toy", call())
    monkeypatch.setattr(tuning, "_defaults", {"entries": {
        sig.key(with_placement=False): {"backend": "slow", "why": "2 benchmark case(s)"}}})
    assert tuning.explain(d, call()) == ("slow", "default table row: 2 benchmark case(s)")
    tuning.user_table().entries[sig.key()] = tuning.Entry("reference", {"fast": 2.0, "reference": 1.0})
    assert tuning.explain(d, call()) == ("reference", "measured (fast 2.000 ms, reference 1.000 ms)")
    monkeypatch.setenv("FUSEDPAR_BACKEND", "slow")
    settings.refresh()
    assert tuning.explain(d, call()) == ("slow", "forced by FUSEDPAR_BACKEND")
    monkeypatch.setattr(tuning, "TUNED_DEVICES", ())
    monkeypatch.delenv("FUSEDPAR_BACKEND")
    settings.refresh()
    assert tuning.explain(d, call()) == ("fast", "the priority order (nothing is timed on cpu)")


def test_info_says_per_op_what_runs():
    ops = info._ops_info()["ops"]
    for spec in registry.specs():
        if spec.example is None:
            assert "runs" not in ops[spec.name]
            continue
        runs = ops[spec.name]["runs"]
        assert runs["backend"] in spec.backends and runs["why"]
        assert ops[spec.name]["backends"][runs["backend"]]["available"]
    text = info.format_info(info.gather_info())
    for name, entry in ops.items():  # labelled auto, as the benchmarks' rows of backend=None
        if "runs" in entry:
            assert f"  {name}: " in text
            assert f"    runs: {entry['runs']['backend']} (auto: {entry['runs']['why']})" in text


# ---- the model form -------------------------------------------------------------------------

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
            num_kv_heads=2)


def test_model_form_reads_the_model_as_plan_does(tmp_path):
    from fusedpar.models import LlamaConfig, MixtralConfig

    assert tune.model_config("llama") == LlamaConfig()
    assert isinstance(tune.model_config("mixtral"), MixtralConfig)
    path = tmp_path / "fusedpar.json"
    path.write_text(json.dumps({**TINY, "num_experts": 4, "top_k": 1}))
    assert tune.model_config(str(path)) == MixtralConfig(**TINY, num_experts=4, top_k=1)
    path = tmp_path / "config.json"  # Hugging Face keys
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "num_key_value_heads": 2}))
    assert tune.model_config(str(path)) == LlamaConfig(**TINY)
    args = build_parser().parse_args(["tune", "--model", "llama", "--tp", "2", "--cp", "1",
                                      "--seq", "64", "--batch", "4"])
    assert (args.tp, args.cp, args.seq_len, args.batch_size, args.op) == (2, 1, 64, 4, None)


def test_model_form_resolves_the_run_as_train_does(monkeypatch, capsys, tmp_path):
    """``run_model`` under torchrun (faked: no ranks start): train's config resolution, then
    each rank's ``tune_model_rank`` with it; bad input is a clear error."""
    seen = {}

    @contextlib.contextmanager
    def rank(timeout):
        yield torch.device("cpu"), "gloo"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune.launch, "under_torchrun", lambda: True)
    monkeypatch.setattr(tune.launch, "torchrun_rank", rank)
    monkeypatch.setattr(tune, "tune_model_rank", lambda group, device, spec: seen.update(spec)
                        or tuning.Session())
    monkeypatch.setattr(tune.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("FUSEDPAR_BACKEND", raising=False)
    assert main(["tune", "--model", "mixtral", "--seq", "64", "--batch", "4"]) == 0
    assert seen["model"] == fusedpar.models.MixtralConfig()
    assert (seen["parallel"]["ep"], seen["parallel"]["dp_shard"]) == (2, 4)  # train's MoE default
    assert (seen["train"]["seq_len"], seen["train"]["batch_size"], seen["train"]["steps"]) == (64, 4, 1)
    assert "no tuned op call" in capsys.readouterr().out
    assert main(["tune", "--model", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().out
    assert main(["tune", "--model", "llama", "--tp", "3"]) == 2
    assert "tp=3" in capsys.readouterr().out
    assert main(["tune", "--model", "llama", "grouped_mm", "8x8x8x2"]) == 2
    assert "not both" in capsys.readouterr().out
    monkeypatch.setenv("FUSEDPAR_BACKEND", "reference")
    assert main(["tune", "--model", "llama"]) == 2
    assert "unset it" in capsys.readouterr().out


def _tune_tiny_llama(cache_dir):
    """On each of 2 CPU ranks: ``tune_model_rank`` of a tiny Llama at tp=2 (CPU a tuned
    device, a timer that disagrees between the ranks), with every ``Dispatcher.select`` of
    the step recorded by a spy: returns what the spy saw, the session, the stored table and
    the backends timed."""
    import torch.distributed as dist

    from fusedpar.ops.backend import Dispatcher

    rank = dist.get_rank()
    path = os.path.join(cache_dir, f"tune{rank}.json")
    os.environ["FUSEDPAR_TUNE_CACHE"] = path
    saved = tuning.TUNED_DEVICES, tuning.TIMER, tuning._defaults, Dispatcher.select
    hits, timed = set(), []

    def spy(self, call, requested=""):
        if tuning.applies(call) and not self.forced_name(requested):
            hits.add(tuning.signature(self.op, call).key())
        return saved[3](self, call, requested)

    def timer(name, fn):  # alone, rank 0 would choose reference, rank 1 any other backend
        timed.append(name)
        return (1.0 if name == "reference" else 3.0) if rank == 0 else (5.0 if name == "reference" else 2.0)

    def clear():  # choices cached by other tests of this worker, or by this one
        for spec in registry.specs():
            spec.dispatcher._cache.clear()
        tuning._tables.clear()

    tuning.TUNED_DEVICES, tuning.TIMER = ("cpu",), timer
    tuning._defaults = {"entries": {}, "fallback": {}}
    Dispatcher.select = spy
    clear()
    try:
        pcfg = fusedpar.ParallelConfig(tp=2).validate(2)
        tcfg = train.TrainConfig(steps=1, batch_size=2, seq_len=16)
        session = tune.tune_model_rank(dist.group.WORLD, torch.device("cpu"), {
            "parallel": dataclasses.asdict(pcfg), "train": dataclasses.asdict(tcfg),
            "model": fusedpar.models.LlamaConfig(**TINY)})
    finally:
        tuning.TUNED_DEVICES, tuning.TIMER, tuning._defaults, Dispatcher.select = saved
        clear()
    stored = {k: e.to_json() for k, e in tuning.Table.load(path).entries.items()}
    return (hits, {k: e.to_json() for k, e in session.measured.items()}, session.single,
            stored, timed, tune.rows(session))


@pytest.mark.multirank
def test_model_form_tunes_every_op_call_of_a_step_and_ranks_agree(pools, tmp_path):
    (hits, measured, single, stored, timed, rows), other = pools(2).run(
        _tune_tiny_llama, str(tmp_path), timeout=300)
    assert other[:4] == (hits, measured, single, stored)  # one choice on every rank
    assert hits == set(measured) | set(single)  # every (op, bucket) the step hit
    ops = {key.split("|")[0] for key in measured}
    assert {"all_gather_matmul", "matmul_reduce_scatter", "all_gather", "reduce_scatter"} <= ops
    assert stored == measured  # all stored in the user's table
    for key, entry in measured.items():
        times = entry["times_ms"]
        assert len(times) >= 2 and entry["rejected"] == {}, (key, entry)
        # the slowest rank's time counts: reference 5.0 (rank 1), the others 3.0 (rank 0)
        assert times == {n: 5.0 if n == "reference" else 3.0 for n in times}, (key, times)
        assert entry["backend"] == next(n for n in times if n != "reference")
    assert len(timed) == sum(len(e["times_ms"]) for e in measured.values())  # each once
    assert len(rows) == len(measured) + len(single)
