"""benchmarks/defaults.py: the default tuning table shipped in the package is generated from
the committed benchmark rows, and a fusedpar backend slower than its baseline there is not
the default."""

import csv
import json
import sys
from pathlib import Path

import pytest

from fusedpar.ops import tuning

BENCH = Path(__file__).parent.parent / "benchmarks"
HEAD = ["op", "backend", "shape", "dtype", "world", "device", "median_ms", "date", "notes"]


@pytest.fixture
def defaults(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("defaults", "report", "targets"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import defaults

    return defaults


def test_the_shipped_table_is_the_scripts_output(defaults):
    assert json.loads(tuning.DEFAULTS_PATH.read_text()) == defaults.generate()
    assert defaults.main(["--check"]) == 0


def _rows(path, rows):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=HEAD)
        writer.writeheader()
        for i, (op, backend, shape, ms, notes) in enumerate(rows):
            writer.writerow({"op": op, "backend": backend, "shape": shape, "dtype": "bfloat16",
                             "world": 8, "device": "GPU-A", "median_ms": ms,
                             "date": f"2026-01-01T00:00:{i:02d}", "notes": notes})


def test_a_backend_slower_than_its_baseline_in_any_case_is_not_the_default(defaults, tmp_path):
    _rows(tmp_path / "rows.csv", [
        # one bucket (1000 and 1024 rows share it), two cases: triton wins one, loses one
        ("all_gather_matmul", "torch.matmul", "8192x1024x1024", 1.0, "mode=loopback"),
        ("all_gather_matmul", "triton", "8192x1024x1024", 0.5, "mode=loopback"),
        ("all_gather_matmul", "torch.matmul", "8000x1000x1024", 1.0, "mode=loopback"),
        ("all_gather_matmul", "triton", "8000x1000x1024", 1.1, "mode=loopback"),
        # another bucket: triton faster in its only case; an older slower row is superseded
        ("all_gather_matmul", "torch.matmul", "16384x1024x1024", 2.0, "mode=loopback"),
        ("all_gather_matmul", "triton", "16384x1024x1024", 9.0, "mode=loopback"),
        ("all_gather_matmul", "triton", "16384x1024x1024", 1.5, "mode=loopback"),
        # a label no backend has yet is left out; so are ops without buckets and forward-only
        # MoE loopback rows (moe_experts_train's rows tune moe_experts)
        ("all_gather_matmul", "no.such.thing", "16384x1024x1024", 0.1, "mode=loopback"),
        ("moe_dispatch", "padded", "8x128x7168", 1.0, "top_k=8;experts=256"),
        ("moe_experts", "fused", "8x2048x4096x14336", 1.0, "top_k=2;experts=8"),
    ])
    table = defaults.generate(tmp_path)
    key = lambda m: f"all_gather_matmul|GPU-A|8|bfloat16|{m}x1024x1024x0"  # noqa: E731
    assert set(table["entries"]) == {key(8192), key(16384)}
    mixed, faster = table["entries"][key(8192)], table["entries"][key(16384)]
    assert mixed["backend"] == "reference" and "not the default: triton" in mixed["why"]
    assert "torch.matmul stands for reference" in mixed["why"]
    assert faster == {"backend": "triton", "why": "1 benchmark case(s): triton 1.500 ms, "
                                                  "torch.matmul 2.000 ms"}
    fallback = table["fallback"]["all_gather_matmul"]
    # one bucket each: the tie goes to the priority order (triton before reference)
    assert fallback["GPU-A"]["backend"] == fallback["*"]["backend"] == "triton"
    assert "1 of 2" in fallback["*"]["why"]


def test_without_rows_the_table_is_empty(defaults, tmp_path):
    assert defaults.generate(tmp_path) == {
        "generated_by": "python benchmarks/defaults.py (from benchmarks/results/*.csv)",
        "entries": {}, "fallback": {}}


def test_masked_grouped_mm_rows_tune_the_batched_masked_call(defaults, tmp_path):
    """routing=masked rows (shape ExPxKxN) name the batched call with masked_m, whose bucket
    a user's call of that form looks up: here torch.bmm (standing for the torch backend)
    beats the masked triton kernel."""
    import torch

    from fusedpar.ops.grouped_mm import GroupedCall

    _rows(tmp_path / "rows.csv", [
        ("grouped_mm", "torch.bmm", "32x1024x2048x1536", 0.3, "routing=masked;routed_rows=3200"),
        ("grouped_mm", "fusedpar.triton masked", "32x1024x2048x1536", 0.6, "routing=masked;routed_rows=3200"),
    ])
    table = defaults.generate(tmp_path)
    meta = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")  # noqa: E731
    call = GroupedCall(meta(32, 1000, 2048), meta(32, 2048, 1500), None,
                       torch.empty(32, dtype=torch.int32, device="meta"))
    sig = tuning.Signature("grouped_mm", "GPU-A", 8, "bfloat16", tuple(call.bucket()), "")
    row = table["entries"][sig.key(with_placement=False)]
    assert row["backend"] == "torch" and "not the default: fusedpar.triton masked" in row["why"]


def test_moe_train_rows_tune_moe_experts_calls_of_their_sizes(defaults, tmp_path):
    """moe_experts_train rows (W x T x H x I, forward + backward; the experts over all ranks
    and top_k in the notes) tune moe_experts: the key is an ExpertsCall's bucket (tokens
    are not in it), the fastest backend not slower than the reference wins; the auto row
    and the forward-only loopback rows decide nothing."""
    import torch

    from fusedpar.ops.moe.experts_call import ExpertsCall

    train = "mode=train_one_rank;top_k=2;experts=16"
    _rows(tmp_path / "rows.csv", [
        ("moe_experts_train", "reference", "8x4096x4096x14336", 3.0, train),
        ("moe_experts_train", "pipelined", "8x4096x4096x14336", 2.5, train),
        ("moe_experts_train", "fused", "8x4096x4096x14336", 2.0, train),
        ("moe_experts_train", "auto", "8x4096x4096x14336", 1.0, train + ";chose=fused"),
        # another bucket (H=2048): fused slower than the reference, pipelined faster
        ("moe_experts_train", "reference", "8x4096x2048x14336", 3.0, train),
        ("moe_experts_train", "pipelined", "8x4096x2048x14336", 2.5, train),
        ("moe_experts_train", "fused", "8x4096x2048x14336", 3.5, train),
        ("moe_experts", "unfused", "8x2048x1024x768", 9.0, "top_k=2;experts=16"),
        ("moe_experts", "fused", "8x2048x1024x768", 1.0, "top_k=2;experts=16"),
    ])
    table = defaults.generate(tmp_path)
    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731

    def key(t, h):  # a call of 2 experts per rank (16 over 8 ranks), top-2, I=14336
        call = ExpertsCall(meta(t, h), meta(t, 2), meta(t, 2), meta(2, 2 * 14336, h),
                           meta(2, h, 14336), None)
        return tuning.Signature("moe_experts", "GPU-A", 8, "bfloat16", call.bucket(), "").key(False)

    assert key(1000, 4096) == key(4096, 4096) == "moe_experts|GPU-A|8|bfloat16|4096x16384x2x2"
    assert set(table["entries"]) == {key(4096, 4096), key(4096, 2048)}
    assert table["entries"][key(4096, 4096)] == {
        "backend": "fused", "why": "1 benchmark case(s): fused 2.000 ms, pipelined 2.500 ms, "
                                   "reference 3.000 ms"}
    other = table["entries"][key(4096, 2048)]
    assert other["backend"] == "pipelined" and "not the default: fused" in other["why"]
    # one bucket each: the tie goes to the priority order (pipelined before fused)
    assert table["fallback"]["moe_experts"]["*"]["backend"] == "pipelined"
