"""Registers the file backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

from hicache_storage.capabilities import Capabilities
from hicache_storage.registry import BackendSpec, hookimpl

__all__ = ["SPEC", "hicache_backends"]

SPEC = BackendSpec(
    name="file",
    factory="hicache_storage.backends.file.backend:FileBackend",
    config="hicache_storage.backends.file.config:FileConfig",
    extra=None,
    requires=(),
    # What the default config promises; an instance with max_bytes set also claims ``bounded``.
    capabilities=Capabilities(
        persistent=True,
        shared=True,
        native_zero_copy=True,
        bounded=False,
        delete=True,
        crash_safe_writes=True,
    ),
    baseline="hicache_storage.backends.file.baseline:RawDiskBaseline",
    description="one file per key under a directory",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the file backend."""
    return [SPEC]
