"""Settings of the 3FS backend."""

from __future__ import annotations

import math
import re
from typing import Literal

import msgspec

__all__ = ["ThreeFSConfig"]

_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


class ThreeFSConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of :class:`~hicache_storage.backends.threefs.ThreeFSBackend`.

    Attributes
    ----------
    path
        Directory holding the data files: on a 3FS mount in production (e.g.
        ``/3fs/stage/hicache``), any local directory in tests. Created if absent.
    file_prefix
        Base name of the data files and of the metadata namespace: files are
        ``<path>/<namespace>.<i>.bin`` where the namespace is ``file_prefix``, plus a rank tag
        with ``ownership="rank"``. Letters, digits, ``_`` and ``-``.
    file_size
        Bytes of each data file; a whole number of slots. Files are extended sparsely.
    file_count
        Data files per namespace. Capacity is ``file_size * file_count``.
    slot_bytes
        Bytes per slot. Set it to the size of one KV page object so each page takes one slot;
        a larger value spans several slots.
    io_threads
        Threads a batch's reads or writes are spread over.
    io_engine
        ``"auto"``: 3FS usrbio rings when ``hf3fs_fuse.io`` imports and ``path`` is on a 3FS
        mount, POSIX ``preadv``/``pwritev`` otherwise. ``"posix"`` or ``"usrbio"`` to insist.
    usrbio_entries
        Entries of each usrbio ring (I/Os per submission).
    usrbio_buffer_bytes
        Registered staging iovec per I/O thread for usrbio.
    metadata_url
        ``http://host:port`` of a ``hicache metadata-server`` shared by every process and
        instance using these files; ``None`` keeps the key → slot map in this process, which
        then must be the only user of the files (they are locked).
    metadata_token
        Bearer token the metadata service expects, if it was started with one.
    timeout_s
        Bound of each metadata call, and of the wait for another writer of the same key.
    fsync
        ``"never"``: a value is visible once written (3FS replicates writes synchronously; on a
        local disk the page cache holds it). ``"before_commit"``: flush the written files before
        the keys become visible, so a visible key survives a power loss.
    ownership
        ``"all"``: one namespace for every rank (keys carry rank suffixes, so they never clash).
        ``"rank"``: a namespace and files per rank, so ranks never evict or clear each other's
        pages; MLA ranks share one (TP rank 0 writes, the others read).
    """

    path: str
    file_prefix: str = "hicache"
    file_size: int = 16 << 30
    file_count: int = 4
    slot_bytes: int = 1 << 20
    io_threads: int = 8
    io_engine: Literal["auto", "posix", "usrbio"] = "auto"
    usrbio_entries: int = 64
    usrbio_buffer_bytes: int = 64 << 20
    metadata_url: str | None = None
    metadata_token: str | None = None
    timeout_s: float = 2.0
    fsync: Literal["never", "before_commit"] = "never"
    ownership: Literal["all", "rank"] = "all"

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path or "\x00" in self.path:
            raise ValueError("path must name a directory (a non-empty string without NUL)")
        if not isinstance(self.file_prefix, str) or not _PREFIX.fullmatch(self.file_prefix):
            raise ValueError(
                f"file_prefix must be letters, digits, '_' or '-', got {self.file_prefix!r}"
            )
        for name in (
            "file_size",
            "file_count",
            "slot_bytes",
            "io_threads",
            "usrbio_entries",
            "usrbio_buffer_bytes",
        ):
            _positive_int(name, getattr(self, name))
        if self.file_size % self.slot_bytes:
            raise ValueError(
                f"file_size ({self.file_size}) must be a whole number of slot_bytes "
                f"({self.slot_bytes})"
            )
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout_s must be a number, got {type(timeout).__name__}")
        if math.isnan(timeout) or timeout <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout}")
        url = self.metadata_url
        if url is not None and not (
            isinstance(url, str) and url.startswith(("http://", "https://"))
        ):
            raise ValueError(f"metadata_url must be http://host:port, got {url!r}")
        if self.metadata_token is not None and self.metadata_url is None:
            raise ValueError("metadata_token is set but metadata_url is not")
