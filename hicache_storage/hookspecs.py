"""Hook specifications: what a plugin may provide to hicache-storage.

A plugin is any module or object with :data:`hookimpl`-marked functions. Built-in backends and
third-party ones are loaded the same way, from the ``hicache_storage.backends`` entry-point group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .registry import BackendSpec

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "hicache_storage"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def hicache_backends() -> list[BackendSpec]:  # type: ignore[empty-body]
    """Return the backends this plugin provides."""
