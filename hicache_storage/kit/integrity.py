"""Integrity records: what lets a hit prove it holds the key's own, complete bytes.

A record of :data:`RECORD_BYTES` is stored with every object: a magic number, the object's length,
a CRC32C of its bytes, a 64-bit digest of its key and a generation (the 3FS backend's reservation
id; 0 where a medium has none). Reading verifies all of them, so bytes that belong to another key
(a slot reused under a late writer, a misnamed file), a missing or zeroed object (a wiped
directory) and any torn or flipped byte are a miss, never data. The backends whose medium can
hand back another key's bytes (file, 3FS: a reused slot, a misnamed file) keep a record beside
every value, read in the same vectored call so the page stays zero-copy; stores that keep each
value as one object under its full name (Redis, S3, Mooncake) need none.
:func:`~hicache_storage.kit.read_checked` and :func:`~hicache_storage.kit.write_checked` compute
the CRC32C while a page moves, for :func:`check` and :func:`record`.

Layout (little-endian)::

    magic "HCI1" | length u64 | crc32c u32 | key digest u64 | generation u64     (32 bytes)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable

import crc32c
from typing_extensions import Buffer

__all__ = ["MAGIC", "RECORD_BYTES", "check", "checksum", "key_digest", "record", "seal", "verify"]

MAGIC = b"HCI1"
"""The first bytes of every record (a file holding none is not ours)."""

_RECORD = struct.Struct("<4sQIQQ")
RECORD_BYTES = _RECORD.size
"""Size of a record: 32 bytes."""


def checksum(parts: Iterable[Buffer]) -> int:
    """Return the CRC32C of the concatenation of ``parts`` (the GIL is released on big parts)."""
    value = 0
    for part in parts:
        value = crc32c.crc32c(part, value=value)
    return int(value)


def key_digest(key: str) -> int:
    """Return the 64-bit digest of ``key`` a record carries (BLAKE2b)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def seal(key: str, parts: Iterable[Buffer], *, generation: int = 0) -> bytes:
    """Return the record of an object made of ``parts`` (concatenated) stored under ``key``."""
    views = [memoryview(part).cast("B") for part in parts]
    return record(key, sum(view.nbytes for view in views), checksum(views), generation=generation)


def record(key: str, length: int, crc: int, *, generation: int = 0) -> bytes:
    """Return the record of an object of ``length`` bytes whose CRC32C is ``crc``.

    What :func:`seal` returns, for a writer that checksummed the bytes as it wrote them
    (:func:`~hicache_storage.kit.pageio.write_checked`).
    """
    return _RECORD.pack(MAGIC, length, crc, key_digest(key), generation)


def verify(
    record: Buffer, key: str, parts: Iterable[Buffer], *, generation: int | None = None
) -> str | None:
    """Check ``parts`` (an object read back) against its ``record``.

    Returns ``None`` when the object is the key's complete value, else why it is not: ``"no
    record"``, ``"other key"``, ``"generation"``, ``"length"`` or ``"checksum"`` (the cheap
    checks first). ``generation=None`` skips the generation check.
    """
    views = [memoryview(part).cast("B") for part in parts]
    return check(
        record, key, sum(view.nbytes for view in views), lambda: checksum(views), generation
    )


def check(
    record: Buffer,
    key: str,
    length: int,
    crc: int | Callable[[], int],
    generation: int | None = None,
) -> str | None:
    """Check a ``record`` against an object of ``length`` bytes whose CRC32C is ``crc``.

    What :func:`verify` does for a reader that checksummed the bytes as it read them
    (:func:`~hicache_storage.kit.pageio.read_checked`); ``crc`` may be a callable, computed only
    once the cheaper checks passed. Returns ``None`` or the reason, as :func:`verify` does.
    """
    raw = memoryview(record).cast("B")
    if raw.nbytes != RECORD_BYTES:
        return "no record"
    magic, stored_length, stored_crc, digest, stored_generation = _RECORD.unpack(raw)
    if magic != MAGIC:
        return "no record"
    if digest != key_digest(key):
        return "other key"
    if generation is not None and stored_generation != generation:
        return "generation"
    if stored_length != length:
        return "length"
    if stored_crc != (crc() if callable(crc) else crc):
        return "checksum"
    return None
