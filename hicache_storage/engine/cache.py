"""The hierarchical KV cache: device pool (L1), host pool (L2) and a storage backend (L3).

:class:`TierCache` owns the three pools and the :class:`~hicache_storage.engine.radix.RadixTree`
that indexes them, and moves pages between tiers. A request goes through it in two calls:

1. :meth:`TierCache.acquire` matches the prompt, brings its cached prefix to the device (host
   pages loaded L2→L1; storage pages fetched L3→L2 then loaded) and locks it;
2. :meth:`TierCache.release` inserts what the request computed, applies the write policy and
   unlocks.

Pages move with :class:`~hicache_storage.kernels.KVTransfer` between the device and the host
pool, and with the backend's zero-copy ``batch_get_v1``/``batch_set_v1`` between the host pool
and storage. Room is made by evicting least recently used unlocked leaves: device pages go to the
host (backed up first unless already there), host pages to storage (written first unless already
stored). A storage failure is a miss (the default layers count it): the request recomputes.

This first version runs every transfer synchronously on the caller's thread; background
prefetch and backup threads and layer-wise overlap build on it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.errors import ConfigError, HostPoolError
from hicache_storage.hostpool import HostKVPool, PageAllocator
from hicache_storage.kernels import DevicePool, KVTransfer
from hicache_storage.keys import KeyScheme, RankSuffixScheme

from .backup import BackupJob, BackupWriter
from .radix import Node, RadixTree, Tier

__all__ = ["CacheConfig", "CacheStats", "Lease", "TierCache", "WritePolicy"]

_WRITE_WAIT_S = 1.0
"""How long room-making waits for one background write at a time."""


class WritePolicy(str, enum.Enum):
    """When pages computed on the device are copied to the host and to storage."""

    WRITE_THROUGH = "write_through"
    """Back up every new page at once (L1→L2→L3)."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """Back up a page once it has been hit ``backup_after_hits`` times."""
    WRITE_BACK = "write_back"
    """Back up only what eviction would otherwise lose."""


@dataclass(frozen=True)
class CacheConfig:
    """Sizes and policies of a :class:`TierCache`.

    Attributes
    ----------
    page_size
        Tokens per page, the unit of every tier.
    write_policy
        When pages are backed up (see :class:`WritePolicy`).
    backup_after_hits
        Hits after which ``write_through_selective`` backs a page up.
    prefetch_threshold
        Fewest pages worth fetching from storage; shorter storage hits are recomputed.
    """

    page_size: int
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    backup_after_hits: int = 2
    prefetch_threshold: int = 1

    def __post_init__(self) -> None:
        for name in ("page_size", "backup_after_hits", "prefetch_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))


@dataclass
class CacheStats:
    """Tokens served by each tier and pages moved between them, since the cache was built."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    computed_tokens: int = 0
    pages_loaded: int = 0
    pages_backed_up: int = 0
    pages_fetched: int = 0
    pages_stored: int = 0
    storage_misses: int = 0


@dataclass
class Lease:
    """A request's hold on its cached prefix, from :meth:`TierCache.acquire` to ``release``."""

    tokens: tuple[int, ...]
    seed: str | None
    node: Node
    device_indices: torch.Tensor
    cached: int
    released: bool = field(default=False)


class TierCache:
    """The three tiers of a KV cache and the radix tree that indexes them.

    Parameters
    ----------
    device_pool
        The layer-first device pool (L1) the model reads.
    host_pool
        The host pool (L2), of any layout; its geometry must match the device pool's.
    backend
        The storage backend (L3), built with the default layers; None for no storage tier.
    config
        Page size and policies.
    scheme
        How page hashes become storage keys; the default is a single rank's rank-suffix scheme.
    writer
        Write backed-up pages to storage on this background writer instead of on the caller's
        thread; the node stays locked until its write completes (:meth:`poll`).

    Raises
    ------
    ConfigError, HostPoolError
        If the pools disagree with each other or with ``config.page_size``.
    """

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostKVPool | None,
        backend: StorageBackend | None,
        config: CacheConfig,
        *,
        scheme: KeyScheme | None = None,
        writer: BackupWriter | None = None,
    ) -> None:
        if backend is not None and host_pool is None:
            raise ConfigError("a storage tier needs a host pool to stage its pages")
        if host_pool is not None and host_pool.page_size != config.page_size:
            raise HostPoolError(
                f"host pool pages hold {host_pool.page_size} tokens, the cache's {config.page_size}"
            )
        self.config = config
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.backend = backend
        self.scheme = scheme or RankSuffixScheme()
        self.tree = RadixTree(config.page_size)
        self.device_alloc = PageAllocator(device_pool.size, config.page_size)
        self.transfer = None if host_pool is None else KVTransfer(device_pool, host_pool)
        if backend is not None and host_pool is not None:
            backend.register_host_pool(host_pool)
        self.stats = CacheStats()
        self.writer = writer
        self._pending: dict[int, Node] = {}

    # -- a request's path -------------------------------------------------------------------------

    def acquire(self, tokens: Sequence[int], *, seed: str | None = None) -> Lease:
        """Bring the longest cached prefix of ``tokens`` to the device and lock it.

        At least one token is always left to compute (the model needs the last prompt token's
        logits), so the prefix stops a page short of a fully cached prompt.
        """
        self.poll()
        page = self.config.page_size
        usable = (len(tokens) - 1) // page * page
        prefix = tuple(int(t) for t in tokens[:usable])
        match = self.tree.match_prefix(prefix, seed=seed)
        self.tree.lock(match.last_node)
        node = match.last_node
        self.stats.device_hit_tokens += match.device_len
        for host_node in match.host_nodes:
            self._load(host_node)
            self.stats.host_hit_tokens += host_node.num_tokens
        matched = match.matched_len
        if self.backend is not None and matched < usable and self._on_host(node):
            node = self._fetch(node, prefix, matched, list(match.remainder_hashes), seed)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            hot = [n for n in self.tree.path(node) if n.hit_count >= self.config.backup_after_hits]
            if hot:
                self._write_through(hot[-1])
        path = [n for n in self.tree.path(node) if not n.is_root]
        parts = [n.device_indices for n in path if n.device_indices is not None]
        device = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return Lease(prefix, seed, node, device, int(device.numel()))

    def release(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor) -> None:
        """Insert the request's computed KV, apply the write policy and drop the lock.

        ``tokens`` are the tokens whose KV the request holds (prompt and output but the last
        token); ``slots`` are the lease's prefix slots followed by every slot the request got
        from :meth:`alloc_device` (whole pages). Slots of pages the tree already holds and of
        the trailing partial page are freed.
        """
        if lease.released:
            raise HostPoolError("this lease was already released")
        lease.released = True
        slots = slots.to("cpu", torch.int64)
        page = self.config.page_size
        aligned = len(tokens) // page * page
        prefix = tuple(int(t) for t in tokens[:aligned])
        result = self.tree.insert(prefix, slots[:aligned], seed=lease.seed)
        duplicate = slots[lease.cached : max(lease.cached, result.existing_len)]
        freed = torch.cat([duplicate, slots[aligned:]])
        if freed.numel():
            self.device_alloc.free(freed)
        self.tree.unlock(lease.node)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH:
            self._write_through(result.node)

    def poll(self) -> None:
        """Apply the background writes that completed: mark their nodes stored and unlock them."""
        if self.writer is None:
            return
        for done in self.writer.poll():
            self._complete(done.ticket, done.stored)

    def close(self) -> None:
        """Finish the background writes still queued and apply them."""
        if self.writer is not None:
            for done in self.writer.close():
                self._complete(done.ticket, done.stored)

    def _complete(self, ticket: object, stored: bool) -> None:
        node = self._pending.pop(id(ticket))
        if stored and node.in_tree:
            self.tree.mark_stored(node)
            self.stats.pages_stored += node.num_tokens // self.config.page_size
        self.tree.unlock(node)

    # -- slots ------------------------------------------------------------------------------------

    def alloc_device(self, count: int) -> torch.Tensor:
        """Allocate whole pages for at least ``count`` device slots, evicting to the host.

        Raises
        ------
        HostPoolError
            If locked pages leave too little room.
        """
        need = -(-count // self.config.page_size) * self.config.page_size
        while self.device_alloc.available_size() < need:
            victim = next(self.tree.evictable(Tier.DEVICE), None)
            if victim is None and self._pending and self.writer is not None:
                # Pages locked by pending writes free up as the writer completes them.
                completed = self.writer.poll(timeout_s=_WRITE_WAIT_S)
                if not completed and not self.writer.alive:
                    raise HostPoolError("the backup writer stopped with writes pending")
                for done in completed:
                    self._complete(done.ticket, done.stored)
                continue
            if victim is None:
                raise HostPoolError(
                    f"the device pool cannot hold {need} more tokens: every page is locked"
                )
            if Tier.HOST not in victim.tiers and self.host_pool is not None:
                self._backup(victim)
            self.device_alloc.free(self.tree.evict_device(victim))
        slots = self.device_alloc.alloc(need)
        if slots is None:
            raise HostPoolError(f"the device pool cannot hold {need} more tokens")
        return slots

    def _on_host(self, node: Node) -> bool:
        """Whether storage pages may attach below ``node``, backing it up to the host if needed."""
        return node.is_root or Tier.HOST in node.tiers or self._backup(node)

    def _alloc_host(self, count: int) -> torch.Tensor | None:
        pool = self.host_pool
        if pool is None:
            return None
        while pool.allocator.available_size() < count:
            victim = next(self.tree.evictable(Tier.HOST), None)
            if victim is None:
                return None
            if not victim.stored and self.backend is not None:
                self._store(victim)
            pool.free(self.tree.evict_host(victim))
        return pool.alloc(count)

    # -- moves between tiers ----------------------------------------------------------------------

    def _load(self, node: Node) -> None:
        """L2→L1: copy a host-only node to fresh device slots."""
        host = node.host_indices
        if host is None or self.transfer is None:
            raise HostPoolError(f"{node!r} is not on the host")
        device = self.alloc_device(host.numel())
        self.transfer.load(host, device)
        self.tree.attach_device(node, device)
        self.stats.pages_loaded += host.numel() // self.config.page_size

    def _backup(self, node: Node) -> bool:
        """L1→L2: copy a device node (and any ancestors not yet on the host) to the host.

        The path is locked meanwhile, so that making room on the host never evicts the part of
        it already copied.
        """
        self.tree.lock(node)
        try:
            for step in self.tree.path(node):
                if step.is_root or Tier.HOST in step.tiers:
                    continue
                device = step.device_indices
                host = self._alloc_host(step.num_tokens)
                if device is None or host is None or self.transfer is None:
                    return False
                self.transfer.backup(device, host)
                self.tree.attach_host(step, host)
                self.stats.pages_backed_up += step.num_tokens // self.config.page_size
            return True
        finally:
            self.tree.unlock(node)

    def _store(self, node: Node) -> bool:
        """L2→L3: write a host node's pages under their keys; mark it stored on success."""
        host = node.host_indices
        if host is None or self.backend is None:
            return False
        done = self.backend.batch_set_v1(self.scheme.keys(node.hashes), host)
        if all(done):
            self.tree.mark_stored(node)
            self.stats.pages_stored += len(done)
            return True
        return False

    def _fetch(
        self,
        anchor: Node,
        prefix: tuple[int, ...],
        matched: int,
        hashes: list[str],
        seed: str | None,
    ) -> Node:
        """L3→L2→L1: fetch the stored continuation of ``anchor`` and load it to the device."""
        backend = self.backend
        page = self.config.page_size
        if backend is None or not hashes:
            return anchor
        per_page = self.scheme.keys_per_page
        hit_pages = backend.batch_exists(self.scheme.keys(hashes)) // per_page
        if hit_pages < self.config.prefetch_threshold:
            return anchor
        host = self._alloc_host(hit_pages * page)
        if host is None:
            return anchor
        got = backend.batch_get_v1(self.scheme.keys(hashes[:hit_pages]), host)
        loaded = next((i for i, ok in enumerate(got) if not ok), len(got))
        if loaded < hit_pages:
            self.stats.storage_misses += hit_pages - loaded
            assert self.host_pool is not None
            self.host_pool.free(host[loaded * page :])
        if loaded == 0:
            return anchor
        tokens = prefix[matched : matched + loaded * page]
        result = self.tree.insert_host(anchor, tokens, host[: loaded * page], stored=True)
        self.tree.lock(result.node)
        self.tree.unlock(anchor)
        self.stats.pages_fetched += loaded
        self.stats.storage_hit_tokens += loaded * page
        for node in self.tree.path(result.node):
            if not node.is_root and Tier.DEVICE not in node.tiers:
                self._load(node)
        return result.node

    def _write_through(self, node: Node) -> None:
        """Back ``node``'s path up to the host and on to storage, where not there yet."""
        if self.host_pool is None:
            return
        if self._backup(node) and self.backend is not None:
            for step in self.tree.path(node):
                if not step.is_root and not step.stored and Tier.HOST in step.tiers:
                    if self.writer is not None:
                        self._store_later(step)
                    else:
                        self._store(step)

    def _store_later(self, node: Node) -> None:
        """Queue ``node``'s pages on the background writer, locked until the write completes."""
        host = node.host_indices
        if self.writer is None or host is None or id(node) in self._pending:
            return
        self.tree.lock(node)
        self._pending[id(node)] = node
        job = BackupJob(node, self.scheme.keys(node.hashes), host.clone())
        if not self.writer.submit(job):
            del self._pending[id(node)]
            self.tree.unlock(node)
