"""The file backend's metadata cache: objects seen lately, so ``exists`` skips a ``stat``.

Opt-in (``metadata_cache``): an entry is trusted for ``metadata_ttl_s`` seconds, so an object
another process removed may be answered as present that long (a read of it is then a miss).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Final

__all__ = ["META_LIMIT", "MetaCache"]

META_LIMIT: Final = 1 << 18
"""Most entries the cache keeps (a few tens of MB); the oldest insertion is dropped beyond it."""


class MetaCache:
    """Sizes of objects seen lately, each trusted for ``ttl_s`` seconds (off unless ``enabled``)."""

    def __init__(self, *, enabled: bool, ttl_s: float, limit: int = META_LIMIT) -> None:
        self.enabled = enabled and ttl_s > 0
        self._ttl_s = ttl_s
        self._limit = limit
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[int, float]] = {}

    def cached(self, key: str) -> bool:
        """Return whether ``key`` was seen within its time to live."""
        return self.enabled and self.leading([key]) == 1

    def leading(self, keys: Sequence[str]) -> int:
        """Return how many of ``keys``, from the first, were seen within their time to live."""
        if not self.enabled:
            return 0
        now = time.monotonic()
        count = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry[1] < now:
                    if entry is not None:
                        del self._entries[key]
                    break
                count += 1
        return count

    def remember(self, key: str, size: int) -> None:
        """Record that ``key`` holds ``size`` bytes, as of now."""
        if not self.enabled:
            return
        expiry = time.monotonic() + self._ttl_s
        with self._lock:
            self._entries[key] = (size, expiry)
            if len(self._entries) > self._limit:
                del self._entries[next(iter(self._entries))]

    def forget(self, key: str) -> None:
        """Drop what is known of ``key`` (removed, or found not to be an object)."""
        if self.enabled:
            with self._lock:
                self._entries.pop(key, None)

    def clear(self) -> None:
        """Drop everything known."""
        with self._lock:
            self._entries.clear()
