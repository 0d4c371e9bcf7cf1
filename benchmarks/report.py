"""Generate ``benchmarks/results/README.md`` (and one PNG per op family) from the CSV rows,
and the planner's measured facts that ship with the package (``fusedpar/plan/measured.json``).

    python benchmarks/report.py            # rewrite README.md, draw plots/<family>.png
    python benchmarks/report.py --check    # exit 1 if README.md is not this script's output
    python benchmarks/report.py --merge DIR   # first append DIR's rows and profiles (the
                                              # results/ of a .ci/gpu all run) to this folder

Per op: the latest row of each (case, backend) (a case: shape, dtype, world, device and the
notes that tell cases apart, e.g. ``causal``, ``mode``), its speed-up over each baseline of
the same case (baseline median / its median), the targets of ``targets.py`` met or missed
(with those a row holds against itself, from its notes), and the device, versions, commit
and date it was measured with. The page holds nothing but what the rows say; what changed
since a row belongs in commit messages. Plots need matplotlib (the ``bench`` extra): without
it they are skipped with a message. Standard library only otherwise, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

# benchmarks/ is on sys.path: run as a script or by pytest
from targets import (AUTO, AUTO_OPS, AUTO_TARGET, BASELINES, FAMILIES, ROW_TARGETS, auto_verdict,
                     runs_baseline)

RESULTS = Path(__file__).parent / "results"
# the planner's measured facts, shipped with the package (fusedpar.plan.speed reads them)
PLANNER_FACTS = Path(__file__).parent.parent / "fusedpar" / "plan" / "measured.json"
# notes that tell cases of one op and shape apart (all other notes are measurements)
CASE_NOTES = ("mode", "causal", "routing", "top_k", "experts")


def parse_notes(text: str) -> dict[str, str]:
    """``"a=1;b=x y"`` -> ``{"a": "1", "b": "x y"}``."""
    pairs = (item.partition("=") for item in text.split(";") if item)
    return {key: value for key, _, value in pairs}


def load(results: Path) -> dict[str, list[dict]]:
    """Every CSV's rows by op, in file order; a row without a ``commit`` (written before
    rows recorded it) has ``unknown``."""
    rows: dict[str, list[dict]] = {}
    for path in sorted(results.glob("*.csv")):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                row["commit"] = row.get("commit") or "unknown"
                rows.setdefault(row["op"], []).append(row)
    return rows


def case_of(row: dict) -> tuple:
    notes = parse_notes(row["notes"])
    case = " ".join(f"{k}={notes[k]}" for k in CASE_NOTES if k in notes)
    return row["shape"], row["dtype"], int(row["world"]), row["device"], case


def latest(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """``{case: {backend: its latest row}}``, cases in order of first appearance (the latest
    by date; rows are appended, so of equal dates the last in the file)."""
    cases: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_backend = cases.setdefault(case_of(row), {})
        old = by_backend.get(row["backend"])
        if old is None or row["date"] >= old["date"]:
            by_backend[row["backend"]] = row
    return cases


def ordered(op: str, by_backend: dict[str, dict]) -> list[str]:
    """A case's backends: its baselines in the table's order, then the others as they came."""
    baselines = [b for b in BASELINES.get(op, {}) if b in by_backend]
    return baselines + [b for b in by_backend if b not in baselines]


def speedups(op: str, by_backend: dict[str, dict], backend: str) -> dict[str, float]:
    """``{baseline: its median / backend's}`` over the case's baselines (none for a baseline)."""
    if backend in BASELINES.get(op, {}):
        return {}
    mine = float(by_backend[backend]["median_ms"])
    return {b: float(by_backend[b]["median_ms"]) / mine
            for b in BASELINES.get(op, {}) if b in by_backend}


def times(row: dict) -> tuple[float, float, float]:
    """A row's ``(median, p20, p80)`` ms (a row without quantiles: its median thrice)."""
    median = float(row["median_ms"])
    return median, float(row.get("p20_ms") or median), float(row.get("p80_ms") or median)


def best_baseline(op: str, by_backend: dict[str, dict]) -> str | None:
    """The case's fastest baseline (by median), or None without one."""
    present = [b for b in BASELINES.get(op, {}) if b in by_backend]
    return min(present, key=lambda b: float(by_backend[b]["median_ms"]), default=None)


def auto_check(op: str, by_backend: dict[str, dict]) -> str | None:
    """The auto row's verdict against the case's best baseline (``targets.auto_verdict``),
    or None where the case has no auto row or no baseline."""
    best = best_baseline(op, by_backend)
    if AUTO not in by_backend or best is None:
        return None
    same = runs_baseline(op, parse_notes(by_backend[AUTO].get("notes", "")), best)
    verdict = auto_verdict(times(by_backend[AUTO]), times(by_backend[best]), same)
    return f">= {AUTO_TARGET}x the best baseline ({best}) within noise: {verdict}"


def verdicts(op: str, ratios: dict[str, float]) -> list[str]:
    out = []
    for baseline, ratio in ratios.items():
        least = BASELINES[op][baseline]
        if least is not None:
            out.append(f">= {least}x {baseline}: {'met' if ratio >= least else 'MISSED'}")
    return out


def row_checks(row: dict) -> list[str]:
    """The targets a row holds against itself (``targets.ROW_TARGETS``), as its notes say them."""
    notes = parse_notes(row.get("notes", ""))
    return [f"{key} {notes[key]}" for key in ROW_TARGETS if key in notes]


def op_section(op: str, rows: list[dict]) -> list[str]:
    cases = latest(rows)
    columns = [b for b in BASELINES.get(op, {})
               if any(b in by_backend for by_backend in cases.values())]
    judged = any(BASELINES[op][b] is not None for b in columns) or any(  # a target column
        auto_check(op, by_backend) or any(row_checks(row) for row in by_backend.values())
        for by_backend in cases.values())
    head = ["shape", "case", "W", "backend", "median ms", *[f"vs {b}" for b in columns],
            *(["target"] if judged else []), "device", "torch / triton / cuda", "commit", "date (UTC)"]
    lines = [f"## {op}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (shape, dtype, world, device, case), by_backend in cases.items():
        for backend in ordered(op, by_backend):
            row = by_backend[backend]
            ratios = speedups(op, by_backend, backend)
            verdict = (auto_check(op, by_backend) or "" if backend == AUTO
                       else "; ".join(verdicts(op, ratios) + row_checks(row)))
            cells = [shape if dtype == "bfloat16" else f"{shape} {dtype}", case, str(world),
                     backend, f"{float(row['median_ms']):.3f}",
                     *[f"{ratios[b]:.2f}x" if b in ratios else "" for b in columns],
                     *([verdict] if judged else []), device,
                     f"{row['torch']} / {row['triton']} / {row['cuda']}", row["commit"][:12],
                     row["date"][:16].replace("T", " ")]
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def summary(rows: dict[str, list[dict]]) -> list[str]:
    """Per op and target: how many latest rows met it."""
    lines = ["| op | baseline | target | latest rows meeting it |", "|---|---|---|---|"]
    for op, baselines in BASELINES.items():
        cases = latest(rows.get(op, []))
        for baseline, least in baselines.items():
            if least is None:
                continue
            met = total = 0
            for by_backend in cases.values():
                for backend in by_backend:
                    ratio = speedups(op, by_backend, backend).get(baseline)
                    if ratio is not None and backend != AUTO:  # auto: its own target below
                        total += 1
                        met += ratio >= least
            lines.append(f"| {op} | {baseline} | >= {least}x | "
                         f"{f'{met} of {total}' if total else 'no row'} |")
        for key, (ops, what, bound) in ROW_TARGETS.items():
            if op not in ops:
                continue
            checks = [parse_notes(row.get("notes", "")).get(key) for by_backend in cases.values()
                      for row in by_backend.values()]
            checks = [c for c in checks if c]
            met = sum(c.endswith(": met)") for c in checks)
            lines.append(f"| {op} | {what} (`{key}`) | <= {bound}x | "
                         f"{f'{met} of {len(checks)}' if checks else 'no row'} |")
        if op in AUTO_OPS:
            checks = [auto_check(op, by_backend) for by_backend in cases.values()]
            checks = [c for c in checks if c]
            met = sum(not c.endswith("MISSED") for c in checks)
            lines.append(f"| {op} | the best baseline, by the {AUTO} row | >= {AUTO_TARGET}x within "
                         f"noise | {f'{met} of {len(checks)}' if checks else 'no row'} |")
    return lines


HEADER = """\
# Benchmark results

<!-- generated by `python benchmarks/report.py` from the CSVs in this folder: edit the
script (or benchmarks/targets.py), not this page; a test checks that they agree -->

One CSV per op, one row per measured case, appended by the suites `benchmarks/bench_<op>.py`
(`record_row` in `benchmarks/conftest.py`). A row exists only for a device it was measured
on: without a CUDA GPU every timing case skips and nothing is written. Each op's section
below shows the latest row of each backend per case, its speed-up over each baseline of the
same case (the baseline's median / its median) and the targets of `benchmarks/targets.py`
(recorded, never asserted). Rows written before rows recorded their commit say `unknown`;
what changed since a row is in the commit messages (`git log <commit>..`).
Plots (speed-up over the case's first baseline against problem size, one line per backend
and case): `plots/<family>.png` ({plots}).

## Targets

The `auto` row of a case is what a user gets (`backend=None`: the dispatcher's choice by the
tuning table, the default table or the priority order; `chose` in its notes). Its target is
the case's best baseline: met within noise where the median misses it but the auto row's p20
is no later than that baseline's p80 (`auto_verdict` in `benchmarks/targets.py`).
A few targets a row holds against itself (`ROW_TARGETS` there: a CUDA-graph replay against
its own GPU busy time, the all-gather GEMM with late flags against its on-time run) are in its
notes as `<key>=<ratio>x (target <= <bound>x: met)` and in its target cell.

"""

FOOTER = """\
## Columns of the CSVs

| column | meaning |
|---|---|
| `op`, `backend` | the op; a fusedpar backend or a baseline (`benchmarks/targets.py`) |
| `shape` | all_gather: the per-rank shard; reduce_scatter: the per-rank output; the fused matmuls: `MxKxN` (all_gather_matmul: A_gathered `[M, K]`, B `[K, N]`; matmul_reduce_scatter: each rank's A `[M, K]`, B `[K, N]`); attention: `BxSxHxD`; grouped_mm: `TxKxNxE`; moe: `WxTxH[xI]` |
| `dtype`, `world` | element type; W, the ranks (simulated ranks in loopback rows) |
| `device` | `torch.cuda.get_device_name()` of the GPU that ran it |
| `median_ms`, `p20_ms`, `p80_ms` | quantiles of one call: CUDA events after warm-up, L2 flushed before each call (`triton.testing.do_bench`; under torchrun the same with repeat counts agreed across ranks, each quantile the slowest rank's) |
| `gbps` | algorithm bandwidth (GB/s) of the bytes the op's result stands for, over `median_ms` |
| `bytes_moved`, `lower_bound` | bytes received from peers as counted by `fusedpar.comm.count_bytes()` (blank where nothing counts them), and the fewest a correct op must receive |
| `torch`, `triton`, `cuda` | `torch.__version__`, `triton.__version__`, `torch.version.cuda` |
| `date`, `commit` | UTC time of the measurement; the git commit measured (`+dirty`: with uncommitted changes) |
| `notes` | the case (`mode`, `causal`, `routing`, ...) and measurements (`tflops`, `pct_roofline`, `gpu_busy_ms`, `host_ms`, ...) |

Loopback rows: one GPU plays all W ranks in one process (no NVLink): they price each
protocol's overhead and kernel quality, not overlap with communication. torchrun rows need
several GPUs.

## Producing rows

    pytest benchmarks --benchmark-only                                  # one GPU: loopback cases
    torchrun --nproc-per-node 8 -m pytest benchmarks --benchmark-only   # several GPUs
    .ci/gpu all                                                         # a lent GPU machine, staged
    python benchmarks/report.py --merge DIR   # a run's rows and profiles (results.tar.gz), then this page

`FUSEDPAR_BENCH_RESULTS=/some/dir` writes the CSVs there instead of this folder;
`FUSEDPAR_COMMIT` names the commit where the checkout has no git metadata.
"""


def planner_facts(rows: dict[str, list[dict]]) -> str:
    """The JSON the planner ships: per device, its fastest ``matmul_roofline`` row's TFLOP/s
    and where it comes from (``fusedpar.plan.speed.measured_peak_tflops``)."""
    best: dict[str, dict] = {}
    for row in rows.get("matmul_roofline", []):
        tflops = parse_notes(row.get("notes", "")).get("tflops")
        if tflops is None or float(tflops) <= best.get(row["device"], {}).get("tflops", -1.0):
            continue
        best[row["device"]] = {"device": row["device"], "tflops": float(tflops),
                               "source": f"matmul_roofline.csv {row['shape']} {row['dtype']} on "
                                         f"{row['device']}, {row['date']}"}
    return json.dumps({"matmul_peaks": [best[d] for d in sorted(best)]}, indent=1) + "\n"


def merge(new: Path, results: Path) -> list[str]:
    """Append the rows of ``new/*.csv`` to ``results/`` (a new file is copied; an existing one
    must have the same header) and copy ``new/profiles/*`` over; returns what it did."""
    import shutil

    done = []
    for path in sorted(new.glob("*.csv")):
        target = results / path.name
        lines = path.read_bytes().decode().splitlines(keepends=True)  # keeps csv's \r\n
        if not target.exists():
            shutil.copyfile(path, target)
        elif target.read_text().splitlines()[:1] != [line.rstrip("\r\n") for line in lines[:1]]:
            raise SystemExit(f"{path}: its columns differ from {target}'s: not merged")
        else:
            with target.open("a", newline="") as f:
                f.writelines(lines[1:])
        done.append(f"{target.name}: +{len(lines) - 1} rows")
    profiles = sorted((new / "profiles").glob("*.txt"))
    if profiles:
        (results / "profiles").mkdir(exist_ok=True)
        for path in profiles:
            shutil.copyfile(path, results / "profiles" / path.name)
        done.append(f"profiles: {len(profiles)} files")
    return done


def render(rows: dict[str, list[dict]]) -> str:
    plots = ", ".join(f"[{family}](plots/{family}.png)" for family in FAMILIES)
    lines = [HEADER.format(plots=plots) + "\n".join(summary(rows)), ""]
    known = [op for op in BASELINES if op in rows]
    for op in known + sorted(op for op in rows if op not in BASELINES):
        lines += op_section(op, rows[op])
    return "\n".join(lines) + "\n" + FOOTER


def problem_size(shape: str) -> int:
    return math.prod(int(d) for d in shape.split("x"))


def draw(rows: dict[str, list[dict]], out_dir: Path) -> list[Path]:
    """One PNG per family of ``FAMILIES`` with rows: a panel per op, speed-up over each
    case's first baseline against the problem size (product of the shape), a line per
    (backend, case); the target as a dashed line. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for family, ops in FAMILIES.items():
        ops = [op for op in ops if op in rows]
        if not ops:
            continue
        fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.5), squeeze=False)
        for ax, op in zip(axes[0], ops):
            lines: dict[str, list[tuple[int, float]]] = {}
            targets = set()
            devices = {row["device"] for row in rows[op]}
            for (shape, dtype, world, device, case), by_backend in latest(rows[op]).items():
                first = next((b for b in BASELINES.get(op, {}) if b in by_backend), None)
                if first is None:
                    continue
                if BASELINES[op][first] is not None:
                    targets.add((first, BASELINES[op][first]))
                for backend in ordered(op, by_backend):
                    ratio = speedups(op, by_backend, backend).get(first)
                    if ratio is not None:
                        label = " ".join([backend, case, f"W={world}",
                                          *([device] if len(devices) > 1 else [])])
                        lines.setdefault(label, []).append((problem_size(shape), ratio))
            for label, points in lines.items():
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", label=label)
            for baseline, least in sorted(targets):
                ax.axhline(least, linestyle="--", color="grey", linewidth=1,
                           label=f"target: {least}x {baseline}")
            ax.axhline(1.0, color="black", linewidth=0.5)
            ax.set_xscale("log")
            ax.set_title(f"{op} ({', '.join(sorted(devices))})")
            ax.set_xlabel("problem size (product of the shape)")
            ax.set_ylabel("speed-up over the baseline")
            ax.legend(fontsize=6)
        fig.tight_layout()
        path = out_dir / f"{family}.png"
        fig.savefig(path, dpi=100, metadata={"Software": None})
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the CSVs")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if README.md differs from the generated page; write nothing")
    parser.add_argument("--no-plots", action="store_true", help="write README.md only")
    parser.add_argument("--merge", type=Path, metavar="DIR",
                        help="first append DIR's CSV rows and profiles to the results folder")
    parser.add_argument("--facts", type=Path, default=None,
                        help="the planner's facts file (default: fusedpar/plan/measured.json for "
                             "the committed results, else measured.json in --results)")
    args = parser.parse_args(argv)
    facts = args.facts or (PLANNER_FACTS if args.results == RESULTS else args.results / "measured.json")
    if args.merge and not args.check:
        print("\n".join(merge(args.merge, args.results)))
    rows = load(args.results)
    outputs = {args.results / "README.md": render(rows), facts: planner_facts(rows)}
    if args.check:
        stale = [path for path, text in outputs.items() if not path.exists() or path.read_text() != text]
        for path in stale:
            print(f"{path} is not what benchmarks/report.py generates: run it", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs.items():
        path.write_text(text)
        print(f"wrote {path}")
    if not args.no_plots:
        try:
            for path in draw(rows, args.results / "plots"):
                print(f"wrote {path}")
        except ImportError as e:
            print(f"plots skipped: matplotlib is not installed (the bench extra): {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
