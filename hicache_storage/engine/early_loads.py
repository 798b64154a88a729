"""Early loads: a waiting request's fetched pages copied to the device as their reads return.

With ``prefetch.early_loads`` (:class:`~hicache_storage.engine.cache_config.PrefetchConfig`)
a request that waits for its storage fetch has each batch of pages copied on to the device as it
is read (:class:`~hicache_storage.engine.loading.EarlyLoad`), so that at admission only the
pages read last are left to load. :class:`EarlyLoads` keeps those copies: it gives them device
slots, and takes the slots back when the request is cancelled or an admission needs the room.
"""

from __future__ import annotations

import torch

from .copies import CopiesInFlight
from .leases import Lookup
from .loading import EarlyLoad
from .nodes import Tier
from .tiers import Tiers

__all__ = ["EarlyLoads"]


class EarlyLoads:
    """The early loads of the waiting requests, and the device slots they hold.

    Parameters
    ----------
    tiers
        The cache's shared state. On a GPU with a storage tier and ``prefetch.early_loads``
        on, the copies run on a side stream of their own.
    copies
        Copies in flight: a device page evicted for an early load may still be read by its
        backup to the host.
    """

    def __init__(self, tiers: Tiers, copies: CopiesInFlight) -> None:
        self.tiers = tiers
        self.copies = copies
        device = tiers.device_pool.device
        wanted = (
            device.type == "cuda" and tiers.io is not None and tiers.config.prefetch.early_loads
        )
        self._stream = torch.cuda.Stream(device) if wanted else None  # type: ignore[no-untyped-call]
        self._waiting: list[Lookup] = []
        self.held = 0
        """Device slots the early loads hold."""

    def watch(self, lookup: Lookup) -> None:
        """Copy ``lookup``'s fetched pages as they are read, when ``prefetch.early_loads`` is on."""
        if self.tiers.config.prefetch.early_loads:
            self._waiting.append(lookup)

    def forget(self, lookup: Lookup) -> None:
        """Stop copying ``lookup``'s pages (it is admitted or cancelled)."""
        if lookup in self._waiting:
            self._waiting.remove(lookup)

    def load(self) -> None:
        """Copy the pages fetches read since the last call to the device (``prefetch.early_loads``).

        A copy takes free device slots or those of unlocked device pages the host holds too
        (dropping them costs no copy), and never more than half the device pool in all: the
        waiting requests' copies must not crowd out the running ones' next admissions.
        """
        tiers = self.tiers
        transfer = tiers.transfer
        if not self._waiting or transfer is None:
            return
        page = tiers.page_size
        limit = tiers.device_pool.size // 2
        still: list[Lookup] = []
        for lookup in self._waiting:
            fetch = lookup.fetch
            if fetch is None:
                continue
            still.append(lookup)
            early = lookup.early
            done = 0 if early is None else early.tokens
            count = min(fetch.read_pages * page - done, (limit - self.held) // page * page)
            device = self._alloc_device(count) if count > 0 else None
            if device is None:
                continue
            if early is None:
                early = lookup.early = EarlyLoad(
                    transfer, self._stream, max_gbps=tiers.config.transfer.load_max_gbps
                )
            assert fetch.host_indices is not None
            early.extend(fetch.host_indices[done : done + count], device)
            self.held += count
            tiers.stats.pages_loaded_early += count // page
        self._waiting = still

    def _alloc_device(self, count: int) -> torch.Tensor | None:
        """Device slots for an early load: free ones, then unlocked pages also on the host."""
        tree, device_alloc = self.tiers.tree, self.tiers.device_alloc
        while device_alloc.available_size() < count:
            victim = next(tree.evictable(Tier.DEVICE), None)
            if victim is None or Tier.HOST not in victim.tiers:
                return None
            freed = tree.evict_device(victim)
            self.copies.release_device(freed)
            device_alloc.free(freed)
        return device_alloc.alloc(count)

    def drop(self, lookup: Lookup) -> None:
        """Give back a request's early-loaded device slots, once their copies are done."""
        early = lookup.early
        if early is None:
            return
        lookup.early = None
        early.synchronize()
        if early.tokens:
            self.tiers.device_alloc.free(early.slots)
        self.held -= early.tokens
        self.tiers.stats.early_pages_dropped += early.tokens // self.tiers.page_size

    def reclaim(self, need: int) -> bool:
        """Drop waiting requests' early loads, newest first, until ``need`` slots are free.

        Return whether any was dropped.
        """
        dropped = False
        for lookup in reversed(self._waiting):
            if self.tiers.device_alloc.available_size() >= need:
                break
            if lookup.early is not None:
                self.drop(lookup)
                dropped = True
        return dropped

    def settle(self, early: EarlyLoad, unused: torch.Tensor) -> None:
        """Hand an admitted request's early copies over to its nodes, freeing ``unused`` slots.

        The slots its nodes took are theirs from now on; those no node took (pages the device
        held already) are given back.
        """
        self.held -= early.tokens
        if unused.numel():
            self.tiers.device_alloc.free(unused)
            self.tiers.stats.early_pages_dropped += unused.numel() // self.tiers.page_size
