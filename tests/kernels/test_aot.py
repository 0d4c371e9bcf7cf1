"""Every Triton kernel compiles for sm_90 and sm_80 without a GPU, and is registered."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

import fusedpar
from fusedpar.kernels import aot_examples

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = pathlib.Path(fusedpar.__file__).parent


@pytest.fixture(scope="module", params=[90, 80])
def compiled(request):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.aot_compile", str(request.param)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return request.param, [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.timeout(300)
def test_every_registered_kernel_compiles(compiled):
    arch, rows = compiled
    assert len(rows) == len(aot_examples())
    failures = [r for r in rows if not r["ok"]]
    assert not failures, failures
    assert {r["target"] for r in rows} == {"sm_90a" if arch == 90 else "sm_80"}


@pytest.mark.timeout(300)
def test_flags_use_system_scope_acquire_and_release(compiled):
    _, rows = compiled
    by_name = {r["name"].split("[")[0]: r for r in rows}
    assert by_name["signal.wait_flags_kernel"]["acquire_sys"]
    assert by_name["signal.signal_peers_kernel"]["release_sys"]
    assert by_name["all_gather.all_gather_pull_kernel"]["acquire_sys"]
    assert by_name["reduce_scatter.reduce_scatter_pull_kernel"]["acquire_sys"]


def _jit_functions():
    """``{name: ast.FunctionDef}`` of every @triton.jit function under fusedpar/."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list
            ):
                found[node.name] = node
    return found


def test_every_triton_kernel_is_registered():
    """A kernel (``*_kernel``) must be in AOT_EXAMPLES; a device helper must be called by one."""
    jitted = _jit_functions()
    registered = {kernel.fn.__name__ for _, kernel, _, _ in aot_examples()}
    missing = sorted(n for n in jitted if n.endswith("_kernel") and n not in registered)
    assert not missing, f"kernels missing from their module's AOT_EXAMPLES: {missing}"
    reached, todo = set(), list(registered)
    while todo:
        name = todo.pop()
        if name in reached or name not in jitted:
            continue
        reached.add(name)
        todo += [n.id for n in ast.walk(jitted[name]) if isinstance(n, ast.Name)]
        todo += [n.attr for n in ast.walk(jitted[name]) if isinstance(n, ast.Attribute)]
    unreached = sorted(set(jitted) - reached)
    assert not unreached, f"@triton.jit functions no registered kernel compiles: {unreached}"
