"""Writes of the file backend: each object reserved within the bound, written, published, settled.

A value goes to a temporary file beside its key's path and is published by ``link`` (the first
complete value wins, a reader never sees a partial one); its room in the capacity bound is
reserved first and committed or given back once the write ended (:meth:`ObjectWriter.store`).
A batch reserves its values in turn and writes the reserved together, one value a thread
(copying calls) or in one native call (host-pool pages), so it stores what one call a value
would (:meth:`ObjectWriter.store_batch`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal

from hicache_storage.errors import HiCacheError
from hicache_storage.kit import (
    PUBLISHED,
    UNLINKED,
    AtomicFiles,
    FileWrite,
    IOWorkers,
    MediumFaults,
    fsync_dir,
    nbytes,
    write_checked,
    write_files,
    write_from,
)
from hicache_storage.kit.integrity import record

from .errors import io_error, oserror
from .evictor import LRUCapacity
from .layout import Layout
from .meta import MetaCache

__all__ = ["BatchWrite", "ObjectWriter"]

BatchWrite = Callable[
    [Sequence[str], list[list[memoryview]], list[int], list[bool], dict[int, HiCacheError]], None
]
"""Writes a batch's reserved values (by index), marking each done or recording its failure."""


def _write_sealed(key: str, fd: int, views: Sequence[memoryview]) -> None:
    """Write ``views`` and then their integrity record, checksumming them as they are written."""
    size, crc = write_checked(fd, views)
    write_from(fd, [memoryview(record(key, size, crc))], size)


class ObjectWriter:
    """Publish objects under a :class:`~.layout.Layout` within a capacity bound.

    ``stored(key)`` says whether ``key`` holds a value already (the first value wins);
    ``owns(key)`` whether this instance indexes it in ``capacity``; ``record`` is the bytes of
    the integrity record written after each value (0: none); the other arguments are the
    backend's own, shared with its reads.
    """

    def __init__(
        self,
        *,
        layout: Layout,
        files: AtomicFiles,
        io: IOWorkers,
        capacity: LRUCapacity,
        meta: MetaCache,
        faults: MediumFaults,
        owns: Callable[[str], bool],
        stored: Callable[[str], bool],
        record: int,
    ) -> None:
        self._layout = layout
        self._files = files
        self._io = io
        self._capacity = capacity
        self._meta = meta
        self._faults = faults
        self._owns = owns
        self._stored = stored
        self._record = record

    def store(self, key: str, views: list[memoryview]) -> bool:
        """Publish ``views`` (concatenated, then the record) under ``key`` within the bound."""
        path = self._layout.path(key)
        if self._stored(key):
            return True
        size = nbytes(views)
        if self._owns(key) and not self._capacity.reserve(size + self._record, key):
            return False
        try:
            published = self._write(key, path, views)
        except BaseException:
            self._settle(key, size, False)
            raise
        self._settle(key, size, published)
        return True

    def _write(self, key: str, path: str, views: list[memoryview]) -> bool:
        """Write a temporary file and link it to ``path``; return False if ``path`` existed."""
        try:
            self._faults.check("write")
            temp = self._layout.temp_path(key)
            if not self._record:
                return self._files.write(path, views, temp)
            return self._files.write(path, views, temp, partial(_write_sealed, key))
        except OSError as exc:
            raise io_error(f"write {key!r}", exc) from exc

    def store_batch(
        self,
        keys: Sequence[str],
        values: list[list[memoryview]],
        write: BatchWrite,
        prepare: Callable[[str], None] | None = None,
    ) -> list[bool]:
        """Store a batch within the bound: reserve each value in turn, write the reserved together.

        When a value finds no room, the batch's own reservations may be what fills the bound:
        they are written first (then they can be evicted for it), and the value is tried again,
        so the batch stores what :meth:`store` one by one would, and a key repeated in the batch
        is found stored by its first copy. ``prepare`` runs before each key's reservation.

        Raises
        ------
        HiCacheError
            The first failure, after every other value was written.
        """
        done = [False] * len(keys)
        failures: dict[int, HiCacheError] = {}
        todo: list[int] = []
        for i, key in enumerate(keys):
            admitted = self._admit(key, nbytes(values[i]), prepare)
            if admitted == "full" and todo:
                write(keys, values, todo, done, failures)
                todo = []
                admitted = self._admit(key, nbytes(values[i]), prepare)
            if isinstance(admitted, HiCacheError):
                failures[i] = admitted
            elif admitted == "stored":
                done[i] = True
            elif admitted == "reserved":
                todo.append(i)
        write(keys, values, todo, done, failures)
        if failures:
            raise failures[min(failures)]
        return done

    def _admit(
        self, key: str, size: int, prepare: Callable[[str], None] | None
    ) -> Literal["stored", "reserved", "full"] | HiCacheError:
        """Ready ``key`` for a batch write: stored already, its room reserved, or no room.

        A failed check or preparation is returned, the batch's other keys going on.
        """
        try:
            if self._stored(key):
                return "stored"
            if prepare is not None:
                prepare(key)
        except HiCacheError as exc:
            return exc
        except OSError as exc:
            return io_error(f"write {key!r}", exc)
        if self._owns(key) and not self._capacity.reserve(size + self._record, key):
            return "full"
        return "reserved"

    def write_values(
        self,
        keys: Sequence[str],
        values: list[list[memoryview]],
        todo: list[int],
        done: list[bool],
        failures: dict[int, HiCacheError],
    ) -> None:
        """Write the reserved values ``todo``, ``io_threads`` at once; mark each done or failed."""
        outcomes = self._io.map(self._write_reserved, [(keys[i], values[i]) for i in todo])
        for i, outcome in zip(todo, outcomes, strict=True):
            if outcome is None:
                done[i] = True
            else:
                failures[i] = outcome

    def _write_reserved(self, item: tuple[str, list[memoryview]]) -> HiCacheError | None:
        """Write one reserved value and settle its reservation; return its failure, if any."""
        key, views = item
        size = nbytes(views)
        try:
            published = self._write(key, self._layout.path(key), views)
        except HiCacheError as exc:
            self._settle(key, size, False)
            return exc
        except BaseException:
            self._settle(key, size, False)
            raise
        self._settle(key, size, published)
        return None

    def prepare_page(self, key: str) -> None:
        """Check the medium and make the key's directory (:func:`write_files` needs it)."""
        self._faults.check("write")
        self._files.ensure_dir(os.path.dirname(self._layout.path(key)))

    def write_pages(
        self,
        keys: Sequence[str],
        pages: list[list[memoryview]],
        todo: list[int],
        done: list[bool],
        failures: dict[int, HiCacheError],
    ) -> None:
        """Write the reserved pages ``todo`` in one batch; mark each done or record its failure."""
        if not todo:
            return
        paths = [self._layout.path(keys[i]) for i in todo]
        temps = [self._layout.temp_path(keys[i]) for i in todo]
        try:
            results = write_files(
                paths,
                temps,
                [pages[i] for i in todo],
                [keys[i] for i in todo] if self._record else None,
                self._io,
                fsync=self._files.fsync,
            )
        except BaseException:
            for i in todo:
                self._settle(keys[i], nbytes(pages[i]), False)
            raise
        for i, path, temp, result in zip(todo, paths, temps, results, strict=True):
            key, size = keys[i], nbytes(pages[i])
            try:
                published = self._published(key, path, temp, pages[i], result)
            except HiCacheError as exc:
                failures[i] = exc
                self._settle(key, size, False)
                continue
            except OSError as exc:
                failures[i] = io_error(f"write {key!r}", exc)
                self._settle(key, size, False)
                continue
            self._settle(key, size, published)
            done[i] = True

    def _published(
        self, key: str, path: str, temp: str, views: list[memoryview], result: FileWrite
    ) -> bool:
        """Finish one page of :meth:`batch_set_v1`; return whether this call published it.

        Raises
        ------
        OSError
            The page's write failed (its errno), or publishing by ``rename`` failed.
        HiCacheError
            The page's second try, after its directory was removed behind the cache, failed.
        """
        if result.error == errno.ENOENT:  # a directory removed behind the cache: once more
            self._files.forget_dirs()
            return self._write(key, path, views)
        if result.error:
            raise oserror(result.error)
        if result.outcome == UNLINKED:
            try:
                published = self._files.publish(temp, path)
            finally:
                self._files.discard(temp)
        else:
            published = result.outcome == PUBLISHED
        if published and self._files.fsync:
            fsync_dir(os.path.dirname(path))
        return published

    def _settle(self, key: str, size: int, published: bool) -> None:
        """Commit or give back the reservation of a value of ``size`` bytes (and its record).

        A key that is now stored is remembered.
        """
        owned = self._owns(key)
        if published:
            if owned:
                self._capacity.commit(key, size + self._record)
            self._meta.remember(key, size)
        elif owned:
            self._capacity.abort(size + self._record, key)
