"""Test setup. Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must
be set before any kernel module is imported (triton reads it when decorating)."""

import glob
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FUSEDPAR_TIMEOUT", "30")

import pytest  # noqa: E402

from fusedpar.comm import settings  # noqa: E402
from fusedpar.comm.symmetric import shm_job_prefix  # noqa: E402
from tests.dist_pool import PoolRegistry  # noqa: E402


def pytest_collection_modifyitems(session, config, items):
    """test_aot.py's tests last: its compiles use only the cores the other tests leave idle
    (test_aot.start_compiles), so the later its tests wait for them, the less is left."""
    items.sort(key=lambda item: item.path.name == "test_aot.py")  # stable: the rest keep their order


def pytest_collection_finish(session):
    """The ahead-of-time compiles take minutes of CPU: when the session runs them, start
    them now, in the background at the lowest priority (tests/kernels/test_aot.py)."""
    if any(item.path.name == "test_aot.py" for item in session.items):
        from tests.kernels import test_aot

        try:
            test_aot.start_compiles()
        except AssertionError:  # a missing interpreter: the test itself reports it
            pass


def pytest_sessionfinish(session):
    from tests.kernels import test_aot

    test_aot.stop_compiles()  # an aborted or deselected run leaves none behind


@pytest.fixture(autouse=True)
def _fresh_settings():
    """fusedpar reads its environment settings once (``fusedpar.comm.settings``): each test
    starts and ends with them read again, after what an earlier test or this one's
    monkeypatch set or put back."""
    settings.refresh()
    yield
    settings.refresh()


@pytest.fixture(scope="session")
def pools(tmp_path_factory):
    """``pools(W)``: a pool of W spawned gloo ranks, shared by the session's tests and
    replaced after any failure. Teardown stops them and removes this session's leftover
    shm segments (named after this process, the ranks' parent)."""
    registry = PoolRegistry(tmp_path_factory.mktemp("rendezvous"))
    yield registry
    registry.close()
    for path in glob.glob(f"/dev/shm/{shm_job_prefix(os.getpid())}*"):
        os.unlink(path)

