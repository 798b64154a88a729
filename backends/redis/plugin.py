"""Registers the Redis backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

from typing import Any

from hicache_storage.registry import BackendSpec, hookimpl
from hicache_storage.urls import UrlScheme

from .config import capabilities

__all__ = ["SPEC", "hicache_backends", "hicache_url_schemes"]

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


def _redis_options(url: str) -> dict[str, Any]:
    """``redis://`` and ``rediss://``: the URL is the backend's ``url`` option, as written."""
    return {"url": url}


@hookimpl
def hicache_url_schemes() -> list[UrlScheme]:
    """Claim ``redis://`` and ``rediss://`` (TLS) for the redis backend."""
    return [
        UrlScheme(
            scheme="redis",
            backend="redis",
            options=_redis_options,
            example="redis://127.0.0.1:6379/0",
        ),
        UrlScheme(scheme="rediss", backend="redis", options=_redis_options),
    ]
