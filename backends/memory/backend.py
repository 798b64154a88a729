"""The ``memory`` backend: a locked dictionary of immutable byte strings.

It is deliberately plain: every other backend is checked against it, so it must be obviously right.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from typing_extensions import Buffer

from hicache_storage.backend import StorageBackend, copy_into
from hicache_storage.buffers import as_readable
from hicache_storage.config import Deployment
from hicache_storage.kit import closed_guard

from .config import MemoryConfig, capabilities

__all__ = ["DictBaseline", "MemoryBackend", "MemoryConfig"]


@closed_guard
class MemoryBackend(StorageBackend):
    """Keep every value in a dictionary; the first complete value of a key wins."""

    name = "memory"
    capabilities = capabilities()

    def __init__(
        self, config: MemoryConfig | None = None, deployment: Deployment | None = None
    ) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the stored bytes, or copy them into ``out``; ``None`` on a miss."""
        with self._lock:
            value = self._data.get(key)
        if value is None:
            return None
        return value if out is None else copy_into(value, out)

    def exists(self, key: str) -> bool:
        """Return whether the key is stored."""
        with self._lock:
            return key in self._data

    def set(self, key: str, value: Buffer) -> bool:
        """Store a copy of ``value`` unless the key already holds one."""
        data = bytes(as_readable(value))
        with self._lock:
            self._data.setdefault(key, data)
        return True

    def delete(self, key: str) -> bool:
        """Remove the key; return whether it was stored."""
        with self._lock:
            return self._data.pop(key, None) is not None

    def clear(self) -> None:
        """Remove every key."""
        with self._lock:
            self._data.clear()

    def stats(self) -> dict[str, Any]:
        """Return the object count and bytes held."""
        with self._lock:
            return {
                **super().stats(),
                "objects": len(self._data),
                "bytes": sum(len(v) for v in self._data.values()),
            }

    def _close(self) -> None:
        with self._lock:
            self._data.clear()


class DictBaseline:
    """The raw yardstick for ``hicache bench memory``: a bare dict of byte copies."""

    def __init__(self, config: MemoryConfig, deployment: Deployment) -> None:
        self._data: dict[str, bytes] = {}

    def batch_write(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        """Copy each value into the dictionary."""
        for name, value in zip(names, values, strict=True):
            self._data[name] = bytes(value)

    def batch_read(self, names: Sequence[str], outs: Sequence[memoryview]) -> None:
        """Copy each stored value into its output buffer."""
        for name, out in zip(names, outs, strict=True):
            out[:] = self._data[name]

    def close(self) -> None:
        """Drop the dictionary."""
        self._data.clear()
