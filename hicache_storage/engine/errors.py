"""The tier engine's own errors, each also a :class:`~hicache_storage.errors.HiCacheError`.

::

    HiCacheError
    ├── InvalidRequestError      (ValueError)  refused before admission: nothing was taken
    │   └── RequestTypeError     (TypeError)   a prompt or bound of the wrong type
    ├── RequestFailedError       (RuntimeError) failed while served; what it held was returned
    ├── StorageBugError          (RuntimeError) a storage call raised something not a BackendError
    └── PoolMismatchError        (ConfigError, HostPoolError) pools that disagree, at start-up
"""

from __future__ import annotations

from hicache_storage.errors import ConfigError, HiCacheError, HostPoolError

__all__ = [
    "InvalidRequestError",
    "PoolMismatchError",
    "RequestFailedError",
    "RequestTypeError",
    "StorageBugError",
]


class InvalidRequestError(HiCacheError, ValueError):
    """A request the engine can never serve (bad token ids, bounds, reuse); refused at submit."""


class RequestTypeError(InvalidRequestError, TypeError):
    """A request whose prompt or ``max_new_tokens`` is not of an accepted type."""


class RequestFailedError(HiCacheError, RuntimeError):
    """A request failed while being served; its locks, pins and slots were given back.

    The underlying exception is the ``__cause__``; the engine goes on serving other requests.
    """


class StorageBugError(HiCacheError, RuntimeError):
    """A storage call raised something other than a ``BackendError``: a bug, not the store.

    Raised by the engine's poll (:meth:`TierCache.poll <hicache_storage.engine.TierCache.poll>`)
    after the storage thread counted the call as a miss; the bug is the ``__cause__``.
    """


class PoolMismatchError(ConfigError, HostPoolError):
    """A host or device pool whose KV geometry, dtype or page size differs from the other side."""
