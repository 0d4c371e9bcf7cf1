"""fusedpar's environment settings, read once and kept: an op call reads no environment
variable (each ``os.environ`` lookup is several Python calls, on every layer of every step).

Set them before the first op call; ``refresh()`` reads them again (tests that change them
call it, as ``fusedpar.testing``'s ``env`` does).

- ``FUSEDPAR_BACKEND``: the backend every op that has it runs (``ops.backend``).
- ``FUSEDPAR_TIMEOUT``: seconds every wait on a peer may take (default 60).
- ``FUSEDPAR_SYNC_ERRORS=1``: a CUDA call waits for its kernels and raises its own failure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    backend: str
    timeout_s: float
    sync_errors: bool
    version: int  # changes at every refresh(): caches keyed on it see the new values

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)


_current: Settings | None = None


def refresh() -> Settings:
    """Read the environment again (after changing a ``FUSEDPAR_*`` variable)."""
    global _current
    _current = Settings(
        backend=os.environ.get("FUSEDPAR_BACKEND", ""),
        timeout_s=float(os.environ.get("FUSEDPAR_TIMEOUT", "60")),
        sync_errors=os.environ.get("FUSEDPAR_SYNC_ERRORS", "0") not in ("", "0"),
        version=(_current.version + 1) if _current is not None else 0,
    )
    return _current


def get() -> Settings:
    """The settings read at the first call (or the last ``refresh()``)."""
    return _current if _current is not None else refresh()
