"""The ``example-sqlite`` backend: one SQLite table of ``(key, value)`` rows.

* ``INSERT OR IGNORE`` gives first-wins ``set``; every statement is its own transaction, so a reader
  never sees a partial row and a writer killed half way leaves nothing behind (SQLite's journal).
* WAL mode lets several processes share one database file.
* Every ``sqlite3`` exception becomes a :class:`~hicache_storage.BackendError` in one place,
  :meth:`SqliteBackend._errors`, so the default layers turn outages into counted misses.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
from typing_extensions import Buffer

from hicache_storage import (
    BackendIOError,
    BackendTimeoutError,
    Capabilities,
    Deployment,
    StorageBackend,
)
from hicache_storage.backend import copy_into
from hicache_storage.buffers import as_readable
from hicache_storage.kit import closed_guard

__all__ = ["SqliteBackend", "SqliteConfig", "TruncatingSqliteBackend"]


class SqliteConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the example backend.

    Attributes
    ----------
    path
        The database file; created with its table (and parent directory) if absent.
    timeout_s
        How long a statement waits for another process's lock before ``BackendTimeoutError``.
    """

    path: str
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path must name a database file")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@closed_guard  # refuse every call after close(), also when used without the layers
class SqliteBackend(StorageBackend):
    """Store every object as one row; the first complete value of a key wins."""

    name = "example-sqlite"
    capabilities = Capabilities(persistent=True, shared=True, delete=True, crash_safe_writes=True)

    def __init__(self, config: SqliteConfig, deployment: Deployment | None = None) -> None:
        super().__init__()
        self._lock = threading.Lock()
        Path(config.path).parent.mkdir(parents=True, exist_ok=True)
        with self._errors():
            self._db = sqlite3.connect(
                config.path,
                timeout=config.timeout_s,
                isolation_level=None,  # autocommit: each statement is one transaction
                check_same_thread=False,  # calls are serialised by self._lock
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, v BLOB NOT NULL)")

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Serialise calls and translate sqlite3 exceptions (the only place that does)."""
        try:
            with self._lock:
                yield
        except sqlite3.OperationalError as exc:
            cls = BackendTimeoutError if "locked" in str(exc) else BackendIOError
            raise cls(f"sqlite: {exc}") from exc
        except sqlite3.Error as exc:
            raise BackendIOError(f"sqlite: {exc}") from exc

    def _store(self, data: bytes) -> bytes:
        """Return the bytes to write for a value (the broken twin overrides this)."""
        return data

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the row's bytes, or copy them into ``out``; ``None`` on a miss."""
        with self._errors():
            row = self._db.execute("SELECT v FROM kv WHERE k = ?", (key,)).fetchone()
        if row is None:
            return None
        value: bytes = row[0]
        return value if out is None else copy_into(value, out)

    def exists(self, key: str) -> bool:
        """Return whether a row holds the key."""
        with self._errors():
            row = self._db.execute("SELECT 1 FROM kv WHERE k = ?", (key,)).fetchone()
        return row is not None

    def set(self, key: str, value: Buffer) -> bool:
        """Insert a copy of ``value`` unless the key already holds one."""
        data = self._store(bytes(as_readable(value)))  # copy: the caller may reuse its buffer
        with self._errors():
            self._db.execute("INSERT OR IGNORE INTO kv (k, v) VALUES (?, ?)", (key, data))
        return True

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Insert every value in one transaction (all or nothing)."""
        if len(keys) != len(values):
            return super().batch_set(keys, values)  # raises BatchMismatchError
        rows = [(k, self._store(bytes(as_readable(v)))) for k, v in zip(keys, values, strict=True)]
        with self._errors():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("INSERT OR IGNORE INTO kv (k, v) VALUES (?, ?)", rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return [True] * len(rows)

    def delete(self, key: str) -> bool:
        """Remove the key's row; return whether there was one."""
        with self._errors():
            return self._db.execute("DELETE FROM kv WHERE k = ?", (key,)).rowcount > 0

    def clear(self) -> None:
        """Remove every row (this instance owns the whole database)."""
        with self._errors():
            self._db.execute("DELETE FROM kv")

    def stats(self) -> dict[str, Any]:
        """Return the row count and stored bytes (only the name once closed)."""
        if self.closed:
            return super().stats()
        with self._errors():
            count, size = self._db.execute("SELECT COUNT(*), TOTAL(LENGTH(v)) FROM kv").fetchone()
        return {**super().stats(), "objects": count, "bytes": int(size)}

    def _close(self) -> None:
        with self._lock:
            self._db.close()


class TruncatingSqliteBackend(SqliteBackend):
    """A deliberately broken twin: values over 64 KiB lose their tail. The suite must fail it."""

    name = "example-broken"
    LIMIT = 64 * 1024

    def _store(self, data: bytes) -> bytes:
        return data[: self.LIMIT]
