"""Choosing a backend by measurement (docs/design.md §2): what ``Dispatcher.select`` asks on
a GPU when more than one backend can take a call.

A call is reduced to its signature: op, device name, world size, dtype, shape bucket (each
call type's ``bucket()``: powers of two of the sizes that matter, so a training run hits
few) and group placement (``hosts x ranks per host``; ``loopback`` or ``local`` without a
group). The choice, in order:

1. the user's table (a JSON file, ``FUSEDPAR_TUNE_CACHE`` or ``~/.cache/fusedpar/tune.json``)
   filled by ``fusedpar tune`` or by ``FUSEDPAR_AUTOTUNE=1`` (the signature is measured at
   its first call and stored, as ``torch.backends.cudnn.benchmark`` does). A file written
   under other versions of torch / triton / fusedpar / the driver, or unreadable, is
   ignored with one warning;
2. the default table shipped in the package (``tuning_defaults.json``, generated from the
   committed benchmark rows by ``benchmarks/defaults.py``): the row of this device name,
   world size, dtype and bucket, else the op's fallback for this device;
3. the priority order (the dispatcher's list).

Measuring: each candidate is first checked against the op's oracle (the reference
backend), then timed (``cuda_median_ms``: CUDA events after warm-up, L2 flushed, median;
``TIMER`` is injectable); every rank times every candidate and the slowest rank's time
counts (an all-reduce MAX), so all ranks choose alike. Ties go to the priority order. With
a group every local decision is agreed too (one all-reduce per new signature), so ranks
whose tables differ still run one backend. On CPU nothing is timed (interpreter timings
mean nothing): ``applies`` is False there and the priority order stays.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import statistics
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import settings
from ..comm.groups import host_collective_device
from ..comm.symmetric import bounded_wait, exchange_strings
from . import registry

TUNED_DEVICES = ("cuda",)  # where timings mean something; elsewhere the priority order
FORMAT = 1  # of the JSON files; another is ignored as stale
DEFAULTS_PATH = Path(__file__).with_name("tuning_defaults.json")
# how far a candidate's output may be from the oracle's (max |diff| / max |oracle|): catches
# a broken kernel, not rounding (fp32 GEMMs may run in TF32)
CHECK_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 5e-3,
                   torch.float64: 1e-9}


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0): a bucket edge."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def applies(call) -> bool:
    """Whether the choice for ``call`` is tuned: a GPU call of a type with a ``bucket()``."""
    return hasattr(call, "bucket") and tensor(call).device.type in TUNED_DEVICES


def autotune_enabled() -> bool:
    return os.environ.get("FUSEDPAR_AUTOTUNE", "0") not in ("", "0")


def cache_path() -> Path:
    """The user's table: ``FUSEDPAR_TUNE_CACHE``, else ``$XDG_CACHE_HOME/fusedpar/tune.json``
    (``~/.cache`` without it)."""
    if os.environ.get("FUSEDPAR_TUNE_CACHE"):
        return Path(os.environ["FUSEDPAR_TUNE_CACHE"])
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "fusedpar" / "tune.json"


def versions() -> dict[str, str]:
    """What a measurement depends on besides the signature; a table of other versions is stale."""
    import triton

    # the package imports this module: read its version at call time, not at import
    fusedpar = sys.modules[__name__.split(".")[0]]
    return {"torch": torch.__version__, "triton": triton.__version__,
            "fusedpar": fusedpar.__version__, "driver": _driver_version()}


def _driver_version() -> str:
    try:  # Linux NVIDIA driver: "NVRM version: ... Kernel Module  550.54.15  ..."
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "none"
    words = text.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), "unknown")


def tensor(call) -> torch.Tensor:
    """The tensor that stands for the call's device and dtype (``x``, or attention's ``q``)."""
    return call.x if hasattr(call, "x") else call.q


_placements: dict[str, str] = {}


def placement(group, world: int) -> str:
    """``"<hosts>x<ranks per host>"`` of ``group`` (collective, cached per group); without a
    group ``"local"`` (one rank) or ``"loopback"`` (simulated ranks in one process)."""
    if group is None:
        return "local" if world == 1 else "loopback"
    if group.group_name not in _placements:
        hosts = exchange_strings(socket.gethostname(), group, "the tuning placement check")
        counts = [hosts.count(h) for h in sorted(set(hosts))]
        _placements[group.group_name] = f"{len(counts)}x{max(counts)}"
    return _placements[group.group_name]


@dataclass(frozen=True)
class Signature:
    """What a choice depends on; ``key()`` is its name in the JSON tables."""

    op: str
    device: str
    world: int
    dtype: str
    bucket: tuple
    placement: str

    def key(self, with_placement: bool = True) -> str:
        parts = [self.op, self.device, str(self.world), self.dtype,
                 "x".join(str(int(s)) for s in self.bucket)]
        return "|".join(parts + ([self.placement] if with_placement else []))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def signature(op: str, call) -> Signature:
    t = tensor(call)
    world = getattr(call, "world_size", 1)
    return Signature(op, device_name(t.device), world, str(t.dtype).replace("torch.", ""),
                     tuple(call.bucket()), placement(getattr(call, "group", None), world))


@dataclass
class Entry:
    """One measured signature: the backend chosen and every candidate's median in ms
    (None: rejected, with the reason in ``rejected``)."""

    backend: str
    times_ms: dict[str, float | None]
    rejected: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"backend": self.backend, "times_ms": self.times_ms, "rejected": self.rejected}

    @classmethod
    def from_json(cls, d) -> Entry:
        if (not isinstance(d, dict) or not isinstance(d.get("backend"), str)
                or not isinstance(d.get("times_ms"), dict)):
            raise ValueError(f"malformed entry {d!r}")
        return cls(d["backend"], dict(d["times_ms"]), dict(d.get("rejected", {})))

    def describe(self) -> str:
        times = ", ".join(f"{n} {t:.3f} ms" if t is not None else f"{n} rejected"
                          for n, t in self.times_ms.items())
        return f"measured ({times})"


class Table:
    """The user's table: ``{signature key: Entry}`` under one set of ``versions()``."""

    def __init__(self, path: Path, entries: dict[str, Entry] | None = None):
        self.path, self.entries = Path(path), entries or {}

    @classmethod
    def load(cls, path: Path) -> Table:
        """The table at ``path``: empty when there is none; a corrupt or stale file is
        ignored with one warning (then overwritten at the next save)."""
        path = Path(path)
        if not path.exists():
            return cls(path)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError("no 'entries' object")
            if data.get("format") != FORMAT or data.get("versions") != versions():
                warnings.warn(f"fusedpar: ignoring the tuning table {path}: it was measured with "
                              f"{data.get('versions')}, this is {versions()} (format "
                              f"{data.get('format')}, expected {FORMAT}); rerun `fusedpar tune` "
                              "or set FUSEDPAR_AUTOTUNE=1", stacklevel=2)
                return cls(path)
            return cls(path, {k: Entry.from_json(v) for k, v in data["entries"].items()})
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            warnings.warn(f"fusedpar: ignoring the tuning table {path}: it is unreadable ({e}); "
                          "it will be rewritten by the next tuning", stacklevel=2)
            return cls(path)

    def save(self) -> None:
        """Write atomically (ranks sharing a file write the same agreed entries)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        data = {"format": FORMAT, "versions": versions(),
                "entries": {k: e.to_json() for k, e in sorted(self.entries.items())}}
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.path)


_tables: dict[Path, Table] = {}


def user_table() -> Table:
    """The user's table at ``cache_path()``, loaded once per process and path."""
    path = cache_path()
    if path not in _tables:
        _tables[path] = Table.load(path)
    return _tables[path]


def load_defaults(path: Path = DEFAULTS_PATH) -> dict:
    """The shipped default table: ``{"entries": {signature key without placement: row},
    "fallback": {op: {device name or "*" (any device): row}}}``, each row
    ``{"backend", "why"}``."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        warnings.warn(f"fusedpar: the default tuning table {path} is unreadable ({e}); the "
                      "priority order decides", stacklevel=2)
        return {"entries": {}, "fallback": {}}


_defaults: dict | None = None


def defaults() -> dict:
    global _defaults
    if _defaults is None:
        _defaults = load_defaults()
    return _defaults


MEASURED, DEFAULT, UNTUNED = 0, 1, 2  # where a choice came from, best informed first


def lookup(sig: Signature, candidates: list[str]) -> tuple[str, str, int]:
    """``(backend, why, source)`` for ``sig`` from the tables alone (no timing, no
    collective): the user's entry (``MEASURED``), the default row or the op's fallback on
    this device (``DEFAULT``), or the priority order (``UNTUNED``). A table naming a backend
    that cannot take the call is passed over."""
    entry = user_table().entries.get(sig.key())
    if entry is not None and entry.backend in candidates:
        return entry.backend, entry.describe(), MEASURED
    table = defaults()
    row = table.get("entries", {}).get(sig.key(with_placement=False))
    if row is not None and row.get("backend") in candidates:
        return row["backend"], f"default table row: {row.get('why', '')}", DEFAULT
    fallback = table.get("fallback", {}).get(sig.op, {})
    row = fallback.get(sig.device) or fallback.get("*")  # this device's, else every device's
    if row is not None and row.get("backend") in candidates:
        return row["backend"], f"default for {sig.op} (no row of this bucket): {row.get('why', '')}", DEFAULT
    return candidates[0], "untuned: the priority order", UNTUNED


def _agree(rank_choice: int, tune: bool, group, device) -> tuple[int, bool]:
    """One all-reduce MAX over ``[-rank_choice, tune]``: the least ``rank_choice`` of any
    rank, and whether any rank tunes."""
    flags = torch.tensor([-rank_choice, int(tune)], dtype=torch.int64, device=device)
    bounded_wait(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True),
                 "the tuning agreement", group)
    return -int(flags[0]), bool(flags[1])


@dataclass
class Session:
    """What one ``tuning_session()`` met: ``measured`` ``{signature key: Entry}`` and
    ``single`` ``{signature key: backend}`` (calls only one backend can take)."""

    measured: dict[str, Entry] = field(default_factory=dict)
    single: dict[str, str] = field(default_factory=dict)


_session: Session | None = None


@contextlib.contextmanager
def tuning_session():
    """Within the block, every tuned call's signature is measured at its first call and
    stored, as with ``FUSEDPAR_AUTOTUNE=1``, but also where the table already has it
    (``fusedpar tune --model``: one training step in this block). Yields the ``Session``.
    Only calls that reach ``choose`` count: run it in a fresh process (``Dispatcher``
    caches its choices)."""
    global _session
    saved, _session = _session, Session()
    try:
        yield _session
    finally:
        _session = saved


def choose(dispatcher, call, candidates: list[str]) -> str:
    """The backend to run ``call`` among ``candidates`` (every backend without reasons, in
    priority order; identical on every rank). With a group the ranks agree: if any rank
    tunes (``FUSEDPAR_AUTOTUNE=1`` and no measured entry, or a ``tuning_session`` that has
    not measured it yet) all measure; else the best-informed rank's choice (measured over
    default over untuned; then the earlier backend) wins, so ranks whose tables differ still
    run one backend."""
    if len(candidates) == 1:
        if _session is not None:
            _session.single[signature(dispatcher.op, call).key()] = candidates[0]
        return candidates[0]
    sig = signature(dispatcher.op, call)
    name, _, source = lookup(sig, candidates)
    if _session is not None:
        tune = sig.key() not in _session.measured
    else:
        tune = autotune_enabled() and source != MEASURED
    group = getattr(call, "group", None)
    if group is not None and dist.get_world_size(group) > 1:
        n = len(candidates)
        agreed, tune = _agree(source * n + candidates.index(name), tune, group,
                              host_collective_device(group))
        name = candidates[agreed % n]
    if tune:
        entry = tune_call(dispatcher, call, candidates, sig)
        if _session is not None:
            _session.measured[sig.key()] = entry
        name = entry.backend
    return name


def tune_call(dispatcher, call, candidates: list[str], sig: Signature | None = None,
              timer=None) -> Entry:
    """Measure ``call`` on every candidate (collective with a group: every rank calls it),
    store the entry in the user's table and save it; returns the entry."""
    entry = measure(dispatcher, call, candidates, timer)
    table = user_table()
    table.entries[(sig or signature(dispatcher.op, call)).key()] = entry
    table.save()
    return entry


# ---- measuring ----------------------------------------------------------------------------


def cuda_median_ms(backend: str, fn, warmup: int = 3, reps: int = 10) -> float:
    """Median of ``reps`` timed runs of ``fn`` (CUDA events, after ``warmup`` runs, L2
    flushed before each). Fixed counts, so ranks running collectives in ``fn`` stay in step."""
    flush = torch.empty(64 << 20, dtype=torch.int8, device="cuda")  # more than any L2 yet
    for _ in range(warmup):
        fn()
    pairs = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


TIMER = cuda_median_ms  # ``timer(backend name, fn) -> ms``; tests inject a fake one


def _runner(backend, call):
    """A function running ``call`` once on ``backend``, returning every output tensor: the
    result of ``run``, or for attention forward then backward (the choice serves both)."""
    if hasattr(backend, "forward"):
        gen = torch.Generator(device=call.q.device).manual_seed(0)  # one dout on every rank

        def fwd_bwd():
            out, lse = backend.forward(call)
            dout = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
            gen.manual_seed(0)
            return (out, lse, *backend.backward(call, out, lse, dout, None))

        return fwd_bwd
    if hasattr(backend, "combine"):
        raise TypeError(f"backend {backend.name!r}: exchange ops are not tuned")
    return lambda: backend.run(call)


def _tensors(result) -> list[torch.Tensor | None]:
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in _tensors(r)]
    return [result if isinstance(result, torch.Tensor) else None]


def check_reason(out, ref) -> str | None:
    """Why ``out`` (a backend's outputs) is not ``ref`` (the oracle's), or None if it is."""
    outs, refs = _tensors(out), _tensors(ref)
    if len(outs) != len(refs):
        return f"returned {len(outs)} outputs, the oracle {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs)):
        if (o is None) != (r is None):
            return f"output {i} is {'None' if o is None else 'a tensor'}, the oracle's is not"
        if o is None:
            continue
        if o.shape != r.shape or o.dtype != r.dtype:
            return (f"output {i} is {tuple(o.shape)} {o.dtype}, the oracle's {tuple(r.shape)} "
                    f"{r.dtype}")
        if not o.is_floating_point():
            if not torch.equal(o, r):
                return f"output {i} differs from the oracle's"
            continue
        finite = torch.isfinite(r)
        if not torch.equal(finite, torch.isfinite(o)):
            return f"output {i} has inf/nan where the oracle's has none (or the reverse)"
        diff = (o.double() - r.double()).abs()[finite]
        scale = r.double().abs()[finite].max() if finite.any() else torch.tensor(0.0)
        err = float(diff.max() / max(float(scale), 1e-30)) if diff.numel() else 0.0
        tol = CHECK_TOLERANCE.get(r.dtype, 5e-3)
        if not err <= tol:
            return f"output {i} is {err:.2e} from the oracle's (relative to its largest; at most {tol:g})"
    return None


def _oracle(op: str, dispatcher) -> str | None:
    try:
        return registry.get(op).oracle
    except KeyError:  # a dispatcher no op registered (tests): its reference, if any
        return "reference" if "reference" in dispatcher.backends else None


def measure(dispatcher, call, candidates: list[str], timer=None) -> Entry:
    """Check every candidate against the oracle, time the ones that pass and choose the
    fastest, the slowest rank's time counting (collective with a group: every rank calls
    this with the same candidates). Ties go to the earlier candidate."""
    timer = timer or TIMER
    oracle = _oracle(dispatcher.op, dispatcher)
    ref = _runner(dispatcher.backends[oracle], call)() if oracle else None
    times, rejected = [], {}
    for name in candidates:
        fn = _runner(dispatcher.backends[name], call)
        try:
            reason = None if ref is None or name == oracle else check_reason(fn(), ref)
            times.append(math.inf if reason else float(timer(name, fn)))
        except Exception as e:  # noqa: BLE001 - a candidate that fails is rejected, not fatal
            reason = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            times.append(math.inf)
        if reason:
            rejected[name] = reason
    group = getattr(call, "group", None)
    if group is not None and dist.get_world_size(group) > 1:
        slowest = torch.tensor(times, dtype=torch.float64, device=host_collective_device(group))
        bounded_wait(dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group, async_op=True),
                     "the tuning timings", group)
        times = slowest.tolist()
    for name, t in zip(candidates, times):
        if math.isinf(t) and name not in rejected:
            rejected[name] = "rejected on another rank"
    best = min(range(len(candidates)), key=lambda i: (times[i], i))
    if math.isinf(times[best]):
        raise RuntimeError(f"fusedpar.{dispatcher.op}: every backend failed its check: {rejected}")
    return Entry(candidates[best], {n: (None if math.isinf(t) else t) for n, t in zip(candidates, times)},
                 rejected)


def explain(dispatcher, call) -> tuple[str | None, str]:
    """``(backend, why)``: what ``dispatcher`` runs for ``call`` (a call without a group) and
    why, from the tables alone: no timing, no collective (``fusedpar info``)."""
    forced = settings.get().backend
    if forced in dispatcher.backends:
        return forced, "forced by FUSEDPAR_BACKEND"
    candidates = [name for name, reasons in dispatcher.availability(call).items() if not reasons]
    if not candidates:
        return None, "no backend can run it here"
    if not applies(call):
        return candidates[0], (f"the priority order (nothing is timed on "
                               f"{tensor(call).device.type})" if hasattr(call, "bucket")
                               else "the priority order (this op is not tuned)")
    if len(candidates) == 1:
        return candidates[0], "the only backend that can run it"
    name, why, _ = lookup(signature(dispatcher.op, call), candidates)
    return name, why
