"""The file backend: one file per key under a directory, published atomically, LRU-bounded.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import FileBackend
    from .config import FileConfig

__all__ = ["FileBackend", "FileConfig"]

_EXPORTS = {"FileBackend": ".backend", "FileConfig": ".config"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
