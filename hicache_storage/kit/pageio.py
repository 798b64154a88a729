"""Vectored page I/O: move a page's buffers to and from a file or a stream without staging.

A v1 page is a list of buffers (one per layer, or per K/V half); a unified object can have
thousands. The fd helpers (re-exported from :mod:`hicache_storage.vectored`) issue
``preadv``/``pwritev`` in chunks of at most :data:`IOV_MAX` buffers and loop over short
transfers; :func:`readinto_views` and :func:`write_views` do the same over any binary stream
(an ``open()`` file, an fsspec file, a socket file) through ``readinto``/``write``.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Protocol

from hicache_storage.vectored import IOV_MAX, flat, read_into, write_from

__all__ = [
    "IOV_MAX",
    "flat",
    "nbytes",
    "read_exact",
    "read_into",
    "readinto_views",
    "write_from",
    "write_views",
]


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
