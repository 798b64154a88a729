"""The Redis backend: standalone servers and Redis Cluster through redis-py.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) does not import redis-py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache_storage.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import RedisBackend
    from .config import RedisConfig

__all__ = ["RedisBackend", "RedisConfig"]

__getattr__, __dir__ = lazy_exports(
    __name__, {"RedisBackend": ".backend", "RedisConfig": ".config"}
)
