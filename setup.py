"""Build script for fusedpar.

Metadata lives in pyproject.toml; this file only decides whether to build the CUDA
extension ``fusedpar._C`` (csrc/ops.cpp + csrc/kernels/*.cu) and records the decision in
``fusedpar/_build_info.py`` (read by ``fusedpar._extension``).

The extension is built when torch is importable (install with ``--no-build-isolation``),
torch is a CUDA build, nvcc is found and ``FUSEDPAR_SKIP_CUDA_BUILD`` is not ``1``.
Otherwise a one-line reason is printed and fusedpar installs as pure Python.

Environment:
  FUSEDPAR_SKIP_CUDA_BUILD=1   pure-Python install (no extension)
  TORCH_CUDA_ARCH_LIST         e.g. "8.0;9.0a" or "9.0a+PTX" (default: 8.0 and 9.0a)
  CUDA_HOME                    toolkit root; derived from the nvcc on PATH when unset
                               (nvcc may be a wrapper script, so ask nvcc for its root)
  MAX_JOBS                     parallel compile jobs (default: the CPU count)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO = os.path.join(ROOT, "fusedpar", "_build_info.py")
DEFAULT_ARCHS = ["8.0", "9.0a"]


def log(msg: str) -> None:
    print(f"fusedpar setup: {msg}", file=sys.stderr, flush=True)


def find_packages_checked() -> list[str]:
    pkgs = find_packages(where=ROOT, include=["fusedpar", "fusedpar.*"])
    # A folder of .py files without __init__.py is silently left out of a wheel.
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "fusedpar")):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        if any(f.endswith(".py") for f in filenames) and "__init__.py" not in filenames:
            log(f"warning: {os.path.relpath(dirpath, ROOT)} has no __init__.py; it is not packaged")
    return pkgs


# --------------------------------------------------------------------------------------
# CUDA toolkit discovery


def _nvcc_root(nvcc: str) -> str | None:
    """The toolkit root nvcc itself uses (its ``#$ TOP=`` line), symlinks resolved."""
    try:
        res = subprocess.run(
            [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (res.stdout + res.stderr).splitlines():
        m = re.match(r"^#\$ TOP=(.*)$", line.strip())
        if m and m.group(1).strip():
            return os.path.realpath(m.group(1).strip())
    return None


def find_cuda_home() -> tuple[str | None, str]:
    """Returns (cuda_home, reason-if-None)."""
    env_home = os.environ.get("CUDA_HOME", "").strip()
    if env_home:
        if os.path.isfile(os.path.join(env_home, "bin", "nvcc")):
            return os.path.realpath(env_home), ""
        log(f"CUDA_HOME={env_home!r} has no bin/nvcc; ignoring it and looking for nvcc on PATH")
    nvcc = shutil.which("nvcc")
    if nvcc is None and os.path.isfile("/usr/local/cuda/bin/nvcc"):
        nvcc = "/usr/local/cuda/bin/nvcc"
    if nvcc is None:
        return None, "nvcc not found (not on PATH, no CUDA_HOME, no /usr/local/cuda)"
    root = _nvcc_root(nvcc)
    if root is None:  # not a wrapper, or an nvcc without --dryrun TOP: use its location
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if not os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
        return None, f"nvcc at {nvcc} resolves to {root}, which has no include/cuda_runtime.h"
    return root, ""


def _nvcc_supported(cuda_home: str) -> set[str] | None:
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-code"],
            capture_output=True, text=True, timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    codes = set(re.findall(r"sm_(\d+)", out))
    return codes or None


def _nvcc_version(cuda_home: str) -> str | None:
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--version"],
            capture_output=True, text=True, timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


# --------------------------------------------------------------------------------------
# Architectures

_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


def arch_flags(cuda_home: str) -> tuple[list[str], list[str]]:
    """(nvcc -gencode flags, arch names like 'sm_90a'/'compute_90a')."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    entries = [e for e in re.split(r"[;\s,]+", env) if e] if env else list(DEFAULT_ARCHS)
    if env and not all(_ARCH_RE.match(e) for e in entries):
        # Named arches ("Hopper", "native", ...): let torch expand them.
        from torch.utils.cpp_extension import _get_cuda_arch_flags

        flags = _get_cuda_arch_flags()
        names = []
        for f in flags:
            m = re.search(r"code=((?:sm|compute)_\w+)", f)
            if m:
                names.append(m.group(1))
        return flags, names
    if not env:
        supported = _nvcc_supported(cuda_home)
        if supported is not None:
            kept = [e for e in entries if "".join(_ARCH_RE.match(e).group(1, 2)) in supported]
            for e in entries:
                if e not in kept:
                    log(f"nvcc does not support sm_{e.replace('.', '')}; leaving it out")
            entries = kept
    flags, names = [], []
    for e in entries:
        major, minor, suffix, ptx = _ARCH_RE.match(e).groups()
        num = f"{major}{minor}{suffix}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        names.append(f"sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
            names.append(f"compute_{num}")
    return flags, names


# --------------------------------------------------------------------------------------
# Decide


def decide() -> tuple[bool, str, bool, str | None]:
    """(build_cuda, reason, skipped_on_purpose, cuda_home)."""
    if os.environ.get("FUSEDPAR_SKIP_CUDA_BUILD", "") == "1":
        return False, "FUSEDPAR_SKIP_CUDA_BUILD=1", True, None
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any failure means no torch for the build
        why = f"torch is not importable at build time ({type(e).__name__}: {e}; pip build isolation?)"
        return False, why, False, None
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is not a CUDA build", True, None
    cuda_home, why = find_cuda_home()
    if cuda_home is None:
        return False, why, False, None
    nvcc_version = _nvcc_version(cuda_home)
    if nvcc_version is not None and nvcc_version.split(".")[0] != torch.version.cuda.split(".")[0]:
        # torch's BuildExtension refuses a major-version mismatch; say so up front.
        return (
            False,
            f"nvcc in {cuda_home} is CUDA {nvcc_version} but torch {torch.__version__} was "
            f"built with CUDA {torch.version.cuda} (major versions must match)",
            False,
            None,
        )
    return True, "", False, cuda_home


def write_build_info(built: bool, reason: str, on_purpose: bool, archs: list[str]) -> None:
    text = (
        "# Generated by setup.py at build time; do not edit (git-ignored).\n"
        f"BUILT_WITH_CUDA = {built!r}\n"
        f"REASON = {reason!r}\n"
        f"SKIPPED_ON_PURPOSE = {on_purpose!r}\n"
        f"ARCHS = {archs!r}\n"
    )
    try:
        with open(BUILD_INFO) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(BUILD_INFO, "w") as f:
        f.write(text)


def cuda_extension(cuda_home: str):
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported: set it first.
    os.environ["CUDA_HOME"] = cuda_home
    import torch.utils.cpp_extension as cpp_ext

    if cpp_ext.CUDA_HOME != cuda_home:  # imported earlier by someone else
        cpp_ext.CUDA_HOME = cuda_home

    if shutil.which("ninja") is None:
        try:
            import ninja  # the PyPI package ships the binary

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            log("ninja not found; compiling without it (slower)")
    if "MAX_JOBS" not in os.environ:
        try:
            os.environ["MAX_JOBS"] = str(len(os.sched_getaffinity(0)))
        except AttributeError:
            os.environ["MAX_JOBS"] = str(os.cpu_count() or 1)

    gencode, archs = arch_flags(cuda_home)
    if not gencode:
        raise RuntimeError("fusedpar setup: no CUDA architecture left to build for")
    kernels = sorted(
        os.path.join("csrc", "kernels", f)
        for f in os.listdir(os.path.join(ROOT, "csrc", "kernels"))
        if f.endswith(".cu")
    )
    ext = cpp_ext.CUDAExtension(
        name="fusedpar._C",
        sources=[os.path.join("csrc", "ops.cpp")] + kernels,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={
            # ops.cpp includes torch headers: keep torch's own -std (c++17 or c++20).
            "cxx": ["-O3"],
            # The .cu files are torch-free. An explicit -gencode list stops torch from
            # adding its own arch flags (it adds none when any nvcc flag names an arch).
            "nvcc": ["-O3", "-std=c++17", "-lineinfo"] + gencode,
        },
    )
    build_ext = cpp_ext.BuildExtension.with_options(use_ninja=True)
    return ext, build_ext, archs


def main() -> None:
    build, reason, on_purpose, cuda_home = decide()
    ext_modules, cmdclass, archs = [], {}, []
    if build:
        ext, build_ext, archs = cuda_extension(cuda_home)
        ext_modules, cmdclass = [ext], {"build_ext": build_ext}
        log(f"building CUDA extension fusedpar._C for {', '.join(archs)} "
            f"(CUDA_HOME={cuda_home}, MAX_JOBS={os.environ['MAX_JOBS']})")
    else:
        log(f"not building the CUDA extension: {reason}; installing pure Python")
    write_build_info(build, reason, on_purpose, archs)
    setup(
        packages=find_packages_checked(),
        # the default tuning table; the planner's measured facts (benchmarks/report.py)
        package_data={"fusedpar.ops": ["tuning_defaults.json"], "fusedpar.plan": ["measured.json"]},
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )


main()
