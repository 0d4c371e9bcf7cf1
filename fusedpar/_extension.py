"""Loading of the optional CUDA extension ``fusedpar._C``.

``fusedpar._C`` (built by setup.py from csrc/) registers the ``torch.ops.fusedpar._cuda_*``
ops that the ``cuda`` backends use. Nothing here runs at import time: the extension is
imported on the first :func:`load` call, and the GPU is only queried by
:func:`cuda_ops_unavailable_reason`.

Build-time decisions are recorded by setup.py in ``fusedpar/_build_info.py``
(``BUILT_WITH_CUDA``, ``REASON``, ``SKIPPED_ON_PURPOSE``, ``ARCHS``). When the build skipped
the extension on purpose (``FUSEDPAR_SKIP_CUDA_BUILD=1``, or a CPU-only torch) ``load()``
quietly returns the reason; any other failure is reported once with a ``RuntimeWarning``.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from types import ModuleType

__all__ = ["load", "cuda_ops_unavailable_reason", "build_info"]

_EXT_NAME = "fusedpar._C"
_REBUILD_HINT = "pip install --no-build-isolation -e ."

_lock = threading.Lock()
_result: tuple[ModuleType | None, str | None] | None = None
_warned = False


def build_info() -> dict | None:
    """What setup.py recorded at build time, or None when the file is missing."""
    try:
        mod = importlib.import_module("fusedpar._build_info")
    except ImportError:
        return None
    return {
        "BUILT_WITH_CUDA": bool(getattr(mod, "BUILT_WITH_CUDA", False)),
        "REASON": str(getattr(mod, "REASON", "")),
        "SKIPPED_ON_PURPOSE": bool(getattr(mod, "SKIPPED_ON_PURPOSE", False)),
        "ARCHS": list(getattr(mod, "ARCHS", [])),
    }


def _warn_once(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"fusedpar: CUDA extension {_EXT_NAME} not available ({reason}); the 'cuda' "
        f"backends are disabled. Rebuild with: {_REBUILD_HINT}",
        RuntimeWarning,
        stacklevel=4,  # the caller of load()
    )


def _load_uncached() -> tuple[ModuleType | None, str | None]:
    info = build_info()
    if info is not None and not info["BUILT_WITH_CUDA"]:
        reason = f"fusedpar was installed without its CUDA extension: {info['REASON']}"
        if not info["SKIPPED_ON_PURPOSE"]:
            _warn_once(reason)
        return None, reason
    try:
        import torch  # noqa: F401 - libtorch must be loaded before the extension

        module = importlib.import_module(_EXT_NAME)
    except (ImportError, OSError) as e:
        reason = f"{type(e).__name__}: {e}"
        if info is None:
            reason = f"package not built/installed; {reason}"
        _warn_once(reason)
        return None, reason
    return module, None


def load() -> tuple[ModuleType | None, str | None]:
    """Import ``fusedpar._C`` once. Returns ``(module, None)`` or ``(None, reason)``."""
    global _result
    if _result is None:
        with _lock:
            if _result is None:
                _result = _load_uncached()
    return _result


def cuda_ops_unavailable_reason() -> str | None:
    """Why the ``torch.ops.fusedpar._cuda_*`` ops cannot run here, or None when they can.

    A machine without a CUDA device gets ``"no CUDA device"`` without trying the extension
    (so GPU-less installs do not warn); otherwise the extension's load failure, if any.
    """
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return load()[1]


def _reset_for_tests() -> None:
    global _result, _warned
    with _lock:
        _result = None
        _warned = False
