"""Semantic, concurrency and error bugs: first-wins, freshness, clear, races, typed errors, stats.

Most start from the correct one-file-per-key backend (:class:`.reference.FilePerKey`) and change
one thing, as an author of a real backend might get it wrong; the bounded ones start from a
small capacity-bounded dictionary (:class:`BoundedDict`), correct until a subclass breaks it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

from typing_extensions import Buffer

from hicache_storage import BackendError, BackendIOError, Capabilities
from hicache_storage.backend import copy_into
from hicache_storage.buffers import as_readable
from hicache_storage.kit import ErrorMap, flat, is_missing, read_exact, write_from

from . import Bug, bug
from .dict_bugs import BrokenConfig, DictBackend
from .reference import FilePerKey, FilePerKeyConfig

__all__ = ["BUGS", "BoundedDict"]

logger = logging.getLogger(__name__)

_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
_FILE_CAPS = Capabilities(
    persistent=True, shared=True, native_zero_copy=True, delete=True, crash_safe_writes=True
)


# -- first-wins -------------------------------------------------------------------------------


class LastWins(FilePerKey):
    """Bug: publishes with ``os.replace``, so a second ``set`` overwrites the first value."""

    def _store(self, key: str, views: list[memoryview]) -> bool:
        path, temp = self.paths.path(key), self.paths.temp_path(key)
        with self.errors.guard(f"write {key!r}"):
            self.medium_faults.check("write")
            self.files.ensure_dir(os.path.dirname(path))
            fd = os.open(temp, _CREATE, 0o644)
            try:
                write_from(fd, views)
            finally:
                os.close(fd)
            os.replace(temp, path)
        return True


class RacyFirstWins(LastWins):
    """Bug: first-wins by "stat, then write and rename": concurrent writers all pass the stat.

    Claims ``atomic_first_wins``, which ``link`` would give and ``rename`` does not.
    """

    capabilities = Capabilities(
        persistent=True,
        shared=True,
        native_zero_copy=True,
        delete=True,
        crash_safe_writes=True,
        atomic_first_wins=True,
    )

    def _store(self, key: str, views: list[memoryview]) -> bool:
        if os.path.exists(self.paths.path(key)):
            return True
        return super()._store(key, views)


# -- publication: exists, partial values ------------------------------------------------------


class ExistsBeforeData(FilePerKey):
    """Bug: an in-memory index says a key exists as soon as its write starts."""

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._index: set[str] = set()
        self._index_lock = threading.Lock()

    def _store(self, key: str, views: list[memoryview]) -> bool:
        with self._index_lock:
            self._index.add(key)  # published before the file is
        try:
            return super()._store(key, views)
        except BaseException:
            with self._index_lock:
                self._index.discard(key)
            raise

    def exists(self, key: str) -> bool:
        with self._index_lock:
            if key in self._index:
                return True
        return super().exists(key)

    def delete(self, key: str) -> bool:
        with self._index_lock:
            self._index.discard(key)
        return super().delete(key)

    def clear(self) -> None:
        with self._index_lock:
            self._index.clear()
        super().clear()


class WritesInPlace(FilePerKey):
    """Bug: creates the key's file and writes into it directly: readers see it half written."""

    def _store(self, key: str, views: list[memoryview]) -> bool:
        path = self.paths.path(key)
        with self.errors.guard(f"write {key!r}"):
            self.medium_faults.check("write")
            self.files.ensure_dir(os.path.dirname(path))
            try:
                fd = os.open(path, _CREATE, 0o644)
            except FileExistsError:
                return True
            try:
                for view in views:  # streamed in 256 KiB pieces
                    for start in range(0, view.nbytes, 256 << 10):
                        write_from(fd, [view[start : start + (256 << 10)]])
            finally:
                os.close(fd)
        return True


# -- returned buffers -------------------------------------------------------------------------


class StagingView(FilePerKey):
    """Bug: ``get`` returns a view into a per-thread staging buffer that the next get reuses."""

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._staging = threading.local()

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        if out is not None:
            return super().get(key, out)
        fd = self._open(key)
        if fd is None:
            return None
        try:
            with self.errors.guard(f"read {key!r}"):
                size = os.fstat(fd).st_size
                buffer: bytearray | None = getattr(self._staging, "buffer", None)
                if buffer is None or len(buffer) < size:
                    buffer = self._staging.buffer = bytearray(max(size, 1 << 16))
                view = memoryview(buffer)[:size]
                return view if read_exact(fd, [view]) else None
        finally:
            os.close(fd)


# -- clear ------------------------------------------------------------------------------------


class ClearOwnIndex(FilePerKey):
    """Bug: ``clear()`` removes the files this instance wrote, not every object it owns."""

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._written: set[str] = set()

    def _store(self, key: str, views: list[memoryview]) -> bool:
        stored = super()._store(key, views)
        self._written.add(key)
        return stored

    def clear(self) -> None:
        for key in sorted(self._written):
            self.delete(key)
        self._written.clear()


class ExistenceCache(FilePerKey):
    """An existence cache of keys seen (correctly invalidated by this instance's deletes)."""

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._known: dict[str, float] = {}
        self._known_lock = threading.Lock()

    TTL_S: ClassVar[float] = 3600.0

    def _remember(self, key: str) -> None:
        with self._known_lock:
            self._known[key] = time.monotonic() + self.TTL_S

    def _forget(self, key: str) -> None:
        with self._known_lock:
            self._known.pop(key, None)

    def exists(self, key: str) -> bool:
        with self._known_lock:
            expiry = self._known.get(key)
        if expiry is not None and expiry > time.monotonic():
            return True
        found = super().exists(key)
        if found:
            self._remember(key)
        return found

    def _store(self, key: str, views: list[memoryview]) -> bool:
        stored = super()._store(key, views)
        self._remember(key)
        return stored

    def delete(self, key: str) -> bool:
        self._forget(key)
        return super().delete(key)


class ClearKeepsCache(ExistenceCache):
    """Bug: ``clear()`` removes the files but not the existence cache (exists stays True)."""

    capabilities = Capabilities(
        persistent=True,
        shared=True,
        native_zero_copy=True,
        delete=True,
        crash_safe_writes=True,
        exists_stale_s=ExistenceCache.TTL_S,
    )


class StaleExists(ExistenceCache):
    """Bug: the existence cache lives 30 s, the backend states ``exists_stale_s=0.5``."""

    TTL_S: ClassVar[float] = 30.0
    capabilities = Capabilities(
        persistent=True,
        shared=True,
        native_zero_copy=True,
        delete=True,
        crash_safe_writes=True,
        exists_stale_s=0.5,
    )

    def clear(self) -> None:
        with self._known_lock:
            self._known.clear()
        super().clear()


class StaleGet(FilePerKey):
    """Bug: a per-instance value cache serves ``get`` after another instance deleted the key."""

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._values_lock = threading.Lock()

    def _cached(self, key: str) -> bytes | None:
        with self._values_lock:
            return self._values.get(key)

    def _keep(self, key: str, value: bytes) -> None:
        with self._values_lock:
            self._values[key] = value
            while len(self._values) > 64:
                self._values.popitem(last=False)

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        cached = self._cached(key)
        if cached is not None:
            return cached if out is None else copy_into(cached, out)
        got = super().get(key, out)
        if got is not None and out is None:
            self._keep(key, bytes(memoryview(got)))
        return got

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        hits = []
        for key, out in zip(keys, outs, strict=True):
            cached = self._cached(key)
            if cached is not None and len(cached) == memoryview(out).nbytes:
                _fill(cached, out)
                hits.append(True)
            else:
                hits.extend(super().batch_get([key], [out]))
        return hits

    def delete(self, key: str) -> bool:
        with self._values_lock:
            self._values.pop(key, None)
        return super().delete(key)

    def clear(self) -> None:
        with self._values_lock:
            self._values.clear()
        super().clear()


def _fill(value: bytes, out: Buffer) -> Buffer:
    flat(memoryview(out))[:] = value
    return out


class NegativeCache(FilePerKey):
    """Bug: ``exists`` remembers misses for 30 s: another instance's new value stays unseen."""

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._absent: dict[str, float] = {}
        self._absent_lock = threading.Lock()

    def exists(self, key: str) -> bool:
        with self._absent_lock:
            until = self._absent.get(key)
        if until is not None and until > time.monotonic():
            return False
        found = super().exists(key)
        if not found:
            with self._absent_lock:
                self._absent[key] = time.monotonic() + 30.0
        return found

    def batch_exists(self, keys: Sequence[str]) -> int:
        for count, key in enumerate(keys):
            if not self.exists(key):
                return count
        return len(keys)

    def _store(self, key: str, views: list[memoryview]) -> bool:
        with self._absent_lock:
            self._absent.pop(key, None)
        return super()._store(key, views)


# -- reads racing deletes ---------------------------------------------------------------------


class CheckThenOpen(FilePerKey):
    """Bug: checks that the file exists, then opens it: a delete in between leaks the raw error."""

    def _open(self, key: str) -> int | None:
        path = self.paths.path(key)
        try:
            self.medium_faults.check("read")
        except OSError as exc:
            if is_missing(exc):
                return None
            raise self.errors.translate(exc, f"open {key!r}") from exc
        if not os.path.exists(path):
            return None
        return os.open(path, _READ)  # FileNotFoundError if deleted since the check


# -- typed errors -----------------------------------------------------------------------------


class RawOSError(FilePerKey):
    """Bug: the read path lets the medium's own ``OSError`` through (EIO escapes untyped)."""

    def _open(self, key: str) -> int | None:
        try:
            self.medium_faults.check("read")
            return os.open(self.paths.path(key), _READ)
        except OSError as exc:
            if is_missing(exc):
                return None
            raise


class EverythingIsIO(FilePerKey):
    """Bug: every ``OSError`` becomes ``BackendIOError``: a lost mount is not "unavailable"."""

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self.errors = ErrorMap(f"broken at {self.root}", [(OSError, BackendIOError)])


class TimeoutUntyped(FilePerKey):
    """Bug: a medium timeout is raised as a generic ``BackendError``, not a timeout."""

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self.errors = ErrorMap(f"broken at {self.root}", [(TimeoutError, BackendError)])


class VanishedIsError(FilePerKey):
    """Bug: a file that vanishes between the existence check and the read is an I/O error."""

    def _open(self, key: str) -> int | None:
        path = self.paths.path(key)
        if not os.path.exists(path):
            return None  # absent: a miss
        try:
            self.medium_faults.check("read")
            return os.open(path, _READ)
        except OSError as exc:  # it was there a moment ago, so this must be a failure
            raise self.errors.translate(exc, f"open {key!r}") from exc


class UnguardedFastGet(FilePerKey):
    """Bug: a fast ``get`` added in a subclass is not closed-guarded; it reads after close()."""

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        if out is not None:
            return FilePerKey.get(self, key, out)
        try:
            self.medium_faults.check("read")
            with open(self.paths.path(key), "rb") as stream:
                return stream.read()
        except OSError as exc:
            if is_missing(exc):
                return None
            raise self.errors.translate(exc, f"read {key!r}") from exc


class BatchSetLies(FilePerKey):
    """Bug: ``batch_set`` logs a failed write and reports True for it anyway."""

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        results = []
        for key, value in zip(keys, values, strict=True):
            try:
                self.set(key, value)
            except BackendError as exc:  # "best effort": the error is only logged
                logger.warning("batch_set: %r not stored: %s", key, exc)
            results.append(True)
        return results


# -- bounded backends -------------------------------------------------------------------------


class BoundedDict(DictBackend):
    """A correct bounded dictionary (FIFO eviction) reporting objects/bytes/max_bytes/evictions."""

    name = "broken-bounded-base"
    capabilities = Capabilities(delete=True, bounded=True)
    MAX_BYTES: ClassVar[int] = 512 * 1024

    def __init__(self, config: BrokenConfig | None = None, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._fifo: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._evictions = 0

    def _evict_one(self) -> None:
        key, size = self._fifo.popitem(last=False)
        self._data.pop(key, None)
        self._used -= size
        self._evictions += 1

    def set(self, key: str, value: Buffer) -> bool:
        data = bytes(as_readable(value))
        if len(data) > self.MAX_BYTES:
            return False
        with self._lock:
            if key in self._data:
                return True
            while self._used + len(data) > self.MAX_BYTES:
                self._evict_one()
            self._data[key] = data
            self._fifo[key] = len(data)
            self._used += len(data)
        return True

    def delete(self, key: str) -> bool:
        with self._lock:
            size = self._fifo.pop(key, None)
            if size is not None:
                self._used -= size
            return self._data.pop(key, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._fifo.clear()
            self._used = 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "backend": self.name,
                "objects": len(self._data),
                "bytes": self._used,
                "max_bytes": self.MAX_BYTES,
                "evictions": self._evictions,
            }


class BytesNeverShrink(BoundedDict):
    """Bug: ``stats()["bytes"]`` adds what is stored and subtracts deletes, but not evictions."""

    def __init__(self, config: BrokenConfig | None = None, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._reported = 0

    def set(self, key: str, value: Buffer) -> bool:
        with self._lock:
            new = key not in self._data
        stored = super().set(key, value)
        if stored and new:
            with self._lock:
                self._reported += memoryview(value).nbytes
        return stored

    def delete(self, key: str) -> bool:
        with self._lock:
            self._reported -= self._fifo.get(key, 0)
        return super().delete(key)

    def clear(self) -> None:
        super().clear()
        with self._lock:
            self._reported = 0

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        with self._lock:
            stats["bytes"] = self._reported
        return stats


class EvictionsUncounted(BoundedDict):
    """Bug: evicts, but ``stats()["evictions"]`` never moves."""

    def _evict_one(self) -> None:
        super()._evict_one()
        self._evictions -= 1


class SlotsReusedUnderReaders(BoundedDict):
    """Bug: values live in slots of one arena, and a read copies its slot outside the lock.

    Nothing checks afterwards that the slot still holds the key, so an eviction that reuses the
    slot mid-read hands the reader another key's bytes.
    """

    SLOTS: ClassVar[int] = 8
    PIECE: ClassVar[int] = 4096

    def __init__(self, config: BrokenConfig | None = None, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._slot_bytes = self.MAX_BYTES // self.SLOTS
        self._arena = bytearray(self.MAX_BYTES)
        self._where: dict[str, tuple[int, int]] = {}
        self._free = list(range(self.SLOTS))

    def _copy(self, dst: memoryview, src: memoryview) -> None:
        for start in range(0, len(src), self.PIECE):  # like preadv, piece by piece
            dst[start : start + self.PIECE] = src[start : start + self.PIECE]
            time.sleep(0)

    def set(self, key: str, value: Buffer) -> bool:
        data = memoryview(bytes(as_readable(value)))
        if data.nbytes > self._slot_bytes:
            return False
        with self._lock:
            if key in self._where:
                return True
            if not self._free:
                old, size = self._fifo.popitem(last=False)
                slot, _ = self._where.pop(old)
                self._free.append(slot)
                self._used -= size
                self._evictions += 1
            slot = self._free.pop()
        start = slot * self._slot_bytes
        self._copy(memoryview(self._arena)[start : start + data.nbytes], data)
        with self._lock:
            self._where[key] = (slot, data.nbytes)
            self._fifo[key] = data.nbytes
            self._used += data.nbytes
        return True

    def _lookup(self, key: str) -> bytes | None:
        with self._lock:
            where = self._where.get(key)
        if where is None:
            return None
        slot, size = where
        start = slot * self._slot_bytes
        value = bytearray(size)
        self._copy(memoryview(value), memoryview(self._arena)[start : start + size])
        return bytes(value)

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        value = self._lookup(key)
        if value is None or out is None:
            return value
        return copy_into(value, out)

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._where

    def delete(self, key: str) -> bool:
        with self._lock:
            where = self._where.pop(key, None)
            if where is None:
                return False
            self._free.append(where[0])
            self._used -= self._fifo.pop(key)
            return True

    def clear(self) -> None:
        with self._lock:
            self._where.clear()
            self._fifo.clear()
            self._free = list(range(self.SLOTS))
            self._used = 0

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        with self._lock:
            stats["objects"] = len(self._where)
        return stats


_M = __name__
_REF = "tests.broken_backends.reference:FilePerKeyConfig"
_BOUNDED = Capabilities(delete=True, bounded=True)


def _file_bug(name: str, cls: str, description: str, caught_by: str, **caps: Any) -> Bug:
    capabilities = Capabilities(**{**_caps_dict(_FILE_CAPS), **caps})
    return bug(name, f"{_M}:{cls}", description, caught_by, config=_REF, capabilities=capabilities)


def _caps_dict(caps: Capabilities) -> dict[str, Any]:
    return {name: getattr(caps, name) for name in caps.__dataclass_fields__}


BUGS: list[Bug] = [
    _file_bug(
        "broken-last-wins",
        "LastWins",
        "set publishes with os.replace: the last value wins",
        "TestFirstWins::test_second_set_keeps_first_value",
    ),
    _file_bug(
        "broken-racy-first-wins",
        "RacyFirstWins",
        "first-wins by stat-then-rename; concurrent writers replace each other",
        "TestFirstWins::test_concurrent_writers_agree_on_one_value",
        atomic_first_wins=True,
    ),
    _file_bug(
        "broken-exists-before-data",
        "ExistsBeforeData",
        "an index says a key exists before its file is written",
        "TestConcurrency::test_exists_true_means_get_returns_whole_value",
    ),
    _file_bug(
        "broken-writes-in-place",
        "WritesInPlace",
        "set writes the key's file in place; readers see it half written",
        "TestConcurrency::test_reader_racing_writer_sees_none_or_whole",
    ),
    _file_bug(
        "broken-staging-view",
        "StagingView",
        "get returns a view into a staging buffer the next get reuses",
        "TestLifecycle::test_get_buffer_unchanged_by_later_calls",
    ),
    _file_bug(
        "broken-clear-own-index",
        "ClearOwnIndex",
        "clear removes only the keys this instance wrote",
        "TestClear::test_clear_removes_keys_set_before_keeps_keys_set_after",
    ),
    _file_bug(
        "broken-clear-keeps-cache",
        "ClearKeepsCache",
        "clear removes the files but keeps the existence cache",
        "TestStateMachine::test_state_machine_matches_dict_model",
        exists_stale_s=ExistenceCache.TTL_S,
    ),
    _file_bug(
        "broken-stale-exists",
        "StaleExists",
        "the existence cache outlives the stated exists_stale_s",
        "TestStaleViews::test_exists_after_delete_on_another_instance_within_stated_bound",
        exists_stale_s=0.5,
    ),
    _file_bug(
        "broken-stale-get",
        "StaleGet",
        "a value cache serves get after another instance deleted the key",
        "TestStaleViews::test_delete_on_one_instance_get_on_another_misses_at_once",
    ),
    _file_bug(
        "broken-negative-cache",
        "NegativeCache",
        "exists caches misses: another instance's write stays unseen",
        "TestStaleViews::test_set_on_one_instance_visible_on_another_at_once",
    ),
    _file_bug(
        "broken-read-delete-race",
        "CheckThenOpen",
        "get checks, then opens: a racing delete leaks FileNotFoundError",
        "TestConcurrency::test_readers_racing_deleters_none_or_whole",
    ),
    _file_bug(
        "broken-raw-oserror",
        "RawOSError",
        "a failing read leaks the raw OSError",
        "TestMediumFaults::test_medium_fault_bare_backend_raises_typed_error[io]",
    ),
    _file_bug(
        "broken-untyped-unavailable",
        "EverythingIsIO",
        "every OSError is BackendIOError, a lost mount included",
        "TestMediumFaults::test_medium_fault_bare_backend_raises_typed_error[unavailable]",
    ),
    _file_bug(
        "broken-untyped-timeout",
        "TimeoutUntyped",
        "a medium timeout raises a generic BackendError",
        "TestMediumFaults::test_medium_fault_bare_backend_raises_typed_error[timeout]",
    ),
    _file_bug(
        "broken-vanished-error",
        "VanishedIsError",
        "a file that vanished while being read is an error, not a miss",
        "TestMediumFaults::test_medium_fault_bare_backend_raises_typed_error[vanished]",
    ),
    _file_bug(
        "broken-bare-after-close",
        "UnguardedFastGet",
        "an unguarded fast get keeps reading after close()",
        "TestLifecycle::test_bare_backend_refuses_calls_after_close",
    ),
    _file_bug(
        "broken-batch-set-lies",
        "BatchSetLies",
        "batch_set reports True for a value whose write failed",
        "TestMediumFaults::test_medium_write_fault_in_batch_reports_false_for_unstored",
    ),
    bug(
        "broken-bytes-never-shrink",
        f"{_M}:BytesNeverShrink",
        "stats()['bytes'] is never reduced by eviction",
        "TestBounded::test_stats_report_usage_bound_and_evictions",
        capabilities=_BOUNDED,
    ),
    bug(
        "broken-evictions-uncounted",
        f"{_M}:EvictionsUncounted",
        "stats()['evictions'] never grows",
        "TestBounded::test_stats_report_usage_bound_and_evictions",
        capabilities=_BOUNDED,
    ),
    bug(
        "broken-evict-under-reader",
        f"{_M}:SlotsReusedUnderReaders",
        "eviction reuses a slot while a read copies it",
        "TestBounded::test_readers_racing_eviction_none_or_whole",
        capabilities=_BOUNDED,
    ),
]
