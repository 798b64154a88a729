"""The S3 backend: one object per key in a bucket, under a key prefix.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) never imports botocore.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache_storage.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import S3Backend
    from .config import S3Config

__all__ = ["S3Backend", "S3Config"]

__getattr__, __dir__ = lazy_exports(__name__, {"S3Backend": ".backend", "S3Config": ".config"})
