"""Build checks: the CUDA extension (when CI expects it), the layout constants shared by
csrc/ and fusedpar/comm/layout.py, and the loud-once fallback of fusedpar._extension."""

from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CU = ROOT / "csrc" / "kernels" / "symm_collectives.cu"
HDR = ROOT / "csrc" / "kernels" / "symm_collectives.h"
LAYOUT = ROOT / "fusedpar" / "comm" / "layout.py"

CUDA_OPS = (
    "_cuda_wait_flags",
    "_cuda_signal_peers",
    "_cuda_all_gather_pull",
    "_cuda_reduce_scatter_pull",
)

EXPECTED_SCHEMAS = {
    "_cuda_wait_flags": "(Tensor pad_table, int word_base, int rank, int world_size, "
    "int epoch, int timeout_ns, int code) -> ()",
    "_cuda_signal_peers": "(Tensor pad_table, int word_base, int rank, int world_size, "
    "int epoch, int meta) -> ()",
    "_cuda_all_gather_pull": "(Tensor(a!) out, Tensor x, Tensor pad_table, int rank, "
    "int world_size, int epoch, int meta, int outer, int inner, int timeout_ns, "
    "Tensor(b!) stats) -> ()",
    "_cuda_reduce_scatter_pull": "(Tensor(a!) out, Tensor pad_table, int rank, int world_size, "
    "int epoch, int meta, int outer, int inner, int timeout_ns, Tensor(b!) stats, "
    "float divisor=1.) -> ()",
}


# ---------------------------------------------------------------------------------------
# (a) the built extension


def _require_extension():
    if os.environ.get("FUSEDPAR_EXPECT_EXTENSION") != "1":
        pytest.skip("FUSEDPAR_EXPECT_EXTENSION != 1: the CUDA extension is not expected here")


def _cuobjdump() -> str | None:
    try:
        import triton

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def test_extension_imports_and_registers_ops():
    _require_extension()
    import torch

    import fusedpar._C  # noqa: F401 - registers torch.ops.fusedpar._cuda_*
    from fusedpar import _extension

    _extension._reset_for_tests()
    module, reason = _extension.load()
    assert module is not None, reason
    assert reason is None
    for name in CUDA_OPS:
        assert hasattr(torch.ops.fusedpar, name), f"torch.ops.fusedpar.{name} missing"
        schema = str(getattr(torch.ops.fusedpar, name).default._schema)
        assert schema == f"fusedpar::{name}{EXPECTED_SCHEMAS[name]}"


def test_extension_contains_cubins_for_expected_archs():
    _require_extension()
    import torch  # noqa: F401 - libtorch first

    import fusedpar._C as ext
    from fusedpar import _extension

    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (neither in the triton wheel nor on PATH)")
    out = subprocess.run(
        [tool, "--list-elf", ext.__file__], capture_output=True, text=True, check=True
    ).stdout
    # older cuobjdumps (the GPU image's) list the sm_90a cubin as sm_90: accept both spellings
    listed = {re.sub(r"^sm_90$", "sm_90a", a) for a in re.findall(r"\.(sm_\w+?)\.cubin", out)}

    info = _extension.build_info()
    assert info is not None and info["BUILT_WITH_CUDA"], info
    expected = {a for a in info["ARCHS"] if a.startswith("sm_")}
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        assert {"sm_80", "sm_90a"} <= expected, info["ARCHS"]
    assert expected <= listed, f"cuobjdump --list-elf shows {sorted(listed)}:\n{out}"


# ---------------------------------------------------------------------------------------
# (b) layout constants: csrc/kernels/symm_collectives.{h,cu} == fusedpar/comm/layout.py


def _python_layout() -> dict[str, int]:
    """Evaluate layout.py's top-level integer constants without importing fusedpar."""
    env: dict[str, int] = {}
    for node in ast.parse(LAYOUT.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.isupper()
        ):
            value = eval(compile(ast.Expression(node.value), str(LAYOUT), "eval"), {}, dict(env))
            if isinstance(value, int):
                env[node.targets[0].id] = value
    return env


def _c_layout() -> dict[str, int]:
    text = HDR.read_text() + "\n" + CU.read_text()
    consts: dict[str, int] = {}
    pattern = re.compile(
        r"constexpr\s+(?:int|int32_t|uint32_t|unsigned|long|int64_t)\s+(\w+)\s*=\s*(\d+)\s*;"
        r"|#define\s+(?:FUSEDPAR_)?(\w+)\s+\(?(\d+)\)?\s*$",
        re.M,
    )
    for m in pattern.finditer(text):
        name, value = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        assert consts.get(name, int(value)) == int(value), f"{name} defined twice differently"
        consts[name] = int(value)
    return consts


def test_layout_constants_match_python():
    py = _python_layout()
    c = _c_layout()
    for required in ("MAX_WORLD", "READY", "DONE", "META", "STATUS", "PAD_WORDS", "PAD_BYTES"):
        assert required in py, f"layout.py lost {required}"
    missing = sorted(set(py) - set(c))
    assert not missing, f"constants of layout.py missing from {HDR.name}/{CU.name}: {missing}"
    diff = {k: (py[k], c[k]) for k in py if py[k] != c[k]}
    assert not diff, f"(layout.py, csrc) values differ: {diff}"


# ---------------------------------------------------------------------------------------
# (c) fusedpar._extension: loud once, quiet when skipped on purpose


@pytest.fixture
def ext_module():
    from fusedpar import _extension

    _extension._reset_for_tests()
    yield _extension
    _extension._reset_for_tests()


def _fake_info(built: bool, on_purpose: bool = False, reason: str = ""):
    return lambda: {
        "BUILT_WITH_CUDA": built,
        "REASON": reason,
        "SKIPPED_ON_PURPOSE": on_purpose,
        "ARCHS": ["sm_80", "sm_90a"] if built else [],
    }


def _failing_import(monkeypatch):
    real = importlib.import_module

    def fake(name, package=None):
        if name == "fusedpar._C":
            raise ImportError("libfake.so: cannot open shared object file")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake)


def test_load_failure_returns_reason_and_warns_once(ext_module, monkeypatch):
    monkeypatch.setattr(ext_module, "build_info", _fake_info(built=True))
    _failing_import(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ext_module.load()
        second = ext_module.load()
    assert first == second
    module, reason = first
    assert module is None
    assert isinstance(reason, str) and "libfake.so" in reason
    ours = [w for w in caught if "fusedpar._C not available" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert issubclass(ours[0].category, RuntimeWarning)
    msg = str(ours[0].message)
    assert msg.startswith("fusedpar: CUDA extension fusedpar._C not available (")
    assert "the 'cuda' backends are disabled" in msg
    assert "pip install --no-build-isolation -e ." in msg


def test_load_failure_without_build_info_says_not_built(ext_module, monkeypatch):
    monkeypatch.setattr(ext_module, "build_info", lambda: None)
    _failing_import(monkeypatch)
    with pytest.warns(RuntimeWarning, match="package not built/installed"):
        module, reason = ext_module.load()
    assert module is None and "package not built/installed" in reason


def test_deliberately_skipped_build_is_quiet(ext_module, monkeypatch):
    monkeypatch.setattr(
        ext_module,
        "build_info",
        _fake_info(built=False, on_purpose=True, reason="FUSEDPAR_SKIP_CUDA_BUILD=1"),
    )
    _failing_import(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module, reason = ext_module.load()
    assert module is None and "FUSEDPAR_SKIP_CUDA_BUILD=1" in reason


def test_accidentally_pure_build_warns(ext_module, monkeypatch):
    monkeypatch.setattr(
        ext_module, "build_info", _fake_info(built=False, on_purpose=False, reason="nvcc not found")
    )
    with pytest.warns(RuntimeWarning, match="nvcc not found"):
        module, reason = ext_module.load()
    assert module is None and "nvcc not found" in reason


def test_cuda_ops_unavailable_reason_without_gpu(ext_module, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ext_module.cuda_ops_unavailable_reason() == "no CUDA device"
