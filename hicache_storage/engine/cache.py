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

Stored objects say what their bytes mean. The pools must agree (dtype, layers, KV heads, head dim,
page size, MHA or MLA) or construction fails with a :class:`~.errors.PoolMismatchError`. Under the
rank-suffix scheme every key ends in the :class:`~hicache_storage.keys.format.ObjectFormat` tag of
the host pool and of the model (:meth:`TierCache.bind_model`, which the engine calls), so a reader
of another model, dtype, geometry or host layout misses instead of reading foreign bytes. Under
the unified scheme the namespace digest carries the same facts: its plan must describe the device
pool, and pages move as the plan's objects (:class:`~hicache_storage.hostpool.UnifiedObjectPool`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.config import check_duration
from hicache_storage.errors import ConfigError, HostPoolError
from hicache_storage.hostpool import HostKVPool, PageAllocator, UnifiedObjectPool
from hicache_storage.kernels import CopyFence, DevicePool, KVTransfer
from hicache_storage.keys import (
    KeyScheme,
    KeySchemeError,
    ObjectFormat,
    RankSuffixScheme,
    UnifiedPlan,
    logical_dtype,
)
from hicache_storage.kit.options import MAX_BYTES, positive_int, share
from hicache_storage.planner.fetch import FetchView, adaptive_wait_s, fetch_pays
from hicache_storage.planner.rates import CostModel

from .errors import PoolMismatchError
from .health import Bypass, bypass
from .loading import EarlyLoad, LayerLoad, LoadTiming
from .policies import PrefetchPolicy, PrefetchTimeout, WritePolicy, prefetch_done_waiting
from .radix import MatchResult, Node, RadixTree, Tier
from .storage_io import (
    Backup,
    BackupDone,
    Prefetch,
    PrefetchState,
    StorageIO,
    check_linger,
    check_nice,
)

__all__ = ["CacheConfig", "CacheStats", "Lease", "Lookup", "TierCache"]

_WRITE_WAIT_S = 0.05
"""How long room-making on the host waits for one background write at a time."""

_COPY_OUTCOMES = 64
"""Stored pages copied to the host whose fate (hit there, or evicted unread) decides whether
the next such copy may evict another host page."""

_COPY_PAYS = 0.25
"""Share of those copies hit on the host at which a copy into a full host is worth making: a
hit saves a storage read of the page (0.4-0.5 ms for 8 MiB on the H200), a copy costs a
device→host transfer on the forward's stream (about 0.16 ms) and the host page it evicts."""

_INLINE_QUERY_S = 0.001
"""Existence queries measured this quick (or within 2 % of a forward) are asked in the
scheduler's thread: the answer comes with no hand-over to a query thread, so a request whose
pages storage does not hold is scheduled at once."""


def _positive_int(name: str, value: object) -> None:
    positive_int(name, value, ConfigError)


def _device_geometry(pool: DevicePool, page_size: int) -> str:
    dim = math.prod(pool.row_shape[1:])
    kind = "MLA" if pool.is_mla else f"MHA {pool.row_shape[0]} KV heads x"
    dtype = str(pool.dtype).removeprefix("torch.")
    return f"{kind} {dim} per head, {pool.layer_num} layers, {dtype}, {page_size}-token pages"


def _host_geometry(pool: HostKVPool) -> str:
    mla = pool.is_mla
    dim = getattr(pool, "kv_cache_dim" if mla else "head_dim", None)
    kind = "MLA" if mla else f"MHA {getattr(pool, 'head_num', None)} KV heads x"
    dtype = str(pool.dtype).removeprefix("torch.")
    return f"{kind} {dim} per head, {pool.layer_num} layers, {dtype}, {pool.page_size}-token pages"


def _check_pools(device: DevicePool, host: HostKVPool, page_size: int) -> None:
    """Refuse a host pool whose pages would not hold the device pool's KV, naming both sides.

    Equal row bytes are not enough: 4 heads x 8 and 2 heads x 16 copy without error, and a
    layout that orders a page by head (``page_head``) then gives the model wrong KV.
    """
    if _host_geometry(host) != _device_geometry(device, page_size):
        raise PoolMismatchError(
            f"the host pool ({_host_geometry(host)}) does not hold the device pool's KV "
            f"({_device_geometry(device, page_size)}); build both for the model's geometry, "
            f"dtype and the cache's page size"
        )


def _check_plan(plan: UnifiedPlan, device: DevicePool, page_size: int) -> None:
    """Refuse a unified plan whose namespace does not describe the device pool's KV."""
    space = plan.namespace
    problems = []
    try:
        dtype = logical_dtype(device.dtype)
    except KeySchemeError as exc:
        problems.append(str(exc))
    else:
        if dtype != space.dtype:
            problems.append(f"dtype {space.dtype} != the pools' {dtype}")
    if space.page_size != page_size:
        problems.append(f"page_size {space.page_size} != the cache's {page_size}")
    layers = (plan.objects[0].layers.start, plan.objects[-1].layers.stop)
    if layers != (0, device.layer_num):
        problems.append(f"layers [{layers[0]}, {layers[1]}) != the model's [0, {device.layer_num})")
    if space.rank_replicated != device.is_mla:
        problems.append("an MLA pool needs an MLA namespace and an MHA pool an MHA one")
    elif not device.is_mla:
        local = max(obj.pool_heads.stop for obj in plan.objects)
        heads = device.row_shape[0]
        if (local, space.total_kv_heads) != (heads, heads):
            problems.append(
                f"{local} local of {space.total_kv_heads} KV heads != the model's {heads}"
            )
    if problems:
        raise ConfigError(
            f"the unified scheme's namespace ({space.model_id!r}) does not describe this "
            f"engine's KV ({_device_geometry(device, page_size)}): " + "; ".join(problems)
        )


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
        When a waiting request stops waiting for its storage prefetch. The default,
        ``adaptive``, reads only what reads faster than it computes and waits only while that
        is cheaper than recomputing; ``timeout`` waits up to a deadline grown with the fetch;
        SGLang's default, ``best_effort``, never delays a request and so uses only what arrived
        already.
    prefetch_threshold
        Fewest pages worth fetching from storage; shorter storage hits are recomputed.
    prefetch_capacity
        Most host tokens that in-flight prefetches may hold; None for half the host pool.
    read_batch_pages
        Pages per storage read of a prefetch.
    query_threads, read_threads
        Existence queries and prefetch reads in flight at once.
    write_batch_bytes
        Most bytes a backup writes per storage call (at least one page): background writes
        move a few large pages at a time so that they leave the cores to the forward and the
        reads, and many small pages in one call so that they do not pay a call's overhead each.
    write_linger_s
        How long an idle writer that wakes for less than a call's worth of pages waits for
        more before it writes (cut short when the writer hurries or closes). Each wake-up
        takes the GIL from the scheduler's thread while it admits and releases requests, and
        the backups of one step arrive one request at a time: on two cores a 20 ms linger
        took the write-through's cost beside a CPU forward from 1.37x to 1.27x of the
        host-only cache's TTFT. 0 writes at once.
    write_queue
        Most backups queued for storage at once.
    write_backlog
        Most share of the host pool, in ``(0, 1]``, that pages waiting to be written may hold
        before the writer hurries (:meth:`StorageIO.hurry
        <hicache_storage.engine.storage_io.StorageIO.hurry>`) until its queue drains. Written
        pages are pinned on the host until stored; when prefill produces KV faster than a
        trickling writer stores it, the host fills with them, and the fetches that follow wait
        for writes to make room (measured on the H200: 1.1-2.2 s of a run, and requests priced
        out of their fetches). 1.0 hurries only when making room has to wait.
    load_max_gbps, backup_max_gbps
        Pace of the L2→L1 and L1→L2 copy kernels on a GPU; None for full speed.
    transfer_sms
        Most SMs a copy between the device and host pools occupies on a GPU (the kernel's
        ``sm_budget``); None for the whole GPU. A copy kernel on every SM holds the forward
        beside it back for as long as it runs; a few SMs fill the PCIe link
        (``docs/kernels.md``, *SM confinement*).
    early_loads
        Copy a waiting request's pages to the device as its storage reads return them, into
        free device slots or slots of unlocked pages the host also holds, so that at admission
        only the pages read last are left to load. Such copies are given back when an admission
        needs their room. Off by default: where the forward hides the layer-by-layer load
        (measured on the H200 with an 8B model, 1-3 % of a load was exposed), early
        copies only move the same bytes sooner; turn it on where the bench's exposed load
        share is high (a small model over long prefixes, a slow link).
    switch_interval_s
        While a storage tier's threads run, the interpreter's thread switch interval is at most
        this (``sys.setswitchinterval``, process-wide; restored by ``close``): at Python's
        5 ms, a storage thread that wants the GIL back after each page's system call waits for
        the scheduler's thread, which launches the model's kernels, so reads and queries crawl.
        None leaves it alone.
    storage_nice
        Niceness of the storage threads and the threads they start (Linux; 0..19): a forward
        on the CPU keeps its cores while storage works in the background (on two cores a write
        beside a forward made it 30 % slower). None leaves them at the process's.
    idle_writes
        Run the background writer under Linux's ``SCHED_IDLE`` (:class:`StorageIO
        <hicache_storage.engine.storage_io.StorageIO>`): it takes only cores nothing else
        wants, where at ``storage_nice`` it still took a share of one from a CPU forward that
        fills them all. Queries and reads, which requests wait on, stay at ``storage_nice``.
    close_timeout_s
        Most seconds :meth:`TierCache.close` waits for queued writes and storage calls in
        flight. A thread still in a backend call then is abandoned: it applies nothing when
        the call returns and exits; backups not written by then count as failed.
    """

    page_size: int
    prefix_cache: bool = True
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    backup_after_hits: int = 2
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.ADAPTIVE
    prefetch_timeout: PrefetchTimeout = field(default_factory=PrefetchTimeout)
    prefetch_threshold: int = 1
    prefetch_capacity: int | None = None
    read_batch_pages: int = 32
    query_threads: int = 2
    read_threads: int = 4
    write_batch_bytes: int = 16 << 20
    write_linger_s: float = 0.02
    write_queue: int = 64
    write_backlog: float = 0.25
    load_max_gbps: float | None = None
    backup_max_gbps: float | None = None
    transfer_sms: int | None = 16
    early_loads: bool = False
    switch_interval_s: float | None = 0.0005
    storage_nice: int | None = 10
    idle_writes: bool = True
    close_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "page_size",
            "backup_after_hits",
            "prefetch_threshold",
            "read_batch_pages",
            "query_threads",
            "read_threads",
            "write_batch_bytes",
            "write_queue",
        ):
            _positive_int(name, getattr(self, name))
        for name in ("prefetch_capacity", "transfer_sms"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        for name in ("early_loads", "idle_writes"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.prefetch_timeout, PrefetchTimeout):
            raise ConfigError("prefetch_timeout must be a PrefetchTimeout")
        check_nice(self.storage_nice, "storage_nice")
        share("write_backlog", self.write_backlog, ConfigError)
        check_linger(self.write_linger_s)
        check_duration("close_timeout_s", self.close_timeout_s)
        check_duration("switch_interval_s", self.switch_interval_s, allow_none=True)
        if self.write_batch_bytes > MAX_BYTES:
            raise ConfigError(f"write_batch_bytes must be at most {MAX_BYTES} (1 PiB)")
        for name in ("load_max_gbps", "backup_max_gbps"):
            rate = getattr(self, name)
            if rate is not None and (
                isinstance(rate, bool)
                or not isinstance(rate, int | float)
                or not 0 < rate < math.inf
            ):
                raise ConfigError(f"{name} must be a positive finite number or None, got {rate!r}")
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
    pages_loaded_early: int = 0
    """Pages copied to the device while their request waited for storage (not in
    ``pages_loaded``)."""
    early_pages_dropped: int = 0
    """Early-loaded pages given back unused (cancelled, already on the device, room needed)."""
    pages_backed_up: int = 0
    pages_fetched: int = 0
    pages_stored: int = 0
    pages_staged: int = 0
    """Pages written through host slots outside the tree: their stored prefix found no host room
    (they are in ``pages_stored`` too once written)."""
    pages_known_stored: int = 0
    """Pages a request computed that its storage query had found: marked stored, not written."""
    storage_bytes_read: int = 0
    storage_bytes_written: int = 0
    prefetches: int = 0
    prefetch_pages_cut: int = 0
    prefetch_priced_out: int = 0
    """Fetches that read nothing: reading their pages would take longer than computing them."""
    prefetch_no_room: int = 0
    """Fetches that read nothing for want of host slots (or of their matched prefix)."""
    storage_misses: int = 0
    backups_failed: int = 0
    backups_refused: int = 0
    pages_dropped: int = 0
    """Unstored pages that left the last tier holding them without being written (no room
    on the host to back them up or stage them, or a failed write)."""
    loads: int = 0
    load_s: float = 0.0
    exposed_load_s: float = 0.0
    layer_loads: int = 0
    host_room_wait_s: float = 0.0
    """Seconds the scheduler's thread waited for background writes to free host room."""
    fetch_room_wait_s: float = 0.0
    """The part of ``host_room_wait_s`` spent making room for fetched pages (the rest made it
    for copies of device pages: backups and write-through)."""
    write_waits_skipped: int = 0
    """Times host room was refused instead of waited for: the store reads a page back slower
    than it is computed, so no write is worth a wait (``TierCache._writes_pay``)."""
    writes_shed: int = 0
    """Write-throughs (and writes of evicted host pages) not made under ``adaptive`` while the
    store was bypassed (``TierCache._bypassed``), and queued backups the writer dropped."""
    writes_shed_failing: int = 0
    """Of ``writes_shed``, those shed because the store was failing (its recent calls delivered
    nothing); the rest, because it read back far slower than recompute."""
    calls_abandoned: int = 0
    """Storage threads still in a backend call when ``close`` stopped waiting for them
    (``CacheConfig.close_timeout_s``)."""


@dataclass
class Lookup:
    """A waiting request's match and its storage prefetch, from :meth:`TierCache.lookup`."""

    tokens: tuple[int, ...]
    seed: str | None
    anchor: Node
    anchor_len: int
    fetch: Prefetch | None = None
    rechecked: bool = False
    pinned: bool = False
    """The anchor's host copy is pinned for the fetch (once storage was found to hold pages)."""
    early: EarlyLoad | None = None
    """The fetched pages already copied to the device (``early_loads``)."""


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
    in_storage
        Prompt tokens ``[begin, end)`` its existence query found in storage: what it computes
        of them (a fetch cut or not worth it) is not written again.
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
    in_storage: tuple[int, int] = (0, 0)


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
            _check_pools(device_pool, host_pool, config.page_size)
        if device_pool.size % config.page_size:
            raise PoolMismatchError(
                f"the device pool's {device_pool.size} slots are not whole "
                f"{config.page_size}-token pages"
            )
        self.objects: UnifiedObjectPool | None = None
        if isinstance(scheme, UnifiedPlan):
            _check_plan(scheme, device_pool, config.page_size)
            if host_pool is not None:
                self.objects = UnifiedObjectPool(host_pool, scheme)
        elif scheme is not None and scheme.keys_per_page != 1:
            raise ConfigError(
                f"a key scheme of {scheme.keys_per_page} keys per page must be a UnifiedPlan "
                "(the cache moves multi-object pages as the plan's objects)"
            )
        self.config = config
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.backend = backend
        self._given_scheme = scheme or RankSuffixScheme()
        self._exact_names = backend is not None and backend.capabilities.foreign_names
        self._model: str | None = None
        self.scheme = self._scheme_for("")
        self.tree = RadixTree(config.page_size)
        self.device_alloc = PageAllocator(device_pool.size, config.page_size)
        on_gpu = device_pool.device.type == "cuda"
        sms = config.transfer_sms if on_gpu else None
        self.transfer = (
            None if host_pool is None else KVTransfer(device_pool, host_pool, sm_budget=sms)
        )
        self._early_stream = (
            torch.cuda.Stream(device_pool.device)  # type: ignore[no-untyped-call]
            if on_gpu and backend is not None and config.early_loads
            else None
        )
        self.io: StorageIO | None = None
        self._switch_interval: float | None = None
        self.costs = CostModel()
        """Measured read, query and compute times (the scheduler records its forwards)."""
        self.token_bytes = device_pool.row_nbytes * device_pool.num_kv * device_pool.layer_num
        if backend is not None and host_pool is not None:
            registered = host_pool if self.objects is None else self.objects
            backend.register_host_pool(registered)
            page_bytes = self.token_bytes * config.page_size
            self.io = StorageIO(
                backend,
                read_batch_pages=config.read_batch_pages,
                write_capacity=config.write_queue,
                object_indices=None if self.objects is None else self.objects.object_indices,
                query_threads=config.query_threads,
                read_threads=config.read_threads,
                write_batch_pages=max(1, config.write_batch_bytes // page_bytes),
                write_linger_s=config.write_linger_s,
                costs=self.costs,
                nice=config.storage_nice,
                idle_writes=config.idle_writes,
                shed_failing=config.prefetch_policy is PrefetchPolicy.ADAPTIVE,
                pool=registered,
            )
            if config.switch_interval_s is not None:
                self._switch_interval = sys.getswitchinterval()
                sys.setswitchinterval(min(self._switch_interval, config.switch_interval_s))
        self.stats = CacheStats()
        capacity = config.prefetch_capacity
        if capacity is None and host_pool is not None:
            capacity = max(config.page_size, host_pool.size // 2)
        self._prefetch_capacity = capacity or 0
        self._prefetch_held = 0
        self._draining: list[Prefetch] = []
        self._fetching: list[tuple[Prefetch, Lookup]] = []
        self._reading: list[Prefetch] = []
        self._writing: dict[int, tuple[Node, frozenset[str], torch.Tensor | None]] = {}
        """Nodes whose pages are being written: their hashes, and the staging slots the pages
        are written from when the node's host copy is not (:meth:`_stage`)."""
        self._writing_pages = 0
        """Pages of :attr:`_writing`, kept as it changes (the scheduler asks every step)."""
        self._host_copies: list[tuple[torch.Tensor, CopyFence]] = []
        """Device→host copies that may still be in flight: their host slots and fences."""
        host_size = 0 if host_pool is None else host_pool.size
        self._backlog_tokens = max(config.page_size, int(host_size * config.write_backlog))
        self._write_failed: set[int] = set()
        self._stored_copies: OrderedDict[int, None] = OrderedDict()
        """Stored nodes copied to the host that have been neither hit nor evicted there yet."""
        self._copy_outcomes: deque[bool] = deque(maxlen=_COPY_OUTCOMES)
        """Whether each of the last such copies was hit on the host before it left."""
        self._unstaged: list[Node] = []
        """Device nodes a write-through found no host room for, staged as room frees."""
        self._loads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._load_pins: list[Node] = []
        """Nodes whose host copies the next :meth:`take_load` copies to the device."""
        self._loading: list[tuple[LayerLoad | EarlyLoad, list[Node]]] = []
        """Loads that may still read host slots, and the nodes pinned on the host meanwhile."""
        self._early: list[Lookup] = []
        self._early_held = 0
        self._closed = False

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
        self.scheme = self._scheme_for(identity, bound=True)
        self._model = identity

    def _scheme_for(self, model: str, *, bound: bool = False) -> KeyScheme:
        """Return the given scheme; a rank-suffix one tagged with its page objects' format."""
        given = self._given_scheme
        if not isinstance(given, RankSuffixScheme) or self.host_pool is None or self._exact_names:
            return given
        fmt = ObjectFormat.of_pool(self.host_pool, model=model)
        if not given.object_format:
            return dataclasses.replace(given, object_format=fmt.tag)
        if bound and given.object_format != fmt.tag:
            raise ConfigError(
                f"the key scheme's object_format {given.object_format} is not the format of "
                f"this engine's pages ({fmt.describe()}: {fmt.tag}); leave object_format empty "
                "and the cache sets it"
            )
        return given

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
        """Start asking storage for the pages after ``match`` when enough of them may be there.

        Only the existence query starts here: nothing is copied to the host, pinned or
        allocated for a request until storage is known to hold its pages
        (:meth:`_assign_slots`), so a prefetch that finds nothing costs the host no room.
        """
        pages = len(match.remainder) // self.config.page_size
        if self.io is None or pages < self.config.prefetch_threshold:
            return
        if self._bypassed():  # nothing it holds could pay: not worth asking
            self.stats.prefetches += 1
            self.stats.prefetch_priced_out += 1
            return
        keys = self.scheme.keys(match.remainder_hashes)
        fetch = Prefetch(keys, self.scheme.keys_per_page, None, self.config.page_size)
        lookup.fetch = fetch
        self._fetching.append((fetch, lookup))
        self.stats.prefetches += 1
        query_s = self.costs.query_s
        forward_s = self.costs.forward_s or 0.0
        quick = query_s is not None and query_s <= max(_INLINE_QUERY_S, 0.02 * forward_s)
        self.io.prefetch(fetch, inline=quick)

    def start_reads(self) -> None:
        """Start the reads of fetches whose query answered, between two layers of a forward.

        A forward of a long prefill takes hundreds of milliseconds; a request that arrives
        meanwhile would otherwise have its reads started only at the next step, and its pages
        would arrive a forward late. The scheduler calls this from the forward's layer hook (its
        own thread, which owns the tree and the allocators). Only what touches no KV being
        computed is done here: host slots come from free slots or stored host leaves, and a
        fetch whose matched prefix is not on the host yet waits for the step.
        """
        if self.io is not None and any(
            fetch.state is PrefetchState.QUERIED for fetch, _ in self._fetching
        ):
            self._assign_slots(between_layers=True)

    def _assign_slots(self, *, between_layers: bool = False) -> None:
        """Give host slots to the prefetches whose existence query answered, within the cap.

        Slots are taken only for the pages storage holds, so a prefetch that finds nothing
        never evicts a host page; the request's matched prefix is put on the host and pinned
        then (the fetched pages hang below it). Under ``adaptive`` a fetch whose reads would
        take longer than recomputing its pages (reads queued ahead included) reads nothing.
        ``between_layers`` (:meth:`start_reads`) leaves for the next step a fetch that would
        need a copy to the host or a write to make room.
        """
        if not self._fetching:
            self._load_early()
            return
        page = self.config.page_size
        waiting: list[tuple[Prefetch, Lookup]] = []
        probing = self._probing()
        for fetch, lookup in self._fetching:
            state = fetch.state
            if state is PrefetchState.QUERYING or (probing and state is PrefetchState.QUERIED):
                waiting.append((fetch, lookup))
                continue
            if state is not PrefetchState.QUERIED:
                continue
            room = (self._prefetch_capacity - self._prefetch_held) // page
            hits = fetch.hit_pages or 0
            pages = min(hits, room)
            if pages < hits and self._capacity_returns(hits):
                waiting.append((fetch, lookup))  # the fetches ahead hand their slots back
                continue
            if between_layers and not (
                lookup.pinned or lookup.anchor.is_root or Tier.HOST in lookup.anchor.tiers
            ):
                waiting.append((fetch, lookup))
                continue
            if pages < self.config.prefetch_threshold:
                self.stats.prefetch_no_room += pages < hits  # else too short to be worth it
                fetch.cancel()
                continue
            if self.config.prefetch_policy is PrefetchPolicy.ADAPTIVE and not fetch_pays(
                pages,
                page,
                self._queued_pages(None),
                self.costs,
                in_flight_s_per_page=self._in_flight_s_per_page(),
            ):
                self.stats.prefetch_priced_out += 1
                fetch.cancel()
                continue
            if not self._pin_anchor(lookup):
                self.stats.prefetch_no_room += 1
                fetch.cancel()
                continue
            waited = self.stats.host_room_wait_s
            host = self._alloc_host(pages * page, stored_only=between_layers)
            self.stats.fetch_room_wait_s += self.stats.host_room_wait_s - waited
            if host is None and between_layers:
                waiting.append((fetch, lookup))  # the anchor stays pinned for the step
                continue
            if host is None:
                self.stats.prefetch_no_room += 1
                fetch.cancel()
            elif fetch.assign(host, ready=self._copies_into(host)):
                self._prefetch_held += host.numel()
                self._reading.append(fetch)
                if self.config.early_loads:
                    self._early.append(lookup)
                assert self.io is not None
                self.io.read(fetch)
                probing = self._probing()
            elif self.host_pool is not None:
                self.host_pool.free(host)
        self._fetching = waiting
        self._load_early()

    def _copies_into(self, slots: torch.Tensor) -> Callable[[], None] | None:
        """Return the wait for the device→host copies still in flight into ``slots`` (or None).

        A backed-up page storage holds can be evicted from the host as soon as it is there, and
        its slots handed to a fetch while its copy still waits behind a forward on the GPU: the
        copy would then land on the pages the fetch read (measured on the H200 as checksum
        failures of the file backend, and wrong KV where the copy landed after the check).
        Only copies into the fetch's slots are waited for, and by the read threads before they
        read: neither the scheduler's thread nor the read waits for other pages' backups.
        """
        copies = self._copies_in_flight()
        if not copies:
            return None
        hit = torch.isin(torch.cat([host for host, _ in copies]), slots)
        sizes = [host.numel() for host, _ in copies]
        fences = [
            fence
            for (_, fence), part in zip(copies, hit.split_with_sizes(sizes), strict=True)
            if bool(part.any())
        ]
        if not fences:
            return None

        def ready() -> None:
            for fence in fences:
                fence.wait()

        return ready

    def _copies_in_flight(self) -> list[tuple[torch.Tensor, CopyFence]]:
        """Forget the device→host copies that are done; return those that may not be."""
        self._host_copies = [c for c in self._host_copies if not c[1].done()]
        return self._host_copies

    def _load_early(self) -> None:
        """Copy the pages fetches read since the last call to the device (``early_loads``).

        A copy takes free device slots or those of unlocked device pages the host holds too
        (dropping them costs no copy), and never more than half the device pool in all: the
        waiting requests' copies must not crowd out the running ones' next admissions.
        """
        if not self._early or self.transfer is None:
            return
        page = self.config.page_size
        limit = self.device_pool.size // 2
        still: list[Lookup] = []
        for lookup in self._early:
            fetch = lookup.fetch
            if fetch is None:
                continue
            still.append(lookup)
            early = lookup.early
            done = 0 if early is None else early.tokens
            count = min(fetch.read_pages * page - done, (limit - self._early_held) // page * page)
            device = self._alloc_device_early(count) if count > 0 else None
            if device is None:
                continue
            if early is None:
                early = lookup.early = EarlyLoad(
                    self.transfer, self._early_stream, max_gbps=self.config.load_max_gbps
                )
            assert fetch.host_indices is not None
            early.extend(fetch.host_indices[done : done + count], device)
            self._early_held += count
            self.stats.pages_loaded_early += count // page
        self._early = still

    def _alloc_device_early(self, count: int) -> torch.Tensor | None:
        """Device slots for an early load: free ones, then unlocked pages also on the host."""
        while self.device_alloc.available_size() < count:
            victim = next(self.tree.evictable(Tier.DEVICE), None)
            if victim is None or Tier.HOST not in victim.tiers:
                return None
            self.device_alloc.free(self.tree.evict_device(victim))
        return self.device_alloc.alloc(count)

    def _drop_early(self, lookup: Lookup) -> None:
        """Give back a request's early-loaded device slots, once their copies are done."""
        early = lookup.early
        if early is None:
            return
        lookup.early = None
        early.synchronize()
        if early.tokens:
            self.device_alloc.free(early.slots)
        self._early_held -= early.tokens
        self.stats.early_pages_dropped += early.tokens // self.config.page_size

    def _reclaim_early(self, need: int) -> bool:
        """Drop waiting requests' early loads, newest first, until ``need`` slots are free.

        Return whether any was dropped.
        """
        dropped = False
        for lookup in reversed(self._early):
            if self.device_alloc.available_size() >= need:
                break
            if lookup.early is not None:
                self._drop_early(lookup)
                dropped = True
        return dropped

    def _capacity_returns(self, pages: int) -> bool:
        """Whether a fetch of ``pages`` should wait for prefetch capacity (``adaptive`` only).

        Capacity held by other fetches comes back as they finish; a fetch that would fit in
        it waits for it (its request waits only while that is cheaper than recomputing, the
        queue ahead counted) instead of reading a part or nothing and recomputing the rest.
        """
        return (
            self.config.prefetch_policy is PrefetchPolicy.ADAPTIVE
            and self._prefetch_held > 0
            and pages * self.config.page_size <= self._prefetch_capacity
        )

    def _probing(self) -> bool:
        """Whether reads wait for the first one to measure the store (``adaptive`` only).

        Until a read has returned, the store's speed is unknown: one fetch reads, and the
        others keep their queries' answers without host slots until it returns or its time
        so far prices them out. A store that takes a second a call then holds one fetch's
        slots for that second, not every read thread's.
        """
        return (
            self.config.prefetch_policy is PrefetchPolicy.ADAPTIVE
            and self.costs.read_s_per_page is None
            and any(fetch.state is not PrefetchState.FINISHED for fetch in self._reading)
        )

    def _pin_anchor(self, lookup: Lookup) -> bool:
        """Put the request's matched prefix on the host and pin it; False if it is gone."""
        anchor = lookup.anchor
        if lookup.pinned or anchor.is_root:
            return True
        if not anchor.in_tree or not self._on_host(anchor):
            return False
        self.tree.pin_host(anchor)
        lookup.pinned = True
        return True

    def _unpin_anchor(self, lookup: Lookup) -> None:
        if lookup.pinned:
            lookup.pinned = False
            self.tree.unpin_host(lookup.anchor)

    def _queued_pages(self, fetch: Prefetch | None) -> float:
        """Pages read before ``fetch``'s (None: a fetch started now): the rest of those ahead.

        The read threads take the oldest fetch's batches first, so the pages ahead are read at
        the store's whole rate (:attr:`CostModel.read_s_per_page
        <hicache_storage.planner.rates.CostModel.read_s_per_page>`) before this fetch's.
        """
        still: list[Prefetch] = []
        ahead = 0
        for other in self._reading:
            if other.state is PrefetchState.FINISHED:
                continue
            still.append(other)
            if other is fetch:
                break
            ahead += other.target_pages - other.read_pages
        else:
            self._reading = still
        return float(ahead)

    def _queued_ahead(self, fetch: Prefetch, state: PrefetchState) -> float:
        """Pages read before ``fetch``'s: none once it finished or while it is asking."""
        if state is PrefetchState.READING:
            return self._queued_pages(fetch)
        if state is PrefetchState.QUERIED:
            return self._queued_pages(None)
        return 0.0

    def _in_flight_s_per_page(self) -> float:
        """Seconds per page so far of the slowest read call in flight, at the store's whole rate.

        The calls in flight run side by side, so the slowest one's seconds per page are shared
        among them; 0 when none runs.
        """
        slowest = 0.0
        for fetch in self._reading:
            call_s, call_pages = fetch.call
            if call_pages:
                slowest = max(slowest, call_s / call_pages)
        return slowest / self._calls_in_flight()

    def _calls_in_flight(self) -> int:
        return 1 if self.io is None else max(1, self.io.reads_in_flight)

    def ready(self, lookup: Lookup, *, block_s: float = 0.0, next_step_s: float = 0.0) -> bool:
        """Whether the prefetch policy lets the request be scheduled now.

        Under ``adaptive`` the caller may block up to ``block_s`` for a fetch about to arrive
        (the scheduler does when the wait is short against a forward); otherwise the request
        waits for a later step, ``next_step_s`` from now.
        """
        fetch = lookup.fetch
        if fetch is None or (self.io is not None and not self.io.alive):
            return True
        if fetch.state is PrefetchState.FINISHED:  # read all it will: no policy holds it back
            return True
        policy = self.config.prefetch_policy
        if policy is not PrefetchPolicy.ADAPTIVE:
            return prefetch_done_waiting(
                policy,
                self.config.prefetch_timeout,
                finished=False,
                pages=fetch.target_pages,
                elapsed_s=time.monotonic() - fetch.started,
            )
        deadline = time.monotonic() + block_s
        while True:
            self._assign_slots()
            left = deadline - time.monotonic()
            eta = adaptive_wait_s(
                self._view(fetch),
                self.costs,
                page_size=self.config.page_size,
                block_s=max(left, 0.0),
                next_step_s=next_step_s,
            )
            if eta is None:
                return True
            if eta >= left:
                return False
            fetch.wait_change(min(max(eta, 0.0005), left))

    def _view(self, fetch: Prefetch) -> FetchView:
        state = fetch.state
        call_s, call_pages = fetch.call
        call_s /= self._calls_in_flight()  # the store's whole rate, as the calls share it
        return FetchView(
            queried=state is not PrefetchState.QUERYING,
            finished=state is PrefetchState.FINISHED,
            target_pages=fetch.target_pages,
            read_pages=fetch.read_pages,
            elapsed_s=time.monotonic() - fetch.started,
            call_s=call_s,
            call_pages=call_pages,
            queued_pages=self._queued_ahead(fetch, state),
            in_flight_s_per_page=self._in_flight_s_per_page(),
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
        node = match.last_node
        self.tree.lock(node, host=False)  # the request computes from the device copies
        need = -(-(total_tokens - match.device_len) // page) * page
        room = self.device_alloc.available_size() + self._early_held
        if need > room and not self._evictable_device_reaches(need - room):
            self.tree.unlock(node, host=False)
            return None
        fresh: torch.Tensor | None = None
        early = lookup.early
        hits = 0 if lookup.fetch is None else lookup.fetch.hit_pages or 0
        in_storage = (lookup.anchor_len, lookup.anchor_len + hits * page)
        try:
            storage_hit = self._finish_fetch(lookup)
            if lookup in self._early:
                self._early.remove(lookup)
            if early is not None:
                # Split the tree where the early copies end, so that they cover whole nodes.
                end = lookup.anchor_len + early.tokens
                self.tree.match_prefix(lookup.tokens[:end], seed=lookup.seed, touch=False)
            # Match again: the fetch's pages may split nodes of the first match (pages the tree
            # gained while the fetch ran), which would then name other stretches.
            match = self.tree.match_prefix(lookup.tokens, seed=lookup.seed, touch=False)
            self.tree.lock(match.last_node, host=False)
            self.tree.unlock(node, host=False)
            node = match.last_node
            device_hit = match.device_len
            self._load_host_nodes(match, lookup)
            path = [n for n in self.tree.path(node) if not n.is_root]
            prefix = [n.device_indices for n in path if n.device_indices is not None]
            cached = match.matched_len
            fresh = self.alloc_device(total_tokens - cached)
            slots = torch.cat([*prefix, fresh]) if prefix else fresh
            if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
                hot = [n for n in path if n.hit_count >= self.config.backup_after_hits]
                if hot:
                    self._write_through(hot[-1])
        except BaseException:  # give back what this admission took; loads already queued stay
            self.tree.unlock(node, host=False)
            if fresh is not None and fresh.numel():
                self.device_alloc.free(fresh)
            self._drop_early(lookup)
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

    def _load_host_nodes(self, match: MatchResult, lookup: Lookup) -> None:
        """Put the match's host-only nodes on the device: early copies where they cover a node.

        The other nodes are loaded layer by layer in the next forward. Early slots no node
        takes (pages the device held already) are given back.
        """
        for host_node in match.host_nodes:
            self._copy_outcome(host_node, hit=True)
        early = lookup.early
        if early is None:
            for host_node in match.host_nodes:
                self._schedule_load(host_node)
            return
        lookup.early = None  # from here on each early slot is a node's or freed
        early.order()  # whatever uses the slots from now on runs after the copies
        slots = early.slots
        taken = torch.zeros(slots.numel(), dtype=torch.bool)
        begin = lookup.anchor_len
        pos = match.device_len
        copied: list[Node] = []
        self._loading.append((early, copied))  # their copies may still read the host slots
        try:
            for host_node in match.host_nodes:
                end = pos + host_node.num_tokens
                if begin <= pos and end <= begin + early.tokens:
                    self.tree.attach_device(host_node, slots[pos - begin : end - begin])
                    self.tree.pin_host(host_node)
                    copied.append(host_node)
                    taken[pos - begin : end - begin] = True
                else:
                    self._schedule_load(host_node)
                pos = end
        finally:
            self._early_held -= early.tokens
            unused = slots[~taken]
            if unused.numel():
                self.device_alloc.free(unused)
                self.stats.early_pages_dropped += unused.numel() // self.config.page_size

    def cancel(self, lookup: Lookup) -> None:
        """Drop a request that will not be admitted: stop its prefetch, free what it holds."""
        if lookup in self._early:
            self._early.remove(lookup)
        self._drop_early(lookup)  # before the fetch's host slots can be freed
        fetch = lookup.fetch
        if fetch is None:
            return
        lookup.fetch = None
        fetch.cancel()
        self._drain(fetch)
        self._unpin_anchor(lookup)

    def take_load(self) -> LayerLoad | None:
        """Start the L2→L1 loads of every request admitted since the last call, layer by layer.

        The next forward must pass :meth:`LayerLoad.wait` as its per-layer hook.
        """
        self._unpin_loaded()
        if not self._loads or self.transfer is None:
            return None
        host = torch.cat([h for h, _ in self._loads])
        device = torch.cat([d for _, d in self._loads])
        self._loads.clear()
        load = LayerLoad(self.transfer, host, device, max_gbps=self.config.load_max_gbps)
        self._loading.append((load, self._load_pins))
        self._load_pins = []
        return load

    def _unpin_loaded(self) -> None:
        """Unpin the host copies whose loads to the device are done (their slots may go)."""
        if not self._loading:
            return
        still: list[tuple[LayerLoad | EarlyLoad, list[Node]]] = []
        for load, nodes in self._loading:
            if load.done():
                for node in nodes:
                    self.tree.unpin_host(node)
            else:
                still.append((load, nodes))
        self._loading = still

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
        freed = held[lease.cached :]
        last = lease.node
        try:
            if keep >= lease.cached:
                result = self.tree.insert(
                    tuple(map(int, tokens[:keep])), held[:keep], seed=lease.seed
                )
                taken_from = max(lease.cached, result.existing_len)
                freed = torch.cat([held[lease.cached : taken_from], held[keep:]])
                last = result.node
        finally:  # a refused insert changed nothing: every slot past the prefix is freed
            if freed.numel():
                self.device_alloc.free(freed)
            self.tree.unlock(lease.node, host=False)
        self.stats.computed_tokens += max(len(tokens) - lease.cached, 0)
        if keep:
            self._mark_in_storage(lease, tokens[:keep])
        if self.config.write_policy is WritePolicy.WRITE_THROUGH and keep:
            self._write_through(last)

    def _mark_in_storage(self, lease: Lease, tokens: Sequence[int]) -> None:
        """Mark stored the nodes a request computed over pages its query found in storage.

        Writing them again would cost a host copy, host room (waited for while earlier writes
        drain) and a storage write, for pages storage has: measured on the H200, requests that
        recomputed pages whose fetch was cut fed a round of such waits and further cuts.
        """
        begin, end = lease.in_storage
        end = min(end, len(tokens))
        if self.io is None or end <= begin:
            return
        # Split the tree at both ends, so that whole nodes cover the stretch.
        self.tree.match_prefix(tokens[:begin], seed=lease.seed, touch=False)
        match = self.tree.match_prefix(tokens[:end], seed=lease.seed, touch=False)
        pos = 0
        for node in self.tree.path(match.last_node):
            if node.is_root:
                continue
            if pos >= begin and not node.stored:
                self.tree.mark_stored(node)
                self.stats.pages_known_stored += node.num_tokens // self.config.page_size
            pos += node.num_tokens

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
            for done in self.io.poll():
                self._complete(done)
            self._retry_stages()
        self._unpin_loaded()
        self._assign_slots()
        self._reap()
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
                self._complete(done)
            self.stats.backups_refused = self.io.refused_backups
            self.stats.calls_abandoned = self.io.abandoned_calls
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
        self._reap()

    @property
    def write_backlog_tokens(self) -> int:
        """Host tokens pinned until the writes queued for them are done."""
        return self._writing_pages * self.config.page_size

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
            if victim is None and self._reclaim_early(need):
                continue
            if victim is None:
                raise HostPoolError(
                    f"the device pool cannot hold {need} more tokens: every page is locked"
                )
            if Tier.HOST not in victim.tiers and self.host_pool is not None:
                kept = (
                    self._backup(victim, keep_stored=not victim.stored)
                    or victim.stored
                    or victim.id in self._writing
                )
                if not kept and self.io is not None:  # nowhere else: recomputed when next asked
                    self.stats.pages_dropped += victim.num_tokens // self.config.page_size
            self.device_alloc.free(self.tree.evict_device(victim))
        slots = self.device_alloc.alloc(need)
        if slots is None:
            raise HostPoolError(f"the device pool cannot hold {need} more tokens")
        return slots

    def _evictable_device_reaches(self, tokens: int) -> bool:
        """Whether unlocked device pages hold ``tokens`` slots; walks the tree until they do."""
        found = 0
        for node in self.tree.nodes():
            if node.device_indices is not None and node.lock_ref == 0:
                found += node.num_tokens
                if found >= tokens:
                    return True
        return False

    def _alloc_host(self, count: int, *, stored_only: bool = False) -> torch.Tensor | None:
        """Allocate host slots, evicting host leaves to storage (written first when unstored).

        With ``stored_only``, only leaves already in storage are evicted (nothing is written or
        waited for); None if that does not make room. Waiting for writes hurries the writer:
        measured on the H200, a fetch that waited for a later step instead lost more to
        recompute (its request priced the wait out) than the blocked steps cost. A store whose
        pages read back slower than they compute is not waited for (:meth:`_writes_pay`): None.
        """
        pool = self.host_pool
        if pool is None:
            return None
        if pool.allocator.available_size() < count:
            self._unpin_loaded()
        while pool.allocator.available_size() < count:
            victim = next(self.tree.evictable(Tier.HOST), None)
            if stored_only and (victim is None or not (victim.stored or self.io is None)):
                return None
            if victim is None:
                if not self._writing or self.io is None:
                    return None
                if not self._writes_pay():
                    self.stats.write_waits_skipped += 1
                    return None
                began = time.monotonic()
                self.io.hurry()
                for done in self.io.poll(timeout_s=_WRITE_WAIT_S):
                    self._complete(done)
                self.stats.host_room_wait_s += time.monotonic() - began
                if not self.io.alive:
                    return None
                continue
            unstored = not victim.stored and self.io is not None
            storable = unstored and victim.id not in self._write_failed
            if storable and not self._shed_write() and self._store_later(victim):
                continue  # evicted once written (a failed write is not retried here)
            if unstored and victim.id not in self._writing:  # a staged write still stores it
                self.stats.pages_dropped += victim.num_tokens // self.config.page_size
            self._write_failed.discard(victim.id)
            self._copy_outcome(victim, hit=False)
            pool.free(self.tree.evict_host(victim))
        return pool.alloc(count)

    def _writes_pay(self) -> bool:
        """Whether a written page could pay for a wait: it reads back faster than it computes.

        Waiting for writes to free host room stalls every running request (the scheduler's
        thread waits), for pages that pay only when a later request reads them instead of
        computing them. Priced as one page's fetch (:func:`fetch_pays`: the measured read rate,
        or the slowest read in flight so far); True while the store is unmeasured, and again
        once a slow spell is forgotten. Measured on two cores with a store made slow (1 s a
        read), the waits were half of what serving with storage cost over the host alone.
        """
        return fetch_pays(
            1,
            self.config.page_size,
            0.0,
            self.costs,
            in_flight_s_per_page=self._in_flight_s_per_page(),
        )

    def _bypassed(self) -> bool:
        """Whether ``adaptive`` leaves storage alone (:func:`~.health.bypass`).

        Nothing is asked or written while it fails or reads pages back far slower than they
        compute. SGLang's prefetch policies keep their meaning: every page is asked for and
        written.
        """
        return self._bypass() is not None

    def _bypass(self) -> Bypass | None:
        if self.config.prefetch_policy is not PrefetchPolicy.ADAPTIVE:
            return None
        return bypass(self.costs, self.config.page_size, self._in_flight_s_per_page())

    def _shed_write(self) -> bool:
        """:meth:`_bypassed`, counting the write not made (``writes_shed``, with its reason)."""
        reason = self._bypass()
        if reason is None:
            return False
        self.stats.writes_shed += 1
        self.stats.writes_shed_failing += reason is Bypass.FAILING
        return True

    # -- moves between tiers ----------------------------------------------------------------------

    def _schedule_load(self, node: Node) -> None:
        """L2→L1: give a host-only node device slots; its copy runs in the next forward."""
        host = node.host_indices
        if host is None or self.transfer is None:
            raise HostPoolError(f"{node!r} is not on the host")
        device = self.alloc_device(host.numel())
        try:
            self.tree.attach_device(node, device)
        except BaseException:
            self.device_alloc.free(device)
            raise
        self.tree.pin_host(node)  # until the copy has read it (:meth:`_unpin_loaded`)
        self._load_pins.append(node)
        self._loads.append((host, device))
        self.stats.pages_loaded += host.numel() // self.config.page_size

    def _on_host(self, node: Node) -> bool:
        """Whether ``node`` is a root or on the host, backing it up to the host if needed."""
        return node.is_root or Tier.HOST in node.tiers or self._backup(node, keep_stored=True)

    def _backup(self, node: Node, *, keep_stored: bool = False) -> bool:
        """L1→L2: copy a device node (and any ancestors not yet on the host) to the host.

        A page storage holds evicts another stored host page for its copy only while such
        copies pay (:meth:`_stored_copies_pay`) or ``keep_stored`` (an unstored node or a fetch
        below it needs the path on the host); else it takes free room or stays off the host.
        On the H200 a multi-turn run whose histories outgrow the host copied 9,473 pages (74
        GiB) so, a request's whole stored prefix at each release, and its host tier served no
        page. Such a path's new pages reach storage through staging slots.
        The path is locked meanwhile, so that making room on the host never evicts the part of
        it already copied.
        """
        pool = self.host_pool
        self.tree.lock(node)
        try:
            for step in self.tree.path(node):
                if step.is_root or Tier.HOST in step.tiers:
                    continue
                device = step.device_indices
                if step.stored and not keep_stored and not self._stored_copies_pay():
                    free = self._free_host() >= step.num_tokens
                    host = pool.alloc(step.num_tokens) if pool is not None and free else None
                else:  # a page storage holds is not worth a wait for writes to free host room
                    host = self._alloc_host(step.num_tokens, stored_only=step.stored)
                if step.stored and host is not None:
                    self._stored_copies[step.id] = None
                    while len(self._stored_copies) > 16 * _COPY_OUTCOMES:  # nodes split since
                        self._stored_copies.popitem(last=False)
                if device is None or host is None or self.transfer is None:
                    if host is not None and pool is not None:
                        pool.free(host)
                    return False
                self._copy_to_host(device, host)
                self.tree.attach_host(step, host)
                self.stats.pages_backed_up += step.num_tokens // self.config.page_size
            return True
        finally:
            self.tree.unlock(node)

    def _stored_copies_pay(self) -> bool:
        """Whether recent host copies of stored pages were hit there often enough to evict for.

        True until a few copies have an outcome. A workload whose reuse the host holds keeps
        copying; one whose histories cycle through more than the device and host hold (each
        copy evicted unread) stops, and its copies into free room keep the measure current.
        """
        outcomes = self._copy_outcomes
        return len(outcomes) < 8 or sum(outcomes) >= _COPY_PAYS * len(outcomes)

    def _copy_outcome(self, node: Node, *, hit: bool) -> None:
        """Record whether a stored node copied to the host was hit there before it left."""
        if node.id in self._stored_copies:
            del self._stored_copies[node.id]
            self._copy_outcomes.append(hit)

    def _write_through(self, node: Node) -> None:
        """Back ``node``'s path up to the host and queue its unstored pages for storage.

        Where the path cannot be put on the host, its unstored pages are written through
        staging slots instead (:meth:`_stage`).
        """
        if self.host_pool is None:
            return
        backed_up = self._backup(node)
        if self.io is None or self._shed_write():
            return
        path = self.tree.path(node)
        for i, step in enumerate(path):
            if step.stored:
                continue
            if Tier.HOST in step.tiers:
                self._store_later(step)
            elif not backed_up and not self._stage(step):
                self._unstaged.extend(n for n in path[i:] if not n.stored)  # when room frees
                return

    def _stage(self, node: Node, *, evict: bool = True) -> bool:
        """Write a device node's pages to storage through host slots the tree does not hold.

        A node is on the host only under its parent (the tree's prefix rule), so when a long
        stored prefix finds no host room, the pages computed after it could reach storage no
        other way: their conversation would recompute them every round. The slots come from
        free room or stored host leaves (no wait) and go back once the write is done. Where
        that room is short of the node, its leading pages are staged (the node split where
        they end) and the rest waits for room (:meth:`_retry_stages`): a document larger than
        the free host was otherwise never written. Without ``evict`` only free room is taken
        (a retry does not evict the host's cache for it). False when not a page finds room or
        the writer refuses the job.
        """
        if node.id in self._writing:
            return True
        device = node.device_indices
        if device is None or self.transfer is None or not self.scheme.is_writer:
            return False
        assert self.io is not None and self.host_pool is not None
        pool = self.host_pool
        if evict:
            host = self._alloc_host(node.num_tokens, stored_only=True)
        else:
            host = pool.alloc(node.num_tokens) if self._free_host() >= node.num_tokens else None
        if host is None:  # the room stored leaves made is free now: stage what fits
            room = self._free_host() // self.config.page_size * self.config.page_size
            if room == 0:
                return False
            tokens = [t for step in self.tree.path(node) for t in step.tokens]
            start = len(tokens) - node.num_tokens
            head = self.tree.match_prefix(
                tokens[: start + room], seed=node.namespace, touch=False
            ).last_node  # the upper part of the split; ``node`` keeps the rest
            staged = self._stage(head, evict=False)
            if not staged:  # the writer refused it: both wait, the head first
                self._unstaged.append(head)
            self._unstaged.append(node)
            return staged
        fence = self._copy_to_host(device, host)
        if not self._queue_write(node, host, fence.wait, staging=host):
            self.host_pool.free(host)
            return False
        self.stats.pages_staged += node.num_tokens // self.config.page_size
        return True

    def _free_host(self) -> int:
        return 0 if self.host_pool is None else self.host_pool.allocator.available_size()

    def _retry_stages(self) -> None:
        """Stage the pages a write-through left for lack of host room, oldest first.

        Called as writes finish (their staging slots free room), taking free room only;
        stops at the first node that finds none, so a path is written from its root down. A
        node no longer on the device (evicted meanwhile, counted in ``pages_dropped``) or
        stored is forgotten.
        """
        if not self._unstaged or self._bypassed():
            return
        pending, self._unstaged = self._unstaged, []
        still: list[Node] = []
        for node in pending:
            if not node.in_tree or node.stored or node.id in self._writing:
                continue
            if Tier.HOST in node.tiers:
                self._store_later(node)
            elif node.device_indices is not None and (still or not self._stage(node, evict=False)):
                still.append(node)
        self._unstaged = self._unstaged + still  # the tails of nodes staged in part go first

    def _store_later(self, node: Node) -> bool:
        """Queue a host node's pages for storage, its host copy pinned until written.

        False for a node whose pages are being written through staging slots: its host copy
        is not needed for the write and may be evicted.
        """
        host = node.host_indices
        if self.io is None or host is None or not self.scheme.is_writer:
            return False
        if node.id in self._writing:
            return self._writing[node.id][2] is None
        ready = None if self.transfer is None else self.transfer.fence().wait
        if not self._queue_write(node, host, ready, staging=None):
            return False
        self.tree.pin_host(node)
        return True

    def _copy_to_host(self, device: torch.Tensor, host: torch.Tensor) -> CopyFence:
        """Queue the device→host copy of ``device`` into ``host``; return its fence.

        With a storage tier the copy is remembered until done: a fetch may read into these
        slots once they are freed (:meth:`_copies_into`).
        """
        assert self.transfer is not None
        self.transfer.backup(device, host, max_gbps=self.config.backup_max_gbps)
        fence = self.transfer.fence()
        if self.io is not None:
            self._copies_in_flight().append((host, fence))
        return fence

    def _queue_write(
        self,
        node: Node,
        host: torch.Tensor,
        ready: Callable[[], None] | None,
        *,
        staging: torch.Tensor | None,
    ) -> bool:
        """Queue ``node``'s pages at ``host`` for storage; False when the writer refuses them.

        ``staging`` is the slots to free once written (a staged write), None for the node's
        own host copy.
        """
        assert self.io is not None
        job = Backup(self.scheme.keys(node.hashes), host, node.id, ready, self.scheme.keys_per_page)
        if not self.io.backup(job):
            return False
        assert node.id not in self._writing  # both callers write a node once at a time
        hashes = frozenset(node.hashes)
        self._writing[node.id] = (node, hashes, staging)
        self._writing_pages += len(hashes)
        if self.write_backlog_tokens > self._backlog_tokens:
            self.io.hurry()  # the host fills with pages waiting for storage faster than it drains
        return True

    def _complete(self, done: BackupDone) -> None:
        """Apply a finished backup: unpin or free its slots, mark stored what is still in the tree.

        A staged write (:meth:`_stage`) frees its staging slots; the others unpin the node's
        host copy.
        """
        ticket = done.backup.ticket
        assert isinstance(ticket, int)
        node, hashes, staging = self._writing.pop(ticket)
        self._writing_pages -= len(hashes)
        if staging is None:
            self.tree.unpin_host(node)
        elif self.host_pool is not None:
            self.host_pool.free(staging)
        pages = len(hashes)
        if not done.stored:
            if done.shed:  # the store was failing: its writer dropped the backup untried
                self.stats.writes_shed += 1
                self.stats.writes_shed_failing += 1
            else:
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
        # Ended on its own: every page storage claimed was tried, the rest failed to read.
        # Cancelled (its reads stopped, or priced out or refused room before any): cut.
        failed = fetch.state is PrefetchState.FINISHED and not fetch.cancelled
        read = fetch.cancel()
        short = max((fetch.hit_pages or 0) - read, 0)
        if failed:
            self.stats.storage_misses += short
        else:
            self.stats.prefetch_pages_cut += short
        anchor = lookup.anchor
        tokens = read * page
        inserted = fresh = 0
        try:
            if tokens:
                assert fetch.host_indices is not None
                got = fetch.host_indices[:tokens]
                result = self.tree.insert_host(
                    anchor,
                    lookup.tokens[lookup.anchor_len : lookup.anchor_len + tokens],
                    got,
                    stored=True,
                )
                inserted = tokens
                if result.existing_len and self.host_pool is not None:
                    if lookup.early is not None:  # its copies may still read these slots
                        lookup.early.synchronize()
                    self.host_pool.free(got[: result.existing_len])
                fresh = tokens - result.existing_len
                self.stats.pages_fetched += read
                self.stats.storage_bytes_read += tokens * self.token_bytes
        finally:  # slots the tree did not take go back with the rest of the fetch's
            self._prefetch_held -= inserted
            if fetch.host_indices is not None:
                fetch.host_indices = fetch.host_indices[inserted:]
            self._drain(fetch)
            self._unpin_anchor(lookup)
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
