"""Package attributes that import their module on first use (PEP 562).

A backend package's ``__init__`` runs whenever its plugin module is imported, which happens when
the registry lists backends; exporting the backend class lazily keeps that from importing the
backend's client library.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for ``package`` exporting ``name -> ".module"`` lazily.

    Usage, in a package's ``__init__``::

        __getattr__, __dir__ = lazy_exports(__name__, {"FileBackend": ".backend"})
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
