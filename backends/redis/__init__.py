"""The Redis backend: standalone servers and Redis Cluster through redis-py.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) does not import redis-py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import RedisBackend
    from .config import RedisConfig

__all__ = ["RedisBackend", "RedisConfig"]

_EXPORTS = {"RedisBackend": ".backend", "RedisConfig": ".config"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
