"""Vectored page I/O: move a page's buffers to and from a file or a stream without staging.

A v1 page is a list of buffers (one per layer, or per K/V half); a unified object can have
thousands. The fd helpers (re-exported from :mod:`hicache_storage.kit.vectored`) issue
``preadv``/``pwritev`` in chunks of at most :data:`IOV_MAX` buffers and loop over short
transfers; :func:`readinto_views` and :func:`write_views` do the same over any binary stream
(an ``open()`` file, an fsspec file, a socket file) through ``readinto``/``write``.
:func:`read_checked` and :func:`write_checked` move a page and CRC32C it in one pass, for a
backend that keeps an integrity record beside each value.

:func:`read_files` and :func:`write_files` move a whole batch of pages, one file each, and
:func:`read_runs` and :func:`write_runs` a batch of values kept in ranges of large files. Where the
native helper is built, the batch runs on threads of its own and the caller gives up the GIL once
for all of it: a batch moved page by page from Python threads takes the GIL back after every
``open``, read and ``close``, each time from the thread that launches a model's kernels, and on
the GPU host a forward beside such a batch ran 16 times slower (``docs/performance.md``).
Elsewhere the same steps run page by page on an :class:`~hicache_storage.kit.IOWorkers`.

Only a regular file is ever a value (:func:`open_regular`, :func:`holds_value`): a FIFO, a
directory, a socket or a device at a value's path is never read, never waited on (a FIFO's
``open`` would wait for a writer forever), never taken for a stored value.

Every route of a batch call, native or Python, one page or many, checks its arguments the same
way first (:func:`check_batch`): sequences that do not align, or a path holding a NUL byte (which
the OS would take for the end of the path, naming another file), raise ``ValueError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple, Protocol

from hicache_storage.kit.integrity import checksum, key_digest, record
from hicache_storage.kit.parallel import IOWorkers
from hicache_storage.kit.vectored import IOV_MAX, flat, read_into, write_from

__all__ = [
    "CHECK_CHUNK_BYTES",
    "IOV_MAX",
    "NATIVE_CHECKED_READS",
    "NOT_REGULAR",
    "NO_LINK_ERRORS",
    "PUBLISHED",
    "PRESENT",
    "UNLINKED",
    "READ_FLAGS",
    "WRITE_FLAGS",
    "FileRead",
    "FileWrite",
    "RunRead",
    "RunWrite",
    "check_batch",
    "flat",
    "holds_value",
    "nbytes",
    "open_regular",
    "read_checked",
    "read_exact",
    "read_files",
    "read_into",
    "read_runs",
    "readinto_views",
    "write_checked",
    "write_files",
    "write_from",
    "write_runs",
    "write_views",
]


def _native() -> ModuleType | None:
    try:
        from hicache_storage.kit import _checkedio
    except ImportError:  # not built here (no compiler, not x86-64): the Python path serves
        return None
    return _checkedio


_CHECKED = _native()

NATIVE_CHECKED_READS = _CHECKED is not None
"""Whether :func:`read_checked` runs as one native loop (else a read, then a checksum)."""

CHECK_CHUNK_BYTES = 256 << 10
"""Bytes :func:`read_checked` reads before checksumming them: small enough to be checksummed
from the core's own cache (measured in ``scripts/probe_verify.py``), big enough that a system
call per chunk costs little."""


def read_checked(
    fd: int,
    views: Sequence[memoryview],
    checked: int,
    offset: int = 0,
    *,
    chunk_bytes: int = CHECK_CHUNK_BYTES,
) -> tuple[int, int]:
    """Fill ``views`` from ``fd`` at ``offset``; return the bytes read and a CRC32C.

    The CRC32C covers the first ``checked`` bytes read (a value whose integrity record follows
    it in the same file: pass the record's buffer as the last view and the value's length as
    ``checked``). Where the native helper is built, each chunk of ``chunk_bytes`` is checksummed
    right after it is read, while it is still in the CPU cache, in one loop that never takes the
    GIL; elsewhere this is :func:`read_into` followed by
    ``hicache_storage.kit.integrity.checksum``. A short file gives fewer bytes (and the CRC32C
    of those read).

    Raises
    ------
    OSError
        If a read fails.
    """
    if _CHECKED is not None:
        total, crc = _CHECKED.read_checked(fd, views, offset, chunk_bytes, checked)
        return int(total), int(crc)
    total = read_into(fd, views, offset)
    return total, checksum(_prefix(views, min(checked, total)))


def write_checked(
    fd: int,
    views: Sequence[memoryview],
    offset: int = 0,
    *,
    chunk_bytes: int = CHECK_CHUNK_BYTES,
) -> tuple[int, int]:
    """Write ``views`` back to back to ``fd`` at ``offset``; return the bytes and their CRC32C.

    The mirror of :func:`read_checked`: with the native helper each chunk is checksummed just
    before it is written, so the bytes are read from memory once, in a loop that never takes
    the GIL; elsewhere it is ``hicache_storage.kit.integrity.checksum``, then
    :func:`write_from`.

    Raises
    ------
    OSError
        If a write fails or makes no progress.
    """
    if _CHECKED is not None:
        total, crc = _CHECKED.write_checked(fd, views, offset, chunk_bytes)
        return int(total), int(crc)
    crc = checksum(views)
    write_from(fd, views, offset)
    return nbytes(views), crc


READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
"""How :func:`read_files` opens a page's file unless told otherwise."""

NOT_REGULAR = -1
"""The :attr:`FileRead.size` of a path that names no regular file: never read, a miss."""

_NOT_A_FILE = frozenset({errno.ENXIO, errno.ENODEV, errno.EISDIR})
"""What ``open`` fails with on a socket, a device without a driver, or a directory opened for
writing: the path names something that is not a file, which is not a failure of the medium."""

_GONE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})
"""What ``stat`` fails with where a path names nothing: no entry, or a dangling link."""


def open_regular(path: str | bytes, flags: int = READ_FLAGS, mode: int = 0o644) -> int | None:
    """Open ``path`` with ``flags``; return its descriptor if it is a regular file, else None.

    The ``open`` itself never waits: it is made with ``O_NONBLOCK`` (a FIFO with no writer
    would otherwise hold it forever, beyond any deadline, outside the GIL's reach of a timeout)
    and ``O_NOCTTY``, then ``fstat`` decides, and only a regular file is kept, switched back to
    blocking I/O unless ``flags`` asked for ``O_NONBLOCK``. A FIFO, a directory, a socket, a
    device (or a symlink to one) is closed again, and None says so. With ``O_CREAT`` a missing
    file is created as usual.

    Raises
    ------
    OSError
        If ``open`` or ``fstat`` fails (``FileNotFoundError`` for a missing file).
    """
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY, mode)
    except OSError as exc:
        if exc.errno in _NOT_A_FILE:
            return None
        raise
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular and not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        return None
    return fd


def holds_value(path: str) -> bool:
    """Return whether ``path`` names a regular file (through symlinks), which alone is a value.

    False for a path that names nothing (a dangling symlink included) or anything else: a
    FIFO, a directory, a socket, a device. ``stat`` opens nothing, so it never waits.

    Raises
    ------
    OSError
        If ``stat`` fails otherwise (the answer is unknown).
    """
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError as exc:
        if exc.errno in _GONE:
            return False
        raise


def check_batch(
    paths: Sequence[str | bytes],
    temps: Sequence[str | bytes] | None = None,
    **aligned: Sequence[object] | None,
) -> None:
    """Refuse a batch's arguments unless they align and every path is one the OS can take.

    The one validation of every route of :func:`read_files` and :func:`write_files` (native or
    Python, one page or many), so a call is refused or served the same way wherever it runs.
    ``aligned`` names the other per-page sequences (``pages=``, ``checked=``, ...; None for one
    not given).

    Raises
    ------
    ValueError
        If a sequence's length is not the number of paths, or a path holds a NUL byte (``open``
        would stop there and name another file).
    """
    n = len(paths)
    for name, items in {"temporary paths": temps, **aligned}.items():
        if items is not None and len(items) != n:
            raise ValueError(f"paths and {name} must align: got {n} paths, {len(items)} {name}")
    for path in (*paths, *(temps or ())):
        if (path.find("\x00") if isinstance(path, str) else path.find(b"\x00")) >= 0:
            raise ValueError(f"a path must not contain a NUL byte: {path!r}")


class FileRead(NamedTuple):
    """What :func:`read_files` did with one page's file."""

    error: int
    """0, or the errno of the failed ``open``, ``fstat`` or read (the page may be part-filled)."""
    size: int
    """The file's size in bytes (0 if it could not be opened, :data:`NOT_REGULAR` if the path
    names no regular file: a FIFO, a directory, a socket or a device, never read)."""
    read: int
    """Bytes read: 0 when the file's size is not the page's (the page is left untouched)."""
    crc: int
    """CRC32C of the first ``checked`` bytes read."""


PRESENT = 0
"""A :class:`FileWrite` outcome: the path already held a value (the first complete one wins)."""
PUBLISHED = 1
"""A :class:`FileWrite` outcome: this call published the value."""
UNLINKED = 2
"""A :class:`FileWrite` outcome: written, but not published by ``link``, because the filesystem
cannot hard-link or the path holds no value (a FIFO, a directory, a dangling symlink ...); the
temporary file is left for the caller to publish
(:meth:`~hicache_storage.kit.AtomicFiles.publish` replaces such an entry)."""


class FileWrite(NamedTuple):
    """What :func:`write_files` did with one page."""

    error: int
    """0, or the errno of the failed step (the temporary file is removed)."""
    outcome: int
    """:data:`PUBLISHED`, :data:`PRESENT` or :data:`UNLINKED` (meaningful when ``error`` is 0)."""


def read_files(
    paths: Sequence[str],
    pages: Sequence[Sequence[memoryview]],
    checked: Sequence[int],
    workers: IOWorkers,
    *,
    flags: int = READ_FLAGS,
    chunk_bytes: int = CHECK_CHUNK_BYTES,
) -> list[FileRead]:
    """Fill each page's buffers from its own file; return what happened to each, in order.

    A file is read only when its size is the sum of its page's buffers (give a value's record
    buffer as the page's last); the CRC32C covers its first ``checked[i]`` bytes. A path that
    names no regular file is never read nor waited on (:func:`open_regular`): its size is
    :data:`NOT_REGULAR`. Up to ``workers.threads`` pages are in flight across the calls sharing
    ``workers``; failures are reported per page, never raised.

    Raises
    ------
    ValueError
        If the arguments do not align or a path holds a NUL byte (:func:`check_batch`).
    BackendClosedError
        If ``workers`` is closed.
    """
    check_batch(paths, pages=pages, checked=checked)
    if _CHECKED is not None and len(paths) > 1:
        with workers.share(len(paths)) as threads:
            raw = _CHECKED.read_files(
                [os.fsencode(path) for path in paths], pages, checked, flags, chunk_bytes, threads
            )
        return [FileRead(*row) for row in raw]

    def one(i: int) -> FileRead:
        return _read_file(paths[i], pages[i], checked[i], flags, chunk_bytes)

    return workers.map(one, range(len(paths)))


def _read_file(
    path: str, views: Sequence[memoryview], checked: int, flags: int, chunk_bytes: int
) -> FileRead:
    try:
        fd = open_regular(path, flags)
    except OSError as exc:
        return FileRead(exc.errno or errno.EIO, 0, 0, 0)
    if fd is None:
        return FileRead(0, NOT_REGULAR, 0, 0)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes(views):
            return FileRead(0, size, 0, 0)
        total, crc = read_checked(fd, views, checked, chunk_bytes=chunk_bytes)
        return FileRead(0, size, total, crc)
    except OSError as exc:
        return FileRead(exc.errno or errno.EIO, 0, 0, 0)
    finally:
        os.close(fd)


def write_files(
    paths: Sequence[str],
    temps: Sequence[str],
    pages: Sequence[Sequence[memoryview]],
    keys: Sequence[str] | None,
    workers: IOWorkers,
    *,
    fsync: bool = False,
    chunk_bytes: int = CHECK_CHUNK_BYTES,
) -> list[FileWrite]:
    """Write each page to a new file ``temps[i]`` and publish it as ``paths[i]``; report each.

    With ``keys`` every file ends with its key's integrity record
    (:func:`~hicache_storage.kit.integrity.record`), its CRC32C computed while the page is
    written.
    ``link(temp, path)`` publishes, so the first complete value wins and a reader never sees a
    partial one; the temporary file is removed unless the filesystem cannot hard-link
    (:data:`UNLINKED`) or the path holds no value but some other entry (:func:`holds_value`),
    which the caller replaces. Directories must exist. Failures are reported per page, never
    raised.

    Raises
    ------
    ValueError
        If the arguments do not align or a path holds a NUL byte (:func:`check_batch`).
    BackendClosedError
        If ``workers`` is closed.
    """
    check_batch(paths, temps, pages=pages, keys=keys)
    if _CHECKED is not None and len(paths) > 1:
        encoded = [os.fsencode(path) for path in paths], [os.fsencode(temp) for temp in temps]
        digests = None if keys is None else [key_digest(key) for key in keys]
        with workers.share(len(paths)) as threads:
            raw = _CHECKED.write_files(*encoded, pages, digests, fsync, chunk_bytes, threads)
        return [FileWrite(*row) for row in raw]

    def one(i: int) -> FileWrite:
        key = None if keys is None else keys[i]
        return _write_file(paths[i], temps[i], pages[i], key, fsync, chunk_bytes)

    return workers.map(one, range(len(paths)))


NO_LINK_ERRORS = frozenset(
    code
    for code in (
        errno.EPERM,
        getattr(errno, "ENOTSUP", None),
        getattr(errno, "EOPNOTSUPP", None),
        errno.EXDEV,
        getattr(errno, "ENOSYS", None),
    )
    if code is not None
)
"""Errors of ``link()`` that mean "this filesystem cannot hard-link", not "this write failed"."""

WRITE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
"""How a temporary file is created: a fresh file, never one that exists."""


def _write_file(
    path: str,
    temp: str,
    views: Sequence[memoryview],
    key: str | None,
    fsync: bool,
    chunk_bytes: int,
) -> FileWrite:
    try:
        fd = os.open(temp, WRITE_FLAGS, 0o644)
    except OSError as exc:
        return FileWrite(exc.errno or errno.EIO, PRESENT)
    try:
        try:
            size, crc = write_checked(fd, views, chunk_bytes=chunk_bytes)
            if key is not None:
                write_from(fd, [memoryview(record(key, size, crc))], size)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.link(temp, path)
    except FileExistsError:
        try:
            held = holds_value(path)
        except OSError:
            held = False  # unknown: the caller's publish decides, or fails
        if not held:  # an entry that is no value: the caller replaces it with the temp file
            return FileWrite(0, UNLINKED)
        outcome = FileWrite(0, PRESENT)
    except OSError as exc:
        if exc.errno in NO_LINK_ERRORS:
            return FileWrite(0, UNLINKED)
        outcome = FileWrite(exc.errno or errno.EIO, PRESENT)
    else:
        outcome = FileWrite(0, PUBLISHED)
    with contextlib.suppress(OSError):
        os.unlink(temp)
    return outcome


class RunRead(NamedTuple):
    """What :func:`read_runs` did with one run."""

    error: int
    """0, or the errno of the failed read (the run stopped there)."""
    read: int
    """Bytes read over all the run's ranges (short if a file ended first)."""
    crc: int
    """CRC32C of the run's first ``checked`` bytes read."""


Range = tuple[int, int, Sequence[memoryview]]
"""One range of a run: an open file descriptor, an offset and the buffers filled from there."""


def read_runs(
    runs: Sequence[Sequence[Range]],
    checked: Sequence[int],
    workers: IOWorkers,
    *,
    chunk_bytes: int = CHECK_CHUNK_BYTES,
) -> list[RunRead]:
    """Read each run, one value stored in ranges of open files, and CRC32C it as it arrives.

    For a medium that keeps values in slots of large files (3FS): a run's ranges are read in
    order, the CRC32C continued across them over the run's first ``checked[i]`` bytes (give the
    value's ranges first, then its integrity record's). Up to ``workers.threads`` runs are in
    flight, on the native helper's threads where it is built (the GIL given up once a batch);
    a run stops at its first failed or short range. Failures are reported, never raised.

    Raises
    ------
    ValueError
        If ``checked`` does not hold one size per run.
    BackendClosedError
        If ``workers`` is closed.
    """
    if len(checked) != len(runs):  # every route: a run without a size is refused, not skipped
        raise ValueError(f"runs and checked must align: got {len(runs)} runs, {len(checked)} sizes")
    if _CHECKED is not None and len(runs) > 1:
        with workers.share(len(runs)) as threads:
            raw = _CHECKED.read_runs(runs, checked, chunk_bytes, threads)
        return [RunRead(*row) for row in raw]

    def one(i: int) -> RunRead:
        return _read_run(runs[i], checked[i])

    return workers.map(one, range(len(runs)))


def _read_run(ranges: Sequence[Range], checked: int) -> RunRead:
    total = 0
    views: list[memoryview] = []
    for fd, offset, buffers in ranges:
        try:
            got = read_into(fd, buffers, offset)
        except OSError as exc:
            return RunRead(exc.errno or errno.EIO, total, 0)
        total += got
        views.extend(buffers)
        if got < nbytes(buffers):
            break
    return RunRead(0, total, checksum(_prefix(views, min(checked, total))))


class RunWrite(NamedTuple):
    """What :func:`write_runs` did with one run."""

    error: int
    """0, or the errno of the failed write (the run stopped there)."""
    written: int
    """Bytes written over all the run's ranges."""
    crc: int
    """CRC32C of the bytes written, for the value's integrity record."""


def write_runs(
    runs: Sequence[Sequence[Range]],
    workers: IOWorkers,
    *,
    chunk_bytes: int = CHECK_CHUNK_BYTES,
) -> list[RunWrite]:
    """Write each run, one value stored in ranges of open files, and CRC32C it as it goes.

    The mirror of :func:`read_runs`: a run's ranges are written in order, each chunk
    checksummed just before it is written (the write then reads it from the cache), the CRC32C
    continued across the run, so a value's integrity record
    (:func:`~hicache_storage.kit.integrity.record`) costs no second pass over its bytes. Up to
    ``workers.threads`` runs are in flight, on the native helper's threads where it is built
    (the GIL given up once a batch); a run stops at its first failed range. Failures are
    reported, never raised.

    Raises
    ------
    BackendClosedError
        If ``workers`` is closed.
    """
    if _CHECKED is not None and runs:
        with workers.share(len(runs)) as threads:
            raw = _CHECKED.write_runs(runs, chunk_bytes, threads)
        return [RunWrite(*row) for row in raw]
    return workers.map(lambda i: _write_run(runs[i]), range(len(runs)))


def _write_run(ranges: Sequence[Range]) -> RunWrite:
    total = 0
    views: list[memoryview] = []
    for fd, offset, buffers in ranges:
        try:
            write_from(fd, buffers, offset)
        except OSError as exc:
            return RunWrite(exc.errno or errno.EIO, total, 0)
        total += nbytes(buffers)
        views.extend(buffers)
    return RunWrite(0, total, checksum(views))


def _prefix(views: Sequence[memoryview], size: int) -> list[memoryview]:
    """Return the first ``size`` bytes of ``views`` as views."""
    out: list[memoryview] = []
    for view in views:
        if size <= 0:
            break
        part = flat(view)[:size]
        out.append(part)
        size -= part.nbytes
    return out


class _Readable(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


class _Writable(Protocol):
    def write(self, buffer: memoryview, /) -> int | None: ...


def nbytes(views: Sequence[memoryview]) -> int:
    """Return the total size of ``views`` in bytes."""
    return sum(view.nbytes for view in views)


def read_exact(fd: int, views: Sequence[memoryview], offset: int = 0) -> bool:
    """Fill every byte of ``views`` from ``fd`` at ``offset``; return False if the file is short.

    Raises
    ------
    OSError
        If a read fails.
    """
    return read_into(fd, views, offset) == nbytes(views)


def readinto_views(stream: _Readable, views: Sequence[memoryview]) -> int:
    """Fill ``views`` in order from ``stream``; return the bytes read (short at end of stream).

    Each buffer is filled by as many ``readinto`` calls as it takes, so a stream that returns
    fewer bytes than asked (every network stream does) still fills every byte.
    """
    total = 0
    for view in views:
        target = flat(view)
        done = 0
        while done < target.nbytes:
            got = stream.readinto(target[done:])
            if not got:
                return total + done
            done += got
        total += done
    return total


def write_views(stream: _Writable, views: Sequence[memoryview]) -> int:
    """Write every byte of ``views`` in order to ``stream``; return the bytes written.

    Raises
    ------
    OSError
        If the stream accepts no bytes of a write (it would otherwise loop forever).
    """
    total = 0
    for view in views:
        pending = flat(view)
        while pending.nbytes:
            done = stream.write(pending)
            if done is None:  # a raw stream in non-blocking mode, or a file that writes it all
                done = pending.nbytes
            if done <= 0:
                raise OSError(errno.EIO, "write made no progress")
            pending = pending[done:]
            total += done
    return total
