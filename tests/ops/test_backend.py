"""Backend names are checked at once: a typo never passes silently."""

import pytest

from fusedpar.errors import BackendNotSupportedError
from fusedpar.ops import registry
from fusedpar.ops.backend import check_backend_name, known_backends
from tests.ops.collective_cases import env


def test_known_backends_are_every_registered_ops():
    assert known_backends() == sorted({n for s in registry.specs() for n in s.backends})
    assert {"reference", "triton", "cuda", "pipelined"} <= set(known_backends())


def test_a_misspelt_backend_name_fails_listing_the_backends():
    with pytest.raises(BackendNotSupportedError, match=r"'trition' names no fusedpar backend.*'triton'"):
        check_backend_name("trition")
    check_backend_name("triton")
    check_backend_name(None)


def test_a_misspelt_FUSEDPAR_BACKEND_fails_at_the_first_selection():
    dispatcher = registry.get("all_gather").dispatcher
    with env(FUSEDPAR_BACKEND="trition"):
        with pytest.raises(BackendNotSupportedError, match="FUSEDPAR_BACKEND='trition'"):
            dispatcher.forced_name("")
    with env(FUSEDPAR_BACKEND="pipelined"):  # a real backend that all_gather lacks: auto
        assert dispatcher.forced_name("") == ""
