"""Byte quotas on namespaces of shared stores: the ledger every writer of a namespace shares.

The quota layer (:class:`~hicache_storage.layers.QuotaLayer`) enforces a
:class:`~hicache_storage.config.QuotaConfig` against a :class:`QuotaLedger`: an SQLite file on
the shared file system (:class:`SQLiteLedger`) or keys in Redis (:class:`RedisLedger`).
"""

from __future__ import annotations

from .ledger import Grant, LedgerUsage, QuotaLedger
from .redis_ledger import RedisLedger
from .sqlite_ledger import SQLiteLedger

__all__ = ["Grant", "LedgerUsage", "QuotaLedger", "RedisLedger", "SQLiteLedger", "open_ledger"]


def open_ledger(location: str, namespace: str | None = None) -> QuotaLedger:
    """Open ``namespace``'s ledger at ``location``: a ``redis://`` URL or an SQLite file's path.

    Namespaces sharing one location keep apart accounts there (a Redis ledger needs one).

    Raises
    ------
    MissingDependencyError
        If a Redis ledger is asked for without redis-py (the ``redis`` extra).
    """
    if location.startswith(("redis://", "rediss://")):
        from hicache_storage.errors import MissingDependencyError

        try:
            import redis
        except ImportError as exc:
            raise MissingDependencyError(
                "a redis:// quota ledger needs redis-py: pip install 'hicache-storage[redis]'"
            ) from exc
        assert namespace, "QuotaConfig requires namespace with a redis:// ledger"
        return RedisLedger(redis.Redis.from_url(location), namespace)
    return SQLiteLedger(location, namespace)
