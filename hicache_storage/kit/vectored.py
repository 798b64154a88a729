"""Positional, vectored file I/O straight into and out of lists of buffers.

``preadv``/``pwritev`` move a page's buffers (a host pool's regions, a caller's buffer) to or
from a file in one system call, with no staging copy. These helpers add what every caller needs
around them: chunks of at most ``IOV_MAX`` buffers, loops over partial transfers, and a fallback
to ``pread``/``write`` on platforms without the vectored calls.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

__all__ = ["IOV_MAX", "advance", "flat", "read_into", "write_from"]


def _iov_max() -> int:
    try:
        value = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 1024
    return value if value > 0 else 1024


IOV_MAX = _iov_max()
"""Most buffers one ``preadv``/``pwritev`` call accepts."""


def flat(view: memoryview) -> memoryview:
    """Return ``view`` as a 1-D unsigned-byte view, so that slicing counts bytes."""
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def advance(pending: list[memoryview], index: int, done: int) -> int:
    """Consume ``done`` bytes from ``pending[index:]``; return the index of the next buffer."""
    while done and index < len(pending):
        size = pending[index].nbytes
        if done >= size:
            done -= size
            index += 1
        else:
            pending[index] = pending[index][done:]
            done = 0
    return index


def write_from(fd: int, views: Sequence[memoryview], offset: int = 0) -> None:
    """Write ``views`` back to back at ``offset``, looping over partial writes.

    Raises
    ------
    OSError
        If a write fails or makes no progress.
    """
    pending = [view for view in views if view.nbytes]
    pwritev = getattr(os, "pwritev", None)
    index = 0
    while index < len(pending):
        if pwritev is not None:
            done = pwritev(fd, pending[index : index + IOV_MAX], offset)
        else:
            done = os.pwrite(fd, pending[index], offset)
        if done <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += done
        index = advance(pending, index, done)


def read_into(fd: int, views: Sequence[memoryview], offset: int = 0) -> int:
    """Fill ``views`` from the file at ``offset``; return the bytes read (short at end of file).

    Raises
    ------
    OSError
        If a read fails.
    """
    preadv = getattr(os, "preadv", None)
    pending = [view for view in views if view.nbytes]
    total = index = 0
    while index < len(pending):
        if preadv is not None:
            done = preadv(fd, pending[index : index + IOV_MAX], offset + total)
        else:
            chunk = os.pread(fd, pending[index].nbytes, offset + total)
            done = len(chunk)
            pending[index][:done] = chunk
        if done <= 0:
            break
        total += done
        index = advance(pending, index, done)
    return total
