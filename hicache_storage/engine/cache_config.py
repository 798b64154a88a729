"""The tier cache's configuration: page size, policies, thresholds, threads and transfers.

:class:`CacheConfig` is a frozen value checked when built, so a :class:`TierCache
<hicache_storage.engine.cache.TierCache>` never starts on a setting it cannot honour; every
refusal is a :class:`~hicache_storage.errors.ConfigError` naming the setting by its path
(``write.batch_bytes``). Its settings come in groups, each a frozen value of its own that checks
itself:

- :class:`WriteConfig` (``write``): when pages are backed up, and how the writer batches them;
- :class:`PrefetchConfig` (``prefetch``): when a waiting request's pages are read from storage,
  and how long it waits for them;
- :class:`ThreadConfig` (``threads``): how many storage threads run, and at which priority;
- :class:`TransferConfig` (``transfer``): the pace and SMs of copies between device and host.

A group left out takes its defaults: ``CacheConfig(16, prefetch=PrefetchConfig(
policy=PrefetchPolicy.WAIT_COMPLETE))`` changes the prefetch policy alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hicache_storage.config import check_duration
from hicache_storage.errors import ConfigError
from hicache_storage.kit.options import MAX_BYTES, positive_int, share

from .policies import PrefetchPolicy, PrefetchTimeout, WritePolicy
from .storage_io import check_linger, check_nice

__all__ = ["CacheConfig", "PrefetchConfig", "ThreadConfig", "TransferConfig", "WriteConfig"]


def _positive_int(name: str, value: object) -> None:
    positive_int(name, value, ConfigError)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be a bool, got {value!r}")


def _check_group(name: str, value: object, kind: type) -> None:
    if not isinstance(value, kind):
        raise ConfigError(f"{name} must be a {kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class WriteConfig:
    """When pages computed on the device are backed up, and how the storage writer writes them.

    Attributes
    ----------
    policy
        When pages are backed up (see :class:`~hicache_storage.engine.policies.WritePolicy`).
    backup_after_hits
        Hits after which ``write_through_selective`` backs a page up.
    batch_bytes
        Most bytes a backup writes per storage call (at least one page): background writes
        move a few large pages at a time so that they leave the cores to the forward and the
        reads, and many small pages in one call so that they do not pay a call's overhead each.
    linger_s
        How long an idle writer that wakes for less than a call's worth of pages waits for
        more before it writes (cut short when the writer hurries or closes). Each wake-up
        takes the GIL from the scheduler's thread while it admits and releases requests, and
        the backups of one step arrive one request at a time: on two cores a 20 ms linger
        took the write-through's cost beside a CPU forward from 1.37x to 1.27x of the
        host-only cache's TTFT. 0 writes at once.
    queue
        Most backups queued for storage at once.
    backlog
        Most share of the host pool, in ``(0, 1]``, that pages waiting to be written may hold
        before the writer hurries (:meth:`StorageIO.hurry
        <hicache_storage.engine.storage_io.StorageIO.hurry>`) until its queue drains. Written
        pages are pinned on the host until stored; when prefill produces KV faster than a
        trickling writer stores it, the host fills with them, and the fetches that follow wait
        for writes to make room (measured on the H200: 1.1-2.2 s of a run, and requests priced
        out of their fetches). 1.0 hurries only when making room has to wait. Under the
        planner (``adaptive``) it is also the queue's room: backups waiting behind more than
        this share are shed, oldest first (the planner's ``backlog`` rule).
    """

    policy: WritePolicy = WritePolicy.WRITE_THROUGH
    backup_after_hits: int = 2
    batch_bytes: int = 16 << 20
    linger_s: float = 0.02
    queue: int = 64
    backlog: float = 0.25

    def __post_init__(self) -> None:
        for name in ("backup_after_hits", "batch_bytes", "queue"):
            _positive_int(f"write.{name}", getattr(self, name))
        share("write.backlog", self.backlog, ConfigError)
        check_linger(self.linger_s, "write.linger_s")
        if self.batch_bytes > MAX_BYTES:
            raise ConfigError(f"write.batch_bytes must be at most {MAX_BYTES} (1 PiB)")
        try:
            object.__setattr__(self, "policy", WritePolicy(self.policy))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class PrefetchConfig:
    """When a waiting request's pages are read from storage, and how long it waits for them.

    Attributes
    ----------
    policy, timeout
        When a waiting request stops waiting for its storage prefetch (see
        :class:`~hicache_storage.engine.policies.PrefetchPolicy`). The default, ``adaptive``,
        reads only what reads faster than it computes and waits only while that is cheaper
        than recomputing; ``timeout`` waits up to a deadline grown with the fetch; SGLang's
        default, ``best_effort``, never delays a request and so uses only what arrived
        already.
    threshold
        Fewest pages worth fetching from storage; shorter storage hits are recomputed.
    capacity
        Most host tokens that in-flight prefetches may hold; None for half the host pool.
    read_batch_pages
        Pages per storage read of a prefetch.
    early_loads
        Copy a waiting request's pages to the device as its storage reads return them, into
        free device slots or slots of unlocked pages the host also holds, so that at admission
        only the pages read last are left to load. Such copies are given back when an admission
        needs their room. Off by default: where the forward hides the layer-by-layer load
        (measured on the H200 with an 8B model, 1-3 % of a load was exposed), early
        copies only move the same bytes sooner; turn it on where the bench's exposed load
        share is high (a small model over long prefixes, a slow link).
    """

    policy: PrefetchPolicy = PrefetchPolicy.ADAPTIVE
    timeout: PrefetchTimeout = field(default_factory=PrefetchTimeout)
    threshold: int = 1
    capacity: int | None = None
    read_batch_pages: int = 32
    early_loads: bool = False

    def __post_init__(self) -> None:
        for name in ("threshold", "read_batch_pages"):
            _positive_int(f"prefetch.{name}", getattr(self, name))
        if self.capacity is not None:
            _positive_int("prefetch.capacity", self.capacity)
        _check_bool("prefetch.early_loads", self.early_loads)
        if not isinstance(self.timeout, PrefetchTimeout):
            raise ConfigError("prefetch.timeout must be a PrefetchTimeout")
        try:
            object.__setattr__(self, "policy", PrefetchPolicy(self.policy))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class ThreadConfig:
    """The storage tier's threads: how many run, and how they share the machine with the model.

    Attributes
    ----------
    queries, reads
        Existence queries and prefetch reads in flight at once (a thread each).
    nice
        Niceness of the storage threads and the threads they start (Linux; 0..19): a forward
        on the CPU keeps its cores while storage works in the background (on two cores a write
        beside a forward made it 30 % slower). None leaves them at the process's.
    idle_writes
        Run the background writer under Linux's ``SCHED_IDLE`` (:class:`StorageIO
        <hicache_storage.engine.storage_io.StorageIO>`): it takes only cores nothing else
        wants, where at ``nice`` it still took a share of one from a CPU forward that fills
        them all. Queries and reads, which requests wait on, stay at ``nice``.
    switch_interval_s
        While a storage tier's threads run, the interpreter's thread switch interval is at most
        this (``sys.setswitchinterval``, process-wide; restored by ``close``): at Python's
        5 ms, a storage thread that wants the GIL back after each page's system call waits for
        the scheduler's thread, which launches the model's kernels, so reads and queries crawl.
        None leaves it alone.
    """

    queries: int = 2
    reads: int = 4
    nice: int | None = 10
    idle_writes: bool = True
    switch_interval_s: float | None = 0.0005

    def __post_init__(self) -> None:
        for name in ("queries", "reads"):
            _positive_int(f"threads.{name}", getattr(self, name))
        _check_bool("threads.idle_writes", self.idle_writes)
        check_nice(self.nice, "threads.nice")
        check_duration("threads.switch_interval_s", self.switch_interval_s, allow_none=True)


@dataclass(frozen=True)
class TransferConfig:
    """Copies between the device and host pools on a GPU: their pace and their SMs.

    Attributes
    ----------
    load_max_gbps, backup_max_gbps
        Pace of the L2→L1 and L1→L2 copy kernels on a GPU; None for full speed.
    sms
        Most SMs a copy between the device and host pools occupies on a GPU (the kernel's
        ``sm_budget``); None for the whole GPU. A copy kernel on every SM holds the forward
        beside it back for as long as it runs; a few SMs fill the PCIe link
        (``docs/kernels.md``, *SM confinement*).
    overlap_backups
        Run device→host backups on a side stream beside the forwards (a GPU only). Off, each
        backup runs on the forwards' stream and the next forward waits for it; kept to
        measure the overlap against.
    layer_backups
        Under ``write_through``, copy the pages a forward computes to the host layer by layer
        during that forward, each layer once written, rather than all once the forward is
        done (:mod:`~hicache_storage.engine.layer_backups`). Off by default: with a storage
        tier the host is full of pages waiting for their writes, few copies find room a
        forward ahead, and the rest queue on the backup stream behind copies that wait for
        the forward (``docs/performance.md``, *Never slower: the matrix*).
    """

    load_max_gbps: float | None = None
    backup_max_gbps: float | None = None
    sms: int | None = 16
    overlap_backups: bool = True
    layer_backups: bool = False

    def __post_init__(self) -> None:
        if self.sms is not None:
            _positive_int("transfer.sms", self.sms)
        _check_bool("transfer.overlap_backups", self.overlap_backups)
        _check_bool("transfer.layer_backups", self.layer_backups)
        for name in ("load_max_gbps", "backup_max_gbps"):
            rate = getattr(self, name)
            if rate is not None and (
                isinstance(rate, bool)
                or not isinstance(rate, int | float)
                or not 0 < rate < math.inf
            ):
                raise ConfigError(
                    f"transfer.{name} must be a positive finite number or None, got {rate!r}"
                )


@dataclass(frozen=True)
class CacheConfig:
    """Sizes and policies of a :class:`TierCache <hicache_storage.engine.cache.TierCache>`.

    Attributes
    ----------
    page_size
        Tokens per page, the unit of every tier.
    prefix_cache
        Reuse cached prefixes at all; False makes the no-cache baseline (every token computed).
    write
        When pages are backed up, and how the writer batches them (:class:`WriteConfig`).
    prefetch
        When pages are read from storage, and how long a request waits (:class:`PrefetchConfig`).
    threads
        The storage threads: how many, at which priority (:class:`ThreadConfig`).
    transfer
        Copies between the device and host pools (:class:`TransferConfig`).
    close_timeout_s
        Most seconds :meth:`TierCache.close
        <hicache_storage.engine.cache.TierCache.close>` waits for queued writes and storage
        calls in flight. A thread still in a backend call then is abandoned: it applies
        nothing when the call returns and exits; backups not written by then count as failed.
    """

    page_size: int
    prefix_cache: bool = True
    write: WriteConfig = field(default_factory=WriteConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    threads: ThreadConfig = field(default_factory=ThreadConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    close_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _positive_int("page_size", self.page_size)
        _check_group("write", self.write, WriteConfig)
        _check_group("prefetch", self.prefetch, PrefetchConfig)
        _check_group("threads", self.threads, ThreadConfig)
        _check_group("transfer", self.transfer, TransferConfig)
        check_duration("close_timeout_s", self.close_timeout_s)
