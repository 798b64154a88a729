"""The S3 backend: one object per key in a bucket, under a key prefix.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) never imports botocore.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import S3Backend
    from .config import S3Config

__all__ = ["S3Backend", "S3Config"]

_EXPORTS = {"S3Backend": ".backend", "S3Config": ".config"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
