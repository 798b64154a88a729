"""Prefetches: the storage reads of waiting requests, from existence query to host slots.

:class:`Prefetches` starts a waiting request's existence query (:meth:`~Prefetches.start`),
gives host slots to the fetches whose query answered and hands them to the read threads
(:meth:`~Prefetches.assign_slots`), within a cap on the host room in-flight fetches may hold.
At admission it stops the fetch and puts the pages read in the tree (:meth:`~Prefetches.finish`);
the slots of a stopped fetch go back once its last read has returned. What to read and how long
a request waits is the prefetch policy's
(:class:`~hicache_storage.engine.fetch_decisions.FetchDecisions`).
"""

from __future__ import annotations

from .copies import CopiesInFlight
from .early_loads import EarlyLoads
from .fetch_decisions import FetchDecisions
from .leases import Lookup
from .nodes import MatchResult, Tier
from .storage_jobs import Prefetch, PrefetchState
from .tiers import Tiers
from .transfers import Transfers
from .writes import StorageWrites

__all__ = ["Prefetches"]

_INLINE_QUERY_S = 0.001
"""Existence queries measured this quick (or within 2 % of a forward) are asked in the
scheduler's thread: the answer comes with no hand-over to a query thread, so a request whose
pages storage does not hold is scheduled at once."""


class Prefetches:
    """The fetches in flight, and the host room they hold.

    Parameters
    ----------
    tiers
        The cache's shared state.
    decisions
        The prefetch policy's: whether a fetch is worth reading, how long its request waits.
    copies
        Copies in flight: a fetch's reads wait for the copies still landing in its slots.
    transfers
        Puts a request's matched prefix on the host, where fetched pages hang below it.
    writes
        Host room for the fetched pages.
    early
        Early loads of the fetched pages, for waiting requests.
    """

    def __init__(
        self,
        tiers: Tiers,
        decisions: FetchDecisions,
        copies: CopiesInFlight,
        transfers: Transfers,
        writes: StorageWrites,
        early: EarlyLoads,
    ) -> None:
        self.tiers = tiers
        self.decisions = decisions
        self.copies = copies
        self.transfers = transfers
        self.writes = writes
        self.early = early
        config, host_pool = tiers.config, tiers.host_pool
        capacity = config.prefetch.capacity
        if capacity is None and host_pool is not None:
            capacity = max(config.page_size, host_pool.size // 2)
        self.capacity = capacity or 0
        """Most host tokens that in-flight prefetches may hold."""
        self.held = 0
        """Host tokens the in-flight prefetches hold."""
        self._fetching: list[tuple[Prefetch, Lookup]] = []
        self._draining: list[Prefetch] = []

    def start(self, lookup: Lookup, match: MatchResult) -> None:
        """Start asking storage for the pages after ``match`` when enough of them may be there.

        Only the existence query starts here: nothing is copied to the host, pinned or
        allocated for a request until storage is known to hold its pages
        (:meth:`assign_slots`), so a prefetch that finds nothing costs the host no room.
        """
        tiers = self.tiers
        page = tiers.page_size
        pages = len(match.remainder) // page
        if tiers.io is None or pages < tiers.config.prefetch.threshold:
            return
        if self.decisions.bypassed():  # nothing it holds could pay: not worth asking
            tiers.stats.prefetches += 1
            tiers.stats.prefetch_priced_out += 1
            return
        keys = tiers.scheme.keys(match.remainder_hashes)
        fetch = Prefetch(keys, tiers.scheme.keys_per_page, None, page)
        lookup.fetch = fetch
        self._fetching.append((fetch, lookup))
        tiers.stats.prefetches += 1
        query_s = tiers.costs.query_s
        forward_s = tiers.costs.forward_s or 0.0
        quick = query_s is not None and query_s <= max(_INLINE_QUERY_S, 0.02 * forward_s)
        tiers.io.prefetch(fetch, inline=quick)

    def start_reads(self) -> None:
        """Start the reads of fetches whose query answered, between two layers of a forward.

        See :meth:`TierCache.start_reads <hicache_storage.engine.cache.TierCache.start_reads>`:
        a fetch whose matched prefix is not on the host yet waits for the step.
        """
        if self.tiers.io is not None and any(
            fetch.state is PrefetchState.QUERIED for fetch, _ in self._fetching
        ):
            self.assign_slots(between_layers=True)

    def assign_slots(self, *, between_layers: bool = False) -> None:
        """Give host slots to the prefetches whose existence query answered, within the cap.

        Slots are taken only for the pages storage holds, so a prefetch that finds nothing
        never evicts a host page; the request's matched prefix is put on the host and pinned
        then (the fetched pages hang below it). A fetch the policy finds not worth reading
        (under ``adaptive``: its reads, those queued ahead included, would take longer than
        recomputing its pages) reads nothing. ``between_layers`` (:meth:`start_reads`) leaves
        for the next step a fetch that would need a copy to the host or a write to make room.
        """
        if not self._fetching:
            self.early.load()
            return
        tiers, decisions = self.tiers, self.decisions
        stats = tiers.stats
        page = tiers.page_size
        waiting: list[tuple[Prefetch, Lookup]] = []
        probing = decisions.probing()
        for fetch, lookup in self._fetching:
            state = fetch.state
            if state is PrefetchState.QUERYING or (probing and state is PrefetchState.QUERIED):
                waiting.append((fetch, lookup))
                continue
            if state is not PrefetchState.QUERIED:
                continue
            room = (self.capacity - self.held) // page
            hits = fetch.hit_pages or 0
            pages = min(hits, room)
            if pages < hits and decisions.waits_for_capacity(hits, self.held, self.capacity):
                waiting.append((fetch, lookup))  # the fetches ahead hand their slots back
                continue
            if between_layers and not (
                lookup.pinned or lookup.anchor.is_root or Tier.HOST in lookup.anchor.tiers
            ):
                waiting.append((fetch, lookup))
                continue
            if pages < tiers.config.prefetch.threshold:
                stats.prefetch_no_room += pages < hits  # else too short to be worth it
                fetch.cancel()
                continue
            if not decisions.worth_reading(pages):
                stats.prefetch_priced_out += 1
                fetch.cancel()
                continue
            if not self._pin_anchor(lookup):
                stats.prefetch_no_room += 1
                fetch.cancel()
                continue
            waited = stats.host_room_wait_s
            host = self.writes.alloc_host(pages * page, stored_only=between_layers)
            stats.fetch_room_wait_s += stats.host_room_wait_s - waited
            if host is None and between_layers:
                waiting.append((fetch, lookup))  # the anchor stays pinned for the step
                continue
            if host is None:
                stats.prefetch_no_room += 1
                fetch.cancel()
            elif fetch.assign(host, ready=self.copies.copies_into(host)):
                self.held += host.numel()
                decisions.reading.append(fetch)
                self.early.watch(lookup)
                assert tiers.io is not None
                tiers.io.read(fetch)
                probing = decisions.probing()
            elif tiers.host_pool is not None:
                tiers.host_pool.free(host)
        self._fetching = waiting
        self.early.load()

    def ready(self, lookup: Lookup, *, block_s: float, next_step_s: float) -> bool:
        """Whether the prefetch policy lets the request be scheduled now.

        See :meth:`TierCache.ready <hicache_storage.engine.cache.TierCache.ready>`.
        """
        fetch = lookup.fetch
        io = self.tiers.io
        if fetch is None or (io is not None and not io.alive):
            return True
        if fetch.state is PrefetchState.FINISHED:  # read all it will: no policy holds it back
            return True
        return self.decisions.ready(
            fetch, self.assign_slots, block_s=block_s, next_step_s=next_step_s
        )

    def _pin_anchor(self, lookup: Lookup) -> bool:
        """Put the request's matched prefix on the host and pin it; False if it is gone."""
        anchor = lookup.anchor
        if lookup.pinned or anchor.is_root:
            return True
        if not anchor.in_tree or not self.transfers.on_host(anchor):
            return False
        self.tiers.tree.pin_host(anchor)
        lookup.pinned = True
        return True

    def _unpin_anchor(self, lookup: Lookup) -> None:
        if lookup.pinned:
            lookup.pinned = False
            self.tiers.tree.unpin_host(lookup.anchor)

    def finish(self, lookup: Lookup) -> int:
        """Stop a request's prefetch and put the pages it read on the host; return their tokens.

        Only the pages the tree did not hold already count.
        """
        fetch = lookup.fetch
        if fetch is None:
            return 0
        lookup.fetch = None
        tiers = self.tiers
        stats = tiers.stats
        page = tiers.page_size
        # A read came back short or raised: the store failed to deliver the rest, whether the
        # fetch then ended on its own or was cancelled while its other batches were in flight
        # (a store judged failing meanwhile). Cancelled with no such read (priced out, refused
        # room, its request gone): cut.
        failed = fetch.stopped
        read = fetch.cancel()
        short = max((fetch.hit_pages or 0) - read, 0)
        if failed:
            stats.storage_misses += short
        else:
            stats.prefetch_pages_cut += short
        anchor = lookup.anchor
        tokens = read * page
        inserted = fresh = 0
        try:
            if tokens:
                assert fetch.host_indices is not None
                got = fetch.host_indices[:tokens]
                result = tiers.tree.insert_host(
                    anchor,
                    lookup.tokens[lookup.anchor_len : lookup.anchor_len + tokens],
                    got,
                    stored=True,
                )
                inserted = tokens
                if result.existing_len and tiers.host_pool is not None:
                    if lookup.early is not None:  # its copies may still read these slots
                        lookup.early.synchronize()
                    tiers.host_pool.free(got[: result.existing_len])
                fresh = tokens - result.existing_len
                stats.pages_fetched += read
                stats.storage_bytes_read += tokens * tiers.token_bytes
        finally:  # slots the tree did not take go back with the rest of the fetch's
            self.held -= inserted
            if fetch.host_indices is not None:
                fetch.host_indices = fetch.host_indices[inserted:]
            self._drain(fetch)
            self._unpin_anchor(lookup)
        return fresh

    def cancel(self, lookup: Lookup) -> None:
        """Stop a request's prefetch, reading nothing more; its slots go back once drained."""
        fetch = lookup.fetch
        if fetch is None:
            return
        lookup.fetch = None
        fetch.cancel()
        self._drain(fetch)
        self._unpin_anchor(lookup)

    def _drain(self, fetch: Prefetch) -> None:
        """Free a stopped prefetch's remaining host slots, once its last read has returned."""
        self._draining.append(fetch)
        self.reap()

    def reap(self) -> None:
        """Free the host slots of stopped prefetches whose last read has returned."""
        host_pool = self.tiers.host_pool
        still: list[Prefetch] = []
        for fetch in self._draining:
            if fetch.state is PrefetchState.FINISHED:
                host = fetch.host_indices
                if host is not None and host.numel() and host_pool is not None:
                    host_pool.free(host)
                    self.held -= host.numel()
            else:
                still.append(fetch)
        self._draining = still
