"""Latent bugs, which round trips never meet: reused identities, leaks, miscounts, lazy races.

Each starts from the correct one-file-per-key backend (:class:`.reference.FilePerKey`) and adds
one thing the way an author optimising or instrumenting a real backend might: a read cache keyed
by file identity, an early return on the error path, hit counters, a lazily built worker pool.
Every override is guarded again with :func:`~hicache_storage.kit.closed_guard`, so each backend
keeps exactly its one bug.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from typing_extensions import Buffer

from hicache_storage import BufferSizeError
from hicache_storage.kit import closed_guard, nbytes, read_exact

from . import REFERENCE, Bug, bug
from .reference import FilePerKey, FilePerKeyConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUGS",
    "CountsHits",
    "FdLeakOnWrongSize",
    "IdentityKeyedCache",
    "MissesCountedAsHits",
    "RacyLazyPool",
]


@closed_guard
class IdentityKeyedCache(FilePerKey):
    """Bug: a read cache keyed by file identity (inode, size) serves a deleted object's bytes.

    Published objects never change (the first value wins), so the author took a file's
    identity to name its bytes. But a file system hands a freed inode to the next file it
    creates: a value written after a delete is read from the cache as the deleted one. (ext4
    and XFS reuse a freed inode at once; tmpfs numbers inodes afresh, so on a tmpfs root the
    bug stays latent and nothing can catch it.)
    """

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._cache_lock = threading.Lock()

    def _value(self, key: str) -> bytes | None:
        """Return ``key``'s bytes, from the cache when a file of this identity was read before."""
        fd = self._open(key)
        if fd is None:
            return None
        try:
            with self.errors.guard(f"read {key!r}"):
                info = os.fstat(fd)
                identity = (info.st_ino, info.st_size)
                with self._cache_lock:
                    cached = self._cache.get(identity)
                if cached is not None:
                    return cached
                value = bytearray(info.st_size)
                if not read_exact(fd, [memoryview(value)]):
                    return None
        finally:
            os.close(fd)
        with self._cache_lock:
            self._cache[identity] = cached = bytes(value)
            while len(self._cache) > 256:
                self._cache.popitem(last=False)
        return cached

    def _read(self, key: str, views: list[memoryview], *, strict: bool) -> bool | None:
        value = self._value(key)
        if value is None:
            return None
        if len(value) != nbytes(views):
            if strict:
                raise BufferSizeError(
                    f"output buffer has {nbytes(views)} bytes but {key!r} has {len(value)}"
                )
            return False
        offset = 0
        for view in views:
            view[:] = value[offset : offset + view.nbytes]
            offset += view.nbytes
        return True

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        if out is not None:
            return super().get(key, out)
        return self._value(key)


@closed_guard
class FdLeakOnWrongSize(FilePerKey):
    """Bug: ``get(out)`` refuses a wrong-sized buffer before the ``try`` that closes the file.

    It raises the right ``BufferSizeError``, and leaves one descriptor open each time.
    """

    def _read(self, key: str, views: list[memoryview], *, strict: bool) -> bool | None:
        fd = self._open(key)
        if fd is None:
            return None
        with self.errors.guard(f"stat {key!r}"):
            size = os.fstat(fd).st_size
        if size != nbytes(views):
            if strict:
                raise BufferSizeError(
                    f"output buffer has {nbytes(views)} bytes but {key!r} has {size}"
                )
            os.close(fd)
            return False
        try:
            with self.errors.guard(f"read {key!r}"):
                return read_exact(fd, views) or None
        finally:
            os.close(fd)


@closed_guard
class CountsHits(FilePerKey):
    """Correct: reports ``hits`` and ``misses`` in ``stats()``, per key read by the get paths."""

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._hits = self._misses = 0
        self._count_lock = threading.Lock()

    def _tally(self, found: Sequence[bool]) -> None:
        with self._count_lock:
            self._hits += sum(found)
            self._misses += len(found) - sum(found)

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        got = super().get(key, out)
        self._tally([got is not None])
        return got

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        found = super().batch_get(keys, outs)
        self._tally(found)
        return found

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        found = super().batch_get_v1(keys, host_indices)
        self._tally(found)
        return found

    def stats(self) -> dict[str, Any]:
        with self._count_lock:
            return {**super().stats(), "hits": self._hits, "misses": self._misses}


@closed_guard
class MissesCountedAsHits(CountsHits):
    """Bug: ``hits`` grows by every key looked up, so each miss counts as a hit as well."""

    def _tally(self, found: Sequence[bool]) -> None:
        with self._count_lock:
            self._hits += len(found)
            self._misses += len(found) - sum(found)


@closed_guard
class RacyLazyPool(FilePerKey):
    """Bug: the read worker pool is built on first use by an unlocked check-then-act.

    Nothing slows the window down: it is the few microseconds of building the executor and
    registering its exit hook. First calls that interleave there each build a pool; the last one
    assigned is the one ``close()`` shuts down, and the others (kept alive by their exit hooks)
    keep their threads.
    """

    def __init__(self, config: FilePerKeyConfig, deployment: Any = None) -> None:
        super().__init__(config, deployment)
        self._pool: ThreadPoolExecutor | None = None

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            pool = ThreadPoolExecutor(4, thread_name_prefix="racy-pool")
            atexit.register(pool.shutdown, wait=False)  # shut down even if close() never runs
            self._pool = pool
        return self._pool

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        return self._workers().submit(super().get, key, out).result()

    def exists(self, key: str) -> bool:
        return self._workers().submit(super().exists, key).result()

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        return list(self._workers().map(self._get_one, keys, outs))

    def _get_one(self, key: str, out: Buffer) -> bool:
        return FilePerKey.batch_get(self, [key], [out])[0]

    def _close(self) -> None:
        if self._pool is not None:
            atexit.unregister(self._pool.shutdown)
            self._pool.shutdown(wait=True)
        super()._close()


_M = __name__
_REF = "tests.broken_backends.reference:FilePerKeyConfig"


def _file_bug(name: str, cls: str, description: str, caught_by: str) -> Bug:
    caps = REFERENCE.capabilities
    return bug(name, f"{_M}:{cls}", description, caught_by, config=_REF, capabilities=caps)


BUGS: list[Bug] = [
    _file_bug(
        "broken-identity-cache",
        "IdentityKeyedCache",
        "a read cache keyed by inode and size serves a deleted object's bytes",
        "TestIdentityReuse::test_delete_then_write_cycles_every_byte",
    ),
    _file_bug(
        "broken-fd-leak",
        "FdLeakOnWrongSize",
        "get(out) with a wrong-sized buffer raises but leaves the file open",
        "TestResources::test_error_paths_leak_no_fds_or_threads",
    ),
    _file_bug(
        "broken-misses-as-hits",
        "MissesCountedAsHits",
        "stats()['hits'] counts every key looked up, misses included",
        "TestStats::test_hit_miss_counters_match_model_every_read_path",
    ),
    _file_bug(
        "broken-racy-pool",
        "RacyLazyPool",
        "racing first calls each build a worker pool; close() shuts one down",
        "TestResources::test_concurrent_first_calls_leak_no_fds_or_threads",
    ),
]
