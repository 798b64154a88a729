"""Build a tier cache for a model shape: its device pool, its host pool and the cache over them.

Every caller that wires an engine by hand (the benchmark, the engine checks of the conformance
suite, the examples, the prefix script) sizes the same two pools from the same facts: the
model's KV shape, a token budget per tier and the page size of the cache's config. One
function does it, so a new pool argument is added once.
"""

from __future__ import annotations

import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.kernels import DevicePool
from hicache_storage.keys import KeyScheme

from .cache import CacheConfig, TierCache
from .model import ModelConfig

__all__ = ["build_cache"]


def build_cache(
    shape: ModelConfig,
    config: CacheConfig,
    *,
    device_tokens: int,
    host_tokens: int | None,
    backend: StorageBackend | None = None,
    device: torch.device | str = "cpu",
    host_layout: str = "layer_first",
    pin_memory: bool | None = None,
    shared_host: bool = False,
    scheme: KeyScheme | None = None,
) -> TierCache:
    """Return a :class:`TierCache` over fresh pools for a model of ``shape``.

    Parameters
    ----------
    shape
        The model whose KV the pools hold (layers, KV heads, head size, dtype).
    config
        The cache's policies; its ``page_size`` is the host pool's page.
    device_tokens, host_tokens
        Each tier's size in tokens; ``host_tokens=None`` builds a cache with no host tier
        (and so no storage tier: ``backend`` must be None).
    backend
        The storage tier (L3), or None.
    device
        Where the device pool lives.
    host_layout
        The host pool's layout (``layer_first``, ``page_first``, ``page_first_direct``).
    pin_memory
        Pin the host pool; by default, when the device is a GPU.
    shared_host
        Allocate the host pool in shared memory (a backend serving from another process).
    scheme
        The key scheme of the storage tier (default: the cache's own).

    Raises
    ------
    ConfigError
        If a backend is given without a host tier, or the pools disagree.
    """
    where = torch.device(device)
    pool = DevicePool.mha(
        device_tokens, shape.layers, shape.kv_heads, shape.head_dim, shape.dtype, where
    )
    host = None
    if host_tokens is not None:
        host = MHAHostPool(
            host_tokens,
            config.page_size,
            shape.layers,
            shape.kv_heads,
            shape.head_dim,
            shape.dtype,
            host_layout,
            where.type == "cuda" if pin_memory is None else pin_memory,
            shared=shared_host,
        )
    return TierCache(pool, host, backend, config, scheme=scheme)
