"""Find backends by name: pluggy hooks fed by the ``hicache_storage.backends`` entry points.

Nothing is imported until a backend is asked for: a :class:`BackendSpec` names its factory and
config schema as ``"module:attribute"`` strings, so listing backends never imports a client library.
A plugin that fails to load is skipped with a :class:`PluginLoadWarning` and listed by
:func:`broken_plugins`, so one bad package never hides the other backends.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import importlib.util
import os
import re
import threading
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, cast

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
    "PLUGINS_ENV",
    "BackendConstructor",
    "BackendSpec",
    "BrokenPlugin",
    "Origin",
    "PluginLoadWarning",
    "broken_plugins",
    "registered_backends",
    "get_spec",
    "hookimpl",
    "origin_of",
    "plugin_manager",
    "register_plugin",
    "unregister_plugin",
]

ENTRY_POINT_GROUP = "hicache_storage.backends"
PLUGINS_ENV = "HICACHE_PLUGINS"
"""Comma-separated modules registered as plugins besides the entry points: a plugin under
development, not installed yet, is found in every process that inherits the variable (the
conformance suite's worker processes too)."""
hookimpl = hookspecs.hookimpl


class BackendConstructor(Protocol):
    """What a :attr:`BackendSpec.factory` names (a backend class's constructor is one)."""

    def __call__(self, config: Any, deployment: Deployment, /) -> StorageBackend:
        """Return the bare backend for validated options ``config`` and ``deployment``."""
        ...


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

    def scratch_options(self, directory: str) -> dict[str, str]:
        """Return the options naming a place under ``directory`` for each required location.

        A backend whose options require a ``root`` directory or a ``path`` gets
        ``directory/root`` and ``directory/store``; others get ``{}``. The CLI and the suite's
        ``--hicache-backend`` give such a backend a fresh temporary place when no config is given.
        """
        required = {f.name for f in msgspec.structs.fields(self.load_config_type()) if f.required}
        places = {"root": "root", "path": "store"}
        return {
            name: os.path.join(directory, leaf) for name, leaf in places.items() if name in required
        }

    def load_factory(self) -> type[StorageBackend]:
        """Import and return the backend class."""
        loaded: type[StorageBackend] = self._load(self.factory)
        return loaded

    def load_baseline(self) -> Any:
        """Import and return the raw baseline class, or ``None``."""
        return None if self.baseline is None else self._load(self.baseline)

    def build(self, options: msgspec.Struct, deployment: Deployment) -> StorageBackend:
        """Construct the bare backend (no layers)."""
        factory: BackendConstructor = self._load(self.factory)
        return factory(options, deployment)

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


class PluginLoadWarning(UserWarning):
    """A plugin failed to load (import error, or its ``hicache_backends`` hook raised)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """The installed distribution whose entry point provides a plugin."""

    distribution: str
    version: str

    @property
    def builtin(self) -> bool:
        """Whether the plugin ships with hicache-storage itself."""
        return _canonical(self.distribution) == "hicache-storage"

    def __str__(self) -> str:
        return "built in" if self.builtin else f"{self.distribution} {self.version}"


@dataclasses.dataclass(frozen=True, slots=True)
class BrokenPlugin:
    """A plugin that was skipped: its name, where it came from and what went wrong."""

    name: str
    origin: Origin | None
    error: str


def _canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _origin(entry_point: importlib.metadata.EntryPoint) -> Origin | None:
    dist = entry_point.dist
    return None if dist is None else Origin(dist.name, dist.version)


def _error(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__


class _Registry:
    """The plugin manager and the specs it yields, built on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._manager: pluggy.PluginManager | None = None
        self._specs: dict[str, BackendSpec] | None = None
        self._plugin_origins: dict[str, Origin] = {}
        self._origins: dict[str, Origin] = {}
        self._unloadable: list[BrokenPlugin] = []
        self._failing: list[BrokenPlugin] = []

    def manager(self) -> pluggy.PluginManager:
        broken: list[BrokenPlugin] = []
        with self._lock:
            if self._manager is None:
                manager = pluggy.PluginManager(hookspecs.PROJECT)
                manager.add_hookspecs(hookspecs)
                broken = self._unloadable = self._load_entry_points(manager)
                self._manager = manager
            result = self._manager
        _warn(broken)
        return result

    def _load_entry_points(self, manager: pluggy.PluginManager) -> list[BrokenPlugin]:
        """Register every entry point of the group; return those that failed (skipped)."""
        broken: list[BrokenPlugin] = []
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if manager.is_blocked(entry_point.name) or manager.has_plugin(entry_point.name):
                continue
            origin = _origin(entry_point)
            try:
                manager.register(entry_point.load(), name=entry_point.name)
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not hide the others
                broken.append(BrokenPlugin(entry_point.name, origin, _error(exc)))
                continue
            if origin is not None:
                self._plugin_origins[entry_point.name] = origin
        for module in filter(None, os.environ.get(PLUGINS_ENV, "").replace(" ", "").split(",")):
            if manager.has_plugin(module):
                continue
            try:
                manager.register(importlib.import_module(module), name=module)
            except Exception as exc:  # noqa: BLE001 - as for an entry point
                broken.append(BrokenPlugin(module, None, _error(exc)))
        return broken

    def specs(self) -> dict[str, BackendSpec]:
        manager = self.manager()
        broken: list[BrokenPlugin] = []
        with self._lock:
            if self._specs is None:
                specs: dict[str, BackendSpec] = {}
                origins: dict[str, Origin] = {}
                for impl in manager.hook.hicache_backends.get_hookimpls():
                    origin = self._plugin_origins.get(impl.plugin_name)
                    try:
                        provided = cast("list[BackendSpec]", impl.function())
                    except Exception as exc:  # noqa: BLE001 - as for a plugin that cannot import
                        broken.append(BrokenPlugin(impl.plugin_name, origin, _error(exc)))
                        continue
                    for spec in provided:
                        if spec.name in specs and specs[spec.name] != spec:
                            raise ValueError(f"two plugins register a backend named {spec.name!r}")
                        specs[spec.name] = spec
                        if origin is not None:
                            origins[spec.name] = origin
                self._specs = dict(sorted(specs.items()))
                self._origins = origins
                self._failing = broken
            result = self._specs
        _warn(broken)
        return result

    def origin(self, name: str) -> Origin | None:
        self.specs()
        with self._lock:
            return self._origins.get(name)

    def broken(self) -> tuple[BrokenPlugin, ...]:
        self.specs()
        with self._lock:
            return (*self._unloadable, *self._failing)

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


def _warn(broken: list[BrokenPlugin]) -> None:
    for found in broken:
        source = (
            f" (from {found.origin.distribution} {found.origin.version})" if found.origin else ""
        )
        warnings.warn(
            f"skipped hicache-storage plugin {found.name!r}{source}: {found.error}",
            PluginLoadWarning,
            stacklevel=4,
        )


_REGISTRY = _Registry()


def registered_backends() -> Mapping[str, BackendSpec]:
    """Return the registered backends by name, sorted (a read-only view)."""
    return MappingProxyType(_REGISTRY.specs())


def get_spec(name: str) -> BackendSpec:
    """Return the spec of backend ``name``.

    Raises
    ------
    UnknownBackendError
        If no backend has that name; the message lists the registered ones and names the
        closest of them, if one is close.
    """
    specs = _REGISTRY.specs()
    try:
        return specs[name]
    except KeyError:
        known = ", ".join(specs) or "none"
        broken = "".join(
            f"; plugin {found.name!r} failed to load: {found.error}" for found in _REGISTRY.broken()
        )
        close = difflib.get_close_matches(name, specs, n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownBackendError(
            f"no backend named {name!r} is registered (registered: {known}); install the "
            f"package that provides it or check the spelling{guess}{broken}"
        ) from None


def origin_of(name: str) -> Origin | None:
    """Return the distribution whose entry point provides backend ``name``.

    ``None`` when the backend is unknown or its plugin was registered at run time.
    """
    return _REGISTRY.origin(name)


def broken_plugins() -> tuple[BrokenPlugin, ...]:
    """Return the plugins skipped because they failed to load, with their errors."""
    return _REGISTRY.broken()


def plugin_manager() -> pluggy.PluginManager:
    """Return the plugin manager with every plugin loaded: its ``hook`` calls their hooks."""
    return _REGISTRY.manager()


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register a plugin object at run time (what an entry point does at start-up)."""
    _REGISTRY.register(plugin, name)


def unregister_plugin(plugin: object) -> None:
    """Remove a plugin registered with :func:`register_plugin`."""
    _REGISTRY.unregister(plugin)
