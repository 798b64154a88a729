"""The chain's yardstick: its first tier's own raw baseline, where its hits are served."""

from __future__ import annotations

from typing import Any

from hicache_storage.config import Deployment, convert, read_source
from hicache_storage.registry import get_spec
from hicache_storage.urls import is_url, parse_backend_url

from .config import ChainConfig

__all__ = ["first_tier_baseline"]


def first_tier_baseline(config: ChainConfig, deployment: Deployment | None = None) -> Any:
    """Return the first tier's baseline over its options (None if that backend has none).

    A page the first tier holds should read at the rate of that tier's medium: the chain adds
    only the bookkeeping of which tier served it.
    """
    first = config.tiers[0]
    name, options = first.backend, read_source(first.options)
    if is_url(name):
        name, from_url = parse_backend_url(name)
        options = {**from_url, **options}
    spec = get_spec(name)
    baseline = spec.load_baseline()
    if baseline is None:
        return None
    parsed = convert(options, spec.load_config_type(), f"{spec.name} backend options")
    return baseline(parsed, deployment or Deployment())
