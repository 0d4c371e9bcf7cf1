"""benchmarks/report.py: the results page is generated from the CSV rows, and the committed
page is its output; the rows record the commit they measured (benchmarks/conftest.py)."""

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "benchmarks"
HEAD = ["op", "backend", "shape", "dtype", "world", "device", "median_ms", "torch", "triton",
        "cuda", "date", "commit", "notes"]


@pytest.fixture
def report(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delitem(sys.modules, "report", raising=False)
    import report

    return report


def _write(path, rows, head=HEAD):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=head, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({"dtype": "bfloat16", "world": 8, "device": "GPU-A", "torch": "2.11",
                             "triton": "3.6", "cuda": "13.0", "commit": "c0ffee", "notes": "",
                             **row})


def test_committed_page_is_the_generators_output(report):
    page = (BENCH / "results" / "README.md").read_text()
    assert page == report.render(report.load(BENCH / "results")), \
        "benchmarks/results/README.md is stale: run python benchmarks/report.py"


def test_check_flag_fails_on_a_stale_page(report, tmp_path):
    _write(tmp_path / "ring_attention.csv",
           [dict(op="ring_attention", backend="monolithic", shape="1x8", median_ms="2.0",
                 date="2026-01-01T00:00:00+00:00")])
    assert report.main(["--results", str(tmp_path), "--check"]) == 1  # no page yet
    assert report.main(["--results", str(tmp_path), "--no-plots"]) == 0
    assert report.main(["--results", str(tmp_path), "--check"]) == 0
    (tmp_path / "README.md").write_text((tmp_path / "README.md").read_text() + "edited\n")
    assert report.main(["--results", str(tmp_path), "--check"]) == 1


def test_latest_row_per_case_speedups_and_targets(report, tmp_path):
    day = "2026-01-0{}T00:00:00+00:00".format
    _write(tmp_path / "ring_attention.csv", [
        dict(op="ring_attention", backend="monolithic", shape="1x8", median_ms="3.0", date=day(1),
             notes="causal=True;tflops=1"),
        dict(op="ring_attention", backend="loopback", shape="1x8", median_ms="6.0", date=day(1),
             notes="causal=True;tflops=2"),
        # a later run of the same case: the latest row wins (its commit too)
        dict(op="ring_attention", backend="loopback", shape="1x8", median_ms="3.2", date=day(2),
             commit="beef01", notes="causal=True;tflops=3"),
        # another case (causal=False) of the same shape is compared with its own baseline
        dict(op="ring_attention", backend="monolithic", shape="1x8", median_ms="5.0", date=day(1),
             notes="causal=False"),
        dict(op="ring_attention", backend="loopback", shape="1x8", median_ms="4.0", date=day(1),
             notes="causal=False"),
    ])
    # written before rows had a commit column
    _write(tmp_path / "all_gather.csv", [
        dict(op="all_gather", backend="triton", shape="4x4", median_ms="1.5", date=day(1),
             notes="mode=loopback"),
        dict(op="all_gather", backend="torch.cat", shape="4x4", median_ms="0.75", date=day(1),
             notes="mode=loopback")], head=[h for h in HEAD if h != "commit"])
    page = report.render(report.load(tmp_path))
    rows = [line for line in page.splitlines() if line.startswith("| 1x8") or line.startswith("| 4x4")]
    assert len(rows) == 6  # one per (case, backend): the older loopback row is not shown
    by_key = {(cells[1], cells[3]): cells for cells in
              ([c.strip() for c in row.strip("|").split("|")] for row in rows)}
    ring = report.BASELINES["ring_attention"]["monolithic"]
    assert by_key["causal=True", "loopback"][4:7] == [
        "3.200", f"{3.0 / 3.2:.2f}x", f">= {ring}x monolithic: met"]
    assert by_key["causal=True", "loopback"][-2] == "beef01"
    assert by_key["causal=False", "loopback"][4:7] == [
        "4.000", f"{5.0 / 4.0:.2f}x", f">= {ring}x monolithic: met"]
    assert by_key["causal=True", "monolithic"][5:7] == ["", ""]  # a baseline has no ratio
    # all_gather: baselines listed first, a ratio but no target column, commit unknown
    assert by_key["mode=loopback", "torch.cat"][4] == "0.750"
    assert by_key["mode=loopback", "triton"][4:6] == ["1.500", "0.50x"]
    assert by_key["mode=loopback", "triton"][-2] == "unknown"
    assert rows.index(next(r for r in rows if "torch.cat" in r)) < rows.index(
        next(r for r in rows if "| triton |" in r))
    assert "| ring_attention | monolithic | >= 0.85x | 2 of 2 |" in page


def test_a_missed_target(report, tmp_path):
    _write(tmp_path / "moe_experts.csv", [
        dict(op="moe_experts", backend="fused", shape="8x2", median_ms="10.0",
             date="2026-01-01T00:00:00+00:00"),
        dict(op="moe_experts", backend="unfused", shape="8x2", median_ms="11.0",
             date="2026-01-01T00:00:00+00:00")])
    page = report.render(report.load(tmp_path))
    assert f"| 1.10x | >= {report.BASELINES['moe_experts']['unfused']}x unfused: MISSED |" in page
    assert "| moe_experts | unfused | >= 1.15x | 0 of 1 |" in page


def test_the_auto_row_is_judged_against_the_best_baseline_within_noise(report, tmp_path):
    """An auto row (what a user gets) must reach AUTO_TARGET x the case's fastest baseline;
    one that misses it with overlapping p20..p80 passes as noise, one beyond the noise is
    flagged. The fused backend keeps its own target; auto rows do not count towards it."""
    def row(backend, shape, median, p20, p80):
        return dict(op="grouped_mm", backend=backend, shape=shape, median_ms=median, p20_ms=p20,
                    p80_ms=p80, date="2026-01-01T00:00:00+00:00", notes="routing=uniform")
    _write(tmp_path / "grouped_mm.csv", [
        # the loop is the best baseline (2.0 ms); auto 1.9 ms: met
        row("torch._grouped_mm", "8x1", "3.0", "2.9", "3.1"), row("torch.mm loop", "8x1", "2.0", "1.9", "2.1"),
        row("fusedpar.triton", "8x1", "1.9", "1.8", "2.0"), row("auto", "8x1", "1.9", "1.8", "2.0"),
        # auto 2.05 ms, its p20 2.0 <= the loop's p80 2.1: within noise
        row("torch.mm loop", "8x2", "2.0", "1.9", "2.1"), row("auto", "8x2", "2.05", "2.0", "2.3"),
        # auto 2.4 ms, its p20 2.2 > the loop's p80 2.1: slower beyond noise
        row("torch.mm loop", "8x3", "2.0", "1.9", "2.1"), row("auto", "8x3", "2.4", "2.2", "2.6"),
    ], head=[*HEAD, "p20_ms", "p80_ms"])
    page = report.render(report.load(tmp_path))
    cells = {(c[0], c[3]): c for c in ([x.strip() for x in line.strip("|").split("|")]
                                       for line in page.splitlines() if line.startswith("| 8x"))}
    target = report.AUTO_TARGET
    assert cells["8x1", "auto"][7] == f">= {target}x the best baseline (torch.mm loop) within noise: met"
    assert cells["8x2", "auto"][7].endswith("within noise: met within noise")
    assert cells["8x3", "auto"][7].endswith("within noise: MISSED")
    assert cells["8x1", "fusedpar.triton"][7].startswith(">= 1.0x torch._grouped_mm: met")
    assert f"| grouped_mm | the best baseline, by the auto row | >= {target}x within noise | 2 of 3 |" in page
    assert "| grouped_mm | torch.mm loop | >= 1.3x | 0 of 1 |" in page  # fusedpar.triton's alone
    assert report.auto_verdict((2.4, 2.2, 2.6), (2.0, 1.9, 2.1)) == "MISSED"


def test_plots_one_png_per_family(report, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is not installed")
    rows = report.load(BENCH / "results")
    written = report.draw(rows, tmp_path)
    families = {family for family, ops in report.FAMILIES.items() if any(op in rows for op in ops)}
    assert {p.stem for p in written} == families
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bench_conftest():
    """benchmarks/conftest.py as a module (it imports report and targets: BENCH must be on
    sys.path, as the ``report`` fixture puts it)."""
    spec = importlib.util.spec_from_file_location("bench_conftest", BENCH / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recorder(tmp_path, monkeypatch, report):
    """benchmarks/conftest.py writing its rows into tmp_path, measured on a fixed machine."""
    conf = _bench_conftest()
    monkeypatch.setattr(conf, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(conf, "_provenance", lambda: {
        "device": "GPU-A", "torch": "2.11", "triton": "3.6", "cuda": "13.0",
        "date": "2026-01-01T00:00:00+00:00", "commit": "0123abc"})
    return conf


def test_rows_record_the_commit(tmp_path, recorder, report):
    conf = recorder
    conf._record_row("all_gather", "triton", (4, 4), "torch.bfloat16", 8, 1.0, 0.9, 1.1,
                     algo_bytes=10, mode="loopback")
    with (tmp_path / "all_gather.csv").open(newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert list(row) == conf.COLUMNS and row["commit"] == "0123abc"
    assert report.load(tmp_path)["all_gather"][0]["commit"] == "0123abc"
    # a file with other columns is refused, not appended to under the wrong header
    _write(tmp_path / "reduce_scatter.csv", [], head=[h for h in HEAD if h != "commit"])
    with pytest.raises(ValueError, match="move it aside"):
        conf._record_row("reduce_scatter", "triton", (4, 4), "bf16", 8, 1.0, 0.9, 1.1,
                         algo_bytes=10)


def test_a_recorded_auto_row_is_judged_against_the_cases_best_baseline(tmp_path, monkeypatch,
                                                                        recorder, report):
    """What a suite writes: an auto row slower than the case's fastest baseline beyond noise
    says MISSED in its notes (and in the target lines); another case's baselines do not count."""
    conf = recorder
    lines = []
    monkeypatch.setattr(conf, "_TARGET_LINES", lines)
    row = dict(algo_bytes=10, mode="loopback")
    conf._record_row("all_gather", "torch.cat", (4, 4), "torch.bfloat16", 8, 2.0, 1.9, 2.1, **row)
    conf._record_row("all_gather", "auto", (4, 4), "torch.bfloat16", 8, 2.4, 2.2, 2.6, chose="cuda", **row)
    conf._record_row("all_gather", "auto", (4, 4), "torch.bfloat16", 8, 2.0, 1.9, 2.1,
                     mode="torchrun", algo_bytes=10)  # no baseline of this case (mode) yet
    rows = report.load(tmp_path)["all_gather"]
    notes = [report.parse_notes(r["notes"]) for r in rows]
    assert notes[1]["chose"] == "cuda"
    assert notes[1]["vs_best_baseline"] == "0.833x torch.cat (target >= 1.0x within noise: MISSED)"
    assert notes[2]["vs_best_baseline"] == "n/a"
    assert lines == ["all_gather 4x4 bfloat16 8 mode=loopback auto: 0.833x torch.cat (target >= 1.0x within noise: MISSED)",
                     "all_gather 4x4 bfloat16 8 mode=torchrun auto: vs the best baseline: n/a (no baseline row in this run)"]
    assert "within noise: MISSED" in report.render(report.load(tmp_path))  # the page agrees


def test_an_auto_row_timing_the_baselines_own_code_is_not_judged_by_drift(tmp_path, monkeypatch,
                                                                            recorder, report):
    """A loopback auto row whose choice the baseline stands for (chose=reference: torch.cat)
    timed the baseline's own function: a slower median is drift between two timings, said so
    in its notes and on the page; a torchrun auto row is still judged."""
    conf = recorder
    monkeypatch.setattr(conf, "_TARGET_LINES", [])
    conf._record_row("all_gather", "torch.cat", (4, 4), "torch.bfloat16", 8, 2.0, 1.9, 2.1,
                     algo_bytes=10, mode="loopback")
    conf._record_row("all_gather", "auto", (4, 4), "torch.bfloat16", 8, 2.4, 2.2, 2.6,
                     algo_bytes=10, mode="loopback", chose="reference")
    drift = "met (the baseline's own code: the ratio is run-to-run drift)"
    notes = report.parse_notes(report.load(tmp_path)["all_gather"][1]["notes"])
    assert notes["vs_best_baseline"] == f"0.833x torch.cat (target >= 1.0x within noise: {drift})"
    assert drift in report.render(report.load(tmp_path))
    assert report.runs_baseline("all_gather", {"mode": "loopback", "chose": "reference"}, "torch.cat")
    assert not report.runs_baseline("all_gather", {"mode": "torchrun", "chose": "reference"}, "nccl")
    assert not report.runs_baseline("all_gather", {"mode": "loopback", "chose": "cuda"}, "torch.cat")


def test_commit_from_the_environment_or_git(monkeypatch, report):
    conf = _bench_conftest()
    monkeypatch.setenv("FUSEDPAR_COMMIT", "given")
    assert conf.git_commit() == "given"
    conf.git_commit.cache_clear()
    monkeypatch.delenv("FUSEDPAR_COMMIT")
    commit = conf.git_commit()
    assert commit == "unknown" or len(commit.removesuffix("+dirty")) == 40


def test_committed_rows_carry_the_columns_the_suites_write(report):
    conf = _bench_conftest()
    for path in sorted((BENCH / "results").glob("*.csv")):
        with path.open(newline="") as f:
            assert next(csv.reader(f)) == conf.COLUMNS, path.name


def test_merge_appends_a_runs_rows_and_profiles(report, tmp_path):
    """``--merge DIR``: the rows and profiles a .ci/gpu all run brought back join the folder."""
    results, run = tmp_path / "results", tmp_path / "run"
    results.mkdir()
    (run / "profiles").mkdir(parents=True)
    row = dict(op="moe_experts", backend="fused", shape="8x2", median_ms="9.0",
               date="2026-01-02T00:00:00+00:00")
    _write(results / "moe_experts.csv", [{**row, "median_ms": "10.0", "date": "2026-01-01T00:00:00+00:00"}])
    _write(run / "moe_experts.csv", [row])
    _write(run / "grouped_mm.csv", [{**row, "op": "grouped_mm"}])
    (run / "profiles" / "moe_experts_fused_8x2.txt").write_text("# profile\n")
    assert report.main(["--results", str(results), "--merge", str(run), "--no-plots"]) == 0
    merged = report.load(results)
    assert [r["median_ms"] for r in merged["moe_experts"]] == ["10.0", "9.0"]
    data = (results / "moe_experts.csv").read_bytes()
    assert data.count(b"\r\n") == data.count(b"\n") == 3  # csv's line ends, kept
    assert [r["op"] for r in merged["grouped_mm"]] == ["grouped_mm"]
    assert (results / "profiles" / "moe_experts_fused_8x2.txt").read_text() == "# profile\n"
    assert "| 8x2 |  | 8 | fused | 9.000 |" in (results / "README.md").read_text()  # the latest
    _write(run / "moe_experts.csv", [row], head=[h for h in HEAD if h != "commit"])
    with pytest.raises(SystemExit, match="columns differ"):
        report.main(["--results", str(results), "--merge", str(run), "--no-plots"])


def test_row_targets_from_the_notes(report, tmp_path):
    """A target a row carries in its notes (graph replays against their GPU busy time) is
    shown in its cell and counted per op in the summary ("no row" until measured)."""
    day = "2026-01-01T00:00:00+00:00"
    _write(tmp_path / "all_gather.csv", [
        dict(op="all_gather", backend="torch.cat", shape="4x4", median_ms="1.0", date=day,
             notes="mode=loopback"),
        dict(op="all_gather", backend="triton.graph", shape="4x4", median_ms="1.3", date=day,
             notes="mode=loopback;vs_gpu_busy=1.200x (target <= 1.15x: MISSED)")])
    page = report.render(report.load(tmp_path))
    assert "| triton.graph | 1.300 | 0.77x | vs_gpu_busy 1.200x (target <= 1.15x: MISSED) |" in page
    assert ("| all_gather | a CUDA-graph replay's median / its GPU busy time (`vs_gpu_busy`) "
            "| <= 1.15x | 0 of 1 |") in page
    assert ("| reduce_scatter | a CUDA-graph replay's median / its GPU busy time (`vs_gpu_busy`) "
            "| <= 1.15x | no row |") in page
