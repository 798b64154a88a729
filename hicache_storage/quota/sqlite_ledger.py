"""A namespace's ledger in an SQLite file, for stores on a file system (a shared mount).

SQLite's transactions are atomic across processes through the file system's locks, and on file
systems whose locks reach across machines (NFSv4, CephFS, Lustre with ``flock``) across those too.
The journal is SQLite's rollback journal, not WAL, which needs memory shared between the processes
and so one machine. A machine that loses power mid-transaction leaves the journal to roll back;
the ledger is never half-written.

Tenants may share one file: each namespace keeps tables of its own (``pages``, ``holds`` and
``totals``, suffixed ``/<namespace>`` for a named one), so one tenant's writes, evictions and
clears never touch another's accounting, while every call still takes the file's one lock.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from hicache_storage.errors import BackendTimeoutError, BackendUnavailableError

from .ledger import Grant, LedgerUsage

__all__ = ["SQLiteLedger"]

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS {pages} "
    "(key TEXT PRIMARY KEY, nbytes INTEGER NOT NULL, used REAL NOT NULL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS {pages_by_use} ON {pages} (used)",
    "CREATE TABLE IF NOT EXISTS {holds} "
    "(id TEXT PRIMARY KEY, nbytes INTEGER NOT NULL, expires REAL NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS {totals} (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO {totals} VALUES ('used', 0)",
)


class _Tables:
    """A connection whose statements name one namespace's tables as ``{pages}``, ``{holds}``..."""

    def __init__(self, db: sqlite3.Connection, namespace: str | None) -> None:
        self.db = db
        suffix = f"/{namespace}" if namespace else ""
        self._names = {
            part: '"' + (part + suffix).replace('"', '""') + '"'
            for part in ("pages", "pages_by_use", "holds", "totals")
        }

    def execute(self, statement: str, parameters: Sequence[object] = ()) -> sqlite3.Cursor:
        return self.db.execute(statement.format_map(self._names), parameters)

    def executemany(self, statement: str, rows: Iterable[Sequence[object]]) -> sqlite3.Cursor:
        return self.db.executemany(statement.format_map(self._names), rows)


class SQLiteLedger:
    """:class:`~hicache_storage.quota.QuotaLedger` in the SQLite database at ``path``.

    ``namespace`` picks the ledger's tables in the file (see the module). ``timeout_s`` bounds
    the wait for another process's transaction; past it a call raises
    :class:`~hicache_storage.errors.BackendTimeoutError` (a counted miss under degrade).
    """

    def __init__(self, path: str, namespace: str | None = None, *, timeout_s: float = 5.0) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(
                path, timeout=timeout_s, isolation_level=None, check_same_thread=False
            )
            self._tables = _Tables(self._db, namespace)
            with self._transaction() as db:
                for statement in _SCHEMA:
                    db.execute(statement)
        except sqlite3.Error as exc:
            raise BackendUnavailableError(f"quota ledger {path!r}: {exc}") from exc

    @contextmanager
    def _transaction(self) -> Iterator[_Tables]:
        """Run the block as one write transaction (taken at once, so no lock upgrade fails)."""
        with self._lock:
            db = self._db
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                raise BackendTimeoutError(f"quota ledger {self.path!r}: {exc}") from exc
            except sqlite3.Error as exc:  # closed, or not a database
                raise BackendUnavailableError(f"quota ledger {self.path!r}: {exc}") from exc
            try:
                yield self._tables
                db.execute("COMMIT")
            except sqlite3.Error as exc:  # a damaged or vanished file: an error of the store
                _rollback(db)
                raise BackendUnavailableError(f"quota ledger {self.path!r}: {exc}") from exc
            except BaseException:
                _rollback(db)
                raise

    def reserve(
        self,
        nbytes: int,
        *,
        quota: int,
        target: int,
        now: float,
        hold_s: float,
        touched: Sequence[tuple[str, float]] = (),
    ) -> Grant | None:
        """See :meth:`QuotaLedger.reserve`."""
        hold = "w" + uuid.uuid4().hex
        with self._transaction() as db:
            db.execute("DELETE FROM {holds} WHERE expires < ?", (now,))
            _touch(db, touched)
            if nbytes > quota:
                return None
            used = _used(db)
            held = db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM {holds}").fetchone()[0]
            taken = used + held + nbytes
            if taken <= quota:
                db.execute("INSERT INTO {holds} VALUES (?, ?, ?)", (hold, nbytes, now + hold_s))
                return Grant(hold)
            if db.execute("SELECT 1 FROM {holds} WHERE id LIKE 'e%' LIMIT 1").fetchone():
                return None  # another writer's eviction is freeing room: wait for it
            victims: list[tuple[str, int]] = []
            freed = 0
            for key, size in db.execute("SELECT key, nbytes FROM {pages} ORDER BY used"):
                if freed >= taken - target:
                    break
                victims.append((key, size))
                freed += size
            if taken - freed > quota:
                return None
            db.executemany("DELETE FROM {pages} WHERE key = ?", [(key,) for key, _ in victims])
            db.execute("UPDATE {totals} SET value = value - ? WHERE name = 'used'", (freed,))
            evicting = "e" + uuid.uuid4().hex
            db.executemany(
                "INSERT INTO {holds} VALUES (?, ?, ?)",
                [(hold, nbytes, now + hold_s), (evicting, freed, now + hold_s)],
            )
            return Grant(hold, victims, evicting)

    def settle(self, hold: str, stored: Sequence[tuple[str, int]], *, now: float) -> None:
        """See :meth:`QuotaLedger.settle`."""
        with self._transaction() as db:
            db.execute("DELETE FROM {holds} WHERE id = ?", (hold,))
            added = 0
            for key, size in stored:
                cursor = db.execute(
                    "INSERT OR IGNORE INTO {pages} VALUES (?, ?, ?)", (key, size, now)
                )
                if cursor.rowcount:
                    added += size
                else:  # already held (another writer stored it first): just used
                    db.execute("UPDATE {pages} SET used = ? WHERE key = ?", (now, key))
            db.execute("UPDATE {totals} SET value = value + ? WHERE name = 'used'", (added,))

    def release(self, hold: str) -> None:
        """See :meth:`QuotaLedger.release`."""
        with self._transaction() as db:
            db.execute("DELETE FROM {holds} WHERE id = ?", (hold,))

    def touch(self, touched: Sequence[tuple[str, float]]) -> None:
        """See :meth:`QuotaLedger.touch`."""
        if touched:
            with self._transaction() as db:
                _touch(db, touched)

    def forget(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        """See :meth:`QuotaLedger.forget`."""
        gone: list[tuple[str, int]] = []
        if not keys:
            return gone
        with self._transaction() as db:
            for key in keys:
                found = db.execute("SELECT nbytes FROM {pages} WHERE key = ?", (key,)).fetchone()
                if found:
                    db.execute("DELETE FROM {pages} WHERE key = ?", (key,))
                    gone.append((key, found[0]))
            freed = sum(size for _, size in gone)
            db.execute("UPDATE {totals} SET value = value - ? WHERE name = 'used'", (freed,))
        return gone

    def clear(self) -> None:
        """See :meth:`QuotaLedger.clear`."""
        with self._transaction() as db:
            db.execute("DELETE FROM {pages}")
            db.execute("UPDATE {totals} SET value = 0 WHERE name = 'used'")

    def usage(self, *, now: float) -> LedgerUsage:
        """See :meth:`QuotaLedger.usage`."""
        with self._transaction() as db:
            used = _used(db)
            held = db.execute(
                "SELECT COALESCE(SUM(nbytes), 0) FROM {holds} WHERE expires >= ?", (now,)
            ).fetchone()[0]
            pages = db.execute("SELECT COUNT(*) FROM {pages}").fetchone()[0]
        return LedgerUsage(used_bytes=used, held_bytes=held, pages=pages)

    def close(self) -> None:
        """See :meth:`QuotaLedger.close`."""
        with self._lock:
            self._db.close()


def _rollback(db: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):  # no transaction left to roll back
        db.execute("ROLLBACK")


def _used(db: _Tables) -> int:
    value: int = db.execute("SELECT value FROM {totals} WHERE name = 'used'").fetchone()[0]
    return value


def _touch(db: _Tables, touched: Sequence[tuple[str, float]]) -> None:
    if touched:
        db.executemany(
            "UPDATE {pages} SET used = max(used, ?) WHERE key = ?",
            [(when, key) for key, when in touched],
        )
