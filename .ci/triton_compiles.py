"""pytest plugin (``-p triton_compiles``, with .ci on PYTHONPATH) for ``.ci/gpu all``: one JSON
line per Triton compile of this process (kernel name, microseconds, whether Triton's cache
served it) appended to ``$FUSEDPAR_TRITON_COMPILE_LOG``, through Triton's compilation
listener (``triton.knobs.compilation.listener``, triton 3.6 and 3.8). Spawned ranks are not
counted. Measures how much of a lease the JIT takes, and whether a cache seeded from the
ahead-of-time compiles serves it (cache hits)."""

import json
import os


def record(path: str):
    """The listener: appends ``{"name", "us", "cache_hit"}`` per compile to ``path``."""
    def listener(*, src, metadata, metadata_group, times, cache_hit):
        with open(path, "a") as f:
            f.write(json.dumps({"name": metadata.get("name", getattr(src, "name", "?")),
                                "us": times.total, "cache_hit": bool(cache_hit)}) + "\n")
    return listener


def pytest_configure(config):
    path = os.environ.get("FUSEDPAR_TRITON_COMPILE_LOG")
    if not path:
        return
    try:
        from triton import knobs
    except ImportError:  # an older triton: nothing recorded, the summary says so
        return
    knobs.compilation.listener = record(path)
