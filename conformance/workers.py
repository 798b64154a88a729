"""Code the suite runs in child processes (spawned, so it must be importable and light)."""

from __future__ import annotations

import hashlib
from typing import Any

from hicache_storage.buffers import as_readable
from hicache_storage.conformance.factory import BackendFactory

__all__ = [
    "digest",
    "make_value",
    "read_digests",
    "write_forever",
    "write_values",
]


def make_value(tag: str, size: int) -> bytes:
    """Return ``size`` deterministic pseudo-random bytes derived from ``tag``."""
    seed = hashlib.sha256(tag.encode()).digest()
    block = hashlib.shake_256(seed).digest(min(size, 1 << 16) or 1)
    repeats, rest = divmod(size, len(block))
    # Mix the block index in so repeated blocks differ (a shifted copy would still compare equal).
    parts = [bytes(b ^ (i & 0xFF) for b in block[:64]) + block[64:] for i in range(repeats)]
    return b"".join(parts) + block[:rest]


def digest(value: object) -> str:
    """Return the sha256 hex digest of a buffer."""
    return hashlib.sha256(as_readable(value)).hexdigest()


def write_values(factory: BackendFactory, items: list[tuple[str, str, int]]) -> list[bool]:
    """Open an instance, ``set`` each ``(key, tag, size)`` to ``make_value(tag, size)``, close."""
    with factory() as backend:
        return [backend.set(key, make_value(tag, size)) for key, tag, size in items]


def read_digests(factory: BackendFactory, keys: list[str]) -> list[str | None]:
    """Open an instance and return each key's sha256 (``None`` on a miss)."""
    with factory() as backend:
        out: list[str | None] = []
        for key in keys:
            value = backend.get(key)
            out.append(None if value is None else digest(value))
        return out


def write_forever(factory: BackendFactory, prefix: str, size: int, started: Any) -> None:
    """Write ``prefix<i>`` = ``make_value(prefix<i>, size)`` for i = 0, 1, ... until killed."""
    backend = factory()
    started.set()
    i = 0
    while True:
        key = f"{prefix}{i}"
        backend.set(key, make_value(key, size))
        i += 1
