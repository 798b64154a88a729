"""One file per key: the fan-out path scheme and first-complete-value-wins publishing.

:class:`FanoutPaths` places ``key`` at ``root/ab/cd/key``, where ``abcd`` are the first four hex
digits of ``blake2b(key)``: 65,536 directories keep each one small at millions of objects.
Keys obey the key rule (no separators, no leading dot), so a key always names a plain file in
its directory and names starting with a dot are free for temporary files.

:class:`AtomicFiles` writes a value to a temporary file beside its key, optionally fsyncs it,
and publishes it with ``link(temp, key)``, which fails if the key exists: the first complete
value wins and a reader never sees a partial object. A writer killed half way leaves only a
temporary file (:func:`is_temp` tells a cleanup scan which). Filesystems without hard links
publish with ``rename`` when the key is absent.

Only a regular file is a value (:func:`~hicache_storage.kit.pageio.holds_value`). Any other
entry at a key's path (a FIFO, a directory, a socket, a device, a symlink to one of those or to
nothing) would otherwise make ``link`` fail forever and the key look stored though nothing
reads it: :func:`clear_entry` moves it aside and removes it, and the value is published in its
place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable, Sequence

from hicache_storage.kit.pageio import NO_LINK_ERRORS, WRITE_FLAGS, holds_value
from hicache_storage.kit.vectored import write_from

__all__ = [
    "TEMP_MARK",
    "AtomicFiles",
    "FanoutPaths",
    "clear_entry",
    "fsync_dir",
    "is_temp",
    "temp_name",
]

logger = logging.getLogger(__name__)

TEMP_MARK = ".tmp."
"""What every temporary file name contains (after a leading dot)."""

PUBLISH_ATTEMPTS = 64
"""Links :meth:`AtomicFiles.publish` tries before it gives up. Each retry follows a key deleted
between a failed link and the look at what was there (a deleter racing the writer), so 64 is
far past what a real race repeats, and still bounds a writer that something keeps racing."""

_FANOUT_DIR = re.compile(r"[0-9a-f]{2}")
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)


def temp_name(key: str) -> str:
    """Return a fresh temporary file name for a value of ``key``.

    ``.<key>.tmp.<pid>.<12 hex>``: at most 230 bytes for the longest valid key, under the
    255-byte ``NAME_MAX`` of common filesystems.
    """
    return f".{key}{TEMP_MARK}{os.getpid()}.{secrets.token_hex(6)}"


def is_temp(name: str) -> bool:
    """Return whether file name ``name`` is a temporary file of :func:`temp_name`."""
    return name.startswith(".") and TEMP_MARK in name


class FanoutPaths:
    """Where each key's file lives under ``root``.

    Parameters
    ----------
    root
        The directory (or object-store prefix) holding the objects.
    fanout
        Spread keys over ``root/ab/cd/`` (True) or keep them all in ``root`` (False).
    sep
        The path separator: ``os.sep`` for local paths, ``"/"`` for fsspec and object stores.
    """

    def __init__(self, root: str, *, fanout: bool = True, sep: str = os.sep) -> None:
        self.root = root.rstrip(sep) or sep
        self.fanout = fanout
        self.sep = sep
        self._prefix = self.root if self.root.endswith(sep) else self.root + sep

    def directory(self, key: str) -> str:
        """Return the directory that holds ``key``."""
        if not self.fanout:
            return self.root
        digest = hashlib.blake2b(key.encode(), digest_size=2).hexdigest()
        return f"{self._prefix}{digest[:2]}{self.sep}{digest[2:]}"

    def path(self, key: str) -> str:
        """Return the path of ``key``'s file."""
        return f"{self.directory(key)}{self.sep}{key}"

    def temp_path(self, key: str) -> str:
        """Return a fresh temporary path beside ``key``'s file."""
        return f"{self.directory(key)}{self.sep}{temp_name(key)}"

    @staticmethod
    def is_fanout_dir(name: str) -> bool:
        """Return whether directory name ``name`` is one level of the fan-out."""
        return _FANOUT_DIR.fullmatch(name) is not None


class AtomicFiles:
    """Publishes values as files, first complete value wins, on a local or mounted filesystem.

    The directories it has made are remembered, so a steady write costs no ``mkdir``.
    Not thread-hostile: concurrent writers of one key race on ``link`` and exactly one wins.

    Parameters
    ----------
    fsync
        Flush each value and its directory entry to stable storage before reporting it stored.
    """

    def __init__(self, *, fsync: bool = False) -> None:
        self.fsync = fsync
        self._dirs: set[str] = set()

    def write(
        self,
        path: str,
        views: Sequence[memoryview],
        temp: str,
        writer: Callable[[int, Sequence[memoryview]], object] = write_from,
    ) -> bool:
        """Write ``views`` back to back into ``temp``, then publish it as ``path``.

        Returns whether this call published the value (False: ``path`` already held one).
        The temporary file is gone when the call returns, whatever happened. ``writer`` fills
        the open file (for a backend that appends an integrity record computed while writing).

        Raises
        ------
        OSError
            If a directory, the temporary file or the write failed.
        """
        directory = os.path.dirname(path)
        self.ensure_dir(directory)
        try:
            fd = os.open(temp, WRITE_FLAGS, 0o644)
        except FileNotFoundError:  # the directory was removed behind our cache
            self._dirs.discard(directory)
            self.ensure_dir(directory)
            fd = os.open(temp, WRITE_FLAGS, 0o644)
        try:
            try:
                writer(fd, views)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            published = self.publish(temp, path)
            if published and self.fsync:
                fsync_dir(directory)
        finally:
            self.discard(temp)
        return published

    def ensure_dir(self, directory: str) -> None:
        """Create ``directory`` and missing parents (fsynced into their parents with ``fsync``)."""
        if directory in self._dirs:
            return
        missing = []
        path = directory
        while path not in self._dirs and not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            if self.fsync:
                fsync_dir(os.path.dirname(path))
        self._dirs.add(directory)

    def forget_dirs(self) -> None:
        """Forget which directories exist (after a cleanup that may have removed them)."""
        self._dirs.clear()

    @staticmethod
    def publish(temp: str, path: str) -> bool:
        """Make ``temp`` visible as ``path`` unless ``path`` holds a value; return whether it did.

        An entry at ``path`` that holds no value (a FIFO, a directory, a dangling symlink ...)
        is cleared (:func:`clear_entry`) and ``temp`` published in its place: such an entry
        never keeps a key from being stored, nor passes for its value.

        Raises
        ------
        OSError
            If publishing failed, or ``path`` still holds no value after it was cleared once
            (something keeps putting an entry there).
        """
        clears = 0
        for _ in range(PUBLISH_ATTEMPTS):
            try:
                os.link(temp, path)
            except FileExistsError:
                if holds_value(path):
                    return False
                if not os.path.lexists(path):
                    continue  # deleted between the link and the look: try again
                if clears == 2:
                    break
                clear_entry(path)
                clears += 1
                continue
            except OSError as exc:
                if exc.errno not in NO_LINK_ERRORS:
                    raise
            else:
                return True
            if os.path.lexists(path):
                if holds_value(path):
                    return False
                clear_entry(path)
            os.rename(temp, path)
            return True
        raise OSError(errno.EEXIST, f"{path} holds no value and was not replaced", path)

    @staticmethod
    def discard(path: str) -> None:
        """Remove ``path`` if it is there; ignore any failure."""
        with contextlib.suppress(OSError):
            os.unlink(path)


def clear_entry(path: str) -> None:
    """Take away the entry at ``path``, which holds no value, whatever it is, following no link.

    It is first renamed to a fresh temporary name beside it (atomic, for a directory too), so
    no reader or writer of the key meets it half removed. If a writer published a value there
    in the meantime, that value is what moved: it is linked back and nothing is lost. A FIFO, a
    socket, a device node or a symlink is then unlinked (the entry only: no data goes with it,
    no link is followed); an empty directory is removed, and one that holds anything stays,
    under its temporary name, with a warning: a store never deletes files it did not write.

    Raises
    ------
    OSError
        If the entry cannot be moved or removed (a missing one is fine).
    """
    directory, name = os.path.split(path)
    aside = os.path.join(directory, temp_name(name.lstrip(".")))
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    mode = os.lstat(aside).st_mode
    if stat.S_ISREG(mode):  # a value published meanwhile: it goes back
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        os.unlink(aside)
    elif not stat.S_ISDIR(mode):
        os.unlink(aside)
    else:
        try:
            os.rmdir(aside)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            logger.warning(
                "%s was a directory where a value belongs; it holds files, so it was moved to "
                "%s and kept",
                path,
                aside,
            )


def fsync_dir(directory: str) -> None:
    """Flush ``directory``'s entries (a new or renamed file in it) to stable storage."""
    fd = os.open(directory, _DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
