"""The 3FS backend: KV pages in slots of large files on a 3FS mount, a shared metadata service.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import ThreeFSBackend
    from .config import ThreeFSConfig

__all__ = ["ThreeFSBackend", "ThreeFSConfig"]

_EXPORTS = {"ThreeFSBackend": ".backend", "ThreeFSConfig": ".config"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
