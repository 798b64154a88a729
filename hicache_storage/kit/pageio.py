"""Vectored page I/O: move a page's buffers to and from a file or a stream without staging.

A v1 page is a list of buffers (one per layer, or per K/V half); a unified object can have
thousands. The fd helpers (re-exported from :mod:`hicache_storage.kit.vectored`) issue
``preadv``/``pwritev`` in chunks of at most :data:`IOV_MAX` buffers and loop over short
transfers; :func:`readinto_views` and :func:`write_views` do the same over any binary stream
(an ``open()`` file, an fsspec file, a socket file) through ``readinto``/``write``.
:func:`read_checked` and :func:`write_checked` move a page and CRC32C it in one pass, for a
backend that keeps an integrity record beside each value.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from types import ModuleType
from typing import Protocol

from hicache_storage.kit.integrity import checksum
from hicache_storage.kit.vectored import IOV_MAX, flat, read_into, write_from

__all__ = [
    "CHECK_CHUNK_BYTES",
    "IOV_MAX",
    "NATIVE_CHECKED_READS",
    "flat",
    "nbytes",
    "read_checked",
    "read_exact",
    "read_into",
    "readinto_views",
    "write_checked",
    "write_from",
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
