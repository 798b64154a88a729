"""The suite's server controls: the ``hicache_conformance_server`` hook over published services.

Services a test or benchmark started (:class:`~hicache_storage.kit.services.LocalService`) and
published (:func:`~hicache_storage.kit.services.publish`) are handed to the conformance suite's
fault checks, which stop, pause and restart them. This module is registered as a plugin through
the ``hicache_storage.backends`` entry point ``local-services``.
"""

from __future__ import annotations

from typing import Any

from hicache_storage.kit.services import LocalService, published_services
from hicache_storage.registry import hookimpl

__all__ = ["hicache_conformance_server"]


@hookimpl
def hicache_conformance_server(name: str, options: dict[str, Any]) -> LocalService | None:
    """Hand the suite the published service of backend ``name`` whose options match ``options``."""
    for service in published_services():
        if service.backend == name and all(
            options.get(key) == value for key, value in service.state.options.items()
        ):
            return service
    return None
