"""The Mooncake store backend: KV pages in a Mooncake distributed store, moved zero-copy.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) never imports the mooncake client library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache_storage.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import MooncakeBackend
    from .config import MooncakeConfig

__all__ = ["MooncakeBackend", "MooncakeConfig"]

__getattr__, __dir__ = lazy_exports(
    __name__, {"MooncakeBackend": ".backend", "MooncakeConfig": ".config"}
)
