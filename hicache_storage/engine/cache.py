"""The cache controller: device pool (L1), host pool (L2) and a storage backend (L3).

:class:`TierCache` owns the three pools, the :class:`~hicache_storage.engine.radix.RadixTree`
that indexes them, and the storage threads (:class:`~hicache_storage.engine.storage_io.StorageIO`).
It is the one place that changes a page's tier, and it runs on the scheduler's thread only; the
threads move bytes and report back through :meth:`TierCache.poll`.

A request goes through it in three calls:

1. :meth:`TierCache.lookup` when it arrives: match its prompt in the tree and, when storage may
   hold a longer prefix, start a prefetch (existence query, then reads into host slots) while the
   request waits;
2. :meth:`TierCache.acquire` when the scheduler admits it: stop the prefetch as the prefetch
   policy allows, put the fetched pages in the tree, lock the prefix, start the L2→L1 load of its
   host part (layer by layer, taken with :meth:`TierCache.take_load` into the next forward), and
   allocate device pages for the rest; None when the device pool has no room (nothing changed);
3. :meth:`TierCache.release` when it finishes: insert what it computed, apply the write policy,
   unlock.

Room is made by evicting least recently used unlocked leaves: device pages go to the host (copied
first unless there), host pages go to storage (written first unless stored; an eviction waits for
such a write rather than lose the page). A storage failure is a miss: the request recomputes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.errors import ConfigError, HostPoolError
from hicache_storage.hostpool import HostKVPool, PageAllocator
from hicache_storage.kernels import DevicePool, KVTransfer
from hicache_storage.keys import KeyScheme, RankSuffixScheme

from .loading import LayerLoad, LoadTiming
from .policies import PrefetchPolicy, PrefetchTimeout, WritePolicy, prefetch_done_waiting
from .radix import MatchResult, Node, RadixTree, Tier
from .storage_io import Backup, BackupDone, Prefetch, PrefetchState, StorageIO

__all__ = ["CacheConfig", "CacheStats", "Lease", "Lookup", "TierCache"]

_WRITE_WAIT_S = 0.05
"""How long room-making on the host waits for one background write at a time."""


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Sizes and policies of a :class:`TierCache`.

    Attributes
    ----------
    page_size
        Tokens per page, the unit of every tier.
    prefix_cache
        Reuse cached prefixes at all; False makes the no-cache baseline (every token computed).
    write_policy
        When pages are backed up (see :class:`~hicache_storage.engine.policies.WritePolicy`).
    backup_after_hits
        Hits after which ``write_through_selective`` backs a page up.
    prefetch_policy, prefetch_timeout
        When a waiting request stops waiting for its storage prefetch. The default waits a
        bounded time (``timeout``) so that storage hits are used; SGLang's default,
        ``best_effort``, never delays a request and so uses only what arrived already.
    prefetch_threshold
        Fewest pages worth fetching from storage; shorter storage hits are recomputed.
    prefetch_capacity
        Most host tokens that in-flight prefetches may hold; None for half the host pool.
    read_batch_pages
        Pages per storage read of a prefetch.
    write_queue
        Most backups queued for storage at once.
    load_max_gbps, backup_max_gbps
        Pace of the L2→L1 and L1→L2 copy kernels on a GPU; None for full speed.
    """

    page_size: int
    prefix_cache: bool = True
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    backup_after_hits: int = 2
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    prefetch_timeout: PrefetchTimeout = field(default_factory=PrefetchTimeout)
    prefetch_threshold: int = 1
    prefetch_capacity: int | None = None
    read_batch_pages: int = 32
    write_queue: int = 64
    load_max_gbps: float | None = None
    backup_max_gbps: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "page_size",
            "backup_after_hits",
            "prefetch_threshold",
            "read_batch_pages",
            "write_queue",
        ):
            _positive_int(name, getattr(self, name))
        if self.prefetch_capacity is not None:
            _positive_int("prefetch_capacity", self.prefetch_capacity)
        if not isinstance(self.prefetch_timeout, PrefetchTimeout):
            raise ConfigError("prefetch_timeout must be a PrefetchTimeout")
        try:
            object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
            object.__setattr__(self, "prefetch_policy", PrefetchPolicy(self.prefetch_policy))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass
class CacheStats:
    """What the cache served and moved since it was built (tokens, pages, bytes, seconds)."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    computed_tokens: int = 0
    pages_loaded: int = 0
    pages_backed_up: int = 0
    pages_fetched: int = 0
    pages_stored: int = 0
    storage_bytes_read: int = 0
    storage_bytes_written: int = 0
    prefetches: int = 0
    prefetch_pages_cut: int = 0
    storage_misses: int = 0
    backups_failed: int = 0
    backups_refused: int = 0
    pages_dropped: int = 0
    loads: int = 0
    load_s: float = 0.0
    exposed_load_s: float = 0.0
    layer_loads: int = 0


@dataclass
class Lookup:
    """A waiting request's match and its storage prefetch, from :meth:`TierCache.lookup`."""

    tokens: tuple[int, ...]
    seed: str | None
    anchor: Node
    anchor_len: int
    fetch: Prefetch | None = None
    rechecked: bool = False


@dataclass
class Lease:
    """An admitted request's hold on its prefix and device slots, until ``release``.

    Attributes
    ----------
    slots
        Device slots of the whole request: the cached prefix's, then fresh ones for every token
        it computes or generates (whole pages).
    cached
        Leading prompt tokens whose KV the cache supplied (ready once the pending load is).
    device_hit, host_hit, storage_hit
        How many of them came from each tier.
    """

    tokens: tuple[int, ...]
    seed: str | None
    node: Node
    slots: torch.Tensor
    cached: int
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    released: bool = False


class TierCache:
    """The three tiers of a KV cache, the radix tree that indexes them and the storage threads.

    Parameters
    ----------
    device_pool
        The layer-first device pool (L1) the model reads.
    host_pool
        The host pool (L2), of any layout; its geometry must match the device pool's. None for a
        device-only cache.
    backend
        The storage backend (L3), built with the default layers; None for no storage tier.
    config
        Page size and policies.
    scheme
        How page hashes become storage keys; the default is a single rank's rank-suffix scheme.

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
    ) -> None:
        if backend is not None and host_pool is None:
            raise ConfigError("a storage tier needs a host pool to stage its pages")
        if host_pool is not None and host_pool.page_size != config.page_size:
            raise HostPoolError(
                f"host pool pages hold {host_pool.page_size} tokens, the cache's {config.page_size}"
            )
        if device_pool.size % config.page_size:
            raise HostPoolError(
                f"the device pool's {device_pool.size} slots are not whole "
                f"{config.page_size}-token pages"
            )
        self.config = config
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.backend = backend
        self.scheme = scheme or RankSuffixScheme()
        self.tree = RadixTree(config.page_size)
        self.device_alloc = PageAllocator(device_pool.size, config.page_size)
        self.transfer = None if host_pool is None else KVTransfer(device_pool, host_pool)
        self.io: StorageIO | None = None
        if backend is not None and host_pool is not None:
            backend.register_host_pool(host_pool)
            self.io = StorageIO(
                backend,
                read_batch_pages=config.read_batch_pages,
                write_capacity=config.write_queue,
            )
        self.stats = CacheStats()
        self.token_bytes = device_pool.row_nbytes * device_pool.num_kv * device_pool.layer_num
        capacity = config.prefetch_capacity
        if capacity is None and host_pool is not None:
            capacity = max(config.page_size, host_pool.size // 2)
        self._prefetch_capacity = capacity or 0
        self._prefetch_held = 0
        self._draining: list[Prefetch] = []
        self._fetching: list[Prefetch] = []
        self._writing: dict[int, tuple[Node, frozenset[str]]] = {}
        self._write_failed: set[int] = set()
        self._loads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._closed = False

    # -- a request's path -------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], *, seed: str | None = None) -> Lookup:
        """Match ``tokens`` and start fetching the part storage may hold beyond the match.

        At least one token is always left to compute (the model needs the last prompt token's
        logits), so the usable prefix stops a page short of a fully cached prompt. ``seed`` is
        the request's cache namespace (``namespace_seed(extra_key, cache_salt)``).
        """
        self._check_open()
        self.poll()
        page = self.config.page_size
        usable = (len(tokens) - 1) // page * page if self.config.prefix_cache else 0
        prefix = tuple(int(t) for t in tokens[:usable])
        match = self.tree.match_prefix(prefix, seed=seed)
        lookup = Lookup(prefix, seed, match.last_node, match.matched_len)
        self._start_prefetch(lookup, match)
        return lookup

    def recheck(self, lookup: Lookup) -> None:
        """Fetch from storage what a waiting request lost from the tree while it waited.

        A request matched on the device or the host at :meth:`lookup` starts no prefetch; if
        those pages are evicted to storage before it is admitted, they would be recomputed.
        Called before each admission attempt, this starts a prefetch once for such a request.
        """
        if self.io is None or lookup.fetch is not None or lookup.rechecked:
            return
        match = self.tree.match_prefix(lookup.tokens, seed=lookup.seed, touch=False)
        if match.matched_len >= lookup.anchor_len:
            return
        lookup.rechecked = True
        lookup.anchor, lookup.anchor_len = match.last_node, match.matched_len
        self._start_prefetch(lookup, match)

    def _start_prefetch(self, lookup: Lookup, match: MatchResult) -> None:
        """Start fetching the pages after ``match`` when storage may hold enough of them."""
        anchor = match.last_node
        hashes = match.remainder_hashes
        if (
            self.io is None
            or len(hashes) < self.config.prefetch_threshold
            or not self._on_host(anchor)
        ):
            return
        if not anchor.is_root:
            self.tree.pin_host(anchor)
        keys = self.scheme.keys(hashes)
        fetch = Prefetch(keys, self.scheme.keys_per_page, None, self.config.page_size)
        lookup.fetch = fetch
        self._fetching.append(fetch)
        self.stats.prefetches += 1
        self.io.prefetch(fetch)

    def _assign_slots(self) -> None:
        """Give host slots to the prefetches whose existence query answered, within the cap.

        Slots are taken only for the pages storage holds, so a prefetch that finds nothing
        never evicts a host page.
        """
        page = self.config.page_size
        waiting: list[Prefetch] = []
        for fetch in self._fetching:
            state = fetch.state
            if state is PrefetchState.QUERYING:
                waiting.append(fetch)
                continue
            if state is not PrefetchState.QUERIED:
                continue
            room = (self._prefetch_capacity - self._prefetch_held) // page
            pages = min(fetch.hit_pages or 0, room)
            if pages < self.config.prefetch_threshold:
                fetch.cancel()
                continue
            host = self._alloc_host(pages * page)
            if host is None:
                fetch.cancel()
            elif fetch.assign(host):
                self._prefetch_held += host.numel()
                assert self.io is not None
                self.io.read(fetch)
            elif self.host_pool is not None:
                self.host_pool.free(host)
        self._fetching = waiting

    def ready(self, lookup: Lookup) -> bool:
        """Whether the prefetch policy lets the request be scheduled now."""
        fetch = lookup.fetch
        if fetch is None:
            return True
        return prefetch_done_waiting(
            self.config.prefetch_policy,
            self.config.prefetch_timeout,
            finished=fetch.state is PrefetchState.FINISHED,
            pages=fetch.target_pages,
            elapsed_s=time.monotonic() - fetch.started,
        )

    def acquire(self, lookup: Lookup, total_tokens: int) -> Lease | None:
        """Admit a request: its cached prefix on the device, locked, and slots for the rest.

        Parameters
        ----------
        lookup
            The request's :meth:`lookup`.
        total_tokens
            Slots the request needs in all: prompt and generated tokens but the last.

        Returns
        -------
        Lease or None
            None when the device pool cannot make room even by evicting every unlocked page;
            nothing changed and the prefetch runs on.
        """
        self._check_open()
        page = self.config.page_size
        match = self.tree.match_prefix(lookup.tokens, seed=lookup.seed, touch=False)
        self.tree.lock(match.last_node)
        need = -(-(total_tokens - match.device_len) // page) * page
        if need > self.device_alloc.available_size() + self._evictable_device_tokens():
            self.tree.unlock(match.last_node)
            return None
        node = match.last_node
        storage_hit = self._finish_fetch(lookup)
        if storage_hit:
            rematch = self.tree.match_prefix(lookup.tokens, seed=lookup.seed, touch=False)
            self.tree.lock(rematch.last_node)
            self.tree.unlock(node)
            match, node = rematch, rematch.last_node
        device_hit = match.device_len
        for host_node in match.host_nodes:
            self._schedule_load(host_node)
        path = [n for n in self.tree.path(node) if not n.is_root]
        prefix = [n.device_indices for n in path if n.device_indices is not None]
        cached = match.matched_len
        fresh = self.alloc_device(total_tokens - cached)
        slots = torch.cat([*prefix, fresh]) if prefix else fresh
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            hot = [n for n in path if n.hit_count >= self.config.backup_after_hits]
            if hot:
                self._write_through(hot[-1])
        storage_hit = min(storage_hit, cached - device_hit)
        host_hit = cached - device_hit - storage_hit
        self.stats.device_hit_tokens += device_hit
        self.stats.host_hit_tokens += host_hit
        self.stats.storage_hit_tokens += storage_hit
        return Lease(
            lookup.tokens, lookup.seed, node, slots, cached, device_hit, host_hit, storage_hit
        )

    def cancel(self, lookup: Lookup) -> None:
        """Drop a request that will not be admitted: stop its prefetch, free what it holds."""
        fetch = lookup.fetch
        if fetch is None:
            return
        lookup.fetch = None
        fetch.cancel()
        self._drain(fetch)
        if not lookup.anchor.is_root:
            self.tree.unpin_host(lookup.anchor)

    def take_load(self) -> LayerLoad | None:
        """Start the L2→L1 loads of every request admitted since the last call, layer by layer.

        The next forward must pass :meth:`LayerLoad.wait` as its per-layer hook.
        """
        if not self._loads or self.transfer is None:
            return None
        host = torch.cat([h for h, _ in self._loads])
        device = torch.cat([d for _, d in self._loads])
        self._loads.clear()
        return LayerLoad(self.transfer, host, device, max_gbps=self.config.load_max_gbps)

    def record_load(self, timing: LoadTiming) -> None:
        """Add a finished load's duration and exposed time to the stats."""
        self.stats.loads += 1
        self.stats.layer_loads += timing.layers
        self.stats.load_s += timing.load_s
        self.stats.exposed_load_s += timing.exposed_s

    def release(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor) -> None:
        """Insert the request's computed KV, apply the write policy and drop the lock.

        ``tokens`` are the tokens whose KV is at ``slots`` (for a finished request: prompt and
        output but the last token); ``slots`` is a prefix of :attr:`Lease.slots` or all of it.
        Every slot of the lease the tree does not take is freed.
        """
        if lease.released:
            raise HostPoolError("this lease was already released")
        lease.released = True
        held = lease.slots.to("cpu", torch.int64)
        page = self.config.page_size
        keep = len(tokens) // page * page if self.config.prefix_cache else 0
        keep = max(min(keep, slots.numel()), 0)
        if keep >= lease.cached:
            result = self.tree.insert(
                tuple(int(t) for t in tokens[:keep]), held[:keep], seed=lease.seed
            )
            taken_from = max(lease.cached, result.existing_len)
            freed = torch.cat([held[lease.cached : taken_from], held[keep:]])
            last = result.node
        else:
            freed = held[lease.cached :]
            last = lease.node
        if freed.numel():
            self.device_alloc.free(freed)
        self.tree.unlock(lease.node)
        self.stats.computed_tokens += max(len(tokens) - lease.cached, 0)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH and keep:
            self._write_through(last)

    # -- background completions ------------------------------------------------------------------

    def poll(self) -> None:
        """Apply what the storage threads finished: stored pages, drained prefetch slots."""
        if self.io is not None:
            for done in self.io.poll():
                self._complete(done)
        self._assign_slots()
        self._reap()

    def close(self) -> None:
        """Flush queued backups, stop every thread and apply the outcomes; idempotent.

        Backups the queue refused or that failed are counted (``backups_refused``,
        ``backups_failed``); after close no thread of the cache is left.
        """
        if self._closed:
            return
        self._closed = True
        if self.io is not None:
            for done in self.io.close():
                self._complete(done)
            self.stats.backups_refused = self.io.refused_backups
        self._reap()

    @property
    def threads(self) -> tuple[object, ...]:
        """The cache's threads (empty without a storage tier)."""
        return () if self.io is None else self.io.threads

    # -- slots ------------------------------------------------------------------------------------

    def alloc_device(self, count: int) -> torch.Tensor:
        """Allocate whole pages for at least ``count`` device slots, evicting to the host.

        Raises
        ------
        HostPoolError
            If locked pages leave too little room.
        """
        need = -(-count // self.config.page_size) * self.config.page_size
        if need == 0:
            return torch.empty(0, dtype=torch.int64)
        while self.device_alloc.available_size() < need:
            victim = next(self.tree.evictable(Tier.DEVICE), None)
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

    def _evictable_device_tokens(self) -> int:
        return sum(
            n.num_tokens
            for n in self.tree.nodes()
            if n.device_indices is not None and n.lock_ref == 0
        )

    def _alloc_host(self, count: int) -> torch.Tensor | None:
        """Allocate host slots, evicting host leaves to storage (written first when unstored)."""
        pool = self.host_pool
        if pool is None:
            return None
        while pool.allocator.available_size() < count:
            victim = next(self.tree.evictable(Tier.HOST), None)
            if victim is None:
                if not self._writing or self.io is None:
                    return None
                for done in self.io.poll(timeout_s=_WRITE_WAIT_S):
                    self._complete(done)
                if not self.io.alive:
                    return None
                continue
            unstored = not victim.stored and self.io is not None
            if unstored and victim.id not in self._write_failed and self._store_later(victim):
                continue  # evicted once written (a failed write is not retried here)
            if unstored:
                self.stats.pages_dropped += victim.num_tokens // self.config.page_size
            self._write_failed.discard(victim.id)
            pool.free(self.tree.evict_host(victim))
        return pool.alloc(count)

    # -- moves between tiers ----------------------------------------------------------------------

    def _schedule_load(self, node: Node) -> None:
        """L2→L1: give a host-only node device slots; its copy runs in the next forward."""
        host = node.host_indices
        if host is None or self.transfer is None:
            raise HostPoolError(f"{node!r} is not on the host")
        device = self.alloc_device(host.numel())
        self.tree.attach_device(node, device)
        self._loads.append((host, device))
        self.stats.pages_loaded += host.numel() // self.config.page_size

    def _on_host(self, node: Node) -> bool:
        """Whether ``node`` is a root or on the host, backing it up to the host if needed."""
        return node.is_root or Tier.HOST in node.tiers or self._backup(node)

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
                    if host is not None and self.host_pool is not None:
                        self.host_pool.free(host)
                    return False
                self.transfer.backup(device, host, max_gbps=self.config.backup_max_gbps)
                self.tree.attach_host(step, host)
                self.stats.pages_backed_up += step.num_tokens // self.config.page_size
            return True
        finally:
            self.tree.unlock(node)

    def _write_through(self, node: Node) -> None:
        """Back ``node``'s path up to the host and queue its unstored pages for storage."""
        if self.host_pool is None:
            return
        if self._backup(node) and self.io is not None:
            for step in self.tree.path(node):
                if not step.is_root and not step.stored and Tier.HOST in step.tiers:
                    self._store_later(step)

    def _store_later(self, node: Node) -> bool:
        """Queue a host node's pages for storage, its host copy pinned until written."""
        host = node.host_indices
        if self.io is None or host is None:
            return False
        if node.id in self._writing:
            return True
        ready = None
        if self.device_pool.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            ready = event.synchronize
        job = Backup(self.scheme.keys(node.hashes), host, node.id, ready)
        if not self.io.backup(job):
            return False
        self.tree.pin_host(node)
        self._writing[node.id] = (node, frozenset(node.hashes))
        return True

    def _complete(self, done: BackupDone) -> None:
        """Apply a finished backup: unpin, and mark stored every node of it still in the tree."""
        ticket = done.backup.ticket
        assert isinstance(ticket, int)
        node, hashes = self._writing.pop(ticket)
        self.tree.unpin_host(node)
        pages = len(hashes)
        if not done.stored:
            self.stats.backups_failed += pages
            self._write_failed.add(node.id)
            return
        self._write_failed.discard(node.id)
        self.stats.pages_stored += pages
        self.stats.storage_bytes_written += pages * self.config.page_size * self.token_bytes
        step: Node | None = node
        while step is not None and not step.is_root and step.in_tree:
            if not set(step.hashes) <= hashes:
                break
            self.tree.mark_stored(step)
            step = step.parent

    def _finish_fetch(self, lookup: Lookup) -> int:
        """Stop a request's prefetch and put the pages it read on the host; return their tokens."""
        fetch = lookup.fetch
        if fetch is None:
            return 0
        lookup.fetch = None
        page = self.config.page_size
        finished = fetch.state is PrefetchState.FINISHED
        read = fetch.cancel()
        short = max((fetch.hit_pages or 0) - read, 0)
        if finished:  # every page storage claimed was tried: the rest failed to read
            self.stats.storage_misses += short
        else:  # the prefetch policy stopped waiting
            self.stats.prefetch_pages_cut += short
        anchor = lookup.anchor
        tokens = read * page
        fresh = tokens
        if tokens:
            assert fetch.host_indices is not None
            got = fetch.host_indices[:tokens]
            result = self.tree.insert_host(
                anchor,
                lookup.tokens[lookup.anchor_len : lookup.anchor_len + tokens],
                got,
                stored=True,
            )
            if result.existing_len and self.host_pool is not None:
                self.host_pool.free(got[: result.existing_len])
            fresh -= result.existing_len
            self.stats.pages_fetched += read
            self.stats.storage_bytes_read += tokens * self.token_bytes
        self._prefetch_held -= tokens
        if fetch.host_indices is not None:
            fetch.host_indices = fetch.host_indices[tokens:]
        self._drain(fetch)
        if not anchor.is_root:
            self.tree.unpin_host(anchor)
        return fresh

    def _drain(self, fetch: Prefetch) -> None:
        """Free a stopped prefetch's remaining host slots, once its last read has returned."""
        self._draining.append(fetch)
        self._reap()

    def _reap(self) -> None:
        still: list[Prefetch] = []
        for fetch in self._draining:
            if fetch.state is PrefetchState.FINISHED:
                host = fetch.host_indices
                if host is not None and host.numel() and self.host_pool is not None:
                    self.host_pool.free(host)
                    self._prefetch_held -= host.numel()
            else:
                still.append(fetch)
        self._draining = still

    def _check_open(self) -> None:
        if self._closed:
            raise HostPoolError("the cache is closed")
