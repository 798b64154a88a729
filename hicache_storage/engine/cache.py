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
   unlock. Under write-through, :meth:`TierCache.prefilled` inserts and backs up the prompt's
   pages as soon as the forward that ends it is done, so that their copy runs under the
   request's decode steps.

Room is made by evicting least recently used unlocked leaves: device pages go to the host (copied
first unless there), host pages go to storage (written first unless stored; an eviction waits for
such a write rather than lose the page). A storage failure is a miss: the request recomputes.

:class:`TierCache` is the facade over parts that each own one concern and share the state in
:class:`~hicache_storage.engine.tiers.Tiers`:

- :class:`~hicache_storage.engine.prefetches.Prefetches`: the storage reads of waiting requests;
- :class:`~hicache_storage.engine.fetch_decisions.FetchDecisions`: the prefetch policy's
  decisions (what is worth reading, how long to wait, whether storage is left alone);
- :class:`~hicache_storage.planner.Planner` (:attr:`TierCache.planner`): under ``adaptive``,
  which fetches are read and which backups the storage writer makes, each decision counted by
  its rule (the component the SGLang adapter and the vLLM tier hold too);
- :class:`~hicache_storage.engine.writes.StorageWrites`: backups to storage, and host room;
- :class:`~hicache_storage.engine.transfers.Transfers`: device room, loads and backups between
  the device and the host, with :class:`~hicache_storage.engine.early_loads.EarlyLoads` and
  the bookkeeping of copies in flight (:mod:`hicache_storage.engine.copies`).

Stored objects say what their bytes mean. The pools must agree (dtype, layers, KV heads, head dim,
page size, MHA or MLA) or construction fails with a :class:`~.errors.PoolMismatchError`
(:mod:`hicache_storage.engine.geometry`). Under the rank-suffix scheme every key ends in the
:class:`~hicache_storage.keys.format.ObjectFormat` tag of the host pool and of the model
(:meth:`TierCache.bind_model`, which the engine calls), so a reader of another model, dtype,
geometry or host layout misses instead of reading foreign bytes. Under the unified scheme the
namespace digest carries the same facts: its plan must describe the device pool, and pages move
as the plan's objects (:class:`~hicache_storage.hostpool.UnifiedObjectPool`).

:class:`CacheConfig`, :class:`CacheStats`, :class:`Lookup` and :class:`Lease` are defined in
modules of their own and importable from here too.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.errors import ConfigError, HostPoolError
from hicache_storage.hostpool import HostKVPool, PageAllocator, UnifiedObjectPool
from hicache_storage.kernels import DevicePool, KVTransfer
from hicache_storage.keys import KeyScheme, ObjectFormat, RankSuffixScheme, UnifiedPlan
from hicache_storage.layers import watch_planner
from hicache_storage.planner import Planner
from hicache_storage.planner.rates import CostModel

from .cache_config import CacheConfig
from .cache_stats import CacheStats
from .copies import CopiesInFlight, StoredCopies
from .early_loads import EarlyLoads
from .errors import PoolMismatchError
from .fetch_decisions import decisions_for
from .geometry import check_plan, check_pools
from .layer_backups import ForwardBackups, LayerBackups
from .leases import Lease, Lookup
from .loading import LayerLoad, LoadTiming
from .nodes import Node
from .policies import WritePolicy
from .prefetches import Prefetches
from .radix import RadixTree
from .storage_io import StorageIO
from .tiers import Tiers
from .transfers import Transfers
from .writes import StorageWrites

__all__ = ["CacheConfig", "CacheStats", "Lease", "Lookup", "TierCache"]


def _scheme_for(
    given: KeyScheme,
    host_pool: HostKVPool | None,
    exact_names: bool,
    model: str,
    *,
    bound: bool = False,
) -> KeyScheme:
    """Return the given scheme; a rank-suffix one tagged with its page objects' format."""
    if not isinstance(given, RankSuffixScheme) or host_pool is None or exact_names:
        return given
    fmt = ObjectFormat.of_pool(host_pool, model=model)
    if not given.object_format:
        return dataclasses.replace(given, object_format=fmt.tag)
    if bound and given.object_format != fmt.tag:
        raise ConfigError(
            f"the key scheme's object_format {given.object_format} is not the format of "
            f"this engine's pages ({fmt.describe()}: {fmt.tag}); leave object_format empty "
            "and the cache sets it"
        )
    return given


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
        A :class:`~hicache_storage.keys.RankSuffixScheme` without an ``object_format`` gets
        the host pool's (with the model's identity once :meth:`bind_model` names it), unless
        the backend keeps a foreign naming (``capabilities.foreign_names``), which must stay
        exact. A
        :class:`~hicache_storage.keys.UnifiedPlan` stores each page as the plan's objects.

    Attributes
    ----------
    tiers
        The state the parts below share (config, pools, tree, allocator, transfer, storage
        threads, stats, costs, planner); the cache's properties of the same names read it.
    prefetches
        The storage reads of waiting requests
        (:class:`~hicache_storage.engine.prefetches.Prefetches`).
    decisions
        The prefetch policy's decisions
        (:class:`~hicache_storage.engine.fetch_decisions.FetchDecisions`).
    writes
        Backups to storage and host room (:class:`~hicache_storage.engine.writes.StorageWrites`).
    transfers
        Device room, backups to the host and loads
        (:class:`~hicache_storage.engine.transfers.Transfers`).
    early
        The waiting requests' early loads
        (:class:`~hicache_storage.engine.early_loads.EarlyLoads`).
    copies, stored_copies
        Copies between the pools still in flight, and whether host copies of stored pages pay
        (:mod:`hicache_storage.engine.copies`).
    objects
        The host pool seen as a unified plan's objects; None under the rank-suffix scheme.
    backend
        The storage backend; None without a storage tier.

    Raises
    ------
    PoolMismatchError
        If the pools disagree with each other or with ``config.page_size`` (a
        :class:`ConfigError` and a :class:`HostPoolError`).
    ConfigError
        If a unified plan does not describe the pools, or a scheme has several keys per page
        without being a unified plan.
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
        if host_pool is not None:
            check_pools(device_pool, host_pool, config.page_size)
        if device_pool.size % config.page_size:
            raise PoolMismatchError(
                f"the device pool's {device_pool.size} slots are not whole "
                f"{config.page_size}-token pages"
            )
        self.objects: UnifiedObjectPool | None = None
        if isinstance(scheme, UnifiedPlan):
            check_plan(scheme, device_pool, config.page_size)
            if host_pool is not None:
                self.objects = UnifiedObjectPool(host_pool, scheme)
        elif scheme is not None and scheme.keys_per_page != 1:
            raise ConfigError(
                f"a key scheme of {scheme.keys_per_page} keys per page must be a UnifiedPlan "
                "(the cache moves multi-object pages as the plan's objects)"
            )
        self.backend = backend
        self._given_scheme = scheme or RankSuffixScheme()
        self._exact_names = backend is not None and backend.capabilities.foreign_names
        self._model: str | None = None
        on_gpu = device_pool.device.type == "cuda"
        sms = config.transfer.sms if on_gpu else None
        transfer = None if host_pool is None else KVTransfer(device_pool, host_pool, sm_budget=sms)
        costs = CostModel()
        planner = Planner(config.page_size, costs=costs)
        if backend is not None:
            watch_planner(planner, backend.name)
        token_bytes = device_pool.row_nbytes * device_pool.num_kv * device_pool.layer_num
        decide = decisions_for(config.prefetch.policy)
        io: StorageIO | None = None
        self._switch_interval: float | None = None
        if backend is not None and host_pool is not None:
            registered = host_pool if self.objects is None else self.objects
            backend.register_host_pool(registered)
            page_bytes = token_bytes * config.page_size
            io = StorageIO(
                backend,
                read_batch_pages=config.prefetch.read_batch_pages,
                write_capacity=config.write.queue,
                object_indices=None if self.objects is None else self.objects.object_indices,
                query_threads=config.threads.queries,
                read_threads=config.threads.reads,
                write_batch_pages=max(1, config.write.batch_bytes // page_bytes),
                write_linger_s=config.write.linger_s,
                costs=costs,
                nice=config.threads.nice,
                idle_writes=config.threads.idle_writes,
                shed_failing=decide.sheds_failing,
                planner=planner if decide.plans_writes else None,
                write_room_pages=max(
                    1, int(host_pool.size * config.write.backlog) // config.page_size
                ),
                pool=registered,
            )
            if config.threads.switch_interval_s is not None:
                self._switch_interval = sys.getswitchinterval()
                sys.setswitchinterval(min(self._switch_interval, config.threads.switch_interval_s))
        self.tiers = Tiers(
            config=config,
            device_pool=device_pool,
            host_pool=host_pool,
            tree=RadixTree(config.page_size),
            device_alloc=PageAllocator(device_pool.size, config.page_size),
            transfer=transfer,
            io=io,
            scheme=_scheme_for(self._given_scheme, host_pool, self._exact_names, ""),
            stats=CacheStats(),
            costs=costs,
            planner=planner,
            token_bytes=token_bytes,
        )
        self.copies = CopiesInFlight(self.tiers)
        self.stored_copies = StoredCopies()
        self.decisions = decide(self.tiers)
        self.writes = StorageWrites(self.tiers, self.copies, self.stored_copies, self.decisions)
        self.early = EarlyLoads(self.tiers, self.copies)
        self.transfers = Transfers(
            self.tiers, self.copies, self.stored_copies, self.writes, self.early
        )
        self.prefetches = Prefetches(
            self.tiers, self.decisions, self.copies, self.transfers, self.writes, self.early
        )
        self.layer_backups = LayerBackups(self.tiers, self.copies, self.writes)
        self._closed = False

    # -- what the cache is made of ----------------------------------------------------------------

    @property
    def config(self) -> CacheConfig:
        """Page size and policies."""
        return self.tiers.config

    @property
    def device_pool(self) -> DevicePool:
        """The device pool (L1)."""
        return self.tiers.device_pool

    @property
    def host_pool(self) -> HostKVPool | None:
        """The host pool (L2); None for a device-only cache."""
        return self.tiers.host_pool

    @property
    def tree(self) -> RadixTree:
        """The radix tree that indexes every page's tiers."""
        return self.tiers.tree

    @property
    def device_alloc(self) -> PageAllocator:
        """Free slots of the device pool, in whole pages."""
        return self.tiers.device_alloc

    @property
    def transfer(self) -> KVTransfer | None:
        """Copies between the device and host pools; None without a host pool."""
        return self.tiers.transfer

    @property
    def io(self) -> StorageIO | None:
        """The storage threads; None without a storage tier."""
        return self.tiers.io

    @property
    def scheme(self) -> KeyScheme:
        """How page hashes become storage keys (tagged with the model by :meth:`bind_model`)."""
        return self.tiers.scheme

    @property
    def stats(self) -> CacheStats:
        """What the cache served and moved since it was built."""
        return self.tiers.stats

    @property
    def costs(self) -> CostModel:
        """Measured read, query and compute times (the scheduler records its forwards)."""
        return self.tiers.costs

    @property
    def planner(self) -> Planner:
        """Fetch-or-recompute and back-pressure over :attr:`costs` (its ``stats()`` says why)."""
        return self.tiers.planner

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's KV over every layer."""
        return self.tiers.token_bytes

    @property
    def write_backlog_tokens(self) -> int:
        """Host tokens pinned until the writes queued for them are done."""
        return self.writes.backlog_tokens

    @property
    def threads(self) -> tuple[object, ...]:
        """The cache's threads (empty without a storage tier)."""
        return () if self.io is None else self.io.threads

    # -- keys -------------------------------------------------------------------------------------

    def bind_model(self, identity: str) -> None:
        """Name the model whose KV this cache holds; its keys then carry the identity.

        The engine calls it with :attr:`LlamaModel.identity
        <hicache_storage.engine.model.LlamaModel.identity>`. A unified plan's namespace names
        the model itself (its ``model_id``) and is left as given.

        Raises
        ------
        ConfigError
            If the cache already serves another model, or the scheme's explicit
            ``object_format`` is not this model's over this host pool.
        """
        if self._model == identity:
            return
        if self._model is not None:
            raise ConfigError(
                f"this cache holds the KV of model {self._model!r}; model {identity!r} needs a "
                "cache of its own"
            )
        self.tiers.scheme = _scheme_for(
            self._given_scheme, self.host_pool, self._exact_names, identity, bound=True
        )
        self._model = identity

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
        prefix = tuple(map(int, tokens[:usable]))
        match = self.tree.match_prefix(prefix, seed=seed)
        lookup = Lookup(prefix, seed, match.last_node, match.matched_len)
        self.prefetches.start(lookup, match)
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
        self.prefetches.start(lookup, match)

    def start_reads(self) -> None:
        """Start the reads of fetches whose query answered, between two layers of a forward.

        A forward of a long prefill takes hundreds of milliseconds; a request that arrives
        meanwhile would otherwise have its reads started only at the next step, and its pages
        would arrive a forward late. The scheduler calls this from the forward's layer hook (its
        own thread, which owns the tree and the allocators). Only what touches no KV being
        computed is done here: host slots come from free slots or stored host leaves, and a
        fetch whose matched prefix is not on the host yet waits for the step.
        """
        self.prefetches.start_reads()

    def ready(self, lookup: Lookup, *, block_s: float = 0.0, next_step_s: float = 0.0) -> bool:
        """Whether the prefetch policy lets the request be scheduled now.

        Under ``adaptive`` the caller may block up to ``block_s`` for a fetch about to arrive
        (the scheduler does when the wait is short against a forward); otherwise the request
        waits for a later step, ``next_step_s`` from now.
        """
        return self.prefetches.ready(lookup, block_s=block_s, next_step_s=next_step_s)

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
        tree, transfers = self.tree, self.transfers
        page = self.config.page_size
        match = tree.match_prefix(lookup.tokens, seed=lookup.seed, touch=False)
        node = match.last_node
        tree.lock(node, host=False)  # the request computes from the device copies
        need = -(-(total_tokens - match.device_len) // page) * page
        room = self.device_alloc.available_size() + self.early.held
        if need > room and not transfers.evictable_device_reaches(need - room):
            tree.unlock(node, host=False)
            return None
        fresh: torch.Tensor | None = None
        early = lookup.early
        hits = 0 if lookup.fetch is None else lookup.fetch.hit_pages or 0
        in_storage = (lookup.anchor_len, lookup.anchor_len + hits * page)
        try:
            storage_hit = self.prefetches.finish(lookup)
            self.early.forget(lookup)
            if early is not None:
                # Split the tree where the early copies end, so that they cover whole nodes.
                end = lookup.anchor_len + early.tokens
                tree.match_prefix(lookup.tokens[:end], seed=lookup.seed, touch=False)
            # Match again: the fetch's pages may split nodes of the first match (pages the tree
            # gained while the fetch ran), which would then name other stretches.
            match = tree.match_prefix(lookup.tokens, seed=lookup.seed, touch=False)
            tree.lock(match.last_node, host=False)
            tree.unlock(node, host=False)
            node = match.last_node
            device_hit = match.device_len
            transfers.load_host_nodes(match, lookup)
            path = [n for n in tree.path(node) if not n.is_root]
            prefix = [n.device_indices for n in path if n.device_indices is not None]
            cached = match.matched_len
            fresh = transfers.alloc_device(total_tokens - cached)
            slots = torch.cat([*prefix, fresh]) if prefix else fresh
            if self.config.write.policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
                hot = [n for n in path if n.hit_count >= self.config.write.backup_after_hits]
                if hot:
                    self._write_through(hot[-1])
        except BaseException:  # give back what this admission took; loads already queued stay
            tree.unlock(node, host=False)
            if fresh is not None and fresh.numel():
                self.device_alloc.free(fresh)
            self.early.drop(lookup)
            raise
        storage_hit = min(storage_hit, cached - device_hit)
        host_hit = cached - device_hit - storage_hit
        self.stats.device_hit_tokens += device_hit
        self.stats.host_hit_tokens += host_hit
        self.stats.storage_hit_tokens += storage_hit
        return Lease(
            lookup.tokens,
            lookup.seed,
            node,
            slots,
            cached,
            device_hit,
            host_hit,
            storage_hit,
            in_storage=in_storage,
        )

    def cancel(self, lookup: Lookup) -> None:
        """Drop a request that will not be admitted: stop its prefetch, free what it holds."""
        self.early.forget(lookup)
        self.early.drop(lookup)  # before the fetch's host slots can be freed
        self.prefetches.cancel(lookup)

    def take_load(self) -> LayerLoad | None:
        """Start the L2→L1 loads of every request admitted since the last call, layer by layer.

        The next forward must pass :meth:`LayerLoad.wait` as its per-layer hook.
        """
        return self.transfers.take_load()

    def record_load(self, timing: LoadTiming) -> None:
        """Add a finished load's duration and exposed time to the stats."""
        self.stats.loads += 1
        self.stats.layer_loads += timing.layers
        self.stats.load_s += timing.load_s
        self.stats.exposed_load_s += timing.exposed_s

    def ride(self, finishing: Sequence[tuple[Lease, int]]) -> ForwardBackups | None:
        """Plan the next forward's layer-by-layer backups of the pages it completes.

        ``finishing`` names each request whose prompt the forward ends: its lease and prompt
        length. The scheduler queues each layer's copies once the forward has written the
        layer (:meth:`ForwardBackups.written
        <hicache_storage.engine.layer_backups.ForwardBackups.written>`), then
        ``finish()`` or, if the forward failed, ``abandon()``; None when nothing is copied.
        """
        self._check_open()
        return self.layer_backups.plan(finishing)

    def prefilled(self, lease: Lease, prompt_tokens: int) -> None:
        """Insert a request's prompt pages once its prefill has ended; back them up now.

        Under ``write_through`` a request's pages were backed up at its release, after its
        decode steps, and its slots were evicted for the next request at once: that request's
        first forward waited on the GPU for the whole copy (each prefill paid for the backup of
        the one released before it). Inserted when the forward that ends the prompt has been
        queued, the pages are copied behind it and the copy runs under the request's decode
        steps, as SGLang's write-through backs a prompt up when its prefill inserts it.

        The pages stay locked by the request until its release, which inserts the rest (the
        generated tokens). Nothing happens unless the cache keeps prefixes and writes through
        to a host pool, once per lease, or where another request inserted part of the prompt
        while this one computed it (its slots stay this request's, freed at release).
        """
        self._check_open()
        config = self.config
        if (
            lease.released
            or lease.inserted
            or self.host_pool is None
            or not config.prefix_cache
            or config.write.policy is not WritePolicy.WRITE_THROUGH
        ):
            return
        tree = self.tree
        page = config.page_size
        keep = min(prompt_tokens // page * page, int(lease.slots.numel()), len(lease.tokens))
        if keep <= lease.cached:
            return
        tokens = lease.tokens[:keep]
        if tree.match_prefix(tokens, seed=lease.seed, touch=False).device_len > lease.cached:
            return
        held = lease.slots[:keep].to("cpu", torch.int64)
        result = tree.insert(tokens, held, seed=lease.seed)
        tree.lock(result.node, host=False)
        tree.unlock(lease.node, host=False)
        lease.node = result.node
        lease.inserted = keep
        self.writes.mark_in_storage(lease, tokens)
        self.layer_backups.split_at_copies(lease, tokens)
        self._write_through(result.node, lease)

    def release(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor) -> None:
        """Insert the request's computed KV, apply the write policy and drop the lock.

        ``tokens`` are the tokens whose KV is at ``slots`` (for a finished request: prompt and
        output but the last token); ``slots`` is a prefix of :attr:`Lease.slots` or all of it.
        Every slot of the lease the tree does not take is freed.
        """
        if lease.released:
            raise HostPoolError("this lease was already released")
        lease.released = True
        try:
            self._release(lease, tokens, slots)
        finally:  # the host slots of ridden copies no node took
            self.layer_backups.give_back(lease)

    def _release(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor) -> None:
        held = lease.slots.to("cpu", torch.int64)
        page = self.config.page_size
        keep = len(tokens) // page * page if self.config.prefix_cache else 0
        keep = max(min(keep, slots.numel()), 0)
        owned = max(lease.cached, lease.inserted)  # slots the tree holds already
        freed = held[owned:]
        last = lease.node
        try:
            if keep >= lease.cached:
                result = self.tree.insert(
                    tuple(map(int, tokens[:keep])), held[:keep], seed=lease.seed
                )
                taken_from = max(owned, result.existing_len)
                freed = torch.cat([held[owned:taken_from], held[max(keep, owned) :]])
                last = result.node
        finally:  # a refused insert changed nothing: every slot past the prefix is freed
            if freed.numel():
                self.device_alloc.free(freed)
            self.tree.unlock(lease.node, host=False)
        self.stats.computed_tokens += max(len(tokens) - lease.cached, 0)
        if keep:
            self.writes.mark_in_storage(lease, tokens[:keep])
        if self.config.write.policy is WritePolicy.WRITE_THROUGH and keep:
            self.layer_backups.split_at_copies(lease, tokens[:keep])
            self._write_through(last, lease)

    def _write_through(self, node: Node, lease: Lease | None = None) -> None:
        """Back ``node``'s path up to the host and queue its unstored pages for storage.

        Where the path cannot be put on the host, its unstored pages are written through
        staging slots instead (:meth:`StorageWrites.write_path
        <hicache_storage.engine.writes.StorageWrites.write_path>`).
        """
        if self.host_pool is None:
            return
        ridden = None if lease is None else self.layer_backups.taker(lease)
        backed_up = self.transfers.backup(node, ridden=ridden)
        self.writes.write_path(node, backed_up=backed_up)

    # -- background completions ------------------------------------------------------------------

    def poll(self) -> None:
        """Apply what the storage threads finished: stored pages, drained prefetch slots.

        Raises
        ------
        StorageBugError
            After applying the rest, if a storage call raised something other than a
            ``BackendError`` (a bug; the call itself was counted as a miss).
        """
        if self.io is not None:
            self.writes.poll()
        self.copies.unpin_loaded()
        self.prefetches.assign_slots()
        self.prefetches.reap()
        if self.io is not None:
            self.io.check()

    def close(self) -> None:
        """Flush queued backups, stop every thread and apply the outcomes; idempotent.

        Backups the queue refused or that failed are counted (``backups_refused``,
        ``backups_failed``). Close takes at most ``config.close_timeout_s`` (and what applying
        the outcomes costs): a storage thread still in a backend call then is abandoned
        (``calls_abandoned``) and exits when its call returns, acting on nothing; the backups
        not written by then count as failed. No other thread of the cache is left.
        """
        if self._closed:
            return
        self._closed = True
        if self.io is not None:
            for done in self.io.close(self.config.close_timeout_s):
                self.writes.complete(done)
            self.stats.backups_refused = self.io.refused_backups
            self.stats.calls_abandoned = self.io.abandoned_calls
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
        self.prefetches.reap()

    # -- slots ------------------------------------------------------------------------------------

    def alloc_device(self, count: int) -> torch.Tensor:
        """Allocate whole pages for at least ``count`` device slots, evicting to the host.

        Raises
        ------
        HostPoolError
            If locked pages leave too little room.
        """
        return self.transfers.alloc_device(count)

    def _check_open(self) -> None:
        if self._closed:
            raise HostPoolError("the cache is closed")
