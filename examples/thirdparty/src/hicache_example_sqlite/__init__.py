"""An example third-party storage backend for hicache-storage: one SQLite table."""

from .backend import SqliteBackend, SqliteConfig, TruncatingSqliteBackend

__all__ = ["SqliteBackend", "SqliteConfig", "TruncatingSqliteBackend"]
