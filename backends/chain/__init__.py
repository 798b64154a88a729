"""The chain backend: an ordered list of backends (a local disk before a remote store) as one.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache_storage.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import ChainBackend
    from .config import ChainConfig, TierConfig

__all__ = ["ChainBackend", "ChainConfig", "TierConfig"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {"ChainBackend": ".backend", "ChainConfig": ".config", "TierConfig": ".config"},
)
