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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, final

from typing_extensions import Buffer

from ..backend import StorageBackend
from ..errors import BackendError
from .base import ForwardingBackend

if TYPE_CHECKING:
    import torch

__all__ = ["DegradeLayer"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@final
class DegradeLayer(ForwardingBackend):
    """Answer a miss (``None``/``False``/``0``) when the backend raises a ``BackendError``."""

    def __init__(self, inner: StorageBackend, *, log_interval_s: float = 10.0) -> None:
        super().__init__(inner)
        self._log_interval_s = log_interval_s
        self._lock = threading.Lock()
        self._errors: dict[str, Counter[str]] = {}
        self._last_logged: dict[tuple[str, str], float] = {}
        self._suppressed: Counter[tuple[str, str]] = Counter()
        self._last_error = ""

    def _absorb(self, op: str, call: Callable[[], T], fallback: T) -> T:
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

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Forward :meth:`StorageBackend.get`; a backend failure is a miss."""
        return self._absorb("get", lambda: self.inner.get(key, out), None)

    def exists(self, key: str) -> bool:
        """Forward :meth:`StorageBackend.exists`; a backend failure is ``False``."""
        return self._absorb("exists", lambda: self.inner.exists(key), False)

    def set(self, key: str, value: Buffer) -> bool:
        """Forward :meth:`StorageBackend.set`; a backend failure is ``False``."""
        return self._absorb("set", lambda: self.inner.set(key, value), False)

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_get`; a backend failure misses every key."""
        return self._absorb(
            "batch_get", lambda: self.inner.batch_get(keys, outs), [False] * len(keys)
        )

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_set`; a backend failure fails every key."""
        return self._absorb(
            "batch_set", lambda: self.inner.batch_set(keys, values), [False] * len(keys)
        )

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Forward :meth:`StorageBackend.batch_exists`; a backend failure is a prefix of 0."""
        return self._absorb("batch_exists", lambda: self.inner.batch_exists(keys), 0)

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_get_v1`; a backend failure misses every key."""
        return self._absorb(
            "batch_get_v1",
            lambda: self.inner.batch_get_v1(keys, host_indices),
            [False] * len(keys),
        )

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_set_v1`; a backend failure fails every key."""
        return self._absorb(
            "batch_set_v1",
            lambda: self.inner.batch_set_v1(keys, host_indices),
            [False] * len(keys),
        )

    def delete(self, key: str) -> bool:
        """Forward :meth:`StorageBackend.delete`; a backend failure is ``False``."""
        return self._absorb("delete", lambda: self.inner.delete(key), False)

    def clear(self) -> None:
        """Forward :meth:`StorageBackend.clear`; a backend failure is counted and logged."""
        self._absorb("clear", self.inner.clear, None)

    def close(self) -> None:
        """Close the inner backend; a backend failure while closing is counted and logged."""
        self._absorb("close", self.inner.close, None)

    def stats(self) -> dict[str, Any]:
        """Return the inner stats plus a ``degraded`` section of absorbed errors."""
        with self._lock:
            section = {
                "errors": {op: dict(kinds) for op, kinds in sorted(self._errors.items())},
                "total": sum(sum(kinds.values()) for kinds in self._errors.values()),
                "last_error": self._last_error,
            }
        return {**self.inner.stats(), "degraded": section}
