"""``fusedpar check``: every registered op's check cases (``fusedpar.testing``: each op names
its module in ``register(..., checks=...)``, so a new op gets its rows by registering) on
every backend available here, bit for bit (against the op's oracle backend or a float64
plain-torch oracle on exact small-integer data) or, where softmax or a backward makes that
impossible, within the case's atol of float64 plain torch, with the bytes each moved next to
the lower bound; the same through their loopback variants; and a Llama-style block under
``apply_tp`` (TP=2, sequence parallel) per fused-matmul backend against the block in one
process (forward, backward, one SGD step). Without a GPU it spawns ``--world-size`` CPU
ranks (gloo; Triton kernels in the interpreter); under ``torchrun`` with CUDA each rank runs
on its GPU over NCCL."""

from __future__ import annotations

import argparse
import copy
import importlib
import platform
import sys

import torch

import fusedpar
from fusedpar.cli import launch
from fusedpar.kernels.interpreter import interpreting
from fusedpar.ops import registry
from fusedpar.ops.calls import MatmulCall
from fusedpar.testing.cases import dtype_name, max_abs_diff, same
from fusedpar.testing.parallel import (TP_ATOL, TP_BATCH, TP_HEAD_DIM, TP_HEADS,
                                       TP_HIDDEN, TP_INTERMEDIATE, TP_KV_HEADS, TP_OP, TP_SEQ,
                                       TP_SIZE, tp_data, tp_full,
                                       tp_lower_bound, tp_step)


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="run every op on every available backend and check it")
    launch.add_launch_arguments(p, default_world=4, default_timeout=180.0)
    p.add_argument("--backends", default=None,
                   help="comma-separated backends to run, e.g. reference,triton (default: all); "
                        "'reference' always runs as the oracle")


def registered_cases(world: int) -> list:
    """``(spec, case)`` for every check case of every registered op, in registration order
    (each op names the module of its cases: ``register(..., checks=...)``)."""
    out = []
    for spec in registry.specs():
        if spec.checks:
            cases = importlib.import_module(spec.checks).cases(world)
            out += [(spec, case) for case in cases if case.op == spec.name]
    return out


def _grouped(rows: list[dict]) -> list[dict]:
    """Rows grouped by op, then backend (the op's dispatcher priority), then dtype (stable)."""
    ops = list(dict.fromkeys(r["op"] for r in rows))
    priority = {spec.name: spec.backends for spec in registry.specs()}

    def backend_rank(row):
        names = priority.get(row["op"].split(" ")[0], [])
        return names.index(row["backend"]) if row["backend"] in names else len(names)

    return sorted(rows, key=lambda r: (ops.index(r["op"]), backend_rank(r)))


def _merge(per_rank_rows: list[list[dict]], members: list[int]) -> list[dict]:
    """The ``members``' rows (same cases, same order) as one list: correct where correct
    on every member, the bytes and lower bound of the member that moved the most, the worst
    error of tolerance rows."""
    rows = []
    for i, row in enumerate(per_rank_rows[members[0]]):
        per_rank = {r: per_rank_rows[r][i] for r in members}
        busiest = max(per_rank.values(), key=lambda p: p["bytes"])
        merged = dict(row, correct=all(p["correct"] for p in per_rank.values()),
                      bytes=busiest["bytes"], lower_bound=busiest["lower_bound"],
                      wrong_ranks=[r for r, p in per_rank.items() if not p["correct"]])
        if "max_err" in row:
            worst = max(per_rank.values(), key=lambda p: p["max_err"])
            merged.update(max_err=worst["max_err"], worst=worst["worst"])
        rows.append(merged)
    return rows


def _merge_ranks(local: list[dict], group) -> list[dict]:
    """Every rank's rows merged (see :func:`_merge`); all ranks of ``group`` call this."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    gathered = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    return _merge(gathered, list(range(world)))


def _distributed_rows(group, device, selected: list[str]):
    """Run every registered case on this rank. Returns (rows, skipped), identical on every
    rank. A case is checked against its op's oracle backend on the same group, or against
    plain torch from every rank's inputs (``Case.against_oracle_backend``)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cases = []
    for spec, case in registered_cases(world):
        for dtype in case.dtypes:
            inputs = case.inputs(dtype, world, device)
            call = case.availability_call(inputs[rank], world, group)
            cases.append((spec, case, dtype, inputs, spec.dispatcher.availability(call)))
    # every rank must run the same backends: check that availability agrees
    mine = [c[-1] for c in cases]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    for r, theirs in enumerate(everyone):
        if theirs != mine:
            raise RuntimeError(f"backend availability differs between rank {rank} and rank {r}: "
                               f"{mine} vs {theirs}")

    local, skipped = [], []
    for spec, case, dtype, inputs, avail in cases:
        runs = []
        for name in spec.backends:
            if name in selected and avail[name]:
                skipped.append({"section": "distributed", "op": spec.name, "backend": name,
                                "reasons": avail[name]})
            elif name in selected:
                runs.append(name)
        if not runs:
            continue
        args = inputs[rank]
        if case.against_oracle_backend:
            expected = case.call(args, group, spec.oracle)
        else:
            expected = case.expected(inputs, dtype)[rank]
        for name in runs:
            with fusedpar.comm.count_bytes() as counter:
                out = case.call(args, group, name)
            correct, max_err, worst = case.compare(out, expected)
            row = {"op": f"{case.title()} {case.label}", "backend": name,
                   "shape": case.shape(), "dtype": dtype_name(dtype), "correct": correct,
                   "bytes": counter.total(), "lower_bound": case.lower_bound(args, world)}
            if max_err is not None:
                row.update(max_err=max_err, worst=worst)
            local.append(row)
    return _merge_ranks(_grouped(local), group), skipped


def _loopback_rows(world: int, device, selected: list[str]):
    """Every rank in this process through the ops' loopback variants; oracle: plain torch."""
    rows, skipped = [], []
    for spec, case in registered_cases(world):
        names = [n for n in case.loopback_backends() if n in selected]
        if not names:
            continue
        for dtype in case.dtypes:
            inputs = case.inputs(dtype, world, device)
            avail = spec.dispatcher.availability(case.availability_call(inputs[0], world, None))
            expected = case.expected(inputs, dtype)
            for name in names:
                if avail[name]:
                    skipped.append({"section": "loopback", "op": spec.name, "backend": name,
                                    "reasons": avail[name]})
                    continue
                with fusedpar.comm.count_bytes() as counter:
                    outs = case.loopback(inputs, name)
                wrong = [r for r, (o, e) in enumerate(zip(outs, expected)) if not same(o, e)]
                rows.append({"op": f"{case.title()} {case.label}", "backend": name,
                             "shape": case.shape(), "dtype": dtype_name(dtype),
                             "correct": not wrong, "wrong_ranks": wrong, "bytes": counter.total(),
                             "lower_bound": world * case.lower_bound(inputs[0], world)})
    return _grouped(rows), skipped


# ---- a tensor-parallel block ------------------------------------------------------------


def _error_row(op, backend, shape, checks, nbytes, lower_bound) -> dict:
    """A row checked within ``TP_ATOL``: the worst of ``checks`` ((what, actual, expected))."""
    errors = [(max_abs_diff(a, e), what) for what, a, e in checks]
    max_err, worst = max(errors)
    return {"op": op, "backend": backend, "shape": shape, "dtype": "float32",
            "correct": bool(max_err <= TP_ATOL), "max_err": max_err, "worst": worst,
            "bytes": nbytes, "lower_bound": lower_bound}


def _tp_rows(group, device, selected: list[str]):
    """The SP block on the first TP_SIZE ranks of ``group`` against the same block in one
    process, once per fused-matmul backend. Every rank of ``group`` calls this (the
    subgroup is created collectively); the others only join the final gather."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < TP_SIZE:
        return [], [{"section": "tp", "op": TP_OP, "backend": "all",
                     "reasons": [f"needs at least {TP_SIZE} ranks, the demo has {world}"]}]
    members = list(range(TP_SIZE))
    tp_group = dist.new_group([dist.get_global_rank(group, r) for r in members])
    local, skipped = [], []
    if rank in members:
        tp_rank = dist.get_rank(tp_group)
        reference, rope, x_full, g_full = tp_data(device)
        initial = copy.deepcopy(reference)
        y_ref, dx_ref, grads_ref, params_ref = tp_step(reference, rope, x_full, g_full)

        def local_part(t):
            return t.chunk(TP_SIZE, 1)[tp_rank]

        x, g = local_part(x_full), local_part(g_full)
        # representative calls of both fused ops for availability (shapes of the q/k/v gather)
        shard = x.detach()
        weight = torch.zeros(TP_HIDDEN, TP_HIDDEN, device=device)
        calls = {"all_gather_matmul": MatmulCall("all_gather_matmul", shard, 1, TP_SIZE, tp_group,
                                                 [weight]),
                 "matmul_reduce_scatter": MatmulCall("matmul_reduce_scatter", x_full, 1, TP_SIZE,
                                                     tp_group, [weight], reduce_op="sum")}
        for name in registry.get("all_gather_matmul").backends:
            if name not in selected:
                continue
            reasons = [r for op, call in calls.items()
                       for r in registry.get(op).dispatcher.availability(call).get(
                           name, ["no such backend"])]
            if reasons:
                skipped.append({"section": "tp", "op": TP_OP, "backend": name,
                                "reasons": sorted(set(reasons))})
                continue
            block = fusedpar.apply_tp(copy.deepcopy(initial), tp_group, sequence_parallel=True,
                                      backend=name)
            with fusedpar.comm.count_bytes() as counter:
                y, dx, grads, params = tp_step(block, rope, x, g)
            grads, params = tp_full(grads), tp_full(params)
            checks = [("output", y, local_part(y_ref)), ("input grad", dx, local_part(dx_ref))]
            if set(grads) != set(grads_ref):
                raise RuntimeError(f"apply_tp changed the parameter names: {sorted(grads)} vs "
                                   f"{sorted(grads_ref)}")
            checks += [(f"grad of {n}", grads[n], grads_ref[n]) for n in grads_ref]
            checks += [(f"{n} after SGD", params[n], params_ref[n]) for n in params_ref]
            local.append(_error_row(TP_OP, name, str((TP_BATCH, TP_SEQ, TP_HIDDEN)), checks,
                                    counter.total(), tp_lower_bound(TP_SIZE)))
    gathered = [None] * world  # the other ranks contribute nothing but take part
    dist.all_gather_object(gathered, (local, skipped), group=group)
    return _merge([rows for rows, _ in gathered], members), gathered[members[0]][1]


def check_rank(group, device, spec: dict) -> dict:
    """One rank's part (run by :mod:`fusedpar.cli.launch`): the distributed rows, the TP
    block, and on rank 0 the loopback rows."""
    import torch.distributed as dist

    selected = spec["backends"]
    rows, skipped = _distributed_rows(group, device, selected)
    tp_rows, tp_skipped = _tp_rows(group, device, selected)
    result = {"rows": rows, "skipped": skipped, "tp_rows": tp_rows, "tp_skipped": tp_skipped,
              "loopback_rows": [], "loopback_skipped": []}
    if dist.get_rank(group) == 0:
        lb_rows, lb_skipped = _loopback_rows(dist.get_world_size(group), device, selected)
        result["loopback_rows"], result["loopback_skipped"] = lb_rows, lb_skipped
    return result


# ---- the report ------------------------------------------------------------------------


def _fmt_bytes(n: int) -> str:
    return f"{n:,}"


def _correct_cell(r: dict) -> str:
    """``yes`` / ``NO (ranks [..])``; rows checked within a tolerance show their error."""
    notes = []
    if not r["correct"] and r.get("wrong_ranks"):
        notes.append(f"ranks {r['wrong_ranks']}")
    if "max_err" in r:
        notes.append(f"max err {r['max_err']:.1e}" + ("" if r["correct"] else f": {r['worst']}"))
    return ("yes" if r["correct"] else "NO") + (f" ({'; '.join(notes)})" if notes else "")


def format_table(rows: list[dict]) -> str:
    headers = ["op", "backend", "shape", "dtype", "correct", "bytes moved", "lower bound", "ratio"]
    body = []
    for r in rows:
        ratio = f"{r['bytes'] / r['lower_bound']:.2f}" if r["lower_bound"] else "-"
        body.append([r["op"], r["backend"], r["shape"], r["dtype"], _correct_cell(r),
                     _fmt_bytes(r["bytes"]), _fmt_bytes(r["lower_bound"]), ratio])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(headers)]
    right = {5, 6, 7}

    def line(cells):
        return " | ".join(c.rjust(w) if i in right else c.ljust(w)
                          for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(headers), "-+-".join("-" * w for w in widths)]
    out += [line(b) for b in body]
    return "\n".join(out)


def _format_skipped(skipped: list[dict]) -> list[str]:
    seen, lines = set(), []
    for s in skipped:
        key = (s["op"], s["backend"], tuple(s["reasons"]))
        if key not in seen:
            seen.add(key)
            lines.append(f"  {s['op']} / {s['backend']}: " + "; ".join(s["reasons"]))
    return lines


def _legend(result: dict) -> list[str]:
    """How each row is checked and what its lower bound is."""
    shard = f"[{TP_BATCH}, {TP_SEQ // TP_SIZE}, {TP_HIDDEN}]"
    lines = [
        "how to read it:",
        "  correct: all_gather / reduce_scatter bit for bit against the 'reference' backend;",
        "    all_gather_matmul (A_gathered and every A@B) / matmul_reduce_scatter bit for bit "
        "against a float64",
        "    plain-torch oracle rounded once to the dtype: their inputs are small integers "
        "(|A| <= 4, B in {-1, 0, 1},",
        "    at most 4*W*nonzeros-per-column <= 256), so every partial sum is exact in fp32, "
        "fp16 and bf16 in any order;",
        f"    {TP_OP}: max |error| <= {TP_ATOL:g} against the block in one process over the "
        "output, the input grad, every",
        "    parameter's full gradient and every parameter after one SGD step (shards "
        "reassembled), fp32.",
        "  lower bound (bytes a rank must receive): all_gather (W-1)*|x|; reduce_scatter "
        "(W-1)*|x|/W;",
        "    all_gather_matmul (W-1)*|A_shard| (one gather however many Bs share it); "
        "matmul_reduce_scatter (W-1)*|output|;",
        f"    {TP_OP}: forward 2 gathers of the {shard} input shard (q/k/v, gate/up) + 2 "
        f"reduce-scatters of the {shard}",
        "    output shard (o, down), backward the same again; the gradient all-reduces of the "
        "replicated norm weights",
        "    are plain torch collectives, not counted.",
    ]
    lines += [f"  {how}" for how in dict.fromkeys(
        case.how() for _, case in registered_cases(result["world_size"])) if how]
    return lines


def format_report(header: list[str], result: dict) -> tuple[str, bool]:
    """The printed report and whether every result was correct (and something ran)."""
    rows, lb_rows = result["rows"], result["loopback_rows"]
    tp_rows = result.get("tp_rows", [])
    world = result["world_size"]
    lines = list(header)
    lines += ["", f"distributed: {world} ranks; bytes moved = bytes a rank received from its "
                  "peers (max over ranks; 'reference' reports the ring algorithm's volume)",
              format_table(rows)]
    lines += ["", f"tensor parallel: a fusedpar.models Llama decoder layer ({TP_HEADS} q / {TP_KV_HEADS} "
                  f"kv heads of {TP_HEAD_DIM}, SwiGLU {TP_INTERMEDIATE}, RoPE) under fusedpar.apply_tp "
                  f"on ranks 0-{TP_SIZE - 1}, sequence parallel;",
              f"  forward + backward + one SGD step on input {(TP_BATCH, TP_SEQ, TP_HIDDEN)} "
              "(each rank its sequence shard); bytes: fused ops over the step (max over ranks)",
              format_table(tp_rows) if tp_rows else "  (nothing ran)"]
    lines += ["", f"loopback: one process plays all {world} ranks on {result['device']}; "
                  "oracle: plain torch; bytes summed over the simulated ranks",
              format_table(lb_rows) if lb_rows else "  (nothing ran)"]
    lines += [""] + _legend(result)
    skipped = _format_skipped(result["skipped"] + result.get("tp_skipped", [])
                              + result["loopback_skipped"])
    if skipped:
        lines += ["", "not run (unavailable here):"] + skipped
    all_rows = rows + tp_rows + lb_rows
    wrong = [r for r in all_rows if not r["correct"]]
    ok = bool(all_rows) and not wrong
    lines.append("")
    if not all_rows:
        lines.append("FAILED: none of the selected backends can run here")
    elif wrong:
        lines.append(f"FAILED: {len(wrong)} of {len(all_rows)} results differ from the reference")
    else:
        tolerance = sum("max_err" in r for r in all_rows)
        lines.append(f"OK: all {len(all_rows)} results match the reference "
                     f"({len(all_rows) - tolerance} bit for bit"
                     + (f", {tolerance} within their atol" if tolerance else "") + ")")
    return "\n".join(lines), ok


def _header(world: int, device: str, how: str, mode: str) -> list[str]:
    import triton

    return [f"fusedpar check: world size {world}, device {device} ({how}; Triton {mode})",
            f"fusedpar {fusedpar.__version__}, torch {torch.__version__}, "
            f"triton {triton.__version__}, python {platform.python_version()}"]


# ---- the command ------------------------------------------------------------------------


def _parse_backends(text: str | None) -> list[str]:
    known = registry.backend_names()
    if not text:
        return known
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown backend(s) {', '.join(map(repr, unknown)) or repr(text)}; "
            f"choose from {', '.join(known)} (comma-separated)")
    return names


def _torchrun_check(spec: dict, timeout: float, requested_world: int | None) -> int:
    """One rank of a torchrun job (env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...)."""
    import torch.distributed as dist

    with launch.torchrun_rank(timeout) as (device, backend):
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0 and requested_world is not None and requested_world != world:
            print(f"fusedpar check: --world-size {requested_world} ignored: torchrun started "
                  f"{world} ranks", file=sys.stderr)
        result = check_rank(dist.group.WORLD, device, spec)
        result.update(world_size=world, device=device.type)
        mode = "interpreter" if interpreting() else "compiled"
        header = _header(world, device.type, f"torchrun, {backend}", mode)
        if device.type == "cpu" and not interpreting():
            header.append("note: CPU ranks without TRITON_INTERPRET=1: the triton backend is "
                          "skipped; launch with TRITON_INTERPRET=1 torchrun ... to run it")
        report, ok = format_report(header, result)
        if rank == 0:
            print(report, flush=True)
        # every rank knows every distributed row; the loopback rows only rank 0
        return 0 if ok else 1


def run(args, parser) -> int:
    try:
        spec = {"backends": _parse_backends(args.backends)}
    except argparse.ArgumentTypeError as e:
        parser.error(f"--backends: {e}")
    if launch.under_torchrun():
        return _torchrun_check(spec, args.timeout, args.world_size)
    world = 4 if args.world_size is None else args.world_size
    if world < 1:
        parser.error(f"--world-size must be at least 1, got {world}")
    device = launch.pick_device(args.device, world, parser)
    result, error = launch.spawn(check_rank, spec, world, device, args.timeout, "check")
    if error is not None:
        print(f"fusedpar check: {error}", file=sys.stderr, flush=True)
        return 130 if error == "interrupted" else 1
    result.update(world_size=world, device=device)
    how = f"{world} spawned processes, {'nccl' if device == 'cuda' else 'gloo'}"
    mode = "interpreter" if device == "cpu" else "compiled"
    report, ok = format_report(_header(world, device, how, mode), result)
    print(report, flush=True)
    return 0 if ok else 1
