"""The tier engine's own errors, each also a :class:`~hicache_storage.errors.HiCacheError`.

::

    HiCacheError
    ├── InvalidRequestError      (ValueError)  refused before admission: nothing was taken
    │   └── RequestTypeError     (TypeError)   a prompt or bound of the wrong type
    ├── RequestFailedError       (RuntimeError) failed while served; what it held was returned
    └── PoolMismatchError        (ConfigError, HostPoolError) pools that disagree, at start-up
"""

from __future__ import annotations

from hicache_storage.errors import ConfigError, HiCacheError, HostPoolError

__all__ = ["InvalidRequestError", "PoolMismatchError", "RequestFailedError", "RequestTypeError"]


class InvalidRequestError(HiCacheError, ValueError):
    """A request the engine can never serve (bad token ids, bounds, reuse); refused at submit."""


class RequestTypeError(InvalidRequestError, TypeError):
    """A request whose prompt or ``max_new_tokens`` is not of an accepted type."""


class RequestFailedError(HiCacheError, RuntimeError):
    """A request failed while being served; its locks, pins and slots were given back.

    The underlying exception is the ``__cause__``; the engine goes on serving other requests.
    """


class PoolMismatchError(ConfigError, HostPoolError):
    """A host or device pool whose KV geometry, dtype or page size differs from the other side."""
