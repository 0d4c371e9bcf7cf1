"""What the ``benchmarks/bench_*.py`` suites share (docs/design.md §6), besides conftest.py's fixtures.

Not a suite: pytest collects only ``bench_*.py`` here (the hook in conftest.py), and this
module defines no tests. It imports fusedpar, so it is imported after conftest.py has set
TRITON_INTERPRET (the suites import it, never conftest.py).
"""

import contextlib
import functools
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import fusedpar
from fusedpar.errors import BackendNotSupportedError
from fusedpar.ops import registry, tuning
from targets import AUTO, BASELINES, ROW_TARGETS, row_target

W_LOOPBACK = 8  # simulated ranks of a single-GPU loopback case
DTYPE = torch.bfloat16  # of every timed case ("bf16" in the benchmark groups)
PEDANTIC = dict(rounds=10, warmup_rounds=2, iterations=1)  # fixed: identical on every rank

# torch 2.13+ names them all_gather_single / reduce_scatter_single; older ones *_tensor
NCCL_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
NCCL_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Unavailable(Exception):
    """A case cannot run here (this torch, this machine, this backend); the message says why."""


def name(shape) -> str:
    """``4096x8192``: a shape in test ids, benchmark groups and target lines."""
    return "x".join(map(str, shape))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of ``out`` against the higher-precision ``ref``, computed in ref's dtype
    (fp32 or fp64); inf where ``out`` is not finite."""
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.to(ref.dtype) - ref).norm() / ref.norm()).item()


def or_skip(f, *args, **kwargs):
    """``f(*args, **kwargs)``, skipping the test with the reason where it raises ``Unavailable``.
    The skip is reported at the caller's line (``__tracebackhide__``), as if it called
    ``pytest.skip`` itself."""
    __tracebackhide__ = True
    try:
        return f(*args, **kwargs)
    except Unavailable as e:
        pytest.skip(str(e))


def counted(fn):
    """Run a fusedpar op once: ``(fn(), the bytes fusedpar.comm counted)``; ``Unavailable``
    where its backend cannot run these inputs here."""
    try:
        with fusedpar.comm.count_bytes() as counter:
            result = fn()
    except BackendNotSupportedError as e:
        raise Unavailable(str(e)) from e
    return result, counter.total()


def busy_ms(intervals) -> float:
    """Milliseconds covered by the union of ``(start_us, end_us)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def by_name(intervals) -> list[tuple[str, float, int]]:
    """``(name, start_us, end_us)`` intervals as ``(name, total ms, count)`` per name, the
    largest total first."""
    totals: dict[str, list] = {}
    for event, start, end in intervals:
        total = totals.setdefault(event, [0.0, 0])
        total[0] += (end - start) / 1e3
        total[1] += 1
    return sorted(((event, ms, n) for event, (ms, n) in totals.items()), key=lambda row: -row[1])


def gpu_intervals(fn, calls: int = 1) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every kernel, copy and memset that ``calls`` calls of
    ``fn`` (after a warm-up call, back to back) ran on any stream, under torch.profiler's
    CUDA activity, in order of their start."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda i: i[1])


def kernel_ms(intervals, name_part: str, calls: int = 1) -> tuple[float, int]:
    """``(ms per call, launches)`` of the kernels (or copies) among ``gpu_intervals``'
    ``intervals`` of ``calls`` calls whose name contains ``name_part``."""
    mine = [end - start for event, start, end in intervals if name_part in event]
    return sum(mine) / 1e3 / calls, len(mine)


def sleep_cycles_per_ms(lengths=(1 << 20, 1 << 22), repeats: int = 3) -> float:
    """SM clock cycles per ms of ``torch.cuda._sleep`` (it spins a number of cycles of the SM
    clock) on the current device, measured with CUDA events: the slope between two lengths
    (the launch's cost cancels), the median of ``repeats``. The clock of the moment (boost,
    power state), where a nominal one can mislead (and ``clock_rate`` is not in every torch's
    device properties)."""
    torch.cuda._sleep(1000)  # loads the kernel
    torch.cuda.synchronize()
    slopes = []
    for _ in range(repeats):
        ms = []
        for cycles in lengths:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        slopes.append((lengths[1] - lengths[0]) / max(ms[1] - ms[0], 1e-6))
    return sorted(slopes)[len(slopes) // 2]


def gpu_profile(fn) -> tuple[float, list[tuple[str, float, int]]]:
    """One call of ``fn`` (after a warm-up call) under torch.profiler's CUDA activity:
    ``(busy ms, kernels)``. Busy: the union of the intervals of its kernels, copies and
    memsets on every stream; a median well above it is time the GPU waited for the host.
    Kernels: ``by_name`` of those intervals (where the busy time goes)."""
    intervals = gpu_intervals(fn)
    return busy_ms((start, end) for _, start, end in intervals), by_name(intervals)


def host_ms(fn, repeats: int = 5) -> float:
    """Median time the host spends in one call of ``fn`` started on an idle GPU: issuing its
    work plus waiting at its host reads. Near ``gpu_profile``'s busy time or above it, the
    GPU waits for the host (the call is host-bound)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e3


def bench(benchmark, synced, fn, times, **extra_info):
    """Put do_bench's ``times`` (median, p20, p80 ms) and ``extra_info`` in pytest-benchmark's
    report, then let it time ``fn`` itself (fixed rounds, identical on every rank)."""
    median, p20, p80 = times
    benchmark.extra_info.update(do_bench_median_ms=median, p20_ms=p20, p80_ms=p80, **extra_info)
    benchmark.pedantic(synced(fn), **PEDANTIC)


# record_case's medians in this session by (op, shape, world, mode, backend)
_MEDIANS: dict[tuple, float] = {}


def record_case(benchmark, gpu_times, record_row, synced, fn, op, backend, shape, world, mode,
                **row):
    """Time a checked case ``fn`` (do_bench), record its row (``row``: record_row's byte counts
    and notes, after ``mode``) and let pytest-benchmark time it, grouped by op, shape and world.
    A ``GRAPH`` row also notes its GPU busy and host time and how it compares with them and
    with the eager ``triton`` row of its case (``graph_notes``)."""
    where = " loopback" if mode == "loopback" else ""
    benchmark.group = f"{op} {name(shape)} bf16{where} W={world}"
    times = gpu_times(fn)
    case = (op, name(shape), world, mode)
    _MEDIANS[(*case, backend)] = times[0]
    if backend == GRAPH:
        row.update(graph_notes(fn, times[0], _MEDIANS.get((*case, "triton"))))
    record_row(op, backend, shape, DTYPE, world, *times, mode=mode, **row)
    bench(benchmark, synced, fn, times)


# ---- CUDA graphs: a triton call captured once, replayed in the timed loop --------------------
# The loopback row ``GRAPH`` of a suite (all_gather, reduce_scatter and the fused matmuls) times
# its triton call replayed from a CUDA graph, as a training step captured whole would run it
# (bench_moe_dispatch.py's ``padded_graph`` does the same for the MoE exchange): no host work per
# call. Before it is timed, ``graph_replay`` checks the replays against eager calls.

GRAPH = "triton.graph"
REPLAYS = 3  # changes of the inputs a graph's replays are checked with


def graphed(fn):
    """``fn`` captured in a CUDA graph after one eager call on a side stream, as torch advises
    (that call also compiles the kernels and makes the symmetric buffers: a fusedpar op's first
    call of a signature raises under capture); the returned function replays the graph and
    returns the outputs captured, which each replay refills."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()

    def replay():
        graph.replay()
        return outs
    return replay


def tensors(result) -> list[torch.Tensor]:
    """The tensors of an op's (nested list or tuple of) outputs in order, None left out."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)):
        return [t for item in result for t in tensors(item)]
    return []


def changed(t: torch.Tensor, i: int) -> torch.Tensor:
    """``t``'s values moved (rows rolled by ``i``; negated too where ``i`` is odd, exact in any
    dtype): new values of the same magnitudes, so a replay that kept the capture's cannot pass."""
    moved = t.roll(i, 0)
    return moved.neg() if i % 2 and t.is_floating_point() else moved


def graph_replay(fn, inputs, replays: int = REPLAYS):
    """``graphed(fn)``, checked before anything times it: ``fn`` calls an op on the tensors
    ``inputs`` (all it reads that may change); ``replays`` times, new values are copied into
    them in place (``changed``; as a captured training step refills its static inputs), and
    the replay's outputs must equal bitwise an eager ``fn()``'s on the same values. The inputs
    get their values back at the end. Returns the replay function."""
    originals = [t.clone() for t in inputs]
    replay = graphed(fn)
    try:
        for i in range(1, replays + 1):
            for t, original in zip(inputs, originals):
                t.copy_(changed(original, i))
            want = tensors(fn())
            got = tensors(replay())
            assert len(got) == len(want), f"replay {i}: {len(got)} outputs, an eager call {len(want)}"
            differ = [j for j, (x, y) in enumerate(zip(got, want)) if not torch.equal(x, y)]
            assert not differ, (f"replay {i} with new inputs: outputs {differ} (of {len(want)}) "
                                "differ from an eager call's on the same inputs")
    finally:
        for t, original in zip(inputs, originals):
            t.copy_(original)
    if any(t.is_cuda for t in inputs):
        torch.cuda.synchronize()
    return replay


def graph_notes(fn, median: float, eager: float | None = None) -> dict[str, str]:
    """The notes of a ``GRAPH`` row ``fn`` timed at ``median`` ms: its ``gpu_busy_ms`` and
    ``host_ms`` (a replay's: near zero), as every loopback row of the fused matmuls has them,
    and ``graph_ratios``."""
    busy, _ = gpu_profile(fn)
    return {"gpu_busy_ms": f"{busy:.2f}", "host_ms": f"{host_ms(fn):.2f}",
            **graph_ratios(median, busy, eager)}


def graph_ratios(median: float, busy: float, eager: float | None) -> dict[str, str]:
    """``vs_gpu_busy``: a ``GRAPH`` row's median / its GPU busy time (what the GPU still waits
    for), against targets.ROW_TARGETS; ``x_eager``: the eager triton row's median ``eager`` /
    the graph row's, where that row ran in this session."""
    notes = {"vs_gpu_busy": row_target("vs_gpu_busy", median / busy) if busy > 0
             else "n/a (the profile saw no GPU work)"}
    if eager is not None:
        notes["x_eager"] = f"{eager / median:.2f}"
    return notes


# ---- the auto row: what a user gets (backend=None) ------------------------------------------
# A suite times it last in a case, after the baselines (conftest's record_row judges it
# against the fastest of them) and notes ``chose=<auto_choice>``.


def auto_choice(op, call) -> str:
    """The backend ``op``'s dispatcher runs ``call`` with where the caller names none:
    ``Dispatcher.select`` for a call on one device or with a group (what the auto row ran;
    with a group every rank calls this), ``tuning.explain`` (the tables alone, as ``fusedpar
    info`` says) for a loopback call (simulated ranks, no group), which no op runs."""
    dispatcher = registry.get(op).dispatcher
    if getattr(call, "group", None) is None and getattr(call, "world_size", 1) > 1:
        name, why = tuning.explain(dispatcher, call)
        if name is None:
            raise Unavailable(f"{AUTO}: {why}")
        return name
    return dispatcher.select(call).name


def auto_label(op, call, labels) -> tuple[str, str]:
    """``(label, backend)`` of a loopback case's auto row: the backend ``auto_choice`` names
    for the loopback ``call`` and the case among ``labels`` (the suite's loopback rows) that
    times it: itself, or the baseline standing for it (``defaults.LABELS``: a loopback
    baseline is the plain-torch backend's compute). ``Unavailable`` where none does."""
    from defaults import LABELS

    name = auto_choice(op, call)
    label = name if name in labels else next(
        (label for label in labels if LABELS.get(op, {}).get(label) == name), None)
    if label is None:
        raise Unavailable(f"{AUTO}: {op} would run {name!r} here, which no loopback case times")
    return label, name


def loopback_case(op, backend, call, labels, baseline, fused, inputs=()):
    """Run a collective's loopback case once: ``(fn, fn(), bytes_moved, notes)``. ``labels``:
    the suite's loopback rows, the last the plain-torch ``baseline`` (a fn; no bytes counted);
    ``fused(backend)``: runs the fusedpar loopback op with one of the others; ``GRAPH``: its
    ``triton`` call replayed from a CUDA graph (``graph_replay``: checked against eager calls
    on new values of ``inputs``, the tensors it reads; a replay counts no bytes). ``AUTO`` runs
    the row ``auto_label`` names for ``call`` (notes ``chose``); a case that cannot run here
    skips."""
    __tracebackhide__ = True
    runs, notes = backend, {}
    if backend == AUTO:  # the loopback case of what the dispatcher would run
        runs, notes["chose"] = or_skip(auto_label, op, call, labels)
    if runs == labels[-1]:
        return baseline, baseline(), None, notes
    if runs == GRAPH:
        or_skip(counted, functools.partial(fused, "triton"))  # skips where triton cannot run
        fn = graph_replay(functools.partial(fused, "triton"), inputs)
        return fn, fn(), None, notes
    fn = functools.partial(fused, runs)
    outs, bytes_moved = or_skip(counted, fn)
    return fn, outs, bytes_moved, notes


# ---- several GPUs: torchrun ------------------------------------------------------------------


def symm_mem_op(backend, *, enable_for=None):
    """``(torch.distributed._symmetric_memory, torch.ops.symm_mem.<op>)`` of the backend
    ``symm_mem.<op>``; ``Unavailable`` where this torch lacks either. ``enable_for``: a group
    to enable symmetric memory for first (the fused matmul ops needed it before torch 2.9;
    a no-op after)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        raise Unavailable(f"torch.distributed._symmetric_memory: {e}") from e
    op_name = backend.removeprefix("symm_mem.")
    if not hasattr(torch.ops.symm_mem, op_name):
        raise Unavailable(f"torch {torch.__version__} has no torch.ops.symm_mem.{op_name}")
    if enable_for is not None and hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(enable_for.group_name)
    return symm_mem, getattr(torch.ops.symm_mem, op_name)


def run_case(backend, make_case, agree):
    """Build a torchrun case (``make_case() -> (fn, note)``, note ``"fusedpar"`` for fusedpar's
    backends) and run it once: ``(fn, note, fn(), bytes_moved)``, the bytes counted for
    fusedpar's backends only (None for the others). ``Unavailable``, on every rank alike,
    where it cannot run on some rank: make_case raised ``Unavailable``, fusedpar refused the
    backend, or a torch symm_mem op refused the machine."""
    fn = note = result = bytes_moved = reason = None
    try:
        fn, note = make_case()
        with fusedpar.comm.count_bytes() as counter:
            result = fn()
        torch.cuda.synchronize()
        if note == "fusedpar":
            bytes_moved = counter.total()
    except (Unavailable, BackendNotSupportedError) as e:
        reason = f"{backend}: {first_line(e)}"
    except RuntimeError as e:  # torch's symm_mem ops refuse what the machine lacks (multicast)
        if not backend.startswith("symm_mem."):
            raise
        reason = f"{backend}: {first_line(e)}"
    if not agree(reason is None):
        raise Unavailable(reason or f"{backend} cannot run on another rank")
    return fn, note, result, bytes_moved


def split_rows(m, group, agree) -> tuple[int, int]:
    """``(world, rank)`` of ``group``; ``Unavailable`` on every rank alike where the ``m`` rows
    do not split evenly over its ranks."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    reason = None if m % world == 0 else f"M={m} is not divisible by the world size {world}"
    if not agree(reason is None):
        raise Unavailable(reason)
    return world, rank


# ---- the fused matmul suites -----------------------------------------------------------------


class MatmulSuite:
    """The timed cases of a fused matmul suite (bench_all_gather_matmul.py,
    bench_matmul_reduce_scatter.py), with the backends and targets they share: fusedpar's
    backends against ``torch.matmul`` in loopback, against torch's async-TP op ``symm_mem``
    and the ``unfused`` collective + cuBLAS under torchrun (targets: targets.py).
    A row per case carries its TFLOP/s, % of the session's ``matmul_roofline``, in loopback
    ``gpu_busy_ms`` and ``host_ms`` (``gpu_profile``, ``host_ms``) and, for fusedpar's
    backends, the speedups over the baselines in ``notes``.

    ``moved_cols(m, k, n)``: the columns of the ``[M, cols]`` tensor that crosses ranks (the
    gathered A, the product that is reduce-scattered): a row's ``algo_bytes`` is all of it,
    its ``lower_bound`` the W-1 peers' ``[M / W, cols]`` parts, both times the ranks this
    process plays (W in loopback, 1 under torchrun). ``medians``: the median ms of each case
    run so far per ``(mode, shape, world, backend)``, None where it could not run; the
    speedups are taken from them. ``loopback_extra``: more fusedpar variants to time in
    loopback after ``triton``. Last in each mode the ``AUTO`` row: ``backend=None`` under
    torchrun; in loopback the row of ``loopback_labels`` that ``auto_label`` names.
    """

    def __init__(self, op, *, symm_mem, unfused, moved_cols, loopback_extra=()):
        self.op = op
        self.fusedpar = tuple(registry.get(op).backends)
        self.moved_cols = moved_cols
        self.loopback_labels = ["torch.matmul", "triton", *loopback_extra]  # the baseline first
        self.loopback_backends = [*self.loopback_labels, AUTO]
        self.ours = (*self.fusedpar, *loopback_extra)
        least = BASELINES[op]  # targets.py: the least speedup over each baseline
        self.targets = {  # per mode: {baseline: the least speedup over it (TFLOP/s ratio)}
            "loopback": {"torch.matmul": least["torch.matmul"]},
            "torchrun": {symm_mem: least[symm_mem], unfused: least[unfused]},
        }
        self.dist_backends = [unfused, symm_mem, *self.fusedpar, AUTO]  # the baselines first
        self.medians: dict[tuple, float | None] = {}

    def tests(self, shapes, loopback_measure, dist_measure):
        """The suite's ``test_loopback`` and ``test_torchrun`` over ``shapes`` (``M x K x N``),
        each backend a case (the baselines first): ``run`` with
        ``loopback_measure(backend, shape, device, gpu_times)`` on one GPU,
        ``dist_measure(backend, shape, group, device, gpu_times, agree)`` under torchrun."""

        @pytest.mark.parametrize("backend", self.loopback_backends)
        @pytest.mark.parametrize("shape", shapes, ids=name)
        def test_loopback(benchmark, gpu, gpu_times, record_row, synced, matmul_roofline,
                          report_target, shape, backend):
            or_skip(self.run, benchmark, record_row, synced, matmul_roofline, report_target,
                    "loopback", shape, W_LOOPBACK, backend,
                    lambda b: loopback_measure(b, shape, gpu, gpu_times))

        @pytest.mark.parametrize("backend", self.dist_backends)
        @pytest.mark.parametrize("shape", shapes, ids=name)
        def test_torchrun(benchmark, dist_gpu, gpu_times, record_row, agree, synced,
                          matmul_roofline, report_target, shape, backend):
            group, device = dist_gpu
            or_skip(self.run, benchmark, record_row, synced, matmul_roofline, report_target,
                    "torchrun", shape, dist.get_world_size(group), backend,
                    lambda b: dist_measure(b, shape, group, device, gpu_times, agree))

        return test_loopback, test_torchrun

    def run(self, benchmark, record_row, synced, roofline, report_target, mode, shape, world,
            backend, measure):
        """Check and time one case (``mode``: "loopback" or "torchrun"), then record it.
        ``measure(backend)`` checks a case once, then times it: ``(fn, (median, p20, p80),
        bytes_moved, note)`` (note: what a torchrun case runs; for ``AUTO`` the backend it
        chose; in loopback None, or a dict of a variant's own notes) or ``Unavailable``, which
        this raises too. A fusedpar backend is compared with each baseline of the mode,
        measured here where a -k selection left it out; a ``GRAPH`` row with its GPU busy time
        and the eager triton row (``graph_ratios``). Each of targets.ROW_TARGETS in the notes
        is reported as a target line."""
        loopback = mode == "loopback"
        where = " loopback" if loopback else ""
        benchmark.group = f"{self.op} {name(shape)} bf16{where} W={world}"
        key = (mode, shape, world)
        fn, times, bytes_moved, note = self._measure(key, backend, measure)
        extra = note if isinstance(note, dict) else {}  # a loopback variant's own notes
        median = times[0]
        plays = world if loopback else 1  # the ranks this process plays
        m, k, n = shape
        tflops = 2 * m * k * n * plays / (median * 1e-3) / 1e12  # each rank multiplies all M rows
        if backend == AUTO:
            notes = dict(mode=mode, chose=note)
        else:
            notes = dict(mode=mode) if loopback else dict(mode=mode, impl=note)
        notes.update(tflops=f"{tflops:.1f}", roofline_tflops=f"{roofline:.1f}",
                     pct_roofline=f"{100 * tflops / roofline:.1f}")
        if loopback:  # a median well above the busy time: the GPU waited for the host
            busy, _ = gpu_profile(fn)
            notes.update(gpu_busy_ms=f"{busy:.2f}", host_ms=f"{host_ms(fn):.2f}")
            if backend == GRAPH:
                notes.update(graph_ratios(median, busy, self.medians.get((*key, "triton"))))
        notes.update(extra)
        for target in ROW_TARGETS:
            if target in notes:
                report_target(f"{self.op} {name(shape)}{where} W={world} {backend}: "
                              f"{target} {notes[target]}")
        targets = self.targets[mode]
        if backend in self.ours:
            for baseline in targets:  # a -k selection may have left a baseline out
                if (*key, baseline) not in self.medians:
                    with contextlib.suppress(Unavailable):
                        self._measure(key, baseline, measure)
            notes.update(self._speedups(key, median, targets, report_target,
                                        f"{self.op} {name(shape)}{where} W={world} {backend}"))
        cols = self.moved_cols(m, k, n)
        record_row(self.op, backend, shape, DTYPE, world, *times,
                   algo_bytes=plays * m * cols * DTYPE.itemsize, bytes_moved=bytes_moved,
                   lower_bound=plays * (world - 1) * (m // world) * cols * DTYPE.itemsize, **notes)
        bench(benchmark, synced, fn, times, **notes)

    def _measure(self, key, backend, measure):
        """``measure(backend)``, its median noted under ``(*key, backend)`` (None where it
        raises ``Unavailable``)."""
        try:
            result = measure(backend)
        except Unavailable:
            self.medians[(*key, backend)] = None
            raise
        self.medians[(*key, backend)] = result[1][0]
        return result

    def _speedups(self, key, median, targets, report_target, label) -> dict:
        """``notes`` entries comparing ``median`` with each measured baseline of ``key``."""
        notes = {}
        for baseline, target in targets.items():
            base = self.medians.get((*key, baseline))
            if base is None:
                notes[f"vs_{baseline}"] = "n/a"
                report_target(f"{label}: vs {baseline}: n/a (the baseline did not run)")
                continue
            ratio = base / median
            verdict = "met" if ratio >= target else "MISSED"
            notes[f"vs_{baseline}"] = f"{ratio:.3f}x (target >= {target}x: {verdict})"
            report_target(f"{label}: {ratio:.3f}x {baseline} (target >= {target}x: {verdict})")
        return notes
