"""What the parts of the tier cache share: its configuration, pools, tree and counters.

:class:`TierCache <hicache_storage.engine.cache.TierCache>` is split by concern into parts that
each keep their own bookkeeping (:class:`~hicache_storage.engine.prefetches.Prefetches`,
:class:`~hicache_storage.engine.writes.StorageWrites`,
:class:`~hicache_storage.engine.transfers.Transfers`, ...). What more than one of them reads or
changes is here, in one :class:`Tiers` the cache builds and hands to each: the parts read it at
every call rather than keep copies, so that a swapped transfer or a key scheme bound to a model
later is the one every part uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_storage.hostpool import HostKVPool, PageAllocator
from hicache_storage.kernels import DevicePool, KVTransfer
from hicache_storage.keys import KeyScheme
from hicache_storage.planner import Planner
from hicache_storage.planner.rates import CostModel

from .cache_config import CacheConfig
from .cache_stats import CacheStats
from .radix import RadixTree
from .storage_io import StorageIO

__all__ = ["Tiers"]


@dataclass(eq=False)
class Tiers:
    """The state of a tier cache that its parts share; the scheduler's thread alone touches it.

    Attributes
    ----------
    config
        Page size and policies.
    device_pool, host_pool
        L1 and L2 (None for a device-only cache).
    tree
        The index of every page's tiers, the one owner of that state.
    device_alloc
        Free slots of the device pool, in whole pages.
    transfer
        Copies between the device and host pools (None without a host pool).
    io
        The storage threads (None without a storage tier).
    scheme
        How page hashes become storage keys (bound to the model by
        :meth:`TierCache.bind_model <hicache_storage.engine.cache.TierCache.bind_model>`).
    stats
        What the cache served and moved.
    costs
        Measured read, query, write and compute times.
    planner
        The decisions over ``costs``: which fetches are worth reading under ``adaptive``, and
        which backups the storage writer makes (:class:`~hicache_storage.planner.Planner`).
    token_bytes
        Bytes of one token's KV over every layer.
    """

    config: CacheConfig
    device_pool: DevicePool
    host_pool: HostKVPool | None
    tree: RadixTree
    device_alloc: PageAllocator
    transfer: KVTransfer | None
    io: StorageIO | None
    scheme: KeyScheme
    stats: CacheStats
    costs: CostModel
    planner: Planner
    token_bytes: int

    @property
    def page_size(self) -> int:
        """Tokens per page, the unit of every tier."""
        return self.config.page_size

    def free_host(self) -> int:
        """Free host slots (0 without a host pool)."""
        return 0 if self.host_pool is None else self.host_pool.allocator.available_size()
