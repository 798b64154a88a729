"""Build a registered backend from config and wrap it in the default layers."""

from __future__ import annotations

import importlib
from typing import Any

from .backend import StorageBackend
from .config import Deployment, HiCacheConfig, LayerConfig, convert, load_config, read_source
from .errors import BackendTimeoutError, BackendUnavailableError, ConfigError
from .layers import (
    AttachingBackend,
    DegradeLayer,
    FaultInjectionLayer,
    ForwardingBackend,
    HealthLayer,
    MetricsLayer,
    QuotaLayer,
    ValidationLayer,
    VerifyLayer,
)
from .registry import get_spec
from .urls import is_url, parse_backend_url

__all__ = ["apply_layers", "create_backend", "open_backend"]


def apply_layers(
    backend: StorageBackend, layers: LayerConfig | None = None, *, tier: str = ""
) -> StorageBackend:
    """Wrap ``backend`` in validation and then the configured stack (by default the built-ins).

    By default the result is ``Validation(Degrade(Health(Metrics(Verify(Faults(backend))))))``,
    with ``Quota`` inside metrics when a quota is set.
    Validation is always outermost so caller mistakes raise before anything else runs; by
    default health sits inside degrade so it sees the timeouts that tell it the store stopped
    answering (and answers misses itself while it is down), metrics sit inside both so they see
    (and count) the infrastructure errors degrade turns into misses and the pages verify turned
    into misses, and injected faults are innermost so they look exactly like backend failures.
    :attr:`LayerConfig.stack` orders them otherwise, or adds a layer of one's own by its
    ``"module:Class"`` path. ``tier`` labels the metrics layer's series (see
    :class:`~hicache_storage.layers.MetricsLayer`).

    Raises
    ------
    ConfigError
        If a layer named by path cannot be imported or is not a layer.
    """
    layers = layers or LayerConfig()
    wrapped = backend
    for name in reversed(layers.layer_stack()):
        wrapped = _layer(name, wrapped, layers, tier)
    return ValidationLayer(wrapped)


def _layer(name: str, inner: StorageBackend, layers: LayerConfig, tier: str) -> StorageBackend:
    """Return ``inner`` wrapped in the layer ``name`` (a built-in's word or a class path)."""
    if name == "degrade":
        return DegradeLayer(inner)
    if name == "health":
        return HealthLayer(inner, layers.health)
    if name == "metrics":
        return MetricsLayer(inner, tier=tier)
    if name == "verify":
        return VerifyLayer(inner)
    if name == "quota":
        assert layers.quota is not None  # LayerConfig checks that the stack and quota agree
        return QuotaLayer(inner, layers.quota)
    if name == "faults":
        assert layers.faults is not None  # LayerConfig checks that the stack and faults agree
        return FaultInjectionLayer(inner, layers.faults)
    built: StorageBackend = _layer_class(name)(inner)
    return built


def _layer_class(name: str) -> type[ForwardingBackend]:
    """Import the layer class a stack names by ``"module:Class"``.

    Raises
    ------
    ConfigError
        If it cannot be imported or is not a layer.
    """
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
    return layer


def create_backend(
    name: str,
    config: Any = None,
    *,
    deployment: Deployment | None = None,
    layers: LayerConfig | None = None,
    strict_start: bool = True,
    tier: str = "",
) -> StorageBackend:
    """Build backend ``name`` from its options and wrap it in the default layers.

    Parameters
    ----------
    name
        A registered backend name (see ``hicache backends``), or a URL whose scheme a backend
        claims (``redis://host:6379/0``, ``s3://bucket/prefix``, ``file:///path``; see
        ``hicache_storage.urls.parse_backend_url``): its backend with the options it gives.
    config
        The backend's own options: a mapping, a JSON string, ``"@path"`` to a JSON file, or the
        backend's config Struct. With a URL, these keys update the URL's options.
    deployment
        Facts about this rank; defaults to a single-rank deployment.
    layers
        Which layers to apply; defaults to validation, degrade-to-miss, health and metrics.
    strict_start
        Whether a store that cannot be reached fails the call (the default). False returns an
        :class:`~hicache_storage.layers.AttachingBackend` instead: every call a counted miss
        until a background thread has built the backend, once the store answers.
    tier
        The backend's place in a chain of tiers, as the ``tier`` label of its metrics (empty
        for a backend of its own).

    Raises
    ------
    UnknownBackendError
        If ``name`` is not registered.
    MissingDependencyError
        If the backend's client library is missing; the message names the pip extra.
    ConfigError
        If an option is unknown, of the wrong type or out of range, a layer the stack names
        cannot be loaded, or ``name`` is a URL that no backend claims or that does not read as
        its scheme requires.
    BackendUnavailableError, BackendTimeoutError
        With ``strict_start``, if the backend checks its store when built and it does not answer.
    """
    if is_url(name):
        name, from_url = parse_backend_url(name)
        config = {**from_url, **read_source(config)}
    spec = get_spec(name)
    schema = spec.load_config_type()
    options = (
        config
        if isinstance(config, schema)
        else convert(read_source(config), schema, f"{name} backend options")
    )
    deployment = deployment or Deployment()
    layers = layers or LayerConfig()
    for layer in layers.layer_stack():
        if ":" in layer:
            _layer_class(layer)  # a bad layer is a bad config even while the store is down

    def build() -> StorageBackend:
        backend = spec.build(options, deployment)
        try:
            return apply_layers(backend, layers, tier=tier)
        except BaseException:
            backend.close()
            raise

    try:
        return build()
    except (BackendUnavailableError, BackendTimeoutError) as exc:
        if strict_start:
            raise
        return AttachingBackend(
            build, name=name, capabilities=spec.capabilities, error=exc, backoff=layers.health
        )


def open_backend(config: Any = None) -> StorageBackend:
    """Build the backend a whole :class:`~hicache_storage.config.HiCacheConfig` describes.

    ``config`` is anything :func:`~hicache_storage.config.load_config` accepts; the environment
    overrides it. A store that cannot be reached fails the call only with ``strict_start: true``;
    otherwise the backend starts detached and attaches once the store answers (see
    :func:`create_backend`). The SGLang adapter and the vLLM tier start through here.
    """
    loaded = config if isinstance(config, HiCacheConfig) else load_config(config)
    return create_backend(
        loaded.backend,
        loaded.options,
        deployment=loaded.deployment,
        layers=loaded.layers,
        strict_start=loaded.strict_start,
    )
