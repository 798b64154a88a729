"""Server control for the fault checks: what a plugin hands the suite to stop and start a server."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["ServerControl", "find_server_control"]


@runtime_checkable
class ServerControl(Protocol):
    """Stops and restarts the server a networked backend talks to."""

    def stop(self) -> None:
        """Make the server unreachable (stop it, pause it, or drop its traffic)."""
        ...

    def start(self) -> None:
        """Bring the server back; return once it accepts requests again."""
        ...


def find_server_control(name: str, options: dict[str, Any]) -> ServerControl | None:
    """Ask the registered ``hicache_storage`` plugins for a server control of backend ``name``."""
    from hicache_storage.registry import _REGISTRY

    manager = _REGISTRY.manager()
    control: ServerControl | None = manager.hook.hicache_conformance_server(
        name=name, options=dict(options)
    )
    return control
