"""The process backend's yardstick: the served backend's own raw baseline, in this process."""

from __future__ import annotations

from typing import Any

from hicache_storage.config import Deployment, convert, read_source
from hicache_storage.registry import get_spec

from .config import ProcessConfig

__all__ = ["served_baseline"]


def served_baseline(config: ProcessConfig, deployment: Deployment | None = None) -> Any:
    """Return the served backend's baseline over the same options (None if it has none).

    What the process backend adds is the hop to its storage process; the yardstick is the medium
    read as directly as the served backend's own baseline reads it.
    """
    spec = get_spec(config.backend)
    baseline = spec.load_baseline()
    if baseline is None:
        return None
    options = convert(
        read_source(config.options), spec.load_config_type(), f"{spec.name} backend options"
    )
    return baseline(options, deployment or Deployment())
