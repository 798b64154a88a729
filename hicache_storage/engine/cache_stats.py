"""The counters of what a tier cache served and moved (:class:`CacheStats`).

One :class:`CacheStats` per cache, changed only on the scheduler's thread by the cache's parts;
the bench and the conformance checks read it once a run is over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CacheStats"]


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
    pages_backed_up_by_layer: int = 0
    """Pages of ``pages_backed_up`` copied during the forward that computed them, layer by layer
    (:mod:`~hicache_storage.engine.layer_backups`)."""
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
    than it is computed, so no write is worth a wait (``FetchDecisions.writes_pay``)."""
    writes_shed: int = 0
    """Write-throughs (and writes of evicted host pages) not made under ``adaptive`` while the
    store was bypassed (``FetchDecisions.bypassed``), and queued backups the writer dropped."""
    writes_shed_failing: int = 0
    """Of ``writes_shed``, those shed because the store was failing (its recent calls delivered
    nothing); the rest, because it read back far slower than recompute."""
    backup_pages_shed: dict[str, int] = field(default_factory=dict)
    """Pages of backups the planner's back-pressure shed (:meth:`Planner.offer
    <hicache_storage.planner.Planner.offer>`), by the rule that shed them: ``backlog`` (more
    pages waited in the writer's queue behind them than its room), ``failing`` (its last writes
    stored nothing), ``unread`` (reading a page back costs more than computing it) or
    ``probe`` (a write measuring the store was in flight). Each was released unwritten at once,
    as a failed write is: not counted in ``backups_failed``."""
    slots_behind_backups: int = 0
    """Device slots a forward reused while a device→host backup still read them: the forward
    waits on the GPU for that copy (:meth:`CopiesInFlight.release_device
    <hicache_storage.engine.copies.CopiesInFlight.release_device>`). Where the device pool is
    full of admitted requests, the page just released is the only room, and its backup sits in
    front of the next forward."""
    calls_abandoned: int = 0
    """Storage threads still in a backend call when ``close`` stopped waiting for them
    (``CacheConfig.close_timeout_s``)."""
