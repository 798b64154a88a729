"""An MLA (one latent row per token) device pool goes through every tier byte for byte.

No model attends over MLA here; the cache is driven as the scheduler drives it, with each
request's latent rows written by hand, and a fresh cache over the same storage must hand back
the same bytes in the device slots it loads.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache_storage import StorageBackend, create_backend
from hicache_storage.engine.cache import CacheConfig, TierCache
from hicache_storage.engine.cache_config import PrefetchConfig
from hicache_storage.engine.policies import PrefetchPolicy
from hicache_storage.engine.radix import Tier
from hicache_storage.hostpool import MLAHostPool
from hicache_storage.kernels import DevicePool

from .test_running_host_room import admit

PAGE, LAYERS, DIM = 4, 3, 24


@pytest.fixture
def backend() -> Iterator[StorageBackend]:
    store = create_backend("memory")
    yield store
    store.close()


def mla_cache(backend: StorageBackend, layout: str, device_tokens: int = 32) -> TierCache:
    device = DevicePool.mla(device_tokens, LAYERS, DIM, torch.float32)
    host = MLAHostPool(24, PAGE, LAYERS, DIM, torch.float32, layout, pin_memory=False)
    config = CacheConfig(PAGE, prefetch=PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE, capacity=16))
    return TierCache(device, host, backend, config)


def rows(cache: TierCache, slots: torch.Tensor) -> torch.Tensor:
    """The latent rows of ``slots`` in every layer, ``(layers, tokens, DIM)``."""
    pool = cache.device_pool
    return torch.stack([pool.buffers[0][layer][slots, 0] for layer in range(LAYERS)])


def serve(cache: TierCache, tokens: list[int], kv: torch.Tensor) -> torch.Tensor:
    """Admit a request, write the latent rows it computes, release it; return its prefix rows."""
    lease = admit(cache, tokens, generated=0)
    load = cache.take_load()
    if load is not None:
        load.finish()
    slots = lease.slots[: len(tokens)]
    cached = rows(cache, slots[: lease.cached]).clone()
    for layer in range(LAYERS):
        cache.device_pool.buffers[0][layer][slots[lease.cached :], 0] = kv[layer, lease.cached :]
    cache.release(lease, tokens, lease.slots)
    return cached


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_pages_round_trip_through_host_and_storage(
    backend: StorageBackend, layout: str
) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [[i, *torch.randint(0, 1000, (19,), generator=gen).tolist()] for i in range(3)]
    kvs = [torch.randn(LAYERS, 20, DIM, generator=gen) for _ in prompts]
    first = mla_cache(backend, layout)
    for prompt, kv in zip(prompts, kvs, strict=True):
        serve(first, prompt, kv)  # 3 x 20 tokens through a 32-slot device pool and 24-slot host
    assert first.stats.pages_backed_up > 0
    first.close()
    assert first.stats.pages_stored > 0 and first.tree.tokens_on(Tier.HOST) <= 24

    again = mla_cache(backend, layout)
    for prompt, kv in zip(prompts, kvs, strict=True):
        cached = serve(again, prompt, kv)
        assert cached.shape[1] == 16, "every whole page but the last token's is reused"
        assert torch.equal(cached, kv[:, :16]), "the latent rows come back bit for bit"
    assert again.stats.storage_hit_tokens > 0
    again.close()
    again.tree.check()
