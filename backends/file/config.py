"""Settings of the file backend."""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from hicache_storage.capabilities import Capabilities
from hicache_storage.kit.options import MAX_TTL_S, check_bytes, check_count, check_seconds

__all__ = ["FileConfig", "capabilities"]

_OWNERSHIP = ("all", "rank")
_NAMING = ("hicache", "sglang_file_compat")
DEFAULT_IO_THREADS = 16
"""Most pages in flight by default (the CPU count decides below it)."""
MAX_IO_THREADS = 256


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


class FileConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of :class:`~hicache_storage.backends.file.FileBackend`.

    Attributes
    ----------
    root
        Directory holding the objects; created (with its parents) if absent.
    fsync
        Flush each object's data, then its directory entry, before ``set`` returns. Atomic
        publishing already keeps a killed writer from exposing a partial object; ``fsync``
        extends that to power loss and kernel crashes, after which recent objects may otherwise
        be missing, truncated or zero-filled.
    fanout
        Spread objects over two levels of 256 subdirectories named from a blake2b hash of the
        key (``root/ab/cd/<key>``), so no directory grows huge. Off puts every object directly
        in ``root``. Readers and writers of one directory must agree on it. ``None`` (the
        default) means the naming mode's default: on for ``"hicache"``, off for
        ``"sglang_file_compat"``, which cannot have it on.
    metadata_cache
        Remember keys known to exist (and their sizes) for ``metadata_ttl_s`` seconds, so
        repeated ``exists``/``batch_exists`` calls and first-wins ``set`` skip a ``stat``.
    metadata_ttl_s
        How long a cached "exists" answer is trusted; other processes' deletions become visible
        after at most this long.
    max_bytes
        Capacity bound on the bytes of objects this instance owns, or ``None`` for no bound.
        When a write would exceed it, the least recently used owned objects are evicted.
    low_watermark
        Fraction of ``max_bytes`` that eviction frees down to, so that evictions come in
        batches rather than one per write.
    high_watermark
        Fraction of ``max_bytes`` past which eviction starts on a thread of its own, so a
        writer waits for file removals only when it reaches the bound before they are done;
        within (``low_watermark``, 1). ``None`` (the default) evicts at the bound, inside the
        write that reaches it (a batch of removals can take seconds on a busy disk: set it for
        a tier written while it evicts, such as a chain's first tier).
    min_free_bytes
        Free space the file system under ``root`` keeps, whatever ``max_bytes`` says: a write
        that would leave less evicts this instance's least recently used objects first (or is
        not stored when they are too few). ``None`` (the default) keeps 1 % of the file
        system's size free: room for the host's other writers (logs, the engine's own files)
        in proportion to the disk, where a disk filled to the last block fails every writer on
        it. 0 turns the floor off.
    ownership
        ``"all"``: this instance owns every object under ``root`` (its index, eviction and
        ``clear`` cover them all). ``"rank"``: it owns only the keys its deployment's key scheme
        says belong to this rank, so ranks sharing one directory never evict or clear each
        other's objects.
    stale_temp_s
        Temporary files older than this many seconds (left by writers that were killed) are
        removed by the startup scan.
    integrity
        Store a 32-byte integrity record (length, CRC32C, key digest) after each value and
        verify it on every read: a truncated, corrupted or misnamed file is a counted miss and
        is removed, never returned. Off stores bare values (readable by tools that expect them)
        and trusts the filesystem. Readers and writers of one directory must agree on it.
        ``None`` (the default) means the naming mode's default: on for ``"hicache"``, off for
        ``"sglang_file_compat"``, which cannot have it on.
    naming
        How objects are named on disk. ``"hicache"``: the file is named by the key (under the
        fan-out with ``fanout``). ``"sglang_file_compat"``: the file is ``root/<key>.bin``
        holding the bare value, the layout of SGLang's built-in ``HiCacheFile`` storage backend
        (``--hicache-storage-backend file``), so one directory can be shared with it: each reads
        what the other wrote. That layout has no fan-out and no integrity record. Files that are
        not ``<valid key>.bin`` (SGLang's ``.<uuid>.tmp`` files among them) are never indexed,
        evicted or removed; only this backend's own stale temporary files are.
    io_threads
        Pages a ``batch_get_v1``/``batch_set_v1`` moves at once, each on one of this many
        threads (``preadv``/``pwritev`` and CRC32C release the GIL). ``None`` (the default)
        means the machine's CPU count, at most 16; 1 moves one page after another.
    """

    root: str
    fsync: bool = False
    fanout: bool | None = None
    metadata_cache: bool = True
    metadata_ttl_s: float = 5.0
    max_bytes: int | None = None
    low_watermark: float = 0.9
    high_watermark: float | None = None
    min_free_bytes: int | None = None
    ownership: Literal["all", "rank"] = "all"
    stale_temp_s: float = 600.0
    integrity: bool | None = None
    naming: Literal["hicache", "sglang_file_compat"] = "hicache"
    io_threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.root, str):
            raise TypeError(f"root must be a str path, got {type(self.root).__name__}")
        if not self.root:
            raise ValueError("root must name a directory, got an empty string")
        if "\x00" in self.root:
            raise ValueError("root must not contain NUL characters")
        for name in ("fsync", "metadata_cache"):
            _check_bool(name, getattr(self, name))
        for name in ("fanout", "integrity"):
            if getattr(self, name) is not None:
                _check_bool(name, getattr(self, name))
        if self.naming not in _NAMING:
            raise ValueError(
                f"naming must be 'hicache' or 'sglang_file_compat', got {self.naming!r}"
            )
        if self.naming == "sglang_file_compat":
            on = [name for name in ("fanout", "integrity") if getattr(self, name)]
            if on:
                raise ValueError(
                    f"naming='sglang_file_compat' stores bare values flat in root (SGLang's "
                    f"HiCacheFile layout), so fanout and integrity must be false or unset; "
                    f"got {', '.join(f'{name}=True' for name in on)}"
                )
        check_seconds("metadata_ttl_s", self.metadata_ttl_s, allow_zero=True, maximum=MAX_TTL_S)
        check_seconds("stale_temp_s", self.stale_temp_s, allow_zero=True, maximum=MAX_TTL_S)
        if self.max_bytes is not None:
            check_bytes("max_bytes", self.max_bytes)
        if self.min_free_bytes is not None:
            check_bytes("min_free_bytes", self.min_free_bytes, minimum=0)
        low = self.low_watermark
        if isinstance(low, bool) or not isinstance(low, (int, float)):
            raise TypeError(f"low_watermark must be a number, got {type(low).__name__}")
        if not 0.0 < low < 1.0:
            raise ValueError(f"low_watermark must be within (0, 1), got {low}")
        high = self.high_watermark
        if high is not None:
            if isinstance(high, bool) or not isinstance(high, (int, float)):
                raise TypeError(f"high_watermark must be a number, got {type(high).__name__}")
            if not low < high < 1.0:
                raise ValueError(
                    f"high_watermark must be within (low_watermark={low}, 1), got {high}"
                )
        if self.ownership not in _OWNERSHIP:
            raise ValueError(f"ownership must be 'all' or 'rank', got {self.ownership!r}")
        if self.io_threads is not None:
            check_count("io_threads", self.io_threads, maximum=MAX_IO_THREADS)

    @property
    def use_fanout(self) -> bool:
        """Whether objects are spread over the fan-out (``fanout`` with None resolved)."""
        if self.fanout is None:
            return self.naming == "hicache"
        return self.fanout

    @property
    def threads(self) -> int:
        """Pages in flight per batch (``io_threads`` with None resolved)."""
        if self.io_threads is None:
            return min(DEFAULT_IO_THREADS, os.cpu_count() or 1)
        return self.io_threads

    @property
    def use_integrity(self) -> bool:
        """Whether each object carries an integrity record (``integrity`` with None resolved)."""
        if self.integrity is None:
            return self.naming == "hicache"
        return self.integrity


def capabilities(config: FileConfig | None = None) -> Capabilities:
    """Return what a file backend with ``config`` promises; without one, what defaults promise.

    The registry's record and every instance read this one function. None of it depends on
    ``integrity``: bare values are still published atomically (crash-safe, first wins) and read
    zero-copy.
    """
    if config is None:
        config = FileConfig(root=".")  # no claim depends on the directory
    return Capabilities(
        persistent=True,
        shared=True,
        native_zero_copy=True,
        bounded=config.max_bytes is not None,
        delete=True,
        crash_safe_writes=True,
        atomic_first_wins=True,
        exists_stale_s=config.metadata_ttl_s if config.metadata_cache else 0.0,
        foreign_names=config.naming == "sglang_file_compat",
    )
