"""The op registry: what registered ops export, what ``register`` refuses, the backend kinds,
and a toy op (tests/ops/toy_op.py) that ``fusedpar info`` and ``fusedpar check`` pick up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import fusedpar
from fusedpar.ops import registry
from fusedpar.ops.backend import (AttentionBackend, Backend, Dispatcher, ExchangeBackend,
                                  LoopbackBackend, RunBackend, kind)
from tests.cli.common import ROOT


def toy_cli(args, timeout):
    """``fusedpar <args>`` with the toy op registered, in a subprocess (this process's
    registry stays as fusedpar ships it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, os.path.join(ROOT, "tests", "ops", "toy_cli.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_every_registered_function_is_exported_and_nothing_else():
    exported = [f for spec in registry.specs() for f in spec.functions]
    assert sorted(fusedpar.ops.__all__) == sorted(f.__name__ for f in exported)
    for f in exported:
        assert getattr(fusedpar.ops, f.__name__) is f


def test_specs_are_consistent():
    names = [spec.name for spec in registry.specs()]
    assert len(names) == len(set(names))
    assert {"all_gather", "reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter",
            "flash_attention", "ring_attention", "grouped_mm", "moe_dispatch",
            "moe_experts"} <= set(names)
    for spec in registry.specs():
        assert registry.get(spec.name) is spec
        assert spec.backends == list(spec.dispatcher.backends)
        assert spec.oracle is None or spec.oracle in spec.backends, spec.name
        if spec.example is not None:  # evaluable on this machine, every backend judged
            call = spec.example(torch.device("cpu"))
            assert list(spec.dispatcher.availability(call)) == spec.backends


def test_every_op_has_backends_of_one_kind_and_loopbacks_run_views():
    kinds = {spec.name: {kind(b) for b in spec.dispatcher.backends.values()}
             for spec in registry.specs()}
    assert all(len(k) == 1 for k in kinds.values()), kinds
    assert kinds["flash_attention"] == kinds["ring_attention"] == {AttentionBackend}
    assert kinds["moe_dispatch"] == {ExchangeBackend}
    assert kinds["all_gather"] == kinds["grouped_mm"] == kinds["moe_experts"] == {RunBackend}
    for op in ("all_gather", "reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter",
               "ring_attention", "moe_dispatch"):  # their *_loopback runs the triton backend's
        assert isinstance(registry.get(op).dispatcher.backends["triton"], LoopbackBackend), op


class _Runs(Backend):
    name = "a"

    def run(self, call):
        return call


class _Attends(Backend):
    name = "b"

    def forward(self, call):
        return call

    def backward(self, call, out, lse, dout, dlse):
        return call


def test_a_dispatcher_refuses_backends_of_mixed_kinds():
    with pytest.raises(TypeError, match=r"toy_mixed: its backends must all be of one kind"):
        Dispatcher("toy_mixed", [_Runs(), _Attends()])


def test_register_refuses_what_would_be_ambiguous():
    before = [s.name for s in registry.specs()]
    with pytest.raises(ValueError, match="'all_gather' is registered twice"):
        registry.register(registry.get("all_gather").dispatcher, ())
    with pytest.raises(ValueError, match=r"oracle='reference' is not one of its backends \['a'\]"):
        registry.register(Dispatcher("toy_no_reference", [_Runs()]), ())
    with pytest.raises(ValueError, match=r"\['all_gather'\] are already exported by \['all_gather'\]"):
        registry.register(Dispatcher("toy_clash", [_Runs()]), (fusedpar.ops.all_gather,),
                          oracle=None)
    with pytest.raises(KeyError, match="no fusedpar op is named 'toy_unknown'"):
        registry.get("toy_unknown")
    assert [s.name for s in registry.specs()] == before


@pytest.mark.timeout(180)
def test_info_picks_up_a_registered_toy_op():
    res = toy_cli(["info", "--json"], timeout=150)
    assert res.returncode == 0, res.stderr
    entry = json.loads(res.stdout)["backends"]["ops"]["toy_double"]
    assert entry["call"] == "x of shape (4, 3) torch.float32 on cpu"  # its example call
    assert entry["backends"] == {"toy": {"available": True, "reasons": []},
                                 "reference": {"available": True, "reasons": []}}


@pytest.mark.timeout(300)
def test_check_picks_up_a_registered_toy_op():
    res = toy_cli(["check", "--world-size", "1", "--backends", "toy"], timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [tuple(c.strip() for c in line.split(" | ")) for line in res.stdout.splitlines()
            if line.startswith("toy_double")]
    # float16 is refused by the toy backend: reported, not run
    assert [r[:5] for r in rows] == [("toy_double odd", "toy", "(3, 5)", dtype, "yes")
                                     for dtype in ("float32", "bfloat16")], res.stdout
    assert "toy_double / toy: toy takes no float16" in res.stdout
    assert "OK: all 2 results match the reference (2 bit for bit)" in res.stdout
