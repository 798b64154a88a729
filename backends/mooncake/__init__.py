"""The Mooncake store backend: KV pages in a Mooncake distributed store, moved zero-copy.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) never imports the mooncake client library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import MooncakeBackend
    from .config import MooncakeConfig

__all__ = ["MooncakeBackend", "MooncakeConfig"]

_EXPORTS = {"MooncakeBackend": ".backend", "MooncakeConfig": ".config"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
