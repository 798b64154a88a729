"""Registers the fsspec backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

from hicache_storage import BackendSpec, hookimpl

from .config import capabilities

__all__ = ["SPEC", "hicache_backends"]

SPEC = BackendSpec(
    name="fsspec",
    factory="hicache_storage.backends.fsspec.backend:FsspecBackend",
    config="hicache_storage.backends.fsspec.config:FsspecConfig",
    extra="fsspec",
    requires=("fsspec",),
    # What every URL gets; an instance claims more from its medium (file://, memory://, s3://).
    capabilities=capabilities(),
    baseline="hicache_storage.backends.fsspec.baseline:FsspecBaseline",
    description="one object per key under any fsspec URL (file://, memory://, s3:// ...)",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the fsspec backend."""
    return [SPEC]
