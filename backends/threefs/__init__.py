"""The 3FS backend: KV pages in slots of large files on a 3FS mount, a shared metadata service.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache_storage.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import ThreeFSBackend
    from .config import ThreeFSConfig

__all__ = ["ThreeFSBackend", "ThreeFSConfig"]

__getattr__, __dir__ = lazy_exports(
    __name__, {"ThreeFSBackend": ".backend", "ThreeFSConfig": ".config"}
)
