"""The planner as vLLM's tier uses it: which stored chunks a lookup hits, which chunks are written.

:class:`TierPlanner` holds one :class:`~hicache_storage.planner.Planner` for a
:class:`~hicache_storage.integrations.vllm.HiCacheTier` and what it measures for it:

- lookups (vLLM's lookup thread): the existence query's time and hits, then
  :meth:`~hicache_storage.planner.Planner.fetchable` over the leading stored chunks, with the
  chunks of the loads in flight read first and the slowest of those loads' seconds so far per
  chunk; the tier answers HIT for the chunks it returns and MISS for the rest (vLLM recomputes
  them), every decision counted by its rule in :meth:`stats`;
- loads (the tier's read threads): every ``batch_get_v1`` call, its chunks delivered over its
  seconds shared by the calls that ran beside it (the store's whole rate), a call that delivered
  nothing a failure;
- the probe (:meth:`probe`): when the tier starts, reads of a key never stored, timed, so that
  a slow store is priced before the first request would wait on it. The planner prices a page
  at a probe's round trip (:meth:`~hicache_storage.planner.Planner.probe`); two things differ
  under vLLM. vLLM reads all of a request's stored chunks in one call, so one round trip is
  spread over the chunks a fetch reads; priced a chunk each, a store slower to answer than a
  chunk is to compute would be neither read nor written (the planner sheds the writes of a
  store whose reads do not pay). And a price given at start-up is forgotten after
  :data:`~hicache_storage.planner.rates.READ_TTL_S`, often before the first request of a server
  that starts its API after its engine, while until then it would shed the writes of a store
  that holds nothing yet. So the round trip waits for the first lookup that finds stored
  chunks and is given to the planner spread over them: the least a fetch of them in one call
  takes. A load that returned before then supersedes it;
- stores: each step's store jobs offered in one call
  (:meth:`~hicache_storage.planner.Planner.offer`), the outcome of the admitted write reported
  (:meth:`~hicache_storage.planner.Planner.done`);
- prefill: what recomputing costs, from
  :class:`~hicache_storage.integrations.vllm.prefill.PrefillClock`.

vLLM's back-pressure detector of the tier reports the planner's shedding
(:class:`~hicache_storage.integrations.vllm.pressure.PlannerPressure`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_storage.planner import Planner, WritePlan

from .prefill import PrefillClock

__all__ = ["PROBE_READS", "ReadCall", "TierPlanner"]

PROBE_READS = 3
"""Timed reads of the probe: the fewest whose median passes over one stalled read."""


@dataclass(eq=False)
class ReadCall:
    """A read call running: when it began, its chunks, the calls beside it.

    A probe reads no chunk (``pages`` 0) and makes several round trips, ``done`` of them so far.
    """

    began: float
    pages: int
    beside: int
    done: int = 0


class TierPlanner:
    """The tier's planner and its measurements (see the module docstring); thread-safe.

    Parameters
    ----------
    planner
        The planner (its ``page_tokens`` a chunk's tokens).
    prefill
        The clock that feeds it forwards.
    clock
        Monotonic seconds.
    """

    def __init__(
        self,
        planner: Planner,
        prefill: PrefillClock,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.planner = planner
        self.prefill = prefill
        self._clock = clock
        self._lock = threading.Lock()
        self._queued = 0  # chunks of loads submitted and not yet started
        self._running: list[ReadCall] = []
        self._round_trip: float | None = None  # the probe's, until a lookup spends it
        self._probe_s: float | None = None  # the probe's, for stats
        self._read = False  # a load has returned: the probe is superseded

    # -- lookups (vLLM's lookup thread) ---------------------------------------------------------

    def fetchable(self, keys: Sequence[str], found: int, query_s: float) -> int:
        """How many of the ``found`` leading stored chunks of ``keys`` to fetch (all or none)."""
        self.planner.query(query_s, asked=len(keys), found=found)
        self.planner.seen(keys)
        if found > 0:
            with self._lock:
                round_trip, self._round_trip = self._round_trip, None
            if round_trip is not None:
                self.planner.probe(round_trip / found)
        queued, slowest = self._reads_ahead(found)
        plan = self.planner.fetchable(found, queued_pages=queued, in_flight_s_per_page=slowest)
        return plan.pages

    def _reads_ahead(self, found: int) -> tuple[float, float]:
        """Chunks read before a fetch of ``found`` decided now, and the slowest call's pace.

        The read threads take loads in order, so every chunk submitted before is read first;
        the calls in flight share the store, so the slowest one's seconds so far per chunk are
        shared among them (0 when none runs). A probe in flight reads no chunk: its seconds so
        far over its round trips begun (at most one of them each) are spread over the ``found``
        chunks, as its round trip will be.
        """
        now = self._clock()
        with self._lock:
            queued = self._queued + sum(call.pages for call in self._running)
            slowest = max(
                (
                    (now - c.began) / (c.pages or (c.done + 1) * max(found, 1))
                    for c in self._running
                ),
                default=0.0,
            )
            calls = max(len(self._running), 1)
        return float(queued), slowest / calls

    # -- reads (submitted on the scheduler thread, run on the tier's read threads) ------------

    def queue_read(self, pages: int) -> None:
        """Count a load of ``pages`` chunks submitted (read after those before it)."""
        with self._lock:
            self._queued += pages

    def begin_read(self, pages: int, *, queued: bool = True) -> ReadCall:
        """Start a read call of ``pages`` chunks (``queued``: counted by :meth:`queue_read`)."""
        with self._lock:
            if queued:
                self._queued -= pages
            call = ReadCall(self._clock(), pages, len(self._running) + 1)
            self._running.append(call)
        return call

    def end_read(self, call: ReadCall, delivered: int) -> None:
        """End ``call``, ``delivered`` of its chunks read (0: a failure), and report its rate."""
        seconds = self._clock() - call.began
        with self._lock:
            self._running.remove(call)
            beside = (call.beside + len(self._running) + 1) / 2
            self._read, self._round_trip = True, None
        self.planner.read(delivered, seconds / beside)

    def probe(self, read: Callable[[], object]) -> None:
        """Time ``read`` (of a key never stored): the store's round trip, for the first fetch.

        A client's first call pays its connection's set-up (an S3 client's can take longer than
        hundreds of round trips), which no later read pays, so the first read is not timed; the
        round trip is the median of the :data:`PROBE_READS` after it, which passes over one
        read stalled behind other threads on a busy CPU. While it runs it is a read call in
        flight whose seconds so far over the round trips it has begun are at most their mean,
        so a lookup meanwhile sees a store that has not answered for longer than computing
        costs as slow before it answers.
        """
        samples = []
        call = self.begin_read(0, queued=False)
        try:
            for timed in [False] + [True] * PROBE_READS:
                began = self._clock()
                read()
                if timed:
                    samples.append(self._clock() - began)
                with self._lock:
                    call.done += 1
        finally:
            with self._lock:
                self._running.remove(call)
                if samples:
                    self._probe_s = statistics.median(samples)
                    if not self._read:
                        self._round_trip = self._probe_s

    # -- writes ---------------------------------------------------------------------------------

    def offer(self, keys: Sequence[str]) -> WritePlan:
        """Which of a step's chunks under ``keys`` to write (never blocks)."""
        return self.planner.offer(keys)

    def done(self, plan: WritePlan, stored: int) -> None:
        """Report an admitted write that returned with ``stored`` chunks stored."""
        self.planner.done(plan, stored)

    def write_s_per_page(self) -> float | None:
        """Return the store's measured seconds a chunk takes to write (None unmeasured)."""
        return self.planner.costs.write_s_per_page

    def stats(self) -> dict[str, Any]:
        """Return the planner's decisions by rule, its measured rates, and the probe's.

        ``probe_s`` is the store's round trip the probe measured (None until it has).
        """
        with self._lock:
            probe_s = self._probe_s
        return {**self.planner.stats(), "probe_s": probe_s}
