"""The prefetch policy's decisions: what to read from storage, how long to wait, when to write.

Each :class:`~hicache_storage.engine.policies.PrefetchPolicy` decides through one object,
:func:`decisions_for` picks its class:

- :class:`FetchDecisions`, SGLang's three policies (``best_effort``, ``wait_complete``,
  ``timeout``): every page storage holds is read, a request waits as the policy's deadline says
  (:func:`~hicache_storage.engine.policies.prefetch_done_waiting`), and the store is always
  asked and written (SGLang's own controller, the baseline the bench compares against);
- :class:`AdaptiveDecisions`, ``adaptive``: the cache's planner weighs reading against
  recomputing (:meth:`Planner.fetchable <hicache_storage.planner.Planner.fetchable>`, which
  counts each decision by its rule, and :func:`~hicache_storage.planner.fetch.adaptive_wait_s`
  while a fetch runs), its back-pressure decides which backups the storage writer makes
  (:meth:`Planner.offer <hicache_storage.planner.Planner.offer>`,
  :attr:`FetchDecisions.plans_writes`), and a store that fails or reads far slower than
  compute is left alone (:func:`~hicache_storage.engine.health.bypass`).

Both price against the reads in flight (:attr:`FetchDecisions.reading`): the pages queued ahead
of a fetch, and the slowest call so far while the store is unmeasured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from hicache_storage.planner.fetch import FetchView, adaptive_wait_s, fetch_pays

from .health import Bypass, bypass
from .policies import PrefetchPolicy, prefetch_done_waiting
from .storage_jobs import Prefetch, PrefetchState
from .tiers import Tiers

__all__ = ["AdaptiveDecisions", "FetchDecisions", "decisions_for"]


class FetchDecisions:
    """The decisions of SGLang's prefetch policies, and the read queue every policy prices by.

    Parameters
    ----------
    tiers
        The cache's shared state: its config (the policy, its timeout, the page size), costs
        and storage threads.
    """

    sheds_failing: ClassVar[bool] = False
    """Whether the storage writer drops the backups queued while the store is failing."""

    plans_writes: ClassVar[bool] = False
    """Whether the planner decides which backups the storage writer makes (its back-pressure
    sheds what the store cannot absorb); else every backup queued is written."""

    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        self.reading: list[Prefetch] = []
        """Fetches given host slots and handed to the read threads, oldest first."""

    # -- what the policy decides ------------------------------------------------------------------

    def worth_reading(self, pages: int) -> bool:
        """Whether a fetch whose query found ``pages`` pages should read them (every one here)."""
        return True

    def waits_for_capacity(self, pages: int, held: int, capacity: int) -> bool:
        """Whether a fetch of ``pages`` waits for prefetch capacity held by others (never here).

        ``held`` host tokens of the ``capacity`` are held by the fetches in flight.
        """
        return False

    def probing(self) -> bool:
        """Whether reads wait for the first one to measure the store (never here)."""
        return False

    def bypass(self) -> Bypass | None:
        """Why storage is left alone now, or None (never here: every page is asked and written)."""
        return None

    def bypassed(self) -> bool:
        """Whether storage is left alone now: nothing is asked or written (:meth:`bypass`)."""
        return self.bypass() is not None

    def ready(
        self,
        fetch: Prefetch,
        assign: Callable[[], None],
        *,
        block_s: float,
        next_step_s: float,
    ) -> bool:
        """Whether a request whose ``fetch`` still reads may be scheduled now.

        Under SGLang's policies their deadline decides
        (:func:`~hicache_storage.engine.policies.prefetch_done_waiting`). ``assign`` gives host
        slots to the fetches whose query answered; ``block_s`` and ``next_step_s`` are
        :meth:`TierCache.ready <hicache_storage.engine.cache.TierCache.ready>`'s.
        """
        config = self.tiers.config
        return prefetch_done_waiting(
            config.prefetch.policy,
            config.prefetch.timeout,
            finished=False,
            pages=fetch.target_pages,
            elapsed_s=time.monotonic() - fetch.started,
        )

    # -- what every policy prices by --------------------------------------------------------------

    def writes_pay(self) -> bool:
        """Whether a written page could pay for a wait: it reads back faster than it computes.

        Waiting for writes to free host room stalls every running request (the scheduler's
        thread waits), for pages that pay only when a later request reads them instead of
        computing them. Priced as one page's fetch
        (:func:`~hicache_storage.planner.fetch.fetch_pays`: the measured read rate, or the
        slowest read in flight so far); True while the store is unmeasured, and again once a
        slow spell is forgotten. Measured on two cores with a store made slow (1 s a
        read), the waits were half of what serving with storage cost over the host alone.
        """
        return fetch_pays(
            1,
            self.tiers.page_size,
            0.0,
            self.tiers.costs,
            in_flight_s_per_page=self.in_flight_s_per_page(),
        )

    def queued_pages(self, fetch: Prefetch | None) -> float:
        """Pages read before ``fetch``'s (None: a fetch started now): the rest of those ahead.

        The read threads take the oldest fetch's batches first, so the pages ahead are read at
        the store's whole rate (:attr:`CostModel.read_s_per_page
        <hicache_storage.planner.rates.CostModel.read_s_per_page>`) before this fetch's.
        """
        still: list[Prefetch] = []
        ahead = 0
        for other in self.reading:
            if other.state is PrefetchState.FINISHED:
                continue
            still.append(other)
            if other is fetch:
                break
            ahead += other.target_pages - other.read_pages
        else:
            self.reading = still
        return float(ahead)

    def queued_ahead(self, fetch: Prefetch, state: PrefetchState) -> float:
        """Pages read before ``fetch``'s: none once it finished or while it is asking."""
        if state is PrefetchState.READING:
            return self.queued_pages(fetch)
        if state is PrefetchState.QUERIED:
            return self.queued_pages(None)
        return 0.0

    def in_flight_s_per_page(self) -> float:
        """Seconds per page so far of the slowest read call in flight, at the store's whole rate.

        The calls in flight run side by side, so the slowest one's seconds per page are shared
        among them; 0 when none runs.
        """
        slowest = 0.0
        for fetch in self.reading:
            call_s, call_pages = fetch.call
            if call_pages:
                slowest = max(slowest, call_s / call_pages)
        return slowest / self.calls_in_flight()

    def calls_in_flight(self) -> int:
        """Read calls running now (at least one, to share a call's time among)."""
        io = self.tiers.io
        return 1 if io is None else max(1, io.reads_in_flight)

    def view(self, fetch: Prefetch) -> FetchView:
        """Return what the planner is told of ``fetch`` and of the reads ahead of it."""
        state = fetch.state
        call_s, call_pages = fetch.call
        call_s /= self.calls_in_flight()  # the store's whole rate, as the calls share it
        return FetchView(
            queried=state is not PrefetchState.QUERYING,
            finished=state is PrefetchState.FINISHED,
            target_pages=fetch.target_pages,
            read_pages=fetch.read_pages,
            elapsed_s=time.monotonic() - fetch.started,
            call_s=call_s,
            call_pages=call_pages,
            queued_pages=self.queued_ahead(fetch, state),
            in_flight_s_per_page=self.in_flight_s_per_page(),
        )


class AdaptiveDecisions(FetchDecisions):
    """The ``adaptive`` policy: read only what pays, wait only while waiting is cheaper.

    Its store is left alone while it fails or reads pages back far slower than they compute
    (:meth:`bypass`), and its writer then drops the backups queued for it.
    """

    sheds_failing: ClassVar[bool] = True
    plans_writes: ClassVar[bool] = True

    def writes_pay(self) -> bool:
        """Whether a wait for writes could pay: reads pay, and the store keeps up with its writer.

        Besides the read rate (:meth:`FetchDecisions.writes_pay`), the planner's back-pressure
        measures the writer's seconds a page between its offers, outside the writes, against
        the store's seconds a page written (:class:`~hicache_storage.planner.WriteGate`), and
        sheds the share of the offers the store cannot absorb. Only while the store keeps up
        are the writes ahead of a wait done at the rate they came; otherwise the pages waiting
        are shed as the writer comes to them, or written behind a call slower than their
        coming, and a wait would hold every running request for that call, where an L1+L2
        cache waits for none. Unmeasured (before its first write returned), the store is not
        waited for: a store of unknown speed holds the scheduler for none of its first calls.
        A writer without the planner (:attr:`StorageIO.planner
        <hicache_storage.engine.storage_io.StorageIO.planner>` None) writes every backup, and
        is waited for as under SGLang's policies.
        """
        io = self.tiers.io
        if io is not None and io.planner is not None:
            gate = io.planner.gate.stats()
            produce, write = gate["produce_s_per_page"], gate["write_s_per_page"]
            if not (isinstance(produce, float) and isinstance(write, float) and produce >= write):
                return False
        return super().writes_pay()

    def worth_reading(self, pages: int) -> bool:
        """Whether reading ``pages`` pages (reads queued ahead included) beats recomputing them.

        The planner decides (:meth:`Planner.fetchable
        <hicache_storage.planner.Planner.fetchable>`), counting the pages by its rule.
        """
        plan = self.tiers.planner.fetchable(
            pages,
            queued_pages=self.queued_pages(None),
            in_flight_s_per_page=self.in_flight_s_per_page(),
        )
        return plan.pages > 0

    def waits_for_capacity(self, pages: int, held: int, capacity: int) -> bool:
        """Whether a fetch of ``pages`` should wait for prefetch capacity.

        Capacity held by other fetches comes back as they finish; a fetch that would fit in
        it waits for it (its request waits only while that is cheaper than recomputing, the
        queue ahead counted) instead of reading a part or nothing and recomputing the rest.
        """
        return held > 0 and pages * self.tiers.page_size <= capacity

    def probing(self) -> bool:
        """Whether reads wait for the first one to measure the store.

        Until a read has returned, the store's speed is unknown: one fetch reads, and the
        others keep their queries' answers without host slots until it returns or its time
        so far prices them out. A store that takes a second a call then holds one fetch's
        slots for that second, not every read thread's.
        """
        return self.tiers.costs.read_s_per_page is None and any(
            fetch.state is not PrefetchState.FINISHED for fetch in self.reading
        )

    def bypass(self) -> Bypass | None:
        """Why storage is left alone now (:func:`~hicache_storage.engine.health.bypass`), or None.

        Nothing is asked or written while it fails or reads pages back far slower than they
        compute.
        """
        return bypass(self.tiers.costs, self.tiers.page_size, self.in_flight_s_per_page())

    def ready(
        self,
        fetch: Prefetch,
        assign: Callable[[], None],
        *,
        block_s: float,
        next_step_s: float,
    ) -> bool:
        """Whether waiting longer for ``fetch`` costs more than recomputing what has not arrived.

        The caller may block up to ``block_s`` for a fetch about to arrive (the scheduler does
        when the wait is short against a forward); otherwise the request waits for a later
        step, ``next_step_s`` from now.
        """
        deadline = time.monotonic() + block_s
        while True:
            assign()
            left = deadline - time.monotonic()
            eta = adaptive_wait_s(
                self.view(fetch),
                self.tiers.costs,
                page_size=self.tiers.page_size,
                block_s=max(left, 0.0),
                next_step_s=next_step_s,
            )
            if eta is None:
                return True
            if eta >= left:
                return False
            fetch.wait_change(min(max(eta, 0.0005), left))


def decisions_for(policy: PrefetchPolicy) -> type[FetchDecisions]:
    """Return the class that decides for ``policy``: ``adaptive``'s, or SGLang's three's."""
    return AdaptiveDecisions if policy is PrefetchPolicy.ADAPTIVE else FetchDecisions
