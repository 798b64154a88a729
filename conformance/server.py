"""Server control for the fault checks: what a plugin hands the suite to stop, pause and restart.

``stop``/``start`` are required. ``pause``/``resume`` are optional: a control that has them lets
the suite freeze the server (SIGSTOP: connections open, nothing answers), the fault that finds
client libraries waiting or retrying past their deadline; without them that check is skipped.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["PausableServerControl", "ServerControl", "find_server_control"]


@runtime_checkable
class ServerControl(Protocol):
    """Stops and restarts the server a networked backend talks to."""

    def stop(self) -> None:
        """Make the server unreachable (stop it, pause it, or drop its traffic)."""
        ...

    def start(self) -> None:
        """Bring the server back; return once it accepts requests again."""
        ...


@runtime_checkable
class PausableServerControl(ServerControl, Protocol):
    """A server control that can also freeze the server without closing its sockets."""

    def pause(self) -> None:
        """Make the server hang: accept or keep connections but answer nothing."""
        ...

    def resume(self) -> None:
        """Undo :meth:`pause`; return once the server accepts requests again."""
        ...


def find_server_control(name: str, options: dict[str, Any]) -> ServerControl | None:
    """Ask the registered ``hicache_storage`` plugins for a server control of backend ``name``."""
    from hicache_storage.registry import _REGISTRY

    manager = _REGISTRY.manager()
    control: ServerControl | None = manager.hook.hicache_conformance_server(
        name=name, options=dict(options)
    )
    return control
