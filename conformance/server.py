"""Server control for the fault checks: finding what a plugin hands the suite.

The protocols (:class:`~hicache_storage.kit.services.ServerControl`,
:class:`~hicache_storage.kit.services.PausableServerControl`) live in the core's kit.
``stop``/``start`` are required. ``pause``/``resume`` are optional: a control that has them lets
the suite freeze the server (SIGSTOP: connections open, nothing answers), the fault that finds
client libraries waiting or retrying past their deadline; without them that check is skipped.
"""

from __future__ import annotations

from typing import Any

from hicache_storage.kit.services import ServerControl

__all__ = ["find_server_control"]


def find_server_control(name: str, options: dict[str, Any]) -> ServerControl | None:
    """Ask the registered ``hicache_storage`` plugins for a server control of backend ``name``."""
    from hicache_storage.registry import plugin_manager

    manager = plugin_manager()
    control: ServerControl | None = manager.hook.hicache_conformance_server(
        name=name, options=dict(options)
    )
    return control
