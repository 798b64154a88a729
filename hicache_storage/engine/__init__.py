"""The tier engine: a GPU (L1) / host (L2) / storage (L3) KV cache driven by a real transformer.

What users write is exported here (``docs/engine.md``); each name imports its module on first
use, so ``import hicache_storage.engine`` stays cheap:

- :class:`Engine`: model, cache and scheduler together; :class:`Scheduler` and :class:`Request`
  when driving them by hand (:class:`StepRecord`: where a step's time went);
- :class:`TierCache` and its :class:`CacheConfig` with its groups (:class:`WriteConfig`,
  :class:`PrefetchConfig`, :class:`ThreadConfig`, :class:`TransferConfig`), and
  :func:`build_cache`, which sizes the pools for a model shape and builds the cache over them;
- :class:`LlamaModel` and its :class:`ModelConfig` (shapes, seeded weights);
- the engine's errors (:mod:`hicache_storage.engine.errors`).
"""

from __future__ import annotations

from hicache_storage.kit.lazy import lazy_exports

__all__ = [
    "CacheConfig",
    "Engine",
    "InvalidRequestError",
    "LlamaModel",
    "ModelConfig",
    "PoolMismatchError",
    "PrefetchConfig",
    "Request",
    "RequestFailedError",
    "RequestTypeError",
    "Scheduler",
    "StepRecord",
    "StorageBugError",
    "ThreadConfig",
    "TierCache",
    "TransferConfig",
    "WriteConfig",
    "build_cache",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CacheConfig": ".cache_config",
        "PrefetchConfig": ".cache_config",
        "ThreadConfig": ".cache_config",
        "TransferConfig": ".cache_config",
        "WriteConfig": ".cache_config",
        "build_cache": ".build",
        "TierCache": ".cache",
        "Engine": ".engine",
        "LlamaModel": ".model",
        "ModelConfig": ".model",
        "Request": ".scheduler",
        "Scheduler": ".scheduler",
        "StepRecord": ".scheduler",
        "InvalidRequestError": ".errors",
        "PoolMismatchError": ".errors",
        "RequestFailedError": ".errors",
        "RequestTypeError": ".errors",
        "StorageBugError": ".errors",
    },
)
