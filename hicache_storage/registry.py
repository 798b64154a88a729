"""Find backends by name: pluggy hooks fed by the ``hicache_storage.backends`` entry points.

Nothing is imported until a backend is asked for: a :class:`BackendSpec` names its factory and
config schema as ``"module:attribute"`` strings, so listing backends never imports a client library.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import msgspec
import pluggy

from . import hookspecs
from .capabilities import Capabilities
from .errors import MissingDependencyError, UnknownBackendError

if TYPE_CHECKING:
    from .backend import StorageBackend
    from .config import Deployment

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendSpec",
    "registered_backends",
    "get_spec",
    "hookimpl",
    "register_plugin",
    "unregister_plugin",
]

ENTRY_POINT_GROUP = "hicache_storage.backends"
hookimpl = hookspecs.hookimpl


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BackendSpec:
    """Everything the registry knows about a backend before importing it.

    Attributes
    ----------
    name
        The name users pass to :func:`~hicache_storage.create_backend`.
    factory
        ``"module:Class"``; called as ``Class(config, deployment)``.
    config
        ``"module:Struct"``: the msgspec Struct that validates the backend's settings.
    extra
        The pip extra that installs the client library, or ``None`` when none is needed.
    distribution
        The distribution that declares :attr:`extra` (a third-party plugin names its own).
    requires
        Top-level modules the backend imports (checked by ``hicache backends``).
    capabilities
        What the backend promises by default (an instance may refine it from its config).
    baseline
        ``"module:Class"`` of the raw yardstick ``hicache bench`` compares against, if any.
    description
        One line for ``hicache backends``.
    namespace_option
        The option that names a tenant's namespace in a shared store (``prefix`` ...), if any:
        the conformance suite checks that instances whose namespaces are prefixes of each other
        never see or clear each other's keys. Its values must accept ``[a-z0-9]+``.
    """

    name: str
    factory: str
    config: str
    extra: str | None = None
    distribution: str = "hicache-storage"
    requires: tuple[str, ...] = ()
    capabilities: Capabilities = dataclasses.field(default_factory=Capabilities)
    baseline: str | None = None
    description: str = ""
    namespace_option: str | None = None

    def installed(self) -> bool:
        """Return whether every module in :attr:`requires` can be imported here."""
        return all(importlib.util.find_spec(module) is not None for module in self.requires)

    def load_config_type(self) -> type[msgspec.Struct]:
        """Import and return the config Struct."""
        loaded: type[msgspec.Struct] = self._load(self.config)
        return loaded

    def load_factory(self) -> type[StorageBackend]:
        """Import and return the backend class."""
        loaded: type[StorageBackend] = self._load(self.factory)
        return loaded

    def load_baseline(self) -> Any:
        """Import and return the raw baseline class, or ``None``."""
        return None if self.baseline is None else self._load(self.baseline)

    def build(self, options: msgspec.Struct, deployment: Deployment) -> StorageBackend:
        """Construct the bare backend (no layers)."""
        return self.load_factory()(options, deployment)  # type: ignore[call-arg]

    def _load(self, target: str) -> Any:
        module_name, _, attribute = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = (
                f"pip install '{self.distribution}[{self.extra}]'"
                if self.extra
                else f"reinstall {self.distribution}"
            )
            raise MissingDependencyError(
                f"backend {self.name!r} needs {exc.name or module_name!r}, which is not "
                f"installed; run: {hint}"
            ) from exc
        return getattr(module, attribute)


class _Registry:
    """The plugin manager and the specs it yields, built on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._manager: pluggy.PluginManager | None = None
        self._specs: dict[str, BackendSpec] | None = None

    def manager(self) -> pluggy.PluginManager:
        with self._lock:
            if self._manager is None:
                manager = pluggy.PluginManager(hookspecs.PROJECT)
                manager.add_hookspecs(hookspecs)
                manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
                self._manager = manager
            return self._manager

    def specs(self) -> dict[str, BackendSpec]:
        manager = self.manager()
        with self._lock:
            if self._specs is None:
                specs: dict[str, BackendSpec] = {}
                for provided in manager.hook.hicache_backends():
                    for spec in provided:
                        if spec.name in specs and specs[spec.name] != spec:
                            raise ValueError(f"two plugins register a backend named {spec.name!r}")
                        specs[spec.name] = spec
                self._specs = dict(sorted(specs.items()))
            return self._specs

    def register(self, plugin: object, name: str | None = None) -> None:
        manager = self.manager()
        with self._lock:
            manager.register(plugin, name=name)
            self._specs = None

    def unregister(self, plugin: object) -> None:
        manager = self.manager()
        with self._lock:
            manager.unregister(plugin)
            self._specs = None


_REGISTRY = _Registry()


def registered_backends() -> Mapping[str, BackendSpec]:
    """Return the registered backends by name, sorted (a read-only view)."""
    return MappingProxyType(_REGISTRY.specs())


def get_spec(name: str) -> BackendSpec:
    """Return the spec of backend ``name``.

    Raises
    ------
    UnknownBackendError
        If no backend has that name; the message lists the registered ones.
    """
    specs = _REGISTRY.specs()
    try:
        return specs[name]
    except KeyError:
        known = ", ".join(specs) or "none"
        raise UnknownBackendError(
            f"no backend named {name!r} is registered (registered: {known}); install the "
            f"package that provides it or check the spelling"
        ) from None


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register a plugin object at run time (what an entry point does at start-up)."""
    _REGISTRY.register(plugin, name)


def unregister_plugin(plugin: object) -> None:
    """Remove a plugin registered with :func:`register_plugin`."""
    _REGISTRY.unregister(plugin)
