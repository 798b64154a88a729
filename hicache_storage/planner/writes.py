"""Back-pressure: a write is admitted only while the store absorbs what the caller offers.

A write to the storage tier is never what a request waits for: the pages it holds on the host
(pinned until stored), the thread it occupies (SGLang's backup thread, vLLM's store jobs, the
engine's writer) and the calls queued behind it are all room and time that serving needs. So the
gate answers every offer at once, admitted or shed with the rule that decided, and never blocks:
what the store cannot absorb is dropped (counted, with its reason), not queued in front of
compute. Its rules, in the order they are asked:

``failing``
    The last :data:`~hicache_storage.planner.rates.READ_SAMPLES` admitted writes all stored
    nothing: every offer is shed, except one probe each
    :data:`~hicache_storage.planner.rates.READ_TTL_S`, whose success lifts it.
``probe``
    The store's write rate is unmeasured (no write stored anything lately): one call is admitted
    at a time, so a store of unknown speed holds at most one call's pages while it is measured.
``backlog``
    For a caller that tells the gate its queue (``queued``: pages waiting behind this offer,
    each holding a host page until written or shed, and ``room``: how many such pages it lets
    the queue hold): admitted while ``queued <= room``, shed otherwise. Every page shed this
    way leaves the oldest end of a queue longer than its room, so the queue stays within it,
    and the store is never left idle while pages wait: a burst larger than the store's rate
    is written as fast as the store writes, within the room, instead of being thinned to that
    rate while it arrives (which stores less and holds no less room).
``absorb``
    For a caller whose queue is its own (an engine's backup thread calling the store itself):
    a queue whose arrivals outpace its service grows without bound. The store serves at its
    measured seconds a page (:attr:`CostModel.write_s_per_page
    <hicache_storage.planner.rates.CostModel.write_s_per_page>`, a call's time shared by the
    calls beside it); the caller offers at its own measured seconds a page, counting only the
    time it spent outside the writes this gate admitted, since the gate was made or its last
    offer (a caller whose offers come back to back has writes queued, and offers as fast as it
    is answered). The gate admits the share of
    offered pages the store can write in the time the caller takes to make them,
    ``produce / write`` (at most all), through a credit that each offered page adds its share
    to and each admitted page spends: an offer is admitted once the credit covers all its
    pages, so no more is admitted than the store absorbs, whatever the offers' sizes (a large
    offer is admitted on the credit the small ones beside it left). The credit stays below the
    largest offer's pages (an offer it covers is admitted and spends it), so the burst it
    banks is at most one offer, and it is dropped whenever the store keeps up.

Nothing here is a tuned constant: the rates are measured, and the two counts are the rates'
own (:mod:`~hicache_storage.planner.rates`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .rates import READ_SAMPLES, READ_TTL_S, CostModel

__all__ = ["WriteGate", "WriteTicket"]

_WEIGHT = 0.25
"""Weight of a new offer in the caller's rate, the rates' own default
(:class:`~hicache_storage.planner.rates.CostModel`): the rate is decayed seconds over decayed
pages, so one operation split into calls back to back (SGLang writes 128 pages a call) counts
as its pages made in the time before the first call, not as a caller with a queue."""


@dataclass(frozen=True)
class WriteTicket:
    """The gate's answer to one offer.

    Attributes
    ----------
    admitted
        Write the pages; report the outcome with :meth:`WriteGate.done`.
    pages
        Pages offered.
    rule
        The rule that decided: ``failing``, ``probe``, ``backlog`` or ``absorb`` (see the
        module).
    reason
        One line saying why, with the rates it weighed.
    started
        The gate's clock when it answered.
    """

    admitted: bool
    pages: int
    rule: str
    reason: str
    started: float = 0.0


class WriteGate:
    """Admits or sheds writes from measured rates; thread-safe, never blocks.

    Parameters
    ----------
    costs
        The measured rates it reads and feeds (:meth:`done` records each admitted write).
    clock
        Monotonic seconds; a simulated clock in tests.
    """

    def __init__(
        self, costs: CostModel | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.costs = costs if costs is not None else CostModel(clock=clock)
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since: float | None = None
        self._busy_s = 0.0
        self._last_offer = clock()
        self._made_s = 0.0
        self._made_pages = 0.0
        self._credit = 0.0
        self._failed = 0
        self._probe_at = -float("inf")
        self._shed: Counter[str] = Counter()
        self._admitted = 0

    def offer(self, pages: int, *, queued: int | None = None, room: int = 0) -> WriteTicket:
        """Answer an offer of ``pages`` pages at once: admitted, or shed with its rule.

        ``queued`` (pages waiting behind this offer) and ``room`` (how many the caller lets
        wait) select the ``backlog`` rule; without ``queued``, ``absorb`` decides.
        """
        now = self._clock()
        with self._lock:
            self._measure_offer(now, pages)
            ticket = self._decide(now, pages, queued, room)
            if ticket.admitted:
                self._admitted += pages
                self._begin(now)
            else:
                self._shed[ticket.rule] += pages
            return ticket

    def done(self, ticket: WriteTicket, stored: int) -> None:
        """Record how an admitted write ended: ``stored`` of its pages stored."""
        if not ticket.admitted:
            return
        now = self._clock()
        with self._lock:
            sharing = max(self._in_flight, 1)
            self._end(now)
            if stored > 0:
                self._failed = 0
            else:
                self._failed += 1
                self._probe_at = now  # the next probe comes a READ_TTL_S after this failure
        seconds = max(now - ticket.started, 0.0)
        if stored > 0:
            self.costs.observe_write(stored * sharing, seconds)
        else:
            self.costs.observe_failure(write=True)

    def stats(self) -> dict[str, object]:
        """Pages admitted and shed (by rule), and the rates the gate weighs."""
        with self._lock:
            return {
                "admitted_pages": self._admitted,
                "shed_pages": dict(self._shed),
                "produce_s_per_page": self._produce_s(),
                "write_s_per_page": self.costs.write_s_per_page,
                "in_flight": self._in_flight,
            }

    # -- the rules --------------------------------------------------------------------------------

    def _decide(self, now: float, pages: int, queued: int | None, room: int) -> WriteTicket:
        if self._failed >= READ_SAMPLES:
            if now - self._probe_at < READ_TTL_S:
                return WriteTicket(
                    False, pages, "failing", f"the last {self._failed} writes stored nothing"
                )
            self._probe_at = now
            return WriteTicket(True, pages, "failing", "a probe of a failing store", now)
        write_s = self.costs.write_s_per_page
        if write_s is None:
            if self._in_flight > 0:
                return WriteTicket(
                    False, pages, "probe", "the store's write rate is being measured"
                )
            return WriteTicket(True, pages, "probe", "measuring the store's write rate", now)
        if queued is not None:
            reason = f"{queued} pages wait behind it, room for {room}"
            return WriteTicket(queued <= room, pages, "backlog", reason, now)
        produce_s = self._produce_s()
        if produce_s is None or produce_s >= write_s:
            self._credit = 0.0
            return WriteTicket(True, pages, "absorb", _rates(produce_s, write_s), now)
        self._credit += produce_s / write_s * pages
        if self._credit >= pages * (1 - 1e-9):  # a sum of shares that should reach it exactly
            self._credit = max(self._credit - pages, 0.0)
            return WriteTicket(True, pages, "absorb", _rates(produce_s, write_s), now)
        return WriteTicket(False, pages, "absorb", _rates(produce_s, write_s))

    # -- the caller's rate ------------------------------------------------------------------------

    def _measure_offer(self, now: float, pages: int) -> None:
        """Fold the seconds since the last offer, less the time spent in admitted writes."""
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        if pages > 0:
            keep = 1.0 - _WEIGHT
            self._made_s = self._made_s * keep + max(now - self._last_offer - busy, 0.0)
            self._made_pages = self._made_pages * keep + pages
        self._last_offer = now
        self._busy_s = 0.0
        if self._busy_since is not None:
            self._busy_since = now

    def _produce_s(self) -> float | None:
        """Seconds the caller takes to make a page, over its recent offers (None before one)."""
        return self._made_s / self._made_pages if self._made_pages else None

    def _begin(self, now: float) -> None:
        if self._in_flight == 0:
            self._busy_since = now
        self._in_flight += 1

    def _end(self, now: float) -> None:
        self._in_flight = max(self._in_flight - 1, 0)
        if self._in_flight == 0 and self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._busy_since = None


def _rates(produce_s: float | None, write_s: float) -> str:
    made = "unmeasured" if produce_s is None else f"{produce_s * 1e3:.3g} ms"
    return f"the caller makes a page each {made}, the store writes one each {write_s * 1e3:.3g} ms"
