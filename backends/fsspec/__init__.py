"""The ``fsspec`` backend: one object per key under any fsspec URL (file, memory, s3, gcs ...).

:class:`FsspecBackend` loads on first use, so importing :mod:`.plugin` (which runs this
package's ``__init__``) never imports fsspec.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import FsspecConfig

if TYPE_CHECKING:
    from .backend import FsspecBackend

__all__ = ["FsspecBackend", "FsspecConfig"]


def __getattr__(name: str) -> Any:
    if name == "FsspecBackend":
        return importlib.import_module(".backend", __name__).FsspecBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
