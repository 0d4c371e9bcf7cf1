"""Every kernel variant the launchers produce compiles for sm_90a and sm_80 without a GPU,
with the installed Triton and with the GPU image's Triton 3.6; GPU fast paths do not spill;
and every kernel is registered. ``pytest -s`` prints the table of registers, shared memory
and spills per variant."""

import ast
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

import fusedpar
from fusedpar.kernels import aot_examples

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = pathlib.Path(fusedpar.__file__).parent
TRITON36 = ROOT / ".venv-triton36" / "bin" / "python"
ARCHS = (90, 80)


def _pythons() -> dict[str, str]:
    """The interpreters to compile with: this one, and triton 3.6's env (``./dev test``
    creates it; CI requires it through FUSEDPAR_EXPECT_TRITON36=1)."""
    found = {"installed": sys.executable}
    if TRITON36.exists():
        found["3.6"] = str(TRITON36)
    elif os.environ.get("FUSEDPAR_EXPECT_TRITON36") == "1":
        raise AssertionError(f"{TRITON36} is missing; ./dev test creates it")
    return found


_started: dict[tuple[str, int], tuple[subprocess.Popen, object, object]] = {}


def start_compiles() -> None:
    """Start every (interpreter, arch) compile in the background at the lowest CPU priority
    (tests/conftest.py does it once the session knows it runs this file): they use the
    cores while earlier tests wait on peers, deadlines and spawned ranks, and yield them to
    those tests."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for name, python in _pythons().items():
        for arch in ARCHS:
            if (name, arch) not in _started:
                # files, not pipes: nobody reads until the test runs, and a full pipe would
                # stall the compile
                out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                proc = subprocess.Popen(
                    ["nice", "-n", "19", python, "-m", "tests.kernels.aot_compile", str(arch)],
                    cwd=ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
                _lowest_autogroup(proc.pid)
                _started[name, arch] = proc, out, err


def _lowest_autogroup(pid: int) -> None:
    """Give ``pid``'s session (Linux autogroup) the lowest weight. The scheduler shares the
    cores between sessions first, so ``nice`` alone yields only to this session's processes,
    not to torchrun's workers, each in a session of its own (the torchrun restart test ran
    several times slower beside the compiles)."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write("19")
    except OSError:  # no autogroups (or the compile already ended): nice is all there is
        pass


def stop_compiles() -> None:
    for proc, out, err in _started.values():
        proc.kill()
        proc.wait()
        out.close()
        err.close()
    _started.clear()


def _rows(proc: subprocess.Popen, out, err) -> list[dict]:
    proc.wait(timeout=600)
    out.seek(0)
    err.seek(0)
    assert proc.returncode == 0, err.read()[-4000:]
    return [json.loads(line) for line in out.read().splitlines()]


@pytest.fixture(scope="module")
def compiled():
    """``{(triton, arch): rows}``: every (interpreter, arch) compiled in parallel (started
    here unless already running)."""
    start_compiles()
    out = {key: _rows(*job) for key, job in _started.items()}
    stop_compiles()  # all ended: closes the files
    _print_table(out)
    return out


def _print_table(compiled) -> None:
    print("\nkernel variant                              triton arch dtypes  warps stages regs  smem(B) spill(B)  config")
    for rows in compiled.values():
        for r in rows:
            if r["ok"]:
                print(f"{r['name']:<44}{r['triton']:<7}{r['arch']:<5}{r['dtypes']:<8}{r['warps']:<6}{r['stages']:<7}"
                      f"{r['regs']!s:<6}{r['smem']:<8}{r['spill_bytes']!s:<10}{r['config']}")


def _expected_count(arch: int) -> int:
    return sum(1 for *_, options in aot_examples() if options.get("arch", arch) == arch)


@pytest.mark.timeout(900)
def test_every_variant_compiles(compiled):
    for (triton_version, arch), rows in compiled.items():
        assert len(rows) == _expected_count(arch), (triton_version, arch)
        failures = [r for r in rows if not r["ok"]]
        assert not failures, failures
        assert {r["target"] for r in rows} == {"sm_90a" if arch == 90 else "sm_80"}


@pytest.mark.timeout(900)
def test_gpu_paths_do_not_spill(compiled):
    """A spill on a GPU fast path costs local-memory traffic in the inner loop; only variants
    that say why (``spills_ok``) may spill."""
    for rows in compiled.values():
        assert all(r.get("spill_bytes") is not None for r in rows), "ptxas printed no spill counts"
        spilling = [(r["name"], r["arch"], r["triton"], r["config"], r["spill_bytes"])
                    for r in rows if r["spill_bytes"] and not r["spills_ok"]]
        assert not spilling, spilling


@pytest.mark.timeout(900)
def test_hopper_dots_use_wgmma(compiled):
    """On sm_90 a dot compiled to mma.sync runs at a fraction of wgmma's rate (Triton picks
    mma.sync for tiles it cannot give a warpgroup 64 rows of); only variants that say why
    (``mma_sync_ok``) may."""
    for (triton_version, arch), rows in compiled.items():
        if arch != 90:
            continue
        assert any(r.get("mma") == "wgmma" for r in rows), "no variant compiled to wgmma"
        slow = [(r["name"], r["config"]) for r in rows if r.get("mma") == "mma.sync" and not r["mma_sync_ok"]]
        assert not slow, (triton_version, slow)


@pytest.mark.timeout(900)
def test_16_bit_data_moves_in_vectors(compiled):
    """A kernel that loads or stores 16-bit data one element per instruction reaches a
    fraction of the memory bandwidth: the all_gather / reduce_scatter pull kernels did (an
    int64 division per element hid the contiguity, and peers' data pointers, loaded from
    the pad table, had no alignment the compiler knew), 5.6x / 2.9x slower than a plain
    copy / sum on the H100. Every 16-bit variant's global data accesses are vectors."""
    for (triton_version, arch), rows in compiled.items():
        sixteen = [r for r in rows if {"*bf16", "*fp16"} & set(r["dtypes"].split(","))]
        assert sixteen and all(r.get("scalar_16bit") is not None for r in sixteen)
        scalar = [(r["name"], r["dtypes"], r["config"], r["scalar_16bit"]) for r in sixteen
                  if r["scalar_16bit"]]
        assert not scalar, (triton_version, arch, scalar)


def test_averages_divide_with_ieee_rounding(compiled):
    """reduce_scatter's "avg" (the pull kernel's, and matmul_reduce_scatter's chunk sum)
    rounds like torch's sum / W: Triton's ``/`` on fp32 compiles to the approximate
    ``div.full.f32`` (up to 2 ulp off at a W that is not a power of two), so both divide with
    ``tl.math.div_rn``."""
    averaging = ("reduce_scatter.reduce_scatter_pull_kernel", "matmul_reduce_scatter.reduce_chunks_kernel")
    for (triton_version, arch), rows in compiled.items():
        found = [r for r in rows if r["name"] in averaging]
        assert {r["name"] for r in found} == set(averaging), (triton_version, arch)
        assert all(r["approx_div"] == 0 for r in found), \
            (triton_version, arch, [(r["name"], r["approx_div"]) for r in found])


# the most shared memory one block may have (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SMEM_PER_BLOCK = {90: 232448, 80: 166912}


@pytest.mark.timeout(900)
def test_shared_memory_fits_one_block(compiled):
    """A variant needing more shared memory than an SM gives one block compiles here but
    fails at launch ("out of resource: shared memory")."""
    for (triton_version, arch), rows in compiled.items():
        over = [(r["name"], r["config"], r["smem"]) for r in rows
                if r.get("smem", 0) > SMEM_PER_BLOCK[arch]]
        assert not over, (triton_version, arch, over)


@pytest.mark.timeout(900)
def test_flags_use_system_scope_acquire_and_release(compiled):
    for rows in compiled.values():
        by_name = {}
        for r in rows:
            by_name.setdefault(r["name"], r)
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
    registered = {kernel.fn.__name__ for _, kernel, *_ in aot_examples()}
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


@pytest.mark.timeout(900)
def test_per_call_arguments_are_not_specialised(compiled):
    """rank, world size, epoch, fingerprint and timeout change per call: one binary for all."""
    for rows in compiled.values():
        specialised = [(r["name"], r["specialised_per_call"]) for r in rows if r.get("specialised_per_call")]
        assert not specialised, specialised


def test_scalar_ints_are_compiled_as_the_jit_types_them():
    """The JIT types a Python int as i32 whenever it fits, so a size or stride declared i64
    here would compile a variant no realistic launch runs (an all_gather pull kernel that
    compiled here as i64 failed to compile on the GPU as i32). Only ``timeout_ns``
    (nanoseconds: past 2**31 for any timeout over 2.1 s) is i64 at run time."""
    wide = sorted({(kernel.fn.__name__, arg) for _, kernel, sig, *_ in aot_examples()
                   for arg, kind in sig.items() if kind == "i64" and arg != "timeout_ns"})
    assert not wide, f"scalar ints declared i64 (the JIT passes i32): {wide}"


def _not_specialised(kernel) -> set[str]:
    if hasattr(kernel, "params"):  # compiled mode's JITFunction
        return {p.name for p in kernel.params if p.do_not_specialize}
    return set(kernel.kwargs.get("do_not_specialize") or ())  # the interpreter's wrapper


def test_specialisable_ints_are_never_used_as_tensors():
    """An int argument the JIT may specialise arrives as a plain constexpr 1 when it is 1
    (a row count, a unit stride), which has no ``.to``; widen it with ``tl.cast`` instead
    (the pull kernels did ``outer.to(tl.int64)`` and failed to compile for one-row inputs)."""
    jitted = _jit_functions()
    misuse = []
    for _, kernel, sig, *_ in aot_examples():
        ints = {arg for arg, kind in sig.items() if kind in ("i32", "i64")}
        ints -= _not_specialised(kernel)
        for node in ast.walk(jitted[kernel.fn.__name__]):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in ints and node.attr != "dtype":
                misuse.append((kernel.fn.__name__, f"{node.value.id}.{node.attr}"))
    assert not misuse, sorted(set(misuse))
