"""The tier's settings from its ``secondary_tiers`` entry (no vLLM import: checked anywhere)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache_storage.config import HiCacheConfig, load_config, read_source, require_backend
from hicache_storage.errors import ConfigError
from hicache_storage.kit.options import check_count
from hicache_storage.redact import redacted_repr

__all__ = ["LOCALITIES", "TIER_KEYS", "TierSettings", "tier_settings"]

LOCALITIES = ("LOCAL", "REMOTE")
"""vLLM's tier localities (``vllm.v1.kv_offload.base.Locality``)."""

_OUR_KEYS = frozenset({"backend", "options", "layers", "strict_start", "config"})
_TIER_OPTIONS = frozenset(
    {"read_threads", "write_threads", "locality", "planner", "prefill_tokens_per_s"}
)
TIER_KEYS = _OUR_KEYS | _TIER_OPTIONS
"""Keys a ``secondary_tiers`` entry may hold besides vLLM's ``type``, ``module_path`` and
``backpressure`` (which vLLM takes out before the tier sees its config)."""


@dataclass(frozen=True)
class TierSettings:
    """A tier entry's settings, checked.

    Attributes
    ----------
    hicache
        The backend, its options and layers (its secrets never show in ``repr``).
    read_threads, write_threads
        Load and store jobs running at once (each one ``batch_get_v1``/``batch_set_v1`` call).
    locality
        ``"LOCAL"`` or ``"REMOTE"``: where vLLM should count this tier's storage, or None.
    planner
        Whether the planner decides what is fetched and written
        (:mod:`~hicache_storage.integrations.vllm.planning`); off, every stored chunk found is
        a hit and every chunk offered is written.
    prefill_tokens_per_s
        Tokens a second the served model prefills, what recomputing a chunk is priced at; None
        to derive it from what the tier sees
        (:class:`~hicache_storage.integrations.vllm.prefill.PrefillClock`).
    """

    hicache: HiCacheConfig
    read_threads: int = 4
    write_threads: int = 2
    locality: str | None = None
    planner: bool = True
    prefill_tokens_per_s: float | None = None

    def __repr__(self) -> str:
        return redacted_repr(self)


def tier_settings(entry: Mapping[str, Any]) -> TierSettings:
    """Read a ``secondary_tiers`` entry (vLLM's keys already removed).

    ``config`` (a whole hicache-storage config: JSON, ``@path`` or a mapping) is read first and
    the inline ``backend``/``options``/``layers``/``strict_start`` override it; ``HICACHE_*``
    environment variables override both, as in :func:`~hicache_storage.config.load_config`.

    Raises
    ------
    ConfigError
        For unknown keys, no ``backend`` (here, in ``config`` or ``HICACHE_BACKEND``), a
        ``deployment`` (vLLM states every deployment fact), malformed values, thread counts
        that are not positive integers, a ``planner`` that is not a bool or a
        ``prefill_tokens_per_s`` that is not a positive number.
    """
    entry = dict(entry)
    if "deployment" in entry:
        raise ConfigError(
            "the vLLM tier takes no 'deployment': the model, dtypes, block geometry and "
            "parallel layout come from vLLM and name the chunks' keys"
        )
    unknown = sorted(set(entry) - TIER_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {unknown} in the HiCacheTier entry of secondary_tiers; it takes "
            f"{sorted(TIER_KEYS)} besides vLLM's 'type', 'module_path' and 'backpressure'"
        )
    data = read_source(entry.pop("config", None))
    if "deployment" in data:
        raise ConfigError(
            "the config given to the vLLM tier holds a 'deployment': leave it out, vLLM states "
            "every deployment fact"
        )
    for key in _OUR_KEYS - {"config"}:
        if key in entry:
            data[key] = entry[key]
    require_backend(data, "the HiCacheTier entry of secondary_tiers")
    hicache = load_config(read_source(data))
    if hicache.deployment != HiCacheConfig().deployment:
        raise ConfigError(
            "a HICACHE_DEPLOYMENT__* environment variable sets a deployment fact; the vLLM "
            "tier takes them all from vLLM: unset it"
        )
    threads = {}
    for name, default in (("read_threads", 4), ("write_threads", 2)):
        value = entry.get(name, default)
        try:
            check_count(name, value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"HiCacheTier {name}: {exc}") from exc
        threads[name] = int(value)
    locality = entry.get("locality")
    if locality is not None and locality not in LOCALITIES:
        raise ConfigError(
            f"HiCacheTier locality must be one of {list(LOCALITIES)}, got {locality!r}"
        )
    planner = entry.get("planner", True)
    if not isinstance(planner, bool):
        raise ConfigError(f"HiCacheTier planner must be true or false, got {planner!r}")
    rate = entry.get("prefill_tokens_per_s")
    if rate is not None and (
        isinstance(rate, bool)
        or not isinstance(rate, int | float)
        or not math.isfinite(rate)
        or rate <= 0
    ):
        raise ConfigError(
            f"HiCacheTier prefill_tokens_per_s must be a positive number of tokens a second, "
            f"got {rate!r}"
        )
    return TierSettings(
        hicache,
        threads["read_threads"],
        threads["write_threads"],
        locality,
        planner,
        None if rate is None else float(rate),
    )
