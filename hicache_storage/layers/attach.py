"""Start without a store that cannot be reached, and attach it once it answers.

A serving engine that refuses to start while its cache store is unreachable turns a storage
outage into a serving outage. :func:`~hicache_storage.create_backend` with ``strict_start=False``
(what :func:`~hicache_storage.open_backend` does unless the config says ``strict_start: true``)
returns an :class:`AttachingBackend` when building the backend fails with
:class:`~hicache_storage.errors.BackendUnavailableError` or
:class:`~hicache_storage.errors.BackendTimeoutError`. Until the store answers, every call is a
miss (reads) or ``False`` (writes) at once, counted in ``stats()["attach"]``; a daemon thread
builds the backend again with backoff and, once that succeeds, registers the host pool the
caller registered meanwhile and swaps the real stack in. Caller mistakes still raise while
detached: the stand-in sits under a validation layer of its own.

A bad configuration is not an outage: every other error of the first build (``ConfigError``,
``MissingDependencyError``, a medium error) raises at once, and one met by a later attempt ends
the attempts, logged as an error, the backend left detached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, final

from typing_extensions import Buffer

from ..backend import HostPool, StorageBackend
from ..capabilities import Capabilities
from ..config import HealthConfig
from ..errors import PoolNotRegisteredError
from .base import ForwardingBackend
from .health import not_answering
from .validation import ValidationLayer

if TYPE_CHECKING:
    import torch

__all__ = ["AttachingBackend"]

logger = logging.getLogger(__name__)


@final
class _Detached(StorageBackend):
    """The stand-in for a store not attached yet: every call answered at once, counted."""

    def __init__(self, name: str, capabilities: Capabilities) -> None:
        super().__init__()
        self.name = name
        self.capabilities = capabilities
        self._lock = threading.Lock()
        self.shed: Counter[str] = Counter()

    def _shed(self, op: str) -> None:
        with self._lock:
            self.shed[op] += 1

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Answer a miss."""
        self._shed("get")
        return None

    def exists(self, key: str) -> bool:
        """Answer ``False``."""
        self._shed("exists")
        return False

    def set(self, key: str, value: Buffer) -> bool:
        """Answer ``False``: nothing is stored."""
        self._shed("set")
        return False

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Answer a miss for every key."""
        self._shed("batch_get")
        return [False] * len(keys)

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Answer ``False`` for every key."""
        self._shed("batch_set")
        return [False] * len(keys)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Answer ``0``."""
        self._shed("batch_exists")
        return 0

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Answer a miss for every key; the pool is left untouched."""
        self._shed("batch_get_v1")
        return [False] * len(keys)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Answer ``False`` for every key."""
        self._shed("batch_set_v1")
        return [False] * len(keys)

    def delete(self, key: str) -> bool:
        """Answer ``False``."""
        self._shed("delete")
        return False

    def clear(self) -> None:
        """Clear nothing: nothing is stored here."""
        self._shed("clear")

    def _close(self) -> None:
        """Let go of the host pool (an engine may unmap its memory once the backend closes)."""
        self._host_pool = None


@final
class AttachingBackend(ForwardingBackend):
    """A backend that starts detached (every call a counted miss) and attaches in the background.

    Parameters
    ----------
    build
        Builds the whole stack (layers included); called until it stops raising an error that
        says the store did not answer.
    name
        The backend's registered name.
    capabilities
        What the registry declares for the backend, stated until it is attached (an instance
        may refine them from its config: they change to the built backend's on attach).
    error
        Why the first build failed; logged and kept in ``stats()``.
    backoff
        Wait before the next attempt (``probe_interval_s``, doubling up to
        ``max_probe_interval_s``).
    """

    def __init__(
        self,
        build: Callable[[], StorageBackend],
        *,
        name: str,
        capabilities: Capabilities,
        error: BaseException,
        backoff: HealthConfig | None = None,
    ) -> None:
        self._detached = _Detached(name, capabilities)
        super().__init__(ValidationLayer(self._detached))
        self._build = build
        self._backoff = backoff or HealthConfig()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._since = time.monotonic()
        self._attached_after_s: float | None = None
        self._attempts = 1
        self._last_error = f"{type(error).__name__}: {error}"
        logger.error(
            "storage %s cannot be reached at start (%s); starting without it: every call is a "
            "miss until it answers, attaching in the background (strict_start: true refuses "
            "to start instead)",
            name,
            self._last_error,
        )
        self._thread = threading.Thread(
            target=self._attach_until_up, name=f"hicache-attach-{name}", daemon=True
        )
        self._thread.start()

    @property
    def attached(self) -> bool:
        """Whether the store has been attached."""
        return self._attached_after_s is not None

    def _attach_until_up(self) -> None:
        """Build the backend with backoff until it answers, then swap it in (the attach thread)."""
        wait = interval = self._backoff.probe_interval_s
        while not self._stop.wait(wait):
            with self._lock:
                self._attempts += 1
            try:
                built = self._build()
            except Exception as exc:  # noqa: BLE001 - logged; only an outage is retried
                with self._lock:
                    self._last_error = f"{type(exc).__name__}: {exc}"
                if not_answering(exc):
                    wait, interval = interval, min(2 * interval, self._backoff.max_probe_interval_s)
                    continue
                logger.error(
                    "storage %s cannot be attached (%s); it stays detached: every call a miss",
                    self.name,
                    self._last_error,
                )
                return
            self._swap_in(built)
            return

    def _swap_in(self, built: StorageBackend) -> None:
        """Register the caller's host pool with ``built`` and make it the backend calls reach.

        The stand-in is left open: a call that read it just before the swap still answers.
        """
        with self._lock:
            try:
                if not self._stop.is_set():
                    try:
                        pool: HostPool | None = self._detached.host_pool
                    except PoolNotRegisteredError:
                        pool = None
                    if pool is not None:
                        built.register_host_pool(pool)
                    self.inner = built
                    self.capabilities = built.capabilities
                    self._attached_after_s = time.monotonic() - self._since
            except Exception as exc:  # noqa: BLE001 - the pool does not suit the store: logged
                self._last_error = f"{type(exc).__name__}: {exc}"
                logger.error(
                    "storage %s answers but cannot take the host pool (%s); it stays "
                    "detached: every call a miss",
                    self.name,
                    self._last_error,
                )
            finally:
                if self.inner is not built:
                    built.close()
            shed = sum(self._detached.shed.values())
        if self._attached_after_s is not None:
            logger.warning(
                "storage %s attached after %.1f s; %d calls were answered as misses before",
                self.name,
                self._attached_after_s,
                shed,
            )

    def register_host_pool(self, pool: HostPool) -> None:
        """Register ``pool`` with the backend, or keep it for the attach while detached."""
        with self._lock:
            self.inner.register_host_pool(pool)

    @property
    def host_pool(self) -> HostPool:
        """The registered host pool."""
        return self.inner.host_pool

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._stop.is_set()

    def stats(self) -> dict[str, Any]:
        """Return the backend's stats plus an ``attach`` section (what was shed while detached)."""
        with self._lock:
            shed = dict(sorted(self._detached.shed.items()))
            section = {
                "attached": self.attached,
                "attempts": self._attempts,
                "shed": shed,
                "shed_total": sum(shed.values()),
                "detached_s": round(
                    self._attached_after_s
                    if self._attached_after_s is not None
                    else time.monotonic() - self._since,
                    3,
                ),
                "last_error": self._last_error,
            }
            inner = self.inner
        return {**inner.stats(), "attach": section}

    def close(self) -> None:
        """Stop attaching and close the backend (once attached) or the stand-in.

        An attempt in flight ends within the backend's own start-up deadline; what it built is
        closed.
        """
        with self._lock:
            self._stop.set()
            inner = self.inner
        try:
            inner.close()
        finally:
            self._detached.close()
            self._thread.join()
