"""Registers the Redis backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

from hicache_storage.registry import BackendSpec, hookimpl

from .config import capabilities

__all__ = ["SPEC", "hicache_backends"]

SPEC = BackendSpec(
    name="redis",
    factory="hicache_storage.backends.redis.backend:RedisBackend",
    config="hicache_storage.backends.redis.config:RedisConfig",
    extra="redis",
    requires=("redis",),
    capabilities=capabilities(),
    baseline="hicache_storage.backends.redis.baseline:RawRedisBaseline",
    description="Redis server or Redis Cluster (redis-py + hiredis)",
    namespace_option="prefix",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the Redis backend."""
    return [SPEC]
