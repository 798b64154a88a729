"""Registers the file backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

import os
import urllib.parse
from typing import TYPE_CHECKING, Any

from hicache_storage.registry import BackendSpec, hookimpl
from hicache_storage.urls import UrlScheme, refuse_extras

from .config import capabilities

if TYPE_CHECKING:
    from hicache_storage.backend import StorageBackend

__all__ = ["SPEC", "hicache_backends", "hicache_conformance_corrupt", "hicache_url_schemes"]

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


def _file_options(url: str) -> dict[str, Any]:
    """``file:///PATH``: the backend's ``root`` directory."""
    form = "file:///PATH"
    parts = urllib.parse.urlsplit(url)
    refuse_extras(parts, form)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"{form} names a local directory by its absolute path, after three slashes "
            f"(file:///{parts.netloc}{parts.path} for /{parts.netloc}{parts.path}); "
            f"{parts.netloc!r} reads as a host"
        )
    if not parts.path:
        raise ValueError(f"{form} needs a path")
    return {"root": urllib.parse.unquote(parts.path)}


@hookimpl
def hicache_url_schemes() -> list[UrlScheme]:
    """Claim ``file:///PATH`` for the file backend."""
    return [
        UrlScheme(
            scheme="file", backend="file", options=_file_options, example="file:///var/cache/kv"
        )
    ]
