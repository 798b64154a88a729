"""Build a registered backend from config and wrap it in the default layers."""

from __future__ import annotations

import importlib
from typing import Any

from .backend import StorageBackend
from .config import Deployment, HiCacheConfig, LayerConfig, convert, load_config, read_source
from .errors import ConfigError
from .layers import (
    DegradeLayer,
    FaultInjectionLayer,
    ForwardingBackend,
    HealthLayer,
    MetricsLayer,
    ValidationLayer,
)
from .registry import get_spec

__all__ = ["apply_layers", "create_backend", "open_backend"]


def apply_layers(backend: StorageBackend, layers: LayerConfig | None = None) -> StorageBackend:
    """Wrap ``backend`` in validation and then the configured stack (by default the built-ins).

    By default the result is ``Validation(Degrade(Health(Metrics(Faults(backend)))))``.
    Validation is always outermost so caller mistakes raise before anything else runs; by
    default health sits inside degrade so it sees the timeouts that tell it the store stopped
    answering (and answers misses itself while it is down), metrics sit inside both so they see
    (and count) the infrastructure errors degrade turns into misses, and injected faults are
    innermost so they look exactly like backend failures.
    :attr:`LayerConfig.stack` orders them otherwise, or adds a layer of one's own by its
    ``"module:Class"`` path.

    Raises
    ------
    ConfigError
        If a layer named by path cannot be imported or is not a layer.
    """
    layers = layers or LayerConfig()
    wrapped = backend
    for name in reversed(layers.layer_stack()):
        wrapped = _layer(name, wrapped, layers)
    return ValidationLayer(wrapped)


def _layer(name: str, inner: StorageBackend, layers: LayerConfig) -> StorageBackend:
    """Return ``inner`` wrapped in the layer ``name`` (a built-in's word or a class path)."""
    if name == "degrade":
        return DegradeLayer(inner)
    if name == "health":
        return HealthLayer(inner, layers.health)
    if name == "metrics":
        return MetricsLayer(inner)
    if name == "faults":
        assert layers.faults is not None  # LayerConfig checks that the stack and faults agree
        return FaultInjectionLayer(inner, layers.faults)
    module_name, _, attribute = name.partition(":")
    try:
        layer = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"layer {name!r} could not be loaded: {exc}") from exc
    if not (isinstance(layer, type) and issubclass(layer, ForwardingBackend)):
        raise ConfigError(
            f"layer {name!r} is not a layer: name a subclass of "
            "hicache_storage.layers.ForwardingBackend"
        )
    built: StorageBackend = layer(inner)
    return built


def create_backend(
    name: str,
    config: Any = None,
    *,
    deployment: Deployment | None = None,
    layers: LayerConfig | None = None,
) -> StorageBackend:
    """Build backend ``name`` from its options and wrap it in the default layers.

    Parameters
    ----------
    name
        A registered backend name (see ``hicache backends``).
    config
        The backend's own options: a mapping, a JSON string, ``"@path"`` to a JSON file, or the
        backend's config Struct.
    deployment
        Facts about this rank; defaults to a single-rank deployment.
    layers
        Which layers to apply; defaults to validation, degrade-to-miss, health and metrics.

    Raises
    ------
    UnknownBackendError
        If ``name`` is not registered.
    MissingDependencyError
        If the backend's client library is missing; the message names the pip extra.
    ConfigError
        If an option is unknown, of the wrong type or out of range.
    """
    spec = get_spec(name)
    schema = spec.load_config_type()
    options = (
        config
        if isinstance(config, schema)
        else convert(read_source(config), schema, f"{name} backend options")
    )
    backend = spec.build(options, deployment or Deployment())
    return apply_layers(backend, layers)


def open_backend(config: Any = None) -> StorageBackend:
    """Build the backend a whole :class:`~hicache_storage.config.HiCacheConfig` describes.

    ``config`` is anything :func:`~hicache_storage.config.load_config` accepts; the environment
    overrides it.
    """
    loaded = config if isinstance(config, HiCacheConfig) else load_config(config)
    return create_backend(
        loaded.backend, loaded.options, deployment=loaded.deployment, layers=loaded.layers
    )
