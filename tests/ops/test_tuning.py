"""Choosing a backend by measurement (fusedpar.ops.tuning), on CPU with an injected timer:
CPU is made a tuned device for these tests only (``tuned_cpu``); the timer returns the
times a test gives it, so the choice, ties, rejections, the tables and the rank agreement
are checked without timing anything."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import pytest
import torch

from fusedpar.errors import BackendNotSupportedError
from fusedpar.ops import tuning
from fusedpar.ops.backend import Backend, Dispatcher
from fusedpar.ops.calls import MatmulCall
from fusedpar.ops.grouped_mm import GroupedCall
from tests.ops.collective_cases import env


@dataclass
class Call:
    x: torch.Tensor

    def cache_key(self) -> tuple:
        return (self.x.device.type, self.x.dtype)

    def describe(self) -> str:
        return f"x {tuple(self.x.shape)}"

    def bucket(self) -> tuple:
        return (tuning.pow2(self.x.numel()),)


class Double(Backend):
    """``2 * x``, correct (``wrong``: off by one)."""

    def __init__(self, name: str, wrong: bool = False):
        self.name, self.wrong = name, wrong

    def run(self, call):
        return call.x * 2 + (1 if self.wrong else 0)


def dispatcher(*backends, op="tuning_toy") -> Dispatcher:
    return Dispatcher(op, list(backends) or [Double("fast"), Double("slow"), Double("reference")])


class FakeTimer:
    """Returns ``times[name]`` for a backend (each call recorded); runs nothing."""

    def __init__(self, **times):
        self.times, self.calls = times, []

    def __call__(self, name, fn):
        self.calls.append(name)
        return self.times[name]


@pytest.fixture
def tuned_cpu(monkeypatch, tmp_path):
    """CPU counts as a tuned device, the user's table is a fresh file, no default table."""
    monkeypatch.setattr(tuning, "TUNED_DEVICES", ("cpu",))
    monkeypatch.setattr(tuning, "_defaults", {"entries": {}, "fallback": {}})
    monkeypatch.setenv("FUSEDPAR_TUNE_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.delenv("FUSEDPAR_AUTOTUNE", raising=False)
    monkeypatch.delenv("FUSEDPAR_BACKEND", raising=False)
    tuning._tables.clear()
    yield tmp_path / "tune.json"
    tuning._tables.clear()


def call(n=6):
    return Call(torch.arange(float(n)))


# ---- the choice -------------------------------------------------------------------------


def test_the_fastest_checked_backend_is_chosen_with_every_time():
    d = dispatcher()
    entry = tuning.measure(d, call(), ["fast", "slow", "reference"],
                           FakeTimer(fast=1.0, slow=3.0, reference=2.0))
    assert entry.backend == "fast"
    assert entry.times_ms == {"fast": 1.0, "slow": 3.0, "reference": 2.0}
    assert entry.rejected == {}


def test_ties_go_to_the_priority_order():
    d = dispatcher()
    timer = FakeTimer(fast=2.0, slow=2.0, reference=2.0)
    assert tuning.measure(d, call(), ["slow", "fast", "reference"], timer).backend == "slow"
    assert tuning.measure(d, call(), ["fast", "slow", "reference"], timer).backend == "fast"


def test_a_wrong_backend_is_rejected_however_fast():
    d = dispatcher(Double("broken", wrong=True), Double("reference"))
    timer = FakeTimer(broken=0.1, reference=5.0)
    entry = tuning.measure(d, call(), ["broken", "reference"], timer)
    assert entry.backend == "reference"
    assert entry.times_ms == {"broken": None, "reference": 5.0}
    assert "from the oracle's" in entry.rejected["broken"]
    assert timer.calls == ["reference"]  # a rejected backend is never timed


def test_a_raising_backend_is_rejected_and_all_rejected_is_an_error():
    class Raises(Backend):
        name = "raises"

        def run(self, call):
            raise RuntimeError("kernel exploded")

    d = dispatcher(Raises(), Double("reference"))
    entry = tuning.measure(d, call(), ["raises", "reference"], FakeTimer(reference=1.0))
    assert entry.backend == "reference" and "kernel exploded" in entry.rejected["raises"]
    d = dispatcher(Double("broken", wrong=True), Double("reference"))
    with pytest.raises(RuntimeError, match="every backend failed its check"):
        tuning.measure(d, call(), ["broken"], FakeTimer(broken=1.0))


def test_check_reason_names_shape_dtype_nan_and_size_of_the_error():
    ref = torch.ones(4)
    assert tuning.check_reason(torch.ones(4), ref) is None
    assert "(3,)" in tuning.check_reason(torch.ones(3), ref)
    assert "float64" in tuning.check_reason(torch.ones(4, dtype=torch.float64), ref)
    assert "inf/nan" in tuning.check_reason(torch.tensor([1.0, float("nan"), 1, 1]), ref)
    assert "1.00e-01" in tuning.check_reason(torch.tensor([1.1, 1, 1, 1]), ref)
    assert tuning.check_reason((None, [ref]), (None, [ref.clone()])) is None
    assert "a tensor, the oracle's is not" in tuning.check_reason((ref, [ref]), (None, [ref]))


# ---- buckets ------------------------------------------------------------------------------


def test_bucket_edges_are_powers_of_two():
    assert [tuning.pow2(n) for n in (0, 1, 2, 3, 4, 5, 1023, 1024, 1025)] == \
        [0, 1, 2, 4, 4, 8, 1024, 1024, 2048]


def _grouped(t):
    return GroupedCall(torch.empty(t, 64, device="meta"), torch.empty(4, 64, 96, device="meta"),
                       torch.empty(4, dtype=torch.int32, device="meta"))


def test_call_buckets_split_at_a_power_of_two():
    assert _grouped(513).bucket() == _grouped(1024).bucket() != _grouped(1025).bucket()
    assert _grouped(1024).bucket() == (2, 3, 1024, 64, 4, 64, 128, 4)

    def matmul(op, rows, world, dim=0):
        a = torch.empty(rows, 32, device="meta")
        return MatmulCall(op, a, dim, world, None, [torch.empty(32 * (world if dim else 1), 48,
                                                                 device="meta")])

    # all_gather_matmul's M is the gathered rows (W x the shard's), K-sharded its K
    assert matmul("all_gather_matmul", 100, 4).bucket() == (512, 32, 64, 0)
    assert matmul("all_gather_matmul", 128, 4).bucket() == (512, 32, 64, 0)
    assert matmul("all_gather_matmul", 129, 4).bucket() == (1024, 32, 64, 0)
    assert matmul("all_gather_matmul", 100, 4, dim=1).bucket() == (128, 128, 64, 1)
    assert matmul("matmul_reduce_scatter", 100, 4).bucket() == (128, 32, 64, 0)


# ---- the dispatcher ---------------------------------------------------------------------


def test_autotune_measures_once_stores_and_a_new_process_reads_it(tuned_cpu, monkeypatch):
    timer = FakeTimer(fast=3.0, slow=1.0, reference=2.0)
    monkeypatch.setattr(tuning, "TIMER", timer)
    monkeypatch.setenv("FUSEDPAR_AUTOTUNE", "1")
    d = dispatcher()
    assert d.select(call()).name == "slow"
    assert d.select(call()).name == "slow" and timer.calls == ["fast", "slow", "reference"]
    stored = json.loads(tuned_cpu.read_text())
    assert stored["versions"] == tuning.versions()
    (key, entry), = stored["entries"].items()
    assert key == "tuning_toy|cpu|1|float32|8|local"
    assert entry["backend"] == "slow" and entry["times_ms"]["fast"] == 3.0
    assert d.select(call(9)).name == "slow" and len(timer.calls) == 6  # another bucket: tuned

    tuning._tables.clear()  # as a new process: the file decides, nothing is timed
    monkeypatch.setattr(tuning, "TIMER", FakeTimer())
    monkeypatch.delenv("FUSEDPAR_AUTOTUNE")
    assert dispatcher().select(call(5)).name == "slow"  # 5 elements: the same bucket as 6


def test_a_tuning_session_measures_each_signature_once_even_if_stored(tuned_cpu, monkeypatch):
    """``fusedpar tune --model``'s path: in a session every signature is measured at its
    first call, also one the table has (FUSEDPAR_AUTOTUNE would keep it), once per
    session; calls one backend can take are listed; outside a session nothing is timed."""
    class Refuses(Double):
        def not_supported_reasons(self, call):
            return ["never"]

    _store(tuned_cpu, backend="fast")  # measured before: fast
    timer = FakeTimer(fast=3.0, slow=1.0, reference=2.0)
    monkeypatch.setattr(tuning, "TIMER", timer)
    with tuning.tuning_session() as session:
        assert dispatcher().select(call()).name == "slow"  # re-measured
        assert dispatcher().select(call(5)).name == "slow"  # its bucket: measured already
        assert dispatcher(Refuses("fast"), Double("reference")).select(call()).name == "reference"
    assert timer.calls == ["fast", "slow", "reference"]
    key = tuning.signature("tuning_toy", call()).key()
    assert session.measured == {key: tuning.user_table().entries[key]}
    assert session.measured[key].backend == "slow" and session.single == {key: "reference"}
    assert tuning.Table.load(tuned_cpu).entries[key].backend == "slow"  # saved
    assert dispatcher().select(call(100)).name == "fast" and len(timer.calls) == 3


def test_untuned_and_default_table_choices(tuned_cpu, monkeypatch):
    monkeypatch.setattr(tuning, "TIMER", FakeTimer())  # nothing may be timed
    assert dispatcher().select(call()).name == "fast"  # no entry, no default: priority
    sig = tuning.signature("tuning_toy", call())
    assert tuning.lookup(sig, ["fast", "slow"]) == ("fast", "untuned: the priority order",
                                                    tuning.UNTUNED)
    defaults = {"entries": {sig.key(with_placement=False): {"backend": "reference", "why": "row"}},
                "fallback": {"tuning_toy": {"cpu": {"backend": "slow", "why": "fallback"}}}}
    monkeypatch.setattr(tuning, "_defaults", defaults)
    assert dispatcher().select(call()).name == "reference"  # the row of this bucket
    assert dispatcher().select(call(100)).name == "slow"  # no row: the op's fallback here
    # a default naming a backend that cannot take the call is passed over
    assert tuning.lookup(sig, ["fast", "slow"])[0] == "slow"


def test_forced_backends_win_and_nothing_is_timed(tuned_cpu, monkeypatch):
    monkeypatch.setattr(tuning, "TIMER", FakeTimer())
    monkeypatch.setenv("FUSEDPAR_AUTOTUNE", "1")
    assert dispatcher().select(call(), "reference").name == "reference"
    with env(FUSEDPAR_BACKEND="reference"):
        assert dispatcher().select(call()).name == "reference"
    assert not tuned_cpu.exists()


def test_on_cpu_nothing_is_timed_and_the_priority_order_stays(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDPAR_AUTOTUNE", "1")
    monkeypatch.setenv("FUSEDPAR_TUNE_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setattr(tuning, "TIMER", FakeTimer())
    assert not tuning.applies(call())
    assert dispatcher().select(call()).name == "fast"
    assert not (tmp_path / "tune.json").exists()


def test_a_single_candidate_is_chosen_without_a_lookup(tuned_cpu, monkeypatch):
    class Refuses(Double):
        def not_supported_reasons(self, call):
            return ["never"]

    monkeypatch.setenv("FUSEDPAR_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "TIMER", FakeTimer())
    assert dispatcher(Refuses("fast"), Double("reference")).select(call()).name == "reference"
    with pytest.raises(BackendNotSupportedError, match="fast: never"):
        dispatcher(Refuses("fast")).select(call())


# ---- the user's table -----------------------------------------------------------------------


def _store(path, backend="slow"):
    table = tuning.Table(path)
    table.entries[tuning.signature("tuning_toy", call()).key()] = tuning.Entry(
        backend, {"fast": 2.0, backend: 1.0})
    table.save()


def test_a_table_of_other_versions_is_ignored_with_one_warning(tuned_cpu, monkeypatch):
    _store(tuned_cpu)
    assert tuning.Table.load(tuned_cpu).entries  # same versions: read
    real = tuning.versions()
    monkeypatch.setattr(tuning, "versions", lambda: {**real, "driver": "999.1"})
    with pytest.warns(UserWarning, match="ignoring the tuning table .*rerun `fusedpar tune`"):
        assert dispatcher().select(call()).name == "fast"  # stale: untuned
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loaded once: no second warning
        assert dispatcher().select(call()).name == "fast"


@pytest.mark.parametrize("text", ["{not json", '{"entries": [1]}', '[]',
                                  '{"format": 1, "versions": null, "entries": {}}'])
def test_a_corrupt_table_is_ignored_with_a_warning(tuned_cpu, text):
    tuned_cpu.write_text(text)
    with pytest.warns(UserWarning, match="ignoring the tuning table"):
        assert dispatcher().select(call()).name == "fast"


def test_a_malformed_entry_or_unknown_backend_is_never_chosen(tuned_cpu, monkeypatch):
    _store(tuned_cpu, backend="gone")  # a backend this version no longer has
    assert dispatcher().select(call()).name == "fast"
    data = json.loads(tuned_cpu.read_text())
    data["entries"] = {k: {"backend": 3} for k in data["entries"]}
    tuned_cpu.write_text(json.dumps(data))
    tuning._tables.clear()
    with pytest.warns(UserWarning, match="malformed entry"):
        assert dispatcher().select(call()).name == "fast"


def test_the_cache_path_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("FUSEDPAR_TUNE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.cache_path() == tmp_path / "fusedpar" / "tune.json"
    monkeypatch.setenv("FUSEDPAR_TUNE_CACHE", "/x/t.json")
    assert str(tuning.cache_path()) == "/x/t.json"


# ---- ranks agree ----------------------------------------------------------------------------


def _rank_agreement(cache_dir):
    """On each of 2 ranks: all_gather_matmul tuned where the ranks' own timings disagree,
    then a lookup where only rank 0's table has an entry (pipelined and reference: the
    candidates that run on CPU without the interpreter's slowness)."""
    import torch.distributed as dist

    from fusedpar.ops import registry

    rank, candidates = dist.get_rank(), ["pipelined", "reference"]
    os.environ["FUSEDPAR_TUNE_CACHE"] = os.path.join(cache_dir, f"tune{rank}.json")
    os.environ["FUSEDPAR_AUTOTUNE"] = "1"
    saved = tuning.TUNED_DEVICES, tuning.TIMER, tuning._defaults
    tuning.TUNED_DEVICES, tuning._defaults = ("cpu",), {"entries": {}, "fallback": {}}
    tuning._tables.clear()
    # alone, rank 0 would choose pipelined and rank 1 reference; the slowest rank's times
    # are pipelined 8, reference 7
    mine = [dict(pipelined=1.0, reference=7.0), dict(pipelined=8.0, reference=1.0)][rank]
    tuning.TIMER = lambda name, fn: mine[name]
    try:
        a = torch.arange(12.0).view(3, 4) + 100 * rank
        b = torch.ones(4, 2)
        dispatcher = registry.get("all_gather_matmul").dispatcher
        call = MatmulCall("all_gather_matmul", a, 0, 2, dist.group.WORLD, [b])
        tuned = tuning.choose(dispatcher, call, candidates)
        _, (out,) = dispatcher.backends[tuned].run(call)
        ok = torch.equal(out, torch.cat([torch.arange(12.0).view(3, 4) + 100 * r
                                         for r in range(2)]) @ b)
        sig = tuning.signature("all_gather_matmul", call)
        stored = tuning.Table.load(os.environ["FUSEDPAR_TUNE_CACHE"]).entries[sig.key()]
        # tables that differ: rank 0 measured "pipelined", rank 1 has nothing (untuned,
        # its priority order would give pipelined too: so it prefers reference by default)
        del os.environ["FUSEDPAR_AUTOTUNE"]
        tuning._tables.clear()
        table = tuning.user_table()
        table.entries.clear()
        if rank == 0:
            table.entries[sig.key()] = tuning.Entry("reference", {"reference": 1.0})
        else:
            tuning._defaults = {"entries": {sig.key(with_placement=False): {"backend": "pipelined"}}}
        agreed = tuning.choose(dispatcher, call, candidates)
        return ok, tuned, stored.times_ms, agreed, sig.placement
    finally:
        tuning.TUNED_DEVICES, tuning.TIMER, tuning._defaults = saved
        tuning._tables.clear()
        os.environ.pop("FUSEDPAR_AUTOTUNE", None)


@pytest.mark.multirank
def test_ranks_whose_timings_disagree_pick_one_backend(pools, tmp_path):
    results = pools(2).run(_rank_agreement, str(tmp_path), timeout=120)
    for ok, backend, times, agreed, placement in results:
        assert ok
        assert backend == "reference"
        assert times == {"pipelined": 8.0, "reference": 7.0}
        assert agreed == "reference"  # rank 0's measured entry beats rank 1's default row
        assert placement == "1x2"


def _moe_choices(cache_dir):
    """On each of 2 ranks: moe_experts calls (rank 0 passes 5 tokens, rank 1 7) of three
    buckets (hidden 8, 16, 32), the default table holding a row for the first and a
    fallback of moe_experts; then without the fallback. Selection only: nothing runs."""
    import torch.distributed as dist

    from fusedpar.ops import registry
    from fusedpar.ops.moe.experts_call import ExpertsCall

    rank = dist.get_rank()
    os.environ["FUSEDPAR_TUNE_CACHE"] = os.path.join(cache_dir, f"tune{rank}.json")  # none there
    saved = tuning.TUNED_DEVICES, tuning.TIMER, tuning._defaults
    tuning.TUNED_DEVICES, tuning.TIMER = ("cpu",), None  # nothing may be timed
    tuning._tables.clear()
    registered = registry.get("moe_experts").dispatcher

    def fresh():  # the op's backends, no cached choice
        return Dispatcher(registered.op, list(registered.backends.values()))

    def call(hidden, tokens=5 + 2 * rank):
        idx = torch.zeros(tokens, 2, dtype=torch.long)
        return ExpertsCall(torch.zeros(tokens, hidden), idx, torch.ones(tokens, 2),
                           torch.zeros(2, 12, hidden), torch.zeros(2, hidden, 6), dist.group.WORLD)

    try:
        sig = tuning.signature("moe_experts", call(8))
        tuning._defaults = {
            "entries": {sig.key(with_placement=False): {"backend": "reference", "why": "row"}},
            "fallback": {"moe_experts": {"cpu": {"backend": "fused", "why": "fallback"}}}}
        d = fresh()
        candidates = [n for n, reasons in d.availability(call(8)).items() if not reasons]
        chosen = [d.select(call(h)).name for h in (8, 16, 32)]
        tuning._defaults = {"entries": tuning._defaults["entries"], "fallback": {}}
        untuned = fresh().select(call(16)).name
        return sig.key(), candidates, chosen, untuned
    finally:
        tuning.TUNED_DEVICES, tuning.TIMER, tuning._defaults = saved
        tuning._tables.clear()


@pytest.mark.multirank
def test_moe_experts_choose_by_the_default_table_then_fallback_then_priority(pools, tmp_path):
    """An ExpertsCall's bucket is the sizes every rank shares (hidden, intermediate, experts
    per rank, k), so ranks passing different token counts share one signature and choose
    together: the row of its bucket, else the op's fallback, else the priority order."""
    (key0, candidates, chosen, untuned), (key1, *rest) = pools(2).run(_moe_choices, str(tmp_path),
                                                                      timeout=120)
    assert key0 == key1 == "moe_experts|cpu|2|float32|8x8x2x2|1x2"
    assert candidates == ["pipelined", "fused", "reference"]
    assert chosen == ["reference", "fused", "fused"]  # the row, then the fallback (16, 32)
    assert untuned == "pipelined"  # no row, no fallback: the priority order
    assert rest == [candidates, chosen, untuned]


def test_real_ops_autotune_every_candidate_passing_the_oracle_check(tuned_cpu, monkeypatch):
    """grouped_mm (run kind) and flash_attention (forward and backward checked) through
    their dispatchers: every candidate here (triton in the interpreter, torch._grouped_mm,
    torch's SDPA) matches the oracle."""
    from fusedpar.ops import flash_attention, grouped_mm

    monkeypatch.setenv("FUSEDPAR_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "TIMER", FakeTimer(triton=3.0, reference=2.0, torch=1.0, sdpa=4.0))
    torch.manual_seed(0)
    a, b = torch.randn(32, 16), torch.randn(4, 16, 16)
    offs = torch.tensor([8, 8, 24, 32], dtype=torch.int32)
    torch.testing.assert_close(grouped_mm(a, b, offs), grouped_mm(a, b, offs, backend="reference"))
    q, k, v = (torch.randn(1, 16, 2, 16) for _ in range(3))
    flash_attention(q, k, v, causal=True)
    entries = {key.split("|")[0]: e for key, e in tuning.user_table().entries.items()}
    assert entries["grouped_mm"].times_ms == {"triton": 3.0, "reference": 2.0, "torch": 1.0}
    assert entries["grouped_mm"].backend == "torch"
    assert entries["flash_attention"].times_ms == {"triton": 3.0, "reference": 2.0, "sdpa": 4.0}
    assert entries["flash_attention"].backend == "reference"
    assert entries["flash_attention"].rejected == entries["grouped_mm"].rejected == {}
