"""Generate fusedpar's default tuning table (``fusedpar/ops/tuning_defaults.json``) from the
committed benchmark rows, the choice a GPU gets where nothing was measured on it
(``fusedpar.ops.tuning``).

    python benchmarks/defaults.py            # rewrite the table
    python benchmarks/defaults.py --check    # exit 1 if the shipped table is not this output

Each row's backend label is mapped to the dispatcher backend it measured (``LABELS``; a
baseline stands for the plain-torch backend: a loopback baseline is that path's compute
alone, so a fusedpar backend slower than it is not known to be faster than the plain
path). Per (op, device, world, dtype, shape bucket): the latest row of each label per case
(``report.latest``); a fusedpar backend slower than a baseline in any case is not eligible;
among the eligible backends measured in every case, the least total median wins (ties: the
dispatcher's priority order). Per op and device, and over all devices (``"*"``), the
fallback is the backend chosen in most buckets. Rows of a backend the op does not have
(yet) are left out; so are rows that time something other than the dispatcher's choice:
ops whose calls have no bucket (ring_attention; moe_dispatch, an exchange the tuning does
not time), and forward-only rows of ops whose choice serves the backward too
(flash_attention's forward rows; moe_experts' loopback rows, where ``moe_experts_train``'s
forward + backward rows tune ``moe_experts``: ``TUNES``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from report import RESULTS, load, latest, parse_notes  # benchmarks/ is on sys.path
from targets import BASELINES, LABELS, TUNES

from fusedpar.cli import tune
from fusedpar.ops import registry, tuning
from fusedpar.ops.grouped_mm import GroupedCall
from fusedpar.ops.moe.experts_call import ExpertsCall

OUT = Path(tuning.DEFAULTS_PATH)


def _meta(*shape):
    return torch.empty(*shape, device="meta")


def call_of(op: str, shape: str, world: int, notes: dict):
    """The call a row measured (meta tensors: only its bucket is asked; the shape notation
    is ``fusedpar tune``'s), or None for a row that is not one call of a tuned op."""
    if op == "moe_experts_train":  # W x T x H x I, the experts over all W ranks in the notes
        w, t, h, i = map(int, shape.split("x"))
        local, k = int(notes["experts"]) // w, int(notes["top_k"])
        return ExpertsCall(_meta(t, h), _meta(t, k), _meta(t, k), _meta(local, 2 * i, h),
                           _meta(local, h, i), None)
    if op not in tune.OPS or (op == "flash_attention" and notes.get("mode") != "fwd+bwd"):
        return None  # attention: the choice serves forward and backward
    if op == "grouped_mm" and notes.get("routing") == "masked":  # ExPxKxN, the batched form
        e, p, k, n = map(int, shape.split("x"))
        return GroupedCall(_meta(e, p, k), _meta(e, k, n), None,
                           torch.empty(e, dtype=torch.int32, device="meta"))
    return tune.call_of(op, tune.parse_shape(op, shape), world, None, _meta,
                        causal=notes.get("causal") == "True")


def _key(op: str, device: str, world: int, dtype: str, call) -> str:
    return tuning.Signature(op, device, world, dtype, tuple(call.bucket()), "").key(with_placement=False)


def cases_by_key(rows: dict[str, list[dict]]) -> dict[str, tuple[str, list[dict[str, float]]]]:
    """``{signature key: (the rows' op, [{backend label: latest median ms} per case])}`` of
    the tuned ops; a key names the op the rows tune (``TUNES``)."""
    found: dict[str, tuple[str, list[dict[str, float]]]] = {}
    for op in LABELS:
        for (shape, dtype, world, device, _), by_label in latest(rows.get(op, [])).items():
            notes = parse_notes(next(iter(by_label.values()))["notes"])
            call = call_of(op, shape, world, notes)
            if call is not None:
                key = _key(TUNES.get(op, op), device, world, dtype, call)
                found.setdefault(key, (op, []))[1].append(
                    {label: float(row["median_ms"]) for label, row in by_label.items()})
    return found


def choose(op: str, cases: list[dict[str, float]]) -> dict | None:
    """The default row of one key from ``op``'s rows (see the module docstring), or None if
    no backend the op tuned has was measured in every case."""
    names = registry.get(TUNES.get(op, op)).backends
    labels = {label: b for label, b in LABELS[op].items() if b in names}
    baselines = [label for label in labels if label in BASELINES.get(op, {})]
    measured = [label for label in labels if all(label in case for case in cases)]
    slower = {label for label in measured if label not in baselines
              and any(case[label] > case[base] for case in cases for base in baselines if base in case)}
    eligible = [label for label in measured if label not in slower]
    if not eligible:
        return None
    total = {label: sum(case[label] for case in cases) for label in measured}
    best = min(eligible, key=lambda label: (total[label], names.index(labels[label])))
    times = ", ".join(f"{label} {total[label]:.3f} ms" for label in sorted(total, key=total.get))
    why = f"{len(cases)} benchmark case(s): {times}"
    if best in baselines and labels[best] != best:
        why += f" ({best} stands for {labels[best]})"
    if slower:
        why += "; slower than a baseline, so not the default: " + ", ".join(sorted(slower))
    return {"backend": labels[best], "why": why}


def generate(results: Path = RESULTS) -> dict:
    entries = {}
    for key, (op, cases) in sorted(cases_by_key(load(results)).items()):
        row = choose(op, cases)
        if row is not None:
            entries[key] = row
    fallback: dict[str, dict[str, dict]] = {}
    by_op: dict[str, dict[str, Counter]] = {}
    for key, row in entries.items():
        op, device = key.split("|")[:2]
        for where in (device, "*"):
            by_op.setdefault(op, {}).setdefault(where, Counter())[row["backend"]] += 1
    for op, devices in sorted(by_op.items()):
        names = registry.get(op).backends
        for where, counts in sorted(devices.items()):
            best = min(counts, key=lambda b: (-counts[b], names.index(b)))
            on = "every device measured" if where == "*" else where
            fallback.setdefault(op, {})[where] = {
                "backend": best, "why": f"the default of {counts[best]} of {sum(counts.values())} "
                                        f"measured bucket(s) on {on}"}
    return {"generated_by": "python benchmarks/defaults.py (from benchmarks/results/*.csv)",
            "entries": entries, "fallback": fallback}


def render(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the shipped table differs")
    args = parser.parse_args(argv)
    text = render(generate())
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is not the output of benchmarks/defaults.py: rerun it", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
