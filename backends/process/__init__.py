"""Any backend served from its own storage process, over the engine's shared host pool.

The names below load on first use, so importing :mod:`.plugin` (which runs this package's
``__init__``) does not import the host pools and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache_storage.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from .backend import ProcessBackend
    from .config import ProcessConfig

__all__ = ["ProcessBackend", "ProcessConfig"]

__getattr__, __dir__ = lazy_exports(
    __name__, {"ProcessBackend": ".backend", "ProcessConfig": ".config"}
)
