"""The file backend: one file per key under a directory, published atomically, LRU-bounded.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache_storage.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import FileBackend
    from .config import FileConfig

__all__ = ["FileBackend", "FileConfig"]

__getattr__, __dir__ = lazy_exports(__name__, {"FileBackend": ".backend", "FileConfig": ".config"})
