"""Turn infrastructure failures into counted misses: a cache never fails a request.

Only :class:`~hicache_storage.errors.BackendError` is absorbed; caller mistakes still raise. Each
absorbed error is counted by operation and type in ``stats()["degraded"]`` so an outage is never
mistaken for a miss, and logged at most once per ``log_interval_s`` per operation and error type.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, final

from ..backend import StorageBackend
from ..errors import BackendError
from .base import AnsweringLayer

if TYPE_CHECKING:
    pass

__all__ = ["DegradeLayer"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@final
class DegradeLayer(AnsweringLayer):
    """Answer a miss (``None``/``False``/``0``) when the backend raises a ``BackendError``."""

    def __init__(self, inner: StorageBackend, *, log_interval_s: float = 10.0) -> None:
        super().__init__(inner)
        self._log_interval_s = log_interval_s
        self._lock = threading.Lock()
        self._errors: dict[str, Counter[str]] = {}
        self._last_logged: dict[tuple[str, str], float] = {}
        self._suppressed: Counter[tuple[str, str]] = Counter()
        self._last_error = ""

    def _answer(self, op: str, call: Callable[[], T], fallback: T) -> T:
        try:
            return call()
        except BackendError as exc:
            self._note(op, exc)
            return fallback

    def _note(self, op: str, exc: BackendError) -> None:
        kind = type(exc).__name__
        now = time.monotonic()
        with self._lock:
            self._errors.setdefault(op, Counter())[kind] += 1
            self._last_error = f"{op}: {kind}: {exc}"
            last = self._last_logged.get((op, kind))
            if last is not None and now - last < self._log_interval_s:
                self._suppressed[(op, kind)] += 1
                return
            self._last_logged[(op, kind)] = now
            suppressed = self._suppressed.pop((op, kind), 0)
        logger.warning(
            "storage %s %s failed, answering a miss (%d similar suppressed): %s",
            self.name,
            op,
            suppressed,
            exc,
        )

    def close(self) -> None:
        """Close the inner backend; a backend failure while closing is counted and logged."""
        self._answer("close", self.inner.close, None)

    def stats(self) -> dict[str, Any]:
        """Return the inner stats plus a ``degraded`` section of absorbed errors."""
        with self._lock:
            section = {
                "errors": {op: dict(kinds) for op, kinds in sorted(self._errors.items())},
                "total": sum(sum(kinds.values()) for kinds in self._errors.values()),
                "last_error": self._last_error,
            }
        return {**self.inner.stats(), "degraded": section}
