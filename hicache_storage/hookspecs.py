"""Hook specifications: what a plugin may provide to hicache-storage.

A plugin is any module or object with :data:`hookimpl`-marked functions. Built-in backends and
third-party ones are loaded the same way, from the ``hicache_storage.backends`` entry-point group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click

    from .backend import StorageBackend
    from .kit.services import ServerControl
    from .registry import BackendSpec
    from .urls import UrlScheme

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "hicache_storage"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def hicache_backends() -> list[BackendSpec]:  # type: ignore[empty-body]
    """Return the backends this plugin provides."""


@hookspec
def hicache_url_schemes() -> list[UrlScheme]:  # type: ignore[empty-body]
    """Return the URL schemes this plugin's backends claim (``redis://``, ``s3://``, ...).

    ``hicache check URL`` and ``hicache bench URL`` pick a backend by the URL's scheme and take
    options from the rest (:class:`~hicache_storage.urls.UrlScheme`). A scheme a built-in
    backend claims, or an earlier plugin took, is not replaced.
    """


@hookspec
def hicache_cli_commands() -> list[click.Command]:  # type: ignore[empty-body]
    """Return commands this plugin adds to the ``hicache`` CLI (say, a server its backend needs).

    A name the CLI already has, or an earlier plugin took, is not replaced.
    """


@hookspec(firstresult=True)
def hicache_conformance_server(name: str, options: dict[str, Any]) -> ServerControl | None:
    """Return a handle that stops and restarts the server behind backend ``name``, or ``None``.

    The conformance suite asks for it to check that, with the server down, every call answers a
    miss within the backend's timeout, and that the backend recovers once the server is back.
    ``options`` are the backend options under test. The handle has ``stop()`` and ``start()``
    (see :class:`hicache_storage.kit.services.ServerControl`); it may also carry a
    ``timeout_s`` attribute, the longest a call may take while the server is down.
    """


@hookspec(firstresult=True)
def hicache_conformance_corrupt(backend: StorageBackend, key: str, offset: int) -> bool | None:
    """Flip the stored byte at ``offset`` of ``key``'s value, behind ``backend``'s back.

    ``backend`` is the bare instance (no layers). Return ``True`` once the byte is flipped on
    the medium, ``False`` if ``key`` is not stored, ``None`` if ``backend`` is not yours. The
    conformance suite's integrity checks use it to require that corrupted bytes read as a miss;
    a backend that provides no implementation skips them.
    """
