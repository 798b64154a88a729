"""Registers the file backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hicache_storage.registry import BackendSpec, hookimpl

from .config import capabilities

if TYPE_CHECKING:
    from hicache_storage.backend import StorageBackend

__all__ = ["SPEC", "hicache_backends", "hicache_conformance_corrupt"]

SPEC = BackendSpec(
    name="file",
    factory="hicache_storage.backends.file.backend:FileBackend",
    config="hicache_storage.backends.file.config:FileConfig",
    extra=None,
    requires=(),
    capabilities=capabilities(),
    baseline="hicache_storage.backends.file.baseline:RawDiskBaseline",
    description="one file per key under a directory",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the file backend."""
    return [SPEC]


@hookimpl
def hicache_conformance_corrupt(backend: StorageBackend, key: str, offset: int) -> bool | None:
    """Flip one byte of the file that holds ``key`` (for the conformance integrity checks).

    Answers None (the checks skip) for an instance that stores bare values (``integrity`` off,
    as with ``naming="sglang_file_compat"``): it does not claim to detect corruption.
    """
    from .backend import FileBackend

    if not isinstance(backend, FileBackend) or not backend.config.use_integrity:
        return None
    try:
        fd = os.open(backend.path_of(key), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        old = os.pread(fd, 1, offset)
        if len(old) != 1:
            return False
        os.pwrite(fd, bytes([old[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)
    return True
