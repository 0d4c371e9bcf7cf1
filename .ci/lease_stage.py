"""pytest plugin (``-p lease_stage``, with .ci on PYTHONPATH) for the pytest stages of
``.ci/gpu all``, which are cut at their time limits: what a lease must bring back even from a
stage killed midway, printed (and flushed) the moment it is known.

- each failure or error: its node id, phase, seconds and traceback (``--tb`` style);
- each test slower than ``--report-slow`` seconds (5): one line with its seconds, so the next
  lease knows what is slow;
- an interrupt (the stage's SIGINT): the test it stopped and where; a SIGTERM (a test deaf to
  SIGINT): every thread's Python stack (faulthandler: also where the main thread sits in C);
- ``--max-timeout S``: every test's pytest-timeout at most S seconds, its ``timeout`` marker
  included (a marker outranks ``--timeout``, and the GPU tests' markers allow minutes);
- ``--ranks spawned|in-process``: only the tests on spawned ranks (they use a pool fixture of
  tests/conftest.py or tests/gpu/conftest.py), or only the others.

Its lines start with ``LEASE`` (grep them out of a stage log)."""

import faulthandler
import os
import signal
import time

import pytest

POOL_FIXTURES = {"pools", "shared_pools"}  # tests/conftest.py, tests/gpu/conftest.py


def pytest_addoption(parser):
    group = parser.getgroup("lease_stage", "a GPU lease's stage (.ci/lease_stage.py)")
    group.addoption("--report-slow", type=float, default=5.0, metavar="SECONDS",
                    help="print a line for each test slower than this (default 5)")
    group.addoption("--max-timeout", type=float, default=None, metavar="SECONDS",
                    help="every test's timeout, its timeout marker's included, at most this")
    group.addoption("--ranks", choices=["spawned", "in-process"], default=None,
                    help="run only the tests on spawned ranks (a pool fixture), or only the others")


class LeaseReport:
    def __init__(self, config):
        self.tr = config.pluginmanager.get_plugin("terminalreporter")
        self.slow_s = config.getoption("report_slow")
        self.seconds: dict[str, float] = {}  # node id -> its phases so far
        self.running = None  # (node id, start) of the test in progress
        # SIGTERM: every thread's stack to the real stderr (pytest may be capturing fd 2),
        # then the default action
        self.stderr = os.fdopen(os.dup(2), "w")
        faulthandler.register(signal.SIGTERM, file=self.stderr, all_threads=True, chain=True)

    def say(self, text: str) -> None:
        self.tr.ensure_newline()
        self.tr.write(text.rstrip("\n") + "\n", flush=True)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid):
        self.running = (nodeid, time.monotonic())

    @pytest.hookimpl(trylast=True)  # after the terminal reporter ends the test's -v line
    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            what = "FAILED" if report.when == "call" else f"ERROR at {report.when} of"
            self.say(f"LEASE {what} {report.nodeid} ({report.duration:.1f} s)\n"
                     f"{report.longreprtext}\nLEASE end of {report.nodeid}")
        if report.when == "teardown":
            total = self.seconds.pop(report.nodeid)
            if total >= self.slow_s:
                self.say(f"LEASE SLOW {total:.1f} s {report.nodeid}")

    def pytest_keyboard_interrupt(self, excinfo):
        where = ""
        if self.running:
            nodeid, start = self.running
            where = f" in {nodeid} after {time.monotonic() - start:.1f} s"
        # the test's frames, not pytest's and pluggy's around them
        excinfo.traceback = excinfo.traceback.filter(
            lambda entry: not any(f"/{pkg}/" in str(entry.path) for pkg in ("_pytest", "pluggy")))
        self.say(f"LEASE INTERRUPTED{where}\n{excinfo.getrepr(style='short')}")

    def pytest_unconfigure(self, config):
        faulthandler.unregister(signal.SIGTERM)
        self.stderr.close()


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config):
    if config.pluginmanager.get_plugin("terminalreporter") is not None:
        config.pluginmanager.register(LeaseReport(config), "lease_report")


def spawns_ranks(item) -> bool:
    return bool(POOL_FIXTURES & set(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config, items):
    ranks = config.getoption("ranks")
    if ranks:
        keep, drop = [], []
        for item in items:
            (keep if spawns_ranks(item) == (ranks == "spawned") else drop).append(item)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    cap = config.getoption("max_timeout")
    if cap is not None:
        for item in items:
            marker = item.get_closest_marker("timeout")
            args, kwargs = (marker.args, dict(marker.kwargs)) if marker else ((), {})
            timeout = args[0] if args else kwargs.pop("timeout", None)
            if not timeout or float(timeout) > cap:  # none, 0 (no timeout) or above the cap
                item.add_marker(pytest.mark.timeout(cap, *args[1:], **kwargs), append=False)
