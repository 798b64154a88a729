"""Registers the ``process`` backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache_storage import BackendSpec, Capabilities, hookimpl

if TYPE_CHECKING:
    from .control import StorageProcessControl

__all__ = ["SPEC", "hicache_backends", "hicache_conformance_server"]

SPEC = BackendSpec(
    name="process",
    factory="hicache_storage.backends.process.backend:ProcessBackend",
    config="hicache_storage.backends.process.config:ProcessConfig",
    # An instance claims what the backend it serves claims.
    capabilities=Capabilities(shared_host_pool=True),
    baseline="hicache_storage.backends.process.baseline:served_baseline",
    description="any other backend run in a storage process of its own (no GIL shared)",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the process backend."""
    return [SPEC]


@hookimpl
def hicache_conformance_server(name: str, options: dict[str, Any]) -> StorageProcessControl | None:
    """Hand the suite the control of this interpreter's storage processes."""
    if name != "process":
        return None
    from .config import ProcessConfig
    from .control import StorageProcessControl

    default = ProcessConfig(backend="memory").call_timeout_s
    return StorageProcessControl(float(options.get("call_timeout_s", default)))
