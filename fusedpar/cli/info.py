"""``fusedpar info``: versions, GPU, CUDA extension, Triton mode, which backend of which op
can run here and why not, symmetric-memory backends. ``--json`` for machines."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys

import torch

import fusedpar
from fusedpar import _extension
from fusedpar.kernels.interpreter import interpreting
from fusedpar.ops import registry, tuning


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="versions, GPU, extension, which backends run here and why not")
    p.add_argument("--json", action="store_true", help="print JSON")



def _run_text(cmd: list[str], timeout: float = 60) -> str | None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout + res.stderr


def _nvcc_info() -> dict:
    """nvcc on PATH (it may be a wrapper script) and CUDA_HOME as setup.py derives it."""
    nvcc = shutil.which("nvcc")
    info: dict = {"path": nvcc, "version": None, "cuda_home": None, "cuda_home_source": None}
    env_home = os.environ.get("CUDA_HOME", "").strip()
    if env_home and os.path.isfile(os.path.join(env_home, "bin", "nvcc")):
        info["cuda_home"], info["cuda_home_source"] = os.path.realpath(env_home), "CUDA_HOME"
    if nvcc is None:
        return info
    out = _run_text([nvcc, "--version"]) or ""
    m = re.search(r"release (\d+\.\d+), V([\w.\-]+)", out)
    if m is None:
        m = re.search(r"release (\d+\.\d+)()", out)
    info["version"] = (m.group(2) or m.group(1)) if m else None
    if info["cuda_home"] is None:
        dry = _run_text([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull]) or ""
        for line in dry.splitlines():
            m = re.match(r"^#\$ TOP=(.*)$", line.strip())
            if m and m.group(1).strip():
                info["cuda_home"] = os.path.realpath(m.group(1).strip())
                info["cuda_home_source"] = "nvcc --dryrun (TOP)"
                break
        else:
            info["cuda_home"] = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
            info["cuda_home_source"] = "location of nvcc"
    return info


def _gpu_info() -> dict:
    if not torch.cuda.is_available():  # never touch the GPU past this point without one
        return {"available": False, "count": 0, "devices": []}
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": props.name,
                        "capability": f"{props.major}.{props.minor}",
                        "memory_gib": round(props.total_memory / 2**30, 1)})
    return {"available": True, "count": len(devices), "devices": devices}


def _extension_info() -> dict:
    build = _extension.build_info()
    module, reason = _extension.load()
    return {
        "build_info": build,  # None when fusedpar/_build_info.py is missing
        "built_with_cuda": None if build is None else build["BUILT_WITH_CUDA"],
        "loaded": module is not None,
        "path": getattr(module, "__file__", None),
        "load_error": reason,
        "cuda_ops_usable_here": _extension.cuda_ops_unavailable_reason() is None,
        "cuda_ops_unavailable_reason": _extension.cuda_ops_unavailable_reason(),
    }


def _triton_info() -> dict:
    import triton

    return {"version": triton.__version__,
            "mode": "interpreter" if interpreting() else "compiled",
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}


def _ops_info() -> dict:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    ops = {}
    for spec in registry.specs():
        if spec.example is None:
            ops[spec.name] = {"call": "not evaluated here: it needs a process group",
                              "backends": {name: {"available": None, "reasons": []}
                                           for name in spec.backends}}
            continue
        call = spec.example(device)
        avail = spec.dispatcher.availability(call)
        reduce_op = getattr(call, "reduce_op", "")
        runs, why = tuning.explain(spec.dispatcher, call)
        ops[spec.name] = {
            "call": call.describe() + (f", op={reduce_op!r}" if reduce_op else ""),
            "backends": {name: {"available": not reasons, "reasons": list(reasons)}
                         for name, reasons in avail.items()},
            "runs": {"backend": runs, "why": why},
        }
    return {
        "device": device.type,
        "evaluated_as": "a loopback call (group=None): checks that need a process group "
                        "(shm: every rank on one host) are not evaluated",
        "ops": ops,
    }


def _symmetric_info() -> dict:
    shm_reason = None
    if not os.path.isdir("/dev/shm"):
        shm_reason = "/dev/shm does not exist"
    elif not os.access("/dev/shm", os.W_OK | os.X_OK):
        shm_reason = "/dev/shm is not writable"
    # the reason comes from the same check the ops run before choosing the backend
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_reason = fusedpar.comm.torch_symm_unsupported_reason(device)
    return {
        "shm": {"available": shm_reason is None, "reasons": [shm_reason] if shm_reason else [],
                "what": "CPU processes on one host (/dev/shm files)"},
        "torch": {"available": torch_reason is None,
                  "reasons": [torch_reason] if torch_reason else [],
                  "what": "CUDA torch.distributed._symmetric_memory"},
        "loopback": {"available": True, "reasons": [],
                     "what": "one process holds every rank's buffer (single-device benchmarks)"},
    }


def gather_info() -> dict:
    return {
        "fusedpar": {"version": fusedpar.__version__,
                     "path": os.path.dirname(os.path.abspath(fusedpar.__file__))},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "torch": {"version": torch.__version__, "cuda_runtime": torch.version.cuda},
        "triton": _triton_info(),
        "nvcc": _nvcc_info(),
        "gpu": _gpu_info(),
        "extension": _extension_info(),
        "backends": _ops_info(),
        "symmetric_memory": _symmetric_info(),
    }


def _yes(flag: bool) -> str:
    return "available" if flag else "unavailable"


def format_info(info: dict) -> str:
    lines = []
    add = lines.append
    add(f"fusedpar  {info['fusedpar']['version']}  ({info['fusedpar']['path']})")
    add(f"python    {info['python']['version']}  ({info['python']['executable']})")
    add(f"platform  {info['platform']}")
    t = info["torch"]
    add(f"torch     {t['version']}  (CUDA runtime: {t['cuda_runtime'] or 'none, CPU-only build'})")
    tr = info["triton"]
    add(f"triton    {tr['version']}  (mode: {tr['mode']}; TRITON_INTERPRET="
        f"{tr['TRITON_INTERPRET'] if tr['TRITON_INTERPRET'] is not None else 'unset'})")
    n = info["nvcc"]
    if n["path"]:
        add(f"nvcc      {n['path']}  (version {n['version'] or 'unknown'}; CUDA_HOME "
            f"{n['cuda_home']} from {n['cuda_home_source']})")
    else:
        add("nvcc      not on PATH" + (f" (CUDA_HOME {n['cuda_home']})" if n["cuda_home"] else ""))
    g = info["gpu"]
    if g["available"]:
        for d in g["devices"]:
            add(f"GPU {d['index']}     {d['name']}  (capability {d['capability']}, "
                f"{d['memory_gib']} GiB)")
    else:
        add("GPU       none (torch.cuda.is_available() is False)")
    e = info["extension"]
    b = e["build_info"]
    if b is None:
        built = "no build record (fusedpar/_build_info.py missing: not built by setup.py)"
    elif b["BUILT_WITH_CUDA"]:
        built = f"built with CUDA for {', '.join(b['ARCHS']) or '?'}"
    else:
        built = f"built without CUDA ({b['REASON']})"
    add(f"extension fusedpar._C: {built}")
    loaded = f"yes, {e['path']}" if e["loaded"] else f"no ({e['load_error']})"
    add(f"          loaded: {loaded}")
    add("          CUDA ops usable here: " + ("yes" if e["cuda_ops_usable_here"]
                                              else f"no ({e['cuda_ops_unavailable_reason']})"))
    be = info["backends"]
    add("")
    add(f"backends, for a float32 call on {be['device']} (evaluated as {be['evaluated_as']}; "
        "runs: the auto choice, what the op runs without backend=, as the benchmarks' auto rows):")
    for op, entry in be["ops"].items():
        add(f"  {op}: {entry['call']}")
        if "runs" in entry:
            add(f"    runs: {entry['runs']['backend']} (auto: {entry['runs']['why']})")
        for name, st in entry["backends"].items():
            add(f"    {name:<12} {'-' if st['available'] is None else _yes(st['available'])}"
                + (": " + "; ".join(st["reasons"]) if st["reasons"] else ""))
    if be["device"] == "cpu" and info["triton"]["mode"] == "compiled":
        add("  (`fusedpar check` runs its CPU ranks with TRITON_INTERPRET=1: triton runs there)")
    add("")
    add("symmetric memory:")
    for name, st in info["symmetric_memory"].items():
        add(f"  {name:<10} {_yes(st['available'])}"
            + (": " + "; ".join(st["reasons"]) if st["reasons"] else f"  ({st['what']})"))
    return "\n".join(lines)


def run(args) -> int:
    info = gather_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    return 0

