"""``fusedpar check``: every op (all_gather, reduce_scatter, all_gather_matmul,
matmul_reduce_scatter) on every backend available here, checked bit for bit (the
collectives against the ``reference`` backend, the fused matmul ops against a float64
plain-torch oracle on exact small-integer data), with the bytes each moved next to the
lower bound; the same through the loopback variants; and a Llama-style block under
``apply_tp`` (TP=2, sequence parallel) on the first two ranks, per fused-matmul backend,
against the block in one process (forward, backward, one SGD step). Without a GPU it
spawns ``--world-size`` CPU ranks (gloo; Triton kernels in the interpreter); under
``torchrun`` with CUDA each rank runs on its GPU over NCCL.
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import sys

import torch
import torch.nn.functional as F

import fusedpar
from fusedpar.cli import launch
from fusedpar.kernels.interpreter import interpreting
from fusedpar.ops import protocol, registry
from fusedpar.ops.calls import CollectiveCall, MatmulCall

DEMO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DISPATCHERS = {spec.name: spec.dispatcher for spec in registry.specs()}


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="run every op on every available backend and check it")
    launch.add_launch_arguments(p, default_world=4, default_timeout=180.0)
    p.add_argument("--backends", default=None,
                   help="comma-separated backends to run, e.g. reference,triton (default: all); "
                        "'reference' always runs as the oracle")


def _variants(world: int):
    """(op, label, input shape, dim, reduce_op): odd sizes, the scattered dim a multiple of W."""
    return [
        ("all_gather", "dim=0", (3, 5), 0, ""),
        ("all_gather", "dim=1", (3, 5), 1, ""),
        ("reduce_scatter", "sum", (3 * world, 5), 0, "sum"),
        ("reduce_scatter", "avg", (3 * world, 5), 0, "avg"),
    ]


def _matmul_variants(world: int):
    """(op, label, A shape, dim, N of each B, reduce_op) of the fused matmul ops.

    The 3-D all_gather_matmul gathers the sequence dim of ``[batch, seq, hidden]`` for two
    Bs at once (q/k projections sharing one gather)."""
    return [
        ("all_gather_matmul", "dim=1", (2, 3, 40), 1, (24, 8), ""),
        ("all_gather_matmul", "dim=0", (5, 40), 0, (24,), ""),
        ("matmul_reduce_scatter", "sum", (3 * world, 40), 0, (24,), "sum"),
        ("matmul_reduce_scatter", "avg", (3 * world, 40), 0, (24,), "avg"),
    ]


def demo_input(op: str, shape, dtype, rank: int, world: int, salt: int, device) -> torch.Tensor:
    """Rank ``rank``'s input: small integers that encode the rank, exact in every dtype.

    all_gather: ``(7n + salt) % 13 + 16 (rank + 1)``. reduce_scatter: small values chosen
    so that every element's sum over ranks is ``3W`` or ``4W`` (the last rank tops up):
    partial sums stay exact in bf16 and the average is an integer.
    """
    n = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    if op == "all_gather":
        v = (n * 7 + salt) % 13 + 16 * (rank + 1)
    else:
        def part(r):
            return (n * 7 + salt + r) % 3 + 1

        if rank < world - 1:
            v = part(rank)
        else:
            others = sum((part(r) for r in range(world - 1)), torch.zeros_like(n))
            v = world * (3 + n % 2) - others
    return v.to(dtype).to(device)


def demo_matmul_inputs(op: str, shape, ns, dtype, rank: int, world: int, salt: int, device):
    """Rank ``rank``'s ``(A, [B, ...])`` for a fused matmul op: small integers, exact in
    every dtype whatever the summation order.

    A: ``(7n + salt + rank) % 9 - 4`` in [-4, 4] (shifted by the rank: shards of ranks
    < 9 apart differ). Each B: entries in {-1, 0, 1} with ``c = max(1, 64 // W)`` nonzeros
    per column, the same on every rank for all_gather_matmul (the Bs are replicated) and
    rank-dependent for matmul_reduce_scatter (each rank owns a slice of K). Every partial
    sum is then an integer of magnitude at most ``4c`` (one rank) or ``4cW`` ≤ 256 (the
    reduction over ranks), so it is exact in bf16 (8 significant bits), fp16 and fp32, and
    an ``avg`` (sum / W) rounds once, the same way everywhere.
    """
    n = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    a = (n * 7 + salt + rank) % 9 - 4
    k = shape[-1]
    per_column = max(1, min(k, 64 // max(world, 1)))
    owner = rank if op == "matmul_reduce_scatter" else 0
    kk = torch.arange(k, dtype=torch.float64)[:, None]
    bs = []
    for j, cols in enumerate(ns):
        nn_ = torch.arange(cols, dtype=torch.float64)[None, :]
        nonzero = (kk + 5 * nn_ + 3 * owner + 7 * j + salt) % k < per_column
        sign = torch.where((kk + 2 * nn_ + owner + j) % 3 == 0, -1.0, 1.0)
        bs.append((nonzero * sign).to(dtype).to(device))
    return a.to(dtype).to(device), bs


def _lower_bound(op: str, x: torch.Tensor, world: int) -> int:
    if op == "all_gather":
        return (world - 1) * x.numel() * x.element_size()
    return (world - 1) * (x.numel() // world) * x.element_size()


def _matmul_lower_bound(op: str, a: torch.Tensor, bs, world: int) -> int:
    """all_gather_matmul: the W-1 peer shards of A (however many Bs share the gather);
    matmul_reduce_scatter: the W-1 peer partials of this rank's output chunk."""
    if op == "all_gather_matmul":
        return (world - 1) * a.numel() * a.element_size()
    out_numel = a.numel() // a.shape[-1] * bs[0].shape[1] // world
    return (world - 1) * out_numel * a.element_size()


def _call(op, x, dim, reduce_op, group, backend):
    if op == "all_gather":
        return fusedpar.ops.all_gather(x, dim, group, backend=backend)
    return fusedpar.ops.reduce_scatter(x, reduce_op, dim, group, backend=backend)


def _matmul_call(op, a, bs, dim, reduce_op, group, backend):
    """all_gather_matmul: ``(A_gathered, [outs])``; matmul_reduce_scatter: the output."""
    if op == "all_gather_matmul":
        return fusedpar.ops.all_gather_matmul(a, bs, dim, group, return_A=True, backend=backend)
    return fusedpar.ops.matmul_reduce_scatter(a, bs[0], reduce_op, dim, group, backend=backend)


def _matmul_oracle(op, dim, reduce_op, inputs, dtype) -> list:
    """Each rank's expected result from every rank's ``(A, Bs)``, in float64 plain torch
    rounded once to ``dtype`` (exact: see :func:`demo_matmul_inputs`)."""
    world = len(inputs)
    if op == "all_gather_matmul":
        gathered = torch.cat([a.double() for a, _ in inputs], dim)
        outs = [(gathered @ b.double()).to(dtype) for b in inputs[0][1]]
        return [(gathered.to(dtype), outs)] * world
    total = sum(a.double() @ bs[0].double() for a, bs in inputs)
    if reduce_op == "avg":
        total = total / world
    return list(total.to(dtype).chunk(world, dim))


def _same(actual, expected) -> bool:
    """Bit for bit: tensors, or (gathered, [outs]) pairs of all_gather_matmul."""
    if isinstance(expected, torch.Tensor):
        return (isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
                and actual.shape == expected.shape and torch.equal(actual, expected))
    (gathered, outs), (exp_gathered, exp_outs) = actual, expected
    return (_same(gathered, exp_gathered) and len(outs) == len(exp_outs)
            and all(_same(o, e) for o, e in zip(outs, exp_outs)))


def _matmul_shape(shape, ns) -> str:
    """``(2, 3, 40) @ 40x24, 40x8``: A (or A_shard) and every B."""
    return f"{tuple(shape)} @ " + ", ".join(f"{shape[-1]}x{n}" for n in ns)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _grouped(rows: list[dict]) -> list[dict]:
    """Rows grouped by op, then backend (the op's dispatcher priority), then dtype (stable)."""
    ops = list(dict.fromkeys(r["op"] for r in rows))
    everyone = list(dict.fromkeys(n for d in DISPATCHERS.values() for n in d.names))

    def backend_rank(row):
        dispatcher = DISPATCHERS.get(row["op"].split(" ")[0])
        names = dispatcher.names if dispatcher is not None else everyone
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
    """Run every case on this rank. Returns (rows, skipped), identical on every rank.

    all_gather / reduce_scatter are checked against the ``reference`` backend; the fused
    matmul ops against a float64 plain-torch oracle built from every rank's input."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cases = []
    for salt, (op, label, shape, dim, reduce_op) in enumerate(_variants(world)):
        for dtype in DEMO_DTYPES:
            x = demo_input(op, shape, dtype, rank, world, salt, device)
            call = CollectiveCall(op, x, dim, world, group, reduce_op)
            cases.append((op, label, shape, dim, reduce_op, dtype, x,
                          DISPATCHERS[op].availability(call)))
    matmul_cases = []
    for salt, (op, label, shape, dim, ns, reduce_op) in enumerate(_matmul_variants(world)):
        for dtype in DEMO_DTYPES:
            inputs = [demo_matmul_inputs(op, shape, ns, dtype, r, world, salt, device)
                      for r in range(world)]
            a, bs = inputs[rank]
            call = MatmulCall(op, a, dim, world, group, bs, return_a=True, reduce_op=reduce_op)
            matmul_cases.append((op, label, shape, ns, dim, reduce_op, dtype, inputs,
                                 DISPATCHERS[op].availability(call)))
    # every rank must run the same backends: check that availability agrees
    mine = [c[-1] for c in cases + matmul_cases]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    for r, theirs in enumerate(everyone):
        if theirs != mine:
            raise RuntimeError(f"backend availability differs between rank {rank} and rank {r}: "
                               f"{mine} vs {theirs}")

    local, skipped = [], []

    def runnable(section_op, name, avail) -> bool:
        if name not in selected:
            return False
        if avail[name]:
            skipped.append({"section": "distributed", "op": section_op, "backend": name,
                            "reasons": avail[name]})
            return False
        return True

    for op, label, shape, dim, reduce_op, dtype, x, avail in cases:
        expected = _call(op, x, dim, reduce_op, group, "reference")
        for name in DISPATCHERS[op].names:
            if not runnable(op, name, avail):
                continue
            with fusedpar.comm.count_bytes() as counter:
                out = _call(op, x, dim, reduce_op, group, name)
            local.append({"op": f"{op} {label}", "backend": name, "shape": str(tuple(shape)),
                          "dtype": _dtype_name(dtype), "correct": _same(out, expected),
                          "bytes": counter.total(),
                          "lower_bound": _lower_bound(op, x, world)})
    for op, label, shape, ns, dim, reduce_op, dtype, inputs, avail in matmul_cases:
        a, bs = inputs[rank]
        expected = _matmul_oracle(op, dim, reduce_op, inputs, dtype)[rank]
        for name in DISPATCHERS[op].names:
            if not runnable(op, name, avail):
                continue
            with fusedpar.comm.count_bytes() as counter:
                out = _matmul_call(op, a, bs, dim, reduce_op, group, name)
            local.append({"op": f"{op} {label}", "backend": name, "shape": _matmul_shape(shape, ns),
                          "dtype": _dtype_name(dtype), "correct": _same(out, expected),
                          "bytes": counter.total(),
                          "lower_bound": _matmul_lower_bound(op, a, bs, world)})
    return _merge_ranks(_grouped(local), group), skipped


def _loopback_rows(world: int, device, selected: list[str]):
    """Every rank in this process over a loopback buffer; oracle: plain torch."""
    rows, skipped = [], []
    for salt, (op, label, shape, dim, reduce_op) in enumerate(_variants(world)):
        dispatcher = DISPATCHERS[op]
        symmetric = [n for n in dispatcher.names
                     if isinstance(dispatcher.backends[n], protocol.SymmetricBackend)]
        for dtype in DEMO_DTYPES:
            xs = [demo_input(op, shape, dtype, r, world, salt, device) for r in range(world)]
            call = CollectiveCall(op, xs[0], dim, world, None, reduce_op)
            avail = dispatcher.availability(call)
            if op == "all_gather":
                expected = [torch.cat(xs, dim)] * world
            else:
                total = sum(x.double() for x in xs)
                if reduce_op == "avg":
                    total = total / world
                expected = list(total.to(dtype).chunk(world, dim))
            for name in symmetric:
                if name not in selected:
                    continue
                if avail[name]:
                    skipped.append({"section": "loopback", "op": op, "backend": name,
                                    "reasons": avail[name]})
                    continue
                with fusedpar.comm.count_bytes() as counter:
                    if op == "all_gather":
                        outs = fusedpar.ops.all_gather_loopback(xs, dim, backend=name)
                    else:
                        outs = fusedpar.ops.reduce_scatter_loopback(xs, reduce_op, dim,
                                                                    backend=name)
                wrong = [r for r, (o, e) in enumerate(zip(outs, expected)) if not _same(o, e)]
                rows.append({"op": f"{op} {label}", "backend": name, "shape": str(tuple(shape)),
                             "dtype": _dtype_name(dtype), "correct": not wrong,
                             "wrong_ranks": wrong, "bytes": counter.total(),
                             "lower_bound": world * _lower_bound(op, xs[0], world)})
    # the fused matmul ops' loopback variants run their triton kernels only
    for salt, (op, label, shape, dim, ns, reduce_op) in enumerate(_matmul_variants(world)):
        if "triton" not in selected:
            break
        for dtype in DEMO_DTYPES:
            inputs = [demo_matmul_inputs(op, shape, ns, dtype, r, world, salt, device)
                      for r in range(world)]
            a0, bs0 = inputs[0]
            call = MatmulCall(op, a0, dim, world, None, bs0, return_a=True, reduce_op=reduce_op)
            reasons = DISPATCHERS[op].availability(call)["triton"]
            if reasons:
                skipped.append({"section": "loopback", "op": op, "backend": "triton",
                                "reasons": reasons})
                continue
            expected = _matmul_oracle(op, dim, reduce_op, inputs, dtype)
            with fusedpar.comm.count_bytes() as counter:
                if op == "all_gather_matmul":
                    outs = fusedpar.ops.all_gather_matmul_loopback([a for a, _ in inputs], bs0, dim,
                                                                   return_A=True)
                else:
                    outs = fusedpar.ops.matmul_reduce_scatter_loopback(
                        [a for a, _ in inputs], [bs[0] for _, bs in inputs], reduce_op, dim)
            wrong = [r for r, (o, e) in enumerate(zip(outs, expected)) if not _same(o, e)]
            rows.append({"op": f"{op} {label}", "backend": "triton",
                         "shape": _matmul_shape(shape, ns), "dtype": _dtype_name(dtype),
                         "correct": not wrong, "wrong_ranks": wrong, "bytes": counter.total(),
                         "lower_bound": world * _matmul_lower_bound(op, a0, bs0, world)})
    return _grouped(rows), skipped


# ---- a tensor-parallel block ------------------------------------------------------------

TP_SIZE = 2
TP_BATCH, TP_SEQ, TP_HIDDEN = 2, 8, 32
TP_HEADS, TP_KV_HEADS, TP_HEAD_DIM, TP_INTERMEDIATE = 8, 4, 4, 48
TP_ATOL = 1e-5
TP_LR = 0.1
TP_OP = f"tp={TP_SIZE} block (SP)"


def _tp_data(device):
    """The seeded block (a ``fusedpar.models`` Llama decoder layer, identical on every
    rank), the rotary embeddings of the whole sequence, the input and the loss weights."""
    from fusedpar.models import LlamaConfig
    from fusedpar.models.llama import DecoderLayer, RMSNorm, RotaryEmbedding

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=TP_HIDDEN, num_heads=TP_HEADS, num_kv_heads=TP_KV_HEADS,
                         intermediate_size=TP_INTERMEDIATE)
    block = DecoderLayer(config)
    with torch.no_grad():  # norms away from 1 so that their gradients matter
        for module in block.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape))
    x = torch.randn(TP_BATCH, TP_SEQ, TP_HIDDEN)
    g = torch.randn(TP_BATCH, TP_SEQ, TP_HIDDEN)
    # the attention sees the whole sequence (q/k/v gather it), so RoPE takes every position
    rope = RotaryEmbedding(config.head_dim, config.rope_theta)(x, torch.arange(TP_SEQ)[None])
    return block.to(device), tuple(t.to(device) for t in rope), x.to(device), g.to(device)


def _tp_step(block, rope, x, g):
    """Forward, backward of ``sum(y * g)``, one SGD step: (y, dx, grads, params after)."""
    x = x.detach().clone().requires_grad_()
    y = block(x, position_embeddings=rope)
    (y * g).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters()}
    torch.optim.SGD(block.parameters(), lr=TP_LR).step()
    params = {n: p.detach().clone() for n, p in block.named_parameters()}
    return y.detach(), x.grad.detach(), grads, params


def _tp_full(tensors: dict) -> dict:
    """The TP layers' parameters (or gradients), DTensor shards on the tp group, as full
    tensors (a collective: every member calls it)."""
    from torch.distributed.tensor import DTensor

    return {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in tensors.items()}


def _max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected|; inf for a shape mismatch or a NaN."""
    if actual.shape != expected.shape:
        return math.inf
    diff = (actual.double() - expected.double()).abs()
    return float(torch.nan_to_num(diff, nan=math.inf).max()) if diff.numel() else 0.0


def _error_row(op, backend, shape, checks, nbytes, lower_bound) -> dict:
    errors = [(_max_abs_diff(a, e), what) for what, a, e in checks]
    max_err, worst = max(errors)
    return {"op": op, "backend": backend, "shape": shape, "dtype": "float32",
            "correct": bool(max_err <= TP_ATOL), "max_err": max_err, "worst": worst,
            "bytes": nbytes, "lower_bound": lower_bound}


def _tp_lower_bound(world: int, dtype=torch.float32) -> int:
    """Bytes a rank must receive for one forward + backward of the SP block: forward, the
    q/k/v and gate/up gathers of the ``[B, S/W, H]`` input shard and the o/down
    reduce-scatters of the ``[B, S/W, H]`` output shard; backward, the transposes (two
    reduce-scatters of the gathered inputs' gradients, two gathers of the outputs')."""
    elem = torch.empty((), dtype=dtype).element_size()
    input_shard = TP_BATCH * (TP_SEQ // world) * TP_HIDDEN * elem
    output_shard = TP_BATCH * (TP_SEQ // world) * TP_HIDDEN * elem
    forward = 2 * (world - 1) * input_shard + 2 * (world - 1) * output_shard
    backward = 2 * (world - 1) * output_shard + 2 * (world - 1) * input_shard
    return forward + backward


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
        reference, rope, x_full, g_full = _tp_data(device)
        initial = copy.deepcopy(reference)
        y_ref, dx_ref, grads_ref, params_ref = _tp_step(reference, rope, x_full, g_full)

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
        names = DISPATCHERS["all_gather_matmul"].names
        for name in names:
            if name not in selected:
                continue
            reasons = [r for op, call in calls.items()
                       for r in DISPATCHERS[op].availability(call).get(name, ["no such backend"])]
            if reasons:
                skipped.append({"section": "tp", "op": TP_OP, "backend": name,
                                "reasons": sorted(set(reasons))})
                continue
            block = fusedpar.apply_tp(copy.deepcopy(initial), tp_group, sequence_parallel=True,
                                      backend=name)
            with fusedpar.comm.count_bytes() as counter:
                y, dx, grads, params = _tp_step(block, rope, x, g)
            grads, params = _tp_full(grads), _tp_full(params)
            checks = [("output", y, local_part(y_ref)), ("input grad", dx, local_part(dx_ref))]
            if set(grads) != set(grads_ref):
                raise RuntimeError(f"apply_tp changed the parameter names: {sorted(grads)} vs "
                                   f"{sorted(grads_ref)}")
            checks += [(f"grad of {n}", grads[n], grads_ref[n]) for n in grads_ref]
            checks += [(f"{n} after SGD", params[n], params_ref[n]) for n in params_ref]
            local.append(_error_row(TP_OP, name, str((TP_BATCH, TP_SEQ, TP_HIDDEN)), checks,
                                    counter.total(), _tp_lower_bound(TP_SIZE)))
    gathered = [None] * world  # the other ranks contribute nothing but take part
    dist.all_gather_object(gathered, (local, skipped), group=group)
    return _merge([rows for rows, _ in gathered], members), gathered[members[0]][1]


# ---- context and expert parallelism (the first 2 ranks) ---------------------------------

CP_SIZE = EP_SIZE = 2
CP_BATCH, CP_SEQ, CP_HEADS, CP_KV_HEADS, CP_HEAD_DIM = 1, 16, 4, 2, 16
CP_OP = f"ring_attention cp={CP_SIZE} (zigzag, causal)"
EP_TOKENS, EP_HIDDEN, EP_INTERMEDIATE, EP_EXPERTS, EP_TOPK = 6, 16, 24, 4, 2
EP_OP = f"moe_experts ep={EP_SIZE} ({EP_EXPERTS} experts, top-{EP_TOPK})"


def _zigzag_part(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s zigzag part of the sequence dim 1: chunks ``rank`` and ``2W-1-rank``."""
    chunks = t.chunk(2 * world, 1)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], 1)


def _cp_case(rank: int, world: int, device):
    """q, k, v and the output weights g (full, seeded), the fp64 oracle's output and
    gradients (full), and this rank's zigzag parts of the inputs."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(CP_BATCH, CP_SEQ, CP_HEADS, CP_HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(CP_BATCH, CP_SEQ, CP_KV_HEADS, CP_HEAD_DIM, generator=gen,
                        dtype=torch.float64) for _ in range(2))
    g = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.transpose(1, 2) for t in full)
    groups = CP_HEADS // CP_KV_HEADS
    out = F.scaled_dot_product_attention(qh, kh.repeat_interleave(groups, 1),
                                         vh.repeat_interleave(groups, 1), is_causal=True)
    out = out.transpose(1, 2)
    (out * g).sum().backward()
    expected = [out.detach()] + [t.grad for t in full]
    local = [_zigzag_part(t, rank, world).float().to(device) for t in (q, k, v, g)]
    return local, [_zigzag_part(t, rank, world) for t in expected]


def _ep_case(rank: int, world: int, device):
    """Every rank's tokens and routing (seeded by rank), the experts (the same on every
    rank), the fp64 oracle's outputs and gradients, and this rank's inputs."""
    def inputs(r):
        gen = torch.Generator().manual_seed(100 + r)
        x = torch.randn(EP_TOKENS, EP_HIDDEN, generator=gen, dtype=torch.float64) + r
        idx = torch.stack([torch.randperm(EP_EXPERTS, generator=gen)[:EP_TOPK]
                           for _ in range(EP_TOKENS)])
        weights = torch.rand(EP_TOKENS, EP_TOPK, generator=gen, dtype=torch.float64).softmax(-1)
        g = torch.randn(EP_TOKENS, EP_HIDDEN, generator=gen, dtype=torch.float64)
        return x, idx, weights, g

    gen = torch.Generator().manual_seed(7)
    w13 = torch.randn(EP_EXPERTS, 2 * EP_INTERMEDIATE, EP_HIDDEN, generator=gen,
                      dtype=torch.float64) / EP_HIDDEN ** 0.5
    w2 = torch.randn(EP_EXPERTS, EP_HIDDEN, EP_INTERMEDIATE, generator=gen,
                     dtype=torch.float64) / EP_INTERMEDIATE ** 0.5
    from fusedpar.ops.moe import experts_dense

    every = [inputs(r) for r in range(world)]
    w13_full, w2_full = w13.clone().requires_grad_(), w2.clone().requires_grad_()
    x, idx, weights, g = every[rank]
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    total = 0
    for r, (xr, idxr, wr, gr) in enumerate(every):
        if r == rank:
            xr, wr = x, weights
        total = total + (experts_dense(xr, idxr, wr, w13_full, w2_full) * gr).sum()
    total.backward()
    y = experts_dense(x, idx, weights, w13_full, w2_full).detach()
    local_experts = slice(rank * EP_EXPERTS // world, (rank + 1) * EP_EXPERTS // world)
    expected = [y, x.grad, weights.grad, w13_full.grad[local_experts], w2_full.grad[local_experts]]
    local = [t.detach()[...].float().to(device) for t in (every[rank][0], every[rank][2],
                                                         w13[local_experts], w2[local_experts],
                                                         every[rank][3])]
    from fusedpar.cli.bounds import rows_received, rows_sent

    sent = torch.stack([rows_sent(i, EP_EXPERTS // world, world) for _, i, _, _ in every])
    incoming, outgoing = rows_received(sent, rank)  # [a row per token and rank, per copy]
    return local, idx.to(device), expected, (incoming.tolist(), outgoing.tolist())


def _cp_ep_rows(group, device, selected: list[str]):
    """ring_attention on a cp group and moe_experts on an ep group (the first 2 ranks of
    ``group``), forward and backward, against fp64 plain torch over the whole sequence /
    every rank's tokens. Every rank of ``group`` calls this."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < CP_SIZE:
        return [], [{"section": "cp/ep", "op": f"{CP_OP}, {EP_OP}", "backend": "all",
                     "reasons": [f"needs at least {CP_SIZE} ranks, the check has {world}"]}]
    members = list(range(CP_SIZE))
    sub = dist.new_group([dist.get_global_rank(group, r) for r in members])
    local, skipped = [], []
    if rank in members:
        (q, k, v, g), expected = _cp_case(rank, CP_SIZE, device)
        kv_bytes = (k.numel() + v.numel()) * k.element_size()
        dispatcher = DISPATCHERS["ring_attention"]
        from fusedpar.ops.ring_attention import RingCall

        call = RingCall(q, k, v, sub, True, CP_HEAD_DIM ** -0.5, "zigzag")
        for name, reasons in dispatcher.availability(call).items():
            if name not in selected:
                continue
            if reasons:
                skipped.append({"section": "cp/ep", "op": CP_OP, "backend": name,
                                "reasons": reasons})
                continue
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with fusedpar.comm.count_bytes() as counter:
                out = fusedpar.ops.ring_attention(*leaves, sub, causal=True, backend=name)
                (out * g).sum().backward()
            checks = [("output", out.detach(), expected[0])]
            checks += [(f"grad of {n}", t.grad, e) for n, t, e in zip("qkv", leaves, expected[1:])]
            local.append(_error_row(CP_OP, name, str((CP_BATCH, CP_SEQ, CP_HEADS, CP_HEAD_DIM)),
                                    checks, counter.total(), 2 * (CP_SIZE - 1) * kv_bytes))
        (x, weights, w13, w2, g), idx, expected, ((rows_in, _), (rows_out, _)) = _ep_case(
            rank, EP_SIZE, device)
        from fusedpar.ops.moe.experts_call import ExpertsCall

        call = ExpertsCall(x, idx, weights, w13, w2, sub)
        for name, reasons in DISPATCHERS["moe_experts"].availability(call).items():
            if name not in selected:
                continue
            if reasons:
                skipped.append({"section": "cp/ep", "op": EP_OP, "backend": name,
                                "reasons": reasons})
                continue
            leaves = [t.clone().requires_grad_() for t in (x, weights, w13, w2)]
            with fusedpar.comm.count_bytes() as counter:
                y = fusedpar.ops.moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], sub,
                                             backend=name)
                (y * g).sum().backward()
            names = ("input grad", "topk_weights grad", "grad of w13", "grad of w2")
            checks = [("output", y.detach(), expected[0])]
            checks += [(n, t.grad, e) for n, t, e in zip(names, leaves, expected[1:])]
            row_bytes = EP_HIDDEN * x.element_size()
            local.append(_error_row(EP_OP, name, f"({EP_TOKENS}, {EP_HIDDEN})", checks,
                                    counter.total(), 2 * (rows_in + rows_out) * row_bytes))
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
    cp_ep_rows, cp_ep_skipped = _cp_ep_rows(group, device, selected)
    result = {"rows": rows, "skipped": skipped, "tp_rows": tp_rows, "tp_skipped": tp_skipped,
              "cp_ep_rows": cp_ep_rows, "cp_ep_skipped": cp_ep_skipped,
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
        f"  {CP_OP}: max |error| <= {TP_ATOL:g} over the output and the q/k/v grads; lower "
        "bound 2*(W-1)*|k_local + v_local|",
        "    (forward the peers' K/V, backward the peers' partial dK/dV of this rank's part); "
        "a ring that passes K/V",
        "    again in backward moves 1.5x, Ulysses moves q and the output too.",
        f"  {EP_OP}: max |error| <= {TP_ATOL:g} over the output and the x, topk_weights, w13 "
        "and w2 grads; lower bound:",
        "    a row of H per token and other rank holding one of its experts, in (dispatch) "
        "and back (combine), forward",
        "    and backward; fused and reference send a row per routed copy (more where a "
        "token has two experts on one rank),",
        "    pipelined a row per token and rank, plus each row's k expert ids and weights "
        "there and their gradients back (fp32).",
    ]
    return lines


def format_report(header: list[str], result: dict) -> tuple[str, bool]:
    """The printed report and whether every result was correct (and something ran)."""
    rows, lb_rows = result["rows"], result["loopback_rows"]
    tp_rows = result.get("tp_rows", [])
    cp_ep_rows = result.get("cp_ep_rows", [])
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
    lines += ["", f"context / expert parallel: ring_attention on ranks 0-{CP_SIZE - 1} "
                  f"(q {CP_HEADS} / kv {CP_KV_HEADS} heads, each rank its zigzag part of the "
                  "sequence) and moe_experts",
              f"  on ranks 0-{EP_SIZE - 1} (each rank {EP_EXPERTS // EP_SIZE} experts and "
              f"{EP_TOKENS} tokens); forward + backward against float64 plain torch",
              format_table(cp_ep_rows) if cp_ep_rows else "  (nothing ran)"]
    lines += ["", f"loopback: one process plays all {world} ranks on {result['device']}; "
                  "oracle: plain torch; bytes summed over the simulated ranks",
              format_table(lb_rows) if lb_rows else "  (nothing ran)"]
    lines += [""] + _legend(result)
    skipped = _format_skipped(result["skipped"] + result.get("tp_skipped", [])
                              + result.get("cp_ep_skipped", []) + result["loopback_skipped"])
    if skipped:
        lines += ["", "not run (unavailable here):"] + skipped
    all_rows = rows + tp_rows + cp_ep_rows + lb_rows
    wrong = [r for r in all_rows if not r["correct"]]
    ok = bool(all_rows) and not wrong
    lines.append("")
    if not all_rows:
        lines.append("FAILED: none of the selected backends can run here")
    elif wrong:
        lines.append(f"FAILED: {len(wrong)} of {len(all_rows)} results differ from the reference")
    else:
        tolerance = len(tp_rows) + len(cp_ep_rows)
        lines.append(f"OK: all {len(all_rows)} results match the reference "
                     f"({len(all_rows) - tolerance} bit for bit"
                     + (f", {tolerance} within atol {TP_ATOL:g}" if tolerance else "") + ")")
    return "\n".join(lines), ok


def _header(world: int, device: str, how: str, mode: str) -> list[str]:
    import triton

    return [f"fusedpar check: world size {world}, device {device} ({how}; Triton {mode})",
            f"fusedpar {fusedpar.__version__}, torch {torch.__version__}, "
            f"triton {triton.__version__}, python {platform.python_version()}"]


# ---- the command ------------------------------------------------------------------------


def _parse_backends(text: str | None) -> list[str]:
    known = sorted({n for d in DISPATCHERS.values() for n in d.names})
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
