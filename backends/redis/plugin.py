"""Registers the Redis backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

from hicache_storage.capabilities import Capabilities
from hicache_storage.registry import BackendSpec, hookimpl

__all__ = ["SPEC", "hicache_backends"]

SPEC = BackendSpec(
    name="redis",
    factory="hicache_storage.backends.redis.backend:RedisBackend",
    config="hicache_storage.backends.redis.config:RedisConfig",
    extra="redis",
    requires=("redis",),
    # What the default config promises; an instance with ttl_s set also claims ``ttl``.
    capabilities=Capabilities(
        persistent=True,
        shared=True,
        delete=True,
        crash_safe_writes=True,
        atomic_first_wins=True,
        max_value_size=512 << 20,
    ),
    baseline="hicache_storage.backends.redis.baseline:RawRedisBaseline",
    description="Redis server or Redis Cluster (redis-py + hiredis)",
    namespace_option="prefix",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the Redis backend."""
    return [SPEC]
