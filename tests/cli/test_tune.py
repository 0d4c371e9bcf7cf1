"""``fusedpar tune`` (its shapes, its refusal on CPU) and what ``fusedpar info`` says runs
per op and why (``tuning.explain``)."""

from __future__ import annotations

import pytest
import torch

from fusedpar.cli import info, main, tune
from fusedpar.ops import registry, tuning
from tests.ops.test_tuning import call, dispatcher, tuned_cpu  # noqa: F401 - the fixture


def _meta(*shape):
    return torch.empty(*shape, device="meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is CPU's")
def test_tune_refuses_on_cpu_saying_why(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDPAR_TUNE_CACHE", str(tmp_path / "tune.json"))
    assert main(["tune", "grouped_mm", "64x32x16x4"]) == 2
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
    assert tuning.explain(d, call()) == ("slow", "forced by FUSEDPAR_BACKEND")
    monkeypatch.setattr(tuning, "TUNED_DEVICES", ())
    monkeypatch.delenv("FUSEDPAR_BACKEND")
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
    assert "    runs: " in text
