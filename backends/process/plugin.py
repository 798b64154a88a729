"""Registers the ``process`` backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

from hicache_storage import BackendSpec, Capabilities, hookimpl

__all__ = ["SPEC", "hicache_backends"]

SPEC = BackendSpec(
    name="process",
    factory="hicache_storage.backends.process.backend:ProcessBackend",
    config="hicache_storage.backends.process.config:ProcessConfig",
    # An instance claims what the backend it serves claims.
    capabilities=Capabilities(shared_host_pool=True),
    baseline="hicache_storage.backends.process.baseline:served_baseline",
    description="any other backend run in a storage process of its own (no GIL shared)",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the process backend."""
    return [SPEC]
