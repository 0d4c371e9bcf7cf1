"""Exceptions raised by fusedpar. ``comm`` imports nothing of fusedpar's but these."""


class FusedparError(Exception):
    """Base class of every fusedpar error."""


class FusedparTimeoutError(FusedparError, TimeoutError):
    """A bounded wait on a peer's flag ran out: the peer died, stalled or never called the op."""


class ParallelConfigError(FusedparError, ValueError):
    """Parallel degrees that do not fit the world size or each other."""


class BackendNotSupportedError(FusedparError, RuntimeError):
    """No backend of an op accepts these inputs, or a forced backend rejects them."""
