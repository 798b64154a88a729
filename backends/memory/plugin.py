"""Registers the ``memory`` backend (imports nothing heavy)."""

from __future__ import annotations

from hicache_storage.registry import BackendSpec, hookimpl

from .config import capabilities

SPEC = BackendSpec(
    name="memory",
    factory="hicache_storage.backends.memory.backend:MemoryBackend",
    config="hicache_storage.backends.memory.config:MemoryConfig",
    capabilities=capabilities(),
    baseline="hicache_storage.backends.memory.backend:DictBaseline",
    description="in-process dictionary; the reference and test oracle",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the memory backend."""
    return [SPEC]
