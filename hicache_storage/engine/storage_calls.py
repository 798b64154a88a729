"""One backend as the storage threads call it, and what a bounded close needs of those calls.

The query, read and write threads of :class:`StorageIO
<hicache_storage.engine.storage_io.StorageIO>` share one :class:`StorageCalls`: it checks that
the backend still addresses the caller's host pool, maps host slots to the registered pool's
indices, counts the calls in flight, and holds the one lock under which a thread applies a
call's result. A close that runs out of time sets the abandoned flag under that lock
(:meth:`StorageCalls.abandoning`), so a thread whose call returns afterwards sees it and acts on
nothing. A call that raised something other than a
:class:`~hicache_storage.errors.BackendError` is a bug, kept for the scheduler's next
:meth:`StorageCalls.check`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import torch

from hicache_storage.backend import HostPool, StorageBackend
from hicache_storage.engine.errors import StorageBugError
from hicache_storage.errors import BackendError, HostPoolError

__all__ = ["StorageCalls"]

logger = logging.getLogger(__name__)


class StorageCalls:
    """The backend, the pool check, the calls in flight and the result lock of the threads.

    Parameters
    ----------
    backend
        The storage backend, with the default layers.
    pool
        The host pool the caller registered with ``backend``; None skips :meth:`check_pool`.
    object_indices
        Maps host slots of pages to the registered pool's indices of their objects (a key
        scheme of several objects per page); None when the host pool itself is registered.
    """

    def __init__(
        self,
        backend: StorageBackend,
        *,
        pool: HostPool | None = None,
        object_indices: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.backend = backend
        self._pool = pool
        self._objects = object_indices
        self._acting = threading.Lock()
        self.abandoned = False
        """Set once a close gave up waiting: no thread acts on a result from then on."""
        self._in_calls = 0
        self._in_calls_lock = threading.Lock()
        self._bugs: collections.deque[tuple[str, BaseException]] = collections.deque()

    def check_pool(self) -> None:
        """Raise :class:`HostPoolError` if the backend's registered pool is not the caller's.

        A backend addresses one registered pool; if another user of the same backend object
        registered its own, every page would move through that pool instead.
        """
        if self._pool is not None and self.backend.host_pool is not self._pool:
            raise HostPoolError(
                "the backend's registered host pool is no longer this cache's: another user of "
                "the same backend object registered its own (give each cache a backend of its own)"
            )

    def indices(self, host: torch.Tensor) -> torch.Tensor:
        """Return the registered pool's indices for host slots ``host``."""
        return host if self._objects is None else self._objects(host)

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Count a backend call as running while the block runs."""
        with self._in_calls_lock:
            self._in_calls += 1
        try:
            yield
        finally:
            with self._in_calls_lock:
                self._in_calls -= 1

    @contextlib.contextmanager
    def live(self) -> Iterator[bool]:
        """Hold the result lock; yield whether results may still be applied (not abandoned)."""
        with self._acting:
            yield not self.abandoned

    @contextlib.contextmanager
    def abandoning(self) -> Iterator[int]:
        """Hold the result lock, set the abandoned flag; yield the calls still running."""
        with self._acting:
            self.abandoned = True
            with self._in_calls_lock:
                running = self._in_calls
            yield running

    def failed(self, what: str, exc: BaseException) -> None:
        """Log a storage call that failed; keep it for :meth:`check` unless the store failed.

        Whatever a call raises is caught where it is made, ``BaseException`` too (a client's
        ``CancelledError``, say): a storage thread that died of it would leave its fetch or
        backup unreported, and their host slots held for good.
        """
        if isinstance(exc, BackendError):
            logger.warning("%s failed: %s", what, exc)
            return
        logger.error("%s failed", what, exc_info=exc)
        self._bugs.append((what, exc))

    def check(self) -> None:
        """Raise the first bug a storage thread met since the last check, if any.

        A storage call that raises a :class:`~hicache_storage.errors.BackendError` is the
        store's failure: a miss (or a backup not stored), logged, and nothing more. Anything
        else is a bug (in the backend, a layer or the engine's own copy) and is kept for this
        call, which the engine's poll makes, so it is seen instead of served around.

        Raises
        ------
        StorageBugError
            With the bug as its ``__cause__``.
        """
        if not self._bugs:
            return
        what, bug = self._bugs.popleft()
        raise StorageBugError(
            f"{what} raised {type(bug).__name__}: {bug} (not a BackendError: a bug in the "
            "backend, a layer or the engine, not a failure of the store)"
        ) from bug
