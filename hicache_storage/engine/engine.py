"""Greedy generation through the tier cache: the model computes only what no tier holds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cache import TierCache
from .model import LlamaModel

__all__ = ["Engine"]


class Engine:
    """Serve requests one at a time with a :class:`LlamaModel` over a :class:`TierCache`.

    Parameters
    ----------
    model
        The model; its KV shape must match the cache's device pool.
    cache
        The tier cache, or None to recompute every request from scratch (the baseline).
    """

    def __init__(self, model: LlamaModel, cache: TierCache | None) -> None:
        self.model = model
        self.cache = cache

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, seed: str | None = None
    ) -> list[int]:
        """Continue ``prompt`` greedily for ``max_new_tokens`` tokens.

        With a cache, the longest cached prefix is reused (from whichever tier holds it), the rest
        is computed into fresh device slots, and the request's KV is handed back to the cache.
        ``seed`` is the request's cache namespace (``namespace_seed(extra_key, cache_salt)``).
        """
        cache = self.cache
        if cache is None:
            return self.model.generate_no_cache(prompt, max_new_tokens)
        lease = cache.acquire(prompt, seed=seed)
        held = len(prompt) + max_new_tokens - 1
        try:
            fresh = cache.alloc_device(held - lease.cached)
        except BaseException:
            cache.release(lease, prompt[: lease.cached], lease.device_indices)
            raise
        slots = torch.cat([lease.device_indices, fresh])
        device = cache.device_pool.device
        try:
            out = self.model.generate(
                prompt, max_new_tokens, cache.device_pool, slots.to(device), cached=lease.cached
            )
        except BaseException:
            cache.release(lease, prompt[: lease.cached], slots)
            raise
        cache.release(lease, [*prompt, *out][:held], slots)
        cache.stats.computed_tokens += len(prompt) - lease.cached
        return out
