"""The file backend: one file per key under a directory, published atomically.

Layout
    ``root/ab/cd/<key>`` where ``abcd`` are the first four hex digits of ``blake2b(key)`` (with
    ``fanout``), or ``root/<key>``. Keys obey the key rule (no separators, no leading dot), so a
    key always names a plain file inside its directory, and names starting with a dot are free
    for temporary files and for the raw baseline's ``.raw-baseline`` directory.

Writes
    A value is written to ``.<key>.tmp.<pid>.<random>`` in the key's directory, optionally
    fsynced, then published with ``link(tmp, key)``, which fails if the key exists: the first
    complete value wins and a reader can never see a partial object. A writer killed half way
    leaves only a temporary file, which the startup scan of a later instance removes once it is
    older than ``stale_temp_s``. On filesystems without hard links, ``rename`` is used when the
    key is absent.

Reads
    ``open`` + ``fstat`` + ``preadv`` straight into the caller's buffer (or the host pool's page
    buffers for the v1 calls): the size is checked before any byte is read. The v1 calls move
    ``io_threads`` pages at once (:class:`~hicache_storage.kit.IOWorkers`). In a batch, a file
    that cannot be read costs its own key only: the others are hits or misses as they are, and
    the failure is raised only when no key of the batch was read (counted in
    ``stats()["read_errors"]`` otherwise).

Entries that are not files
    Only a regular file is a value. A FIFO, a directory, a socket or a device at a key's path
    (or a symlink to one) is a miss that is never waited on (``open`` with ``O_NONBLOCK``, then
    ``fstat``), ``exists`` says False, and a write of the key moves it aside and publishes the
    value in its place (:func:`~hicache_storage.kit.clear_entry`). A fan-out directory
    the backend cannot list (another tenant's ``umask 077``) is left out of the startup scan
    with a warning; every other directory is served.

Integrity (``integrity=True``, the default)
    Each file is the value followed by a 32-byte :mod:`~hicache_storage.kit.integrity` record
    (length, CRC32C, key digest), read in the same ``preadv`` and verified before a hit is
    reported: a truncated, corrupted or misnamed file is a miss, counted by reason in
    ``stats()["integrity_failures"]``, and removed.

SGLang file compatibility (``naming="sglang_file_compat"``)
    Each object is ``root/<key>.bin`` holding the bare value (no fan-out, no integrity record):
    the layout of SGLang's ``HiCacheFile``, so one directory can be shared with it. SGLang
    writes ``.<uuid>.tmp`` and renames it into place; its scans look only at names ending in
    ``.bin``. Our temporary files keep their ``.<key>.tmp.<pid>.<random>`` names (never ending in
    ``.bin``), and in this mode only names that are exactly ``<valid key>.bin`` are objects and
    only names that are exactly our temporary names are temporary files: anything else,
    SGLang's temporary files included, is never indexed, evicted or removed.

Capacity
    The objects this instance owns are indexed with their sizes on disk (value and record) in an
    :class:`LRUCapacity`, which evicts the least recently used ones when ``max_bytes`` is set; a
    page and the verify layer's record of it are used and evicted together. The bound is per
    instance: ranks sharing a directory should use ``ownership="rank"`` and give each rank its
    share.

The backend is this module's reads, housekeeping and stats over its parts: :mod:`.layout` (where
objects live, the startup walk), :mod:`.writes` (reserve, write, publish, settle), :mod:`.meta`
(the metadata cache), :mod:`.evictor` (the capacity index) and :mod:`.errors`.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import Buffer

from hicache_storage.backend import HostPool, StorageBackend
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.capacity import Capacity
from hicache_storage.config import Deployment
from hicache_storage.errors import (
    BackendError,
    BatchMismatchError,
    BufferSizeError,
    ConfigError,
    HiCacheError,
)
from hicache_storage.keys.format import ObjectFormat
from hicache_storage.kit import (
    NOT_REGULAR,
    READ_FLAGS,
    AtomicFiles,
    FormatManifest,
    IOWorkers,
    MediumFaults,
    closed_guard,
    flat,
    nbytes,
    open_regular,
    read_checked,
    read_files,
    read_into,
)
from hicache_storage.kit.integrity import RECORD_BYTES, check, verify
from hicache_storage.layers.verify import RECORD_PREFIX, record_key
from hicache_storage.quota import SQLiteLedger

from .config import FileConfig, capabilities
from .errors import MISSING, MISSING_ERRNOS, io_error, oserror
from .evictor import LRUCapacity
from .layout import Layout
from .meta import MetaCache
from .writes import ObjectWriter

if TYPE_CHECKING:
    import torch

__all__ = ["FileBackend"]

logger = logging.getLogger(__name__)

BASELINE_DIR = ".raw-baseline"
"""Directory under ``root`` reserved for :class:`~.baseline.RawDiskBaseline`; never scanned."""

FLOOR_SHARE = 100
"""The default free-space floor is the file system's size divided by this (1 %): see
:attr:`~.config.FileConfig.min_free_bytes`."""

QUOTA_LEDGER = ".hicache-quota.sqlite"
"""The quota ledger's file in the root: a leading dot, so it is never a key's object."""


def _read_bytes(fd: int, size: int) -> bytes | None:
    """Read the ``size`` bytes of a file; return None if it is shorter."""
    data = os.pread(fd, size, 0)
    if len(data) == size:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        chunk = os.pread(fd, size - got, got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _owns_everything(key: str) -> bool:
    return True


def _record_of(key: str) -> str | None:
    """Return the key of the verify layer's record of page ``key``; None for a record itself."""
    return None if key.startswith(RECORD_PREFIX) else record_key(key)


@closed_guard
class FileBackend(StorageBackend):
    """Stores each key as one file under ``config.root``; see the module docstring.

    Parameters
    ----------
    config
        The backend's settings.
    deployment
        The rank this instance serves; with ``ownership="rank"`` its key scheme decides which
        keys this instance indexes, evicts and clears. Defaults to a single-rank deployment.

    Raises
    ------
    BackendIOError
        If ``root`` cannot be created or scanned.
    """

    name = "file"

    def __init__(self, config: FileConfig, deployment: Deployment | None = None) -> None:
        super().__init__()
        self.config = config
        self.deployment = deployment if deployment is not None else Deployment()
        self.root = os.path.abspath(os.path.expanduser(config.root))
        self._compat = config.naming == "sglang_file_compat"
        self._files = AtomicFiles(fsync=config.fsync)
        self.medium_faults = MediumFaults()
        """The suite's fault hook: each disk operation checks it first (see the kit)."""
        self._layout = Layout(
            self.root, fanout=config.use_fanout, compat=self._compat, faults=self.medium_faults
        )
        self.capabilities = capabilities(config)
        self._formats = FormatManifest(self.root)
        self._io = IOWorkers(config.threads, "hicache-file-io")
        self._owns: Callable[[str], bool] = (
            self.deployment.scheme().owns if config.ownership == "rank" else _owns_everything
        )
        self._meta = MetaCache(enabled=config.metadata_cache, ttl_s=config.metadata_ttl_s)
        self._lock = threading.Lock()
        """Guards the failure counts and the unlisted directories."""
        self._capacity = LRUCapacity(
            config.max_bytes,
            config.low_watermark,
            self._evict_file,
            free_bytes=self._free_bytes,
            min_free_bytes=self._floor(config.min_free_bytes),
            # A page leaves with its verify record (the layer writes none over SGLang's names).
            companion=None if self._compat else _record_of,
            high_watermark=config.high_watermark,
        )
        self._record = RECORD_BYTES if config.use_integrity else 0
        self._writer = ObjectWriter(
            layout=self._layout,
            files=self._files,
            io=self._io,
            capacity=self._capacity,
            meta=self._meta,
            faults=self.medium_faults,
            owns=self._owns,
            stored=self._stored,
            record=self._record,
        )
        self._failures: Counter[str] = Counter()
        self._read_errors = 0
        self._unlisted: set[str] = set()
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError(
                f"file backend root {self.root!r} is a file, not a directory: give a directory "
                "(created when missing) for the store's pages"
            )
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise io_error(f"create root directory {self.root!r}", exc) from exc
        self._scan()

    # -- the contract ---------------------------------------------------------------------------

    def register_host_pool(self, pool: HostPool) -> None:
        """Attach ``pool``; with SGLang's names, first check that its format is the store's.

        SGLang's names carry only the model name and the ranks, so the format of the objects
        under this rank's suffix is kept in a :class:`~hicache_storage.kit.FormatManifest`.

        Raises
        ------
        ConfigError
            With ``naming="sglang_file_compat"``, if the directory holds objects of another
            model format (dtype, geometry or layout) under this deployment's key suffix.
        """
        # Imported here: a pool of this SDK means torch is loaded, and the backend needs neither.
        from hicache_storage.hostpool import HostKVPool

        if self._compat and isinstance(pool, HostKVPool):
            fmt = ObjectFormat.of_pool(pool, model=self.deployment.model_name)
            suffix = self.deployment.rank_suffix().suffix
            self._formats.claim(suffix, fmt, lambda: self._layout.holds_suffix(suffix))
        super().register_host_pool(pool)

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the value of ``key`` (``bytes``), or read it into ``out``; None on a miss.

        Raises
        ------
        BufferSizeError
            If ``out`` is not exactly the object's size (``out`` is left untouched).
        BackendIOError
            If the file exists but cannot be read.
        """
        dst = None if out is None else as_writable(out)
        path = self._layout.path(key)
        fd = self._open(path, key)
        if fd is None:
            return None
        try:
            stored = os.fstat(fd).st_size
            size = stored - self._record
            if size < 0:
                result: Buffer | None = None
            elif dst is None:
                result = _read_bytes(fd, size)
                if result is not None and self._record:
                    record = os.pread(fd, self._record, size)
                    if not self._verified(key, [memoryview(result)], record):
                        result = None
            elif size != dst.nbytes:
                raise BufferSizeError(
                    f"output buffer has {dst.nbytes} bytes but the object stored under "
                    f"{key!r} has {size}"
                )
            else:
                result = out if self._read_verified(fd, key, [dst], stored) else None
        except OSError as exc:
            raise io_error(f"read {key!r}", exc) from exc
        finally:
            os.close(fd)
        if result is None:  # truncated or corrupt: not a complete value
            self._drop(key, path, "length" if size < 0 else None)
            return None
        self._hit(key, size)
        return result

    def exists(self, key: str) -> bool:
        """Return whether ``key`` holds a value (the metadata cache first, then ``stat``)."""
        return self._stored(key)

    def _stored(self, key: str) -> bool:
        return self._meta.cached(key) or self._stat(key)

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key`` unless it holds a value already (the first one wins).

        Returns False only when the value does not fit the capacity bound.

        Raises
        ------
        BackendIOError
            If the write failed (disk full, I/O error); nothing is left under the key.
        """
        view = as_readable(value)
        return self._writer.store(key, [view])

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each key into its output buffer, ``io_threads`` at once; per-key hits.

        An object whose size differs from its output buffer is a miss (the buffer untouched);
        a file that cannot be read is a miss of its own key (see :meth:`_per_key`).
        """
        if len(keys) != len(outs):
            raise BatchMismatchError(f"got {len(keys)} keys but {len(outs)} output buffers")
        results = self._io.map(self._get_into, list(zip(keys, outs, strict=True)))
        failures = {i: r for i, r in enumerate(results) if isinstance(r, BackendError)}
        return self._per_key("batch_get", [r is True for r in results], failures)

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value under its key, ``io_threads`` at once (the first value wins).

        Within ``max_bytes`` every value is stored that :meth:`set` one by one would store
        (:meth:`~.writes.ObjectWriter.store_batch`); if a write fails, the others are still
        written and the first failure is raised.
        """
        if len(keys) != len(values):
            raise BatchMismatchError(f"got {len(keys)} keys but {len(values)} values")
        return self._writer.store_batch(
            keys, [[as_readable(value)] for value in values], self._writer.write_values
        )

    def _get_into(self, item: tuple[str, Buffer]) -> bool | BackendError:
        key, out = item
        try:
            return self.get(key, out) is not None
        except BufferSizeError:
            return False
        except BackendError as exc:  # this key's alone: the batch decides (_per_key)
            return exc

    def _per_key(
        self, op: str, hits: list[bool], failures: Mapping[int, HiCacheError]
    ) -> list[bool]:
        """Return a batch read's hits, the keys that failed among its misses.

        One file that cannot be read (a permission, a bad sector) costs its own key, not the
        keys read beside it. Only when no key of the batch was read is the first failure
        raised, so that the layers count a failing medium as they count any outage; otherwise
        the failed keys are counted in ``stats()["read_errors"]`` and logged.

        Raises
        ------
        HiCacheError
            The first failure, if the batch has failures and no hit.
        """
        if not failures:
            return hits
        if not any(hits):
            raise failures[min(failures)]
        with self._lock:
            self._read_errors += len(failures)
        logger.warning(
            "file backend: %s read %d of %d keys; %d could not be read and are misses: %s",
            op,
            sum(hits),
            len(hits),
            len(failures),
            failures[min(failures)],
        )
        return hits

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the length of the leading run of keys that exist."""
        count = self._meta.leading(keys)
        for key in keys[count:]:
            if not self._stat(key):
                break
            count += 1
        return count

    # -- zero-copy page I/O ---------------------------------------------------------------------

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Read each key's object straight into its page of the host pool; return per-key hits.

        The whole batch moves in one :func:`~hicache_storage.kit.read_files` call (up to
        ``io_threads`` files at once, the GIL given up once for all of them). An object whose
        size differs from a page, or an entry that is not a regular file, is a miss and its
        page is left untouched; a page whose file fails is a miss of its own, the other pages
        hits with their bytes (the failure raised only if no page was read, see
        :meth:`_per_key`).
        """
        pages = [[flat(view) for view in views] for views in self.page_views(keys, host_indices)]
        hits = [False] * len(keys)
        failures: dict[int, HiCacheError] = {}
        todo: list[int] = []
        for i, key in enumerate(keys):
            try:
                self.medium_faults.check("read")
            except MISSING:
                self._meta.forget(key)
            except OSError as exc:
                failures[i] = io_error(f"open {key!r}", exc)
            else:
                todo.append(i)
        records = [bytearray(self._record) for _ in todo]
        paths = [self._layout.path(keys[i]) for i in todo]
        buffers = [
            [*pages[i], memoryview(rec)] if self._record else pages[i]
            for i, rec in zip(todo, records, strict=True)
        ]
        results = read_files(
            paths,
            buffers,
            [nbytes(pages[i]) for i in todo],
            self._io,
            flags=READ_FLAGS,
        )
        for i, path, rec, result in zip(todo, paths, records, results, strict=True):
            key, size = keys[i], nbytes(pages[i])
            if result.error in MISSING_ERRNOS or result.size == NOT_REGULAR:
                self._meta.forget(key)
            elif result.error:
                failures[i] = io_error(f"read {key!r}", oserror(result.error))
            elif result.size == size + self._record:
                if result.read == result.size and (
                    not self._record or self._counted(key, check(rec, key, size, result.crc))
                ):
                    self._hit(key, size)
                    hits[i] = True
                else:
                    self._drop(key, path, None)
        return self._per_key("batch_get_v1", hits, failures)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Write each key's page of the host pool as one object, gathering its buffers.

        The pages not yet stored move in one :func:`~hicache_storage.kit.write_files` call
        (each to a temporary file linked to its key, so the first complete value wins); if a
        page fails, the others are still written and the first failure is raised.
        """
        pages = [[flat(view) for view in views] for views in self.page_views(keys, host_indices)]
        return self._writer.store_batch(
            keys, pages, self._writer.write_pages, self._writer.prepare_page
        )

    # -- housekeeping ---------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""
        path = self._layout.path(key)
        try:
            self.medium_faults.check("delete")
            os.unlink(path)
        except (*MISSING, IsADirectoryError):  # a directory is no value: nothing to delete
            existed = False
        except OSError as exc:
            raise io_error(f"delete {key!r}", exc) from exc
        else:
            existed = True
        self._meta.forget(key)
        self._capacity.forget(key)
        return existed

    def clear(self) -> None:
        """Remove every object this instance owns (every object, with ``ownership="all"``).

        Temporary files of writes in flight, other ranks' objects and files whose names are not
        objects are left alone. With ``naming="sglang_file_compat"`` and ``ownership="all"``,
        this backend's own temporary files older than ``stale_temp_s`` are removed too (never
        SGLang's).

        Raises
        ------
        BackendIOError
            If a fan-out directory could not be listed: what it holds may still be there (every
            other directory is cleared first).
        """
        indexed = self._capacity.keys()
        removed: set[str] = set()
        sweep_temps = self._compat and self.config.ownership == "all"
        now = time.time()
        unlisted: list[tuple[str, OSError]] = []
        for directory, entry in self._layout.files(unlisted):
            name = entry.name
            if sweep_temps and self._layout.is_temp(name):
                self._layout.discard_stale_temp(entry, now, self.config.stale_temp_s)
                continue
            key = self._layout.key_of(name)
            if key is None or not self._owns(key):
                continue
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise io_error(f"remove {name!r} from {directory!r}", exc) from exc
            removed.add(key)
        self._capacity.forget_many(removed)
        gone = [k for k in indexed if k not in removed and not os.path.exists(self._layout.path(k))]
        self._capacity.forget_many(gone)
        self._meta.clear()
        if unlisted:
            directory, error = unlisted[0]
            raise io_error(f"clear {directory!r}", error) from error

    def quota_ledger(self) -> SQLiteLedger:
        """Return the ledger in this root (``.hicache-quota.sqlite``, never a key's name)."""
        return SQLiteLedger(os.path.join(self.root, QUOTA_LEDGER))

    def stats(self) -> dict[str, Any]:
        """Return the base stats plus the index (objects, bytes, evictions) and ``capacity``."""
        stats = super().stats()
        capacity = self._capacity.stats()
        stats.update(
            root=self.root,
            ownership=self.config.ownership,
            objects=capacity["objects"],
            bytes=capacity["bytes"],
            reserved_bytes=capacity["reserved_bytes"],
            max_bytes=capacity["max_bytes"],
            min_free_bytes=capacity["min_free_bytes"],
            free_bytes=self._free_bytes(),
            evictions=capacity["evictions"],
            evicted_bytes=capacity["evicted_bytes"],
            integrity=bool(self._record),
            naming=self.config.naming,
        )
        stats["capacity"] = Capacity(
            scope="namespace",
            used_bytes=stats["bytes"],
            bound_bytes=stats["max_bytes"],
            floor_bytes=stats["min_free_bytes"],
            free_bytes=stats["free_bytes"],
            evictions=stats["evictions"],
            policy="lru",
        )
        with self._lock:
            stats["integrity_failures"] = dict(self._failures)
            stats["read_errors"] = self._read_errors
            stats["unlisted_dirs"] = sorted(self._unlisted)
        return stats

    def _free_bytes(self) -> int:
        """Bytes free to this process on the file system under ``root`` (0 if unknown)."""
        try:
            info = os.statvfs(self.root)
        except OSError:
            return 0
        return info.f_bavail * info.f_frsize

    def _floor(self, configured: int | None) -> int:
        """Return the free-space floor: as configured, else 1 % of the file system."""
        if configured is not None:
            return configured
        probe = self.root
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        try:
            info = os.statvfs(probe)
        except OSError:
            return 0
        return info.f_blocks * info.f_frsize // FLOOR_SHARE

    def _close(self) -> None:
        self._capacity.close()
        self._io.close()
        self._meta.clear()
        self._files.forget_dirs()

    # -- paths ----------------------------------------------------------------------------------

    def path_of(self, key: str) -> str:
        """Return the path of the file that holds (or would hold) ``key``."""
        return self._layout.path(key)

    # -- reading --------------------------------------------------------------------------------

    def _open(self, path: str, key: str) -> int | None:
        """Open ``key``'s file; None if there is none, or the entry is not a regular file."""
        try:
            self.medium_faults.check("read")
            fd = open_regular(path, READ_FLAGS)
        except MISSING:
            fd = None
        except OSError as exc:
            raise io_error(f"open {key!r}", exc) from exc
        if fd is None:
            self._meta.forget(key)
        return fd

    def _read_verified(self, fd: int, key: str, views: list[memoryview], stored: int) -> bool:
        """Read the value into ``views`` (and the record beside it); return whether it is whole.

        A failed verification is counted (the caller removes the file).
        """
        if not self._record:
            return read_into(fd, views) == stored
        record = bytearray(self._record)
        size = stored - self._record
        total, crc = read_checked(fd, [*views, memoryview(record)], size)
        return total == stored and self._counted(key, check(record, key, size, crc))

    def _verified(self, key: str, views: list[memoryview], record: Buffer) -> bool:
        """Return whether ``record`` vouches for ``views``; count why not."""
        return self._counted(key, verify(record, key, views))

    def _counted(self, key: str, reason: str | None) -> bool:
        """Return whether a check found nothing wrong (``reason`` None); count why it did."""
        if reason is None:
            return True
        with self._lock:
            self._failures[reason] += 1
        logger.warning("file backend: %r failed its integrity check (%s); removed", key, reason)
        return False

    def _drop(self, key: str, path: str, reason: str | None) -> None:
        """Forget a key whose file is not a complete value and remove that file."""
        if reason is not None:
            with self._lock:
                self._failures[reason] += 1
        self._meta.forget(key)
        if self._record:
            self._discard(path)
            self._capacity.forget(key)

    def _hit(self, key: str, size: int) -> None:
        self._capacity.touch(key)
        self._meta.remember(key, size)

    def _stat(self, key: str) -> bool:
        """Return whether ``key``'s path is a regular file (anything else holds no value)."""
        try:
            self.medium_faults.check("stat")
            info = os.stat(self._layout.path(key))
        except MISSING:
            return False
        except OSError as exc:
            raise io_error(f"stat {key!r}", exc) from exc
        if not stat.S_ISREG(info.st_mode):
            self._meta.forget(key)
            return False
        self._meta.remember(key, info.st_size - self._record)
        return True

    @staticmethod
    def _discard(path: str) -> None:
        AtomicFiles.discard(path)

    def _evict_file(self, key: str) -> None:
        """Remove an evicted object (the capacity index's callback)."""
        try:
            os.unlink(self._layout.path(key))
        except MISSING:
            pass
        except OSError as exc:
            logger.warning("file backend could not evict %r: %s", key, exc)
        self._meta.forget(key)

    # -- the metadata cache ---------------------------------------------------------------------

    # -- the startup scan -----------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the owned objects already on disk (oldest first) and remove stale temps."""
        now = time.time()
        found: list[tuple[int, str, int]] = []
        stale = 0
        unlisted: list[tuple[str, OSError]] = []
        for directory, entry in self._layout.files(unlisted):
            name = entry.name
            if self._layout.is_temp(name):
                stale += self._layout.discard_stale_temp(entry, now, self.config.stale_temp_s)
                continue
            key = self._layout.key_of(name)
            if key is None or not self._owns(key):
                continue
            if self._layout.directory(key) != directory:  # not where this layout would look for it
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:  # listed but not searchable: as if it could not be listed
                unlisted.append((directory, exc))
                continue
            if not stat.S_ISREG(info.st_mode):
                continue
            found.append((info.st_mtime_ns, key, info.st_size))
        for directory, error in dict(unlisted).items():  # once a directory
            logger.warning(
                "file backend at %s: cannot list %s (%s); its objects are not indexed, every "
                "other directory is served",
                self.root,
                directory,
                error,
            )
        with self._lock:
            self._unlisted.update(directory for directory, _ in unlisted)
        found.sort()
        for _, name, size in found:
            self._capacity.add(name, size)
        evicted = self._capacity.enforce()
        if found or stale or evicted:
            logger.info(
                "file backend at %s: found %d objects (%d bytes), removed %d stale temporary "
                "files, evicted %d objects over capacity",
                self.root,
                len(found),
                self._capacity.used,
                stale,
                evicted,
            )

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<FileBackend root={self.root!r}{state}>"
