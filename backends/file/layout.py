"""Where the file backend's objects live under its root, and the walk that finds them.

A key's object is ``root/ab/cd/<key>`` with fan-out (``abcd``: the first hex digits of a hash
of the key), else ``root/<key>``; with SGLang's names it is ``root/<key>.bin``
(:data:`SGLANG_SUFFIX`). Temporary files start with a dot, so they never name a key. The walk
(:meth:`Layout.files`) lists the directories this layout puts objects in and yields their
regular files; a fan-out directory that cannot be listed costs what it holds, never the walk.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

from hicache_storage.errors import InvalidKeyError
from hicache_storage.keys.validation import validate_key
from hicache_storage.kit import AtomicFiles, FanoutPaths, MediumFaults, is_temp

from .errors import MISSING, io_error

__all__ = ["SGLANG_SUFFIX", "Layout", "is_key"]

SGLANG_SUFFIX = ".bin"
"""What SGLang's ``HiCacheFile`` appends to a key to name its file."""

_OUR_TEMP = re.compile(r"\.[A-Za-z0-9][A-Za-z0-9_.\-]*\.tmp\.[0-9]+\.[0-9a-f]{12}")
"""Exactly the names :func:`hicache_storage.kit.temp_name` makes (a strict :func:`is_temp`)."""

Unlisted = list[tuple[str, OSError]]
"""Directories a walk could not list, with why."""


def is_key(name: str) -> bool:
    """Return whether ``name`` is a valid key."""
    try:
        validate_key(name)
    except InvalidKeyError:
        return False
    return True


def _is_our_temp(name: str) -> bool:
    """Return whether ``name`` is exactly one of our temporary names (never SGLang's)."""
    return _OUR_TEMP.fullmatch(name) is not None


class Layout:
    """The paths of a store's objects under ``root``, and the walk over them.

    ``compat`` lays objects out as SGLang's ``HiCacheFile`` does (no fan-out, ``.bin`` names,
    and only our exact temporary names are temporary files, never SGLang's); ``faults`` is
    checked before each listing (the suite's fault hook).
    """

    def __init__(self, root: str, *, fanout: bool, compat: bool, faults: MediumFaults) -> None:
        self.root = root
        self.compat = compat
        self.suffix = SGLANG_SUFFIX if compat else ""
        self.is_temp: Callable[[str], bool] = _is_our_temp if compat else is_temp
        self.paths = FanoutPaths(root, fanout=fanout)
        self._faults = faults

    def directory(self, key: str) -> str:
        """Return the directory that holds (or would hold) ``key``'s object."""
        return self.paths.directory(key)

    def path(self, key: str) -> str:
        """Return the path of the file that holds (or would hold) ``key``."""
        return self.paths.path(key) + self.suffix

    def temp_path(self, key: str) -> str:
        """Return a fresh temporary path beside ``key``'s object."""
        return self.paths.temp_path(key)

    def key_of(self, name: str) -> str | None:
        """Return the key whose object file is named ``name``, or None if it names no object."""
        if self.compat:
            if not name.endswith(SGLANG_SUFFIX):
                return None
            name = name[: -len(SGLANG_SUFFIX)]
        return name if is_key(name) else None

    def holds_suffix(self, suffix: str) -> bool:
        """Whether ``root`` holds an object whose key ends in ``suffix`` (SGLang's flat names)."""
        ending = suffix + SGLANG_SUFFIX
        try:
            with os.scandir(self.root) as entries:
                return any(
                    entry.name.endswith(ending) and is_key(entry.name[: -len(SGLANG_SUFFIX)])
                    for entry in entries
                )
        except OSError as exc:
            raise io_error(f"list {self.root!r}", exc) from exc

    def files(self, unlisted: Unlisted) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """Yield ``(directory, entry)`` for every regular file in the object directories.

        A fan-out directory that cannot be listed (another tenant's ``umask 077``, a bad
        sector) costs the objects in it, not the store: it goes to ``unlisted`` and the walk
        goes on. The root itself must list.

        Raises
        ------
        BackendIOError
            If the root cannot be listed.
        """
        try:
            self._faults.check("list")
            for directory in self._object_dirs(unlisted):
                try:
                    with os.scandir(directory) as entries:
                        files = [e for e in entries if e.is_file(follow_symlinks=False)]
                except MISSING:
                    continue
                except OSError as exc:
                    if directory == self.root:
                        raise
                    unlisted.append((directory, exc))
                    continue
                for entry in files:
                    yield directory, entry
        except OSError as exc:
            raise io_error(f"scan {self.root!r}", exc) from exc

    @staticmethod
    def discard_stale_temp(entry: os.DirEntry[str], now: float, stale_s: float) -> int:
        """Remove temporary file ``entry`` if older than ``stale_s``; return 1 if so."""
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime
        except OSError:  # gone, or not ours to look at: left alone
            return 0
        if now - mtime <= stale_s:
            return 0
        AtomicFiles.discard(entry.path)
        return 1

    def _object_dirs(self, unlisted: Unlisted) -> Iterator[str]:
        """Yield the directories that may hold objects under this layout.

        A fan-out directory that cannot be listed goes to ``unlisted``, and the rest are still
        yielded.
        """
        if not self.paths.fanout:
            yield self.root
            return
        for first in self._subdirs(self.root, unlisted):
            yield from self._subdirs(first, unlisted)

    def _subdirs(self, directory: str, unlisted: Unlisted) -> list[str]:
        """Return the fan-out directories in ``directory`` (the root's listing must succeed)."""
        try:
            with os.scandir(directory) as entries:
                return sorted(
                    entry.path
                    for entry in entries
                    if FanoutPaths.is_fanout_dir(entry.name) and entry.is_dir(follow_symlinks=False)
                )
        except MISSING:
            return []
        except OSError as exc:
            if directory == self.root:
                raise
            unlisted.append((directory, exc))
            return []
