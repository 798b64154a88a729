"""Settings of the 3FS backend."""

from __future__ import annotations

import re
import urllib.parse
from typing import Literal

import msgspec

from hicache_storage.capabilities import Capabilities
from hicache_storage.kit.integrity import RECORD_BYTES
from hicache_storage.kit.options import MAX_COUNT, check_bytes, check_count, check_seconds
from hicache_storage.redact import redact_url, redacted_repr

from .metadata import Geometry

__all__ = ["ThreeFSConfig", "capabilities"]

_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def _check_url(url: object) -> None:
    """Refuse a metadata URL that is not ``http(s)://host[:port]`` with a valid port."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"metadata_url must be http://host:port, got {redact_url(str(url))!r}")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if not parts.hostname or port == -1 or port == 0:
        raise ValueError(
            f"metadata_url must name a host and a port within 1..65535, got {redact_url(url)!r}"
        )
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"metadata_url must be only http://host:port, got {redact_url(url)!r}")


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
        Data files per namespace. Capacity is ``file_size * file_count``. Consecutive values
        start in consecutive files, and with POSIX I/O this bounds how many pages a batch
        writes at once: a kernel filesystem (ext4, XFS, a FUSE mount) serialises buffered
        writes to one file. Give at least ``io_threads`` files there (on the H200 the engine's
        26 GB write-through took 10.4 s of write calls over 4 files, 6.3 s over 16).
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
        Bearer token the metadata service expects, if it was started with one (never shown
        in ``repr``, nor the password of ``metadata_url``).
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
    integrity
        Keep a 32-byte integrity record per slot (after the slots of each file): the key's
        digest, the length, a CRC32C of the bytes and the reservation's generation, written with
        the value and verified on every read. A slot rewritten by a writer that outlived its
        lease, a wiped or foreign data directory, or any flipped byte is then a counted miss,
        never another key's bytes (see docs/backends/3fs.md). Every user of the files must
        agree on it.
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
    integrity: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path or "\x00" in self.path:
            raise ValueError("path must name a directory (a non-empty string without NUL)")
        if not isinstance(self.file_prefix, str) or not _PREFIX.fullmatch(self.file_prefix):
            raise ValueError(
                f"file_prefix must be letters, digits, '_' or '-', got {self.file_prefix!r}"
            )
        for name in ("file_size", "slot_bytes", "usrbio_buffer_bytes"):
            check_bytes(name, getattr(self, name))
        check_count("file_count", self.file_count, maximum=4096)
        check_count("io_threads", self.io_threads, maximum=1024)
        check_count("usrbio_entries", self.usrbio_entries, maximum=MAX_COUNT)
        if not isinstance(self.integrity, bool):
            raise TypeError(f"integrity must be a bool, got {type(self.integrity).__name__}")
        if self.file_size % self.slot_bytes:
            raise ValueError(
                f"file_size ({self.file_size}) must be a whole number of slot_bytes "
                f"({self.slot_bytes})"
            )
        check_seconds("timeout_s", self.timeout_s)
        if self.metadata_url is not None:
            _check_url(self.metadata_url)
        if self.metadata_token is not None and self.metadata_url is None:
            raise ValueError("metadata_token is set but metadata_url is not")

    def __repr__(self) -> str:
        return redacted_repr(self)

    def geometry(self) -> Geometry:
        """Return how each file is cut into slots."""
        return Geometry(self.slot_bytes, self.file_size // self.slot_bytes, self.file_count)

    @property
    def stored_file_size(self) -> int:
        """Bytes of each data file: the slots, then one integrity record per slot if enabled."""
        records = (self.file_size // self.slot_bytes) * RECORD_BYTES if self.integrity else 0
        return self.file_size + records


def capabilities(config: ThreeFSConfig | None = None) -> Capabilities:
    """Return what a 3FS backend with ``config`` promises; without one, the registry's record.

    In-process metadata dies with the process, so only an instance with ``metadata_url`` claims
    persistent, shared and crash-safe writes; a value may take every slot, so the largest one is
    the namespace's capacity, known once a config is (None in the registry's record).
    """
    shared = config is not None and config.metadata_url is not None
    return Capabilities(
        persistent=shared,
        shared=shared,
        native_zero_copy=True,
        bounded=True,
        delete=True,
        crash_safe_writes=shared,
        atomic_first_wins=True,
        max_value_size=None if config is None else config.geometry().capacity,
    )
