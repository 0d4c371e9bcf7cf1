"""Process groups, symmetric memory, signals and byte counters."""

from . import layout
from .counters import ByteCounter, count_bytes
from .groups import group_name, resolve_group
from .symmetric import (
    SymmetricBuffer,
    get_buffer,
    get_loopback_buffers,
    release_buffers,
    shm_unsupported_reason,
    timeout_seconds,
    torch_symm_unsupported_reason,
)

__all__ = [
    "ByteCounter",
    "SymmetricBuffer",
    "count_bytes",
    "get_buffer",
    "get_loopback_buffers",
    "group_name",
    "layout",
    "release_buffers",
    "resolve_group",
    "shm_unsupported_reason",
    "timeout_seconds",
    "torch_symm_unsupported_reason",
]
