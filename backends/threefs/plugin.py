"""Registers the 3FS backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

from hicache_storage.registry import BackendSpec, hookimpl

from .config import capabilities

if TYPE_CHECKING:
    from hicache_storage.backend import StorageBackend

__all__ = ["SPEC", "hicache_backends", "hicache_cli_commands", "hicache_conformance_corrupt"]

SPEC = BackendSpec(
    name="3fs",
    factory="hicache_storage.backends.threefs.backend:ThreeFSBackend",
    config="hicache_storage.backends.threefs.config:ThreeFSConfig",
    # usrbio (hf3fs_fuse.io) is optional and not on PyPI in usable form: the extra is empty and
    # the backend runs on plain POSIX I/O without it.
    extra="3fs",
    requires=(),
    capabilities=capabilities(),
    baseline="hicache_storage.backends.threefs.baseline:RawFileBaseline",
    description="slots of large files on a 3FS mount, key -> slot map in process or shared",
    namespace_option="file_prefix",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the 3FS backend."""
    return [SPEC]


@hookimpl
def hicache_cli_commands() -> list[click.Command]:
    """Add ``hicache metadata-server``, the shared key -> slot map of 3FS instances."""
    from .command import metadata_server_command

    return [metadata_server_command]


@hookimpl
def hicache_conformance_corrupt(backend: StorageBackend, key: str, offset: int) -> bool | None:
    """Flip one byte of ``key``'s value in its slot (for the conformance integrity checks)."""
    from .backend import ThreeFSBackend

    if not isinstance(backend, ThreeFSBackend):
        return None
    where = backend.locate(key, offset)
    if where is None:
        return False
    path, position = where
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, position)
        os.pwrite(fd, bytes([old[0] ^ 0xFF]), position)
    finally:
        os.close(fd)
    return True
