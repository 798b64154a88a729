"""Build a registered backend from config and wrap it in the default layers."""

from __future__ import annotations

from typing import Any

from .backend import StorageBackend
from .config import Deployment, HiCacheConfig, LayerConfig, convert, load_config, read_source
from .layers import DegradeLayer, FaultInjectionLayer, MetricsLayer, ValidationLayer
from .registry import get_spec

__all__ = ["apply_layers", "create_backend", "open_backend"]


def apply_layers(backend: StorageBackend, layers: LayerConfig | None = None) -> StorageBackend:
    """Wrap ``backend`` as ``Validation(Degrade(Metrics(Faults(backend))))``.

    Validation is outermost so caller mistakes raise before anything else runs; metrics sit
    inside degrade so they see (and count) the infrastructure errors degrade turns into misses;
    injected faults are innermost so they look exactly like backend failures.
    """
    layers = layers or LayerConfig()
    wrapped = backend
    if layers.faults is not None:
        wrapped = FaultInjectionLayer(wrapped, layers.faults)
    if layers.metrics:
        wrapped = MetricsLayer(wrapped)
    if layers.degrade:
        wrapped = DegradeLayer(wrapped)
    return ValidationLayer(wrapped)


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
        Which layers to apply; defaults to validation, degrade-to-miss and metrics.

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
