"""The tier cache's configuration: page size, policies, thresholds, threads and transfers.

:class:`CacheConfig` is a frozen value checked when built, so a :class:`TierCache
<hicache_storage.engine.cache.TierCache>` never starts on a setting it cannot honour; every
refusal is a :class:`~hicache_storage.errors.ConfigError` naming the setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hicache_storage.config import check_duration
from hicache_storage.errors import ConfigError
from hicache_storage.kit.options import MAX_BYTES, positive_int, share

from .policies import PrefetchPolicy, PrefetchTimeout, WritePolicy
from .storage_io import check_linger, check_nice

__all__ = ["CacheConfig"]


def _positive_int(name: str, value: object) -> None:
    positive_int(name, value, ConfigError)


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
