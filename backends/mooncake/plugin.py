"""Registers the Mooncake backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

from hicache_storage.registry import BackendSpec, hookimpl

from .config import capabilities

__all__ = ["SPEC", "hicache_backends"]

SPEC = BackendSpec(
    name="mooncake",
    factory="hicache_storage.backends.mooncake.backend:MooncakeBackend",
    config="hicache_storage.backends.mooncake.config:MooncakeConfig",
    extra="mooncake",
    requires=("mooncake",),
    # The default config is a pure client (global_segment_size=0); an instance that mounts a
    # segment of its own claims neither persistent nor shared (see MooncakeBackend).
    capabilities=capabilities(),
    baseline="hicache_storage.backends.mooncake.baseline:RawMooncakeBaseline",
    description="Mooncake distributed store (zero-copy page I/O through registered memory)",
    namespace_option="prefix",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the Mooncake backend."""
    return [SPEC]
