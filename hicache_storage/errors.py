"""The error tree of hicache-storage.

Every error derives from :class:`HiCacheError` and from the builtin it refines, so callers may
catch either. Two families matter to a serving engine:

* caller mistakes raise at once, through every layer, and say what to do;
* infrastructure failures (:class:`BackendError`) say whether a retry may help; the default layer
  stack turns them into counted misses.

::

    HiCacheError
    ├── ConfigError                  (ValueError)
    │   ├── UnknownBackendError      (LookupError)
    │   └── PoolMismatchError ¹      (also a HostPoolError)
    ├── MissingDependencyError       (ImportError)
    ├── InvalidKeyError              (ValueError)
    ├── InvalidValueError            (TypeError)
    ├── BufferSizeError              (ValueError)
    ├── BatchMismatchError           (ValueError)
    ├── HostPoolError                (ValueError)
    │   ├── PoolNotRegisteredError
    │   ├── IndexAlignmentError
    │   └── AllocatorError           (RuntimeError)
    ├── BackendClosedError           (RuntimeError)
    ├── UnsupportedOperationError    (NotImplementedError)
    ├── BackendError                 (infrastructure; ``retryable`` says if a retry may help)
    │   ├── BackendUnavailableError  (ConnectionError)
    │   │   └── InjectedFaultError
    │   ├── BackendTimeoutError      (TimeoutError)
    │   ├── BackendIOError           (OSError)
    │   └── IntegrityError           (ValueError)
    ├── InvalidRequestError ¹        (ValueError)  a request refused before admission
    │   └── RequestTypeError ¹       (TypeError)
    ├── RequestFailedError ¹         (RuntimeError) a request failed while served
    └── StorageBugError ¹            (RuntimeError) a storage call raised no BackendError: a bug

¹ The tier engine's, in ``hicache_storage.engine.errors`` (exported by
``hicache_storage.engine``): the core does not import the engine, but a caller catching
:class:`HiCacheError` catches them too. A request's errors are not pool errors: only a pool that
disagrees with the model is a :class:`HostPoolError`.
"""

from __future__ import annotations

__all__ = [
    "AllocatorError",
    "BackendClosedError",
    "BackendError",
    "BackendIOError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "BatchMismatchError",
    "BufferSizeError",
    "ConfigError",
    "HiCacheError",
    "HostPoolError",
    "IndexAlignmentError",
    "InjectedFaultError",
    "IntegrityError",
    "InvalidKeyError",
    "InvalidValueError",
    "MissingDependencyError",
    "PoolNotRegisteredError",
    "UnknownBackendError",
    "UnsupportedOperationError",
]


class HiCacheError(Exception):
    """Root of every error raised by hicache-storage."""

    retryable: bool = False


class ConfigError(HiCacheError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


class UnknownBackendError(ConfigError, LookupError):
    """No backend is registered under the requested name."""


class MissingDependencyError(HiCacheError, ImportError):
    """A backend's client library is not installed; the message names the pip extra."""


class InvalidKeyError(HiCacheError, ValueError):
    """A key is empty, too long, or contains characters outside the safe alphabet."""


class InvalidValueError(HiCacheError, TypeError):
    """A value is not a C-contiguous buffer (or an output buffer is not writable)."""


class BufferSizeError(HiCacheError, ValueError):
    """An output buffer's size differs from the stored object's size."""


class BatchMismatchError(HiCacheError, ValueError):
    """A batch call got a different number of keys and values (or output buffers)."""


class HostPoolError(HiCacheError, ValueError):
    """A host-pool request is inconsistent with the pool."""


class PoolNotRegisteredError(HostPoolError):
    """A zero-copy call was made before ``register_host_pool``."""


class IndexAlignmentError(HostPoolError):
    """Host indices do not describe whole, in-range, page-aligned pages, one page per key."""


class AllocatorError(HostPoolError, RuntimeError):
    """The host pool allocator saw a double allocation or a double free."""


class BackendClosedError(HiCacheError, RuntimeError):
    """The backend was used after ``close()``."""


class UnsupportedOperationError(HiCacheError, NotImplementedError):
    """The backend does not implement this operation (see its capabilities)."""


class BackendError(HiCacheError):
    """An infrastructure failure: the store could not answer, which is not the same as a miss."""


class BackendUnavailableError(BackendError, ConnectionError):
    """The store cannot be reached or refused the connection."""

    retryable = True


class InjectedFaultError(BackendUnavailableError):
    """A failure injected on purpose by :class:`~hicache_storage.layers.FaultInjectionLayer`."""


class BackendTimeoutError(BackendError, TimeoutError):
    """The store did not answer within the configured timeout."""

    retryable = True


class BackendIOError(BackendError, OSError):
    """The store's medium failed (disk full, I/O error, permission denied)."""


class IntegrityError(BackendError, ValueError):
    """A stored object failed an integrity check; it is treated as a miss, never as data."""
