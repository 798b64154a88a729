"""Run any hicache-storage backend as a storage tier of vLLM's KV offloading (``docs/vllm.md``).

vLLM's ``OffloadingConnector`` with its ``TieringOffloadingSpec`` keeps a CPU primary tier of
KV chunks and hands whole chunks to secondary tiers; :class:`HiCacheTier` is such a tier over
any registered backend::

    vllm serve MODEL --kv-transfer-config '{
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8000000000,
            "secondary_tiers": [{"type": "HiCacheTier",
                                 "module_path": "hicache_storage.integrations.vllm",
                                 "backend": "redis", "options": {"url": "redis://h:6379/0"}}]}}'

This package is the only place that imports vLLM: :mod:`.tier` holds the tier (imported on
first use of ``HiCacheTier``, so the settings and keys can be checked without vLLM),
:mod:`.config` its settings, :mod:`.namespace` what a chunk's bytes mean, :mod:`.cpu` a worker
that lets the offloading path run on a CPU-only vLLM (tests), :mod:`.harness` the end-to-end
checks.
"""

from __future__ import annotations

from hicache_storage.integrations.vllm.config import TIER_KEYS, TierSettings, tier_settings
from hicache_storage.kit.lazy import lazy_exports

__all__ = ["TIER_KEYS", "HiCacheTier", "TierSettings", "tier_settings"]

__getattr__, __dir__ = lazy_exports(__name__, {"HiCacheTier": ".tier"})
