"""The planner: the three decisions over one set of measured rates, each with its rule.

An engine that drives a store asks it

- :meth:`Planner.fetchable`: how many of the leading pages storage holds are worth fetching
  (fetch or recompute, :func:`~hicache_storage.planner.fetch.fetch_pays`: the store's measured
  read rate, including the pages queued ahead, against what computing them costs the batch);
- :meth:`Planner.offer`: which of the pages it would write are written (admission,
  :mod:`~hicache_storage.planner.admission`, then whether reads from this store pay at all,
  then back-pressure, :class:`~hicache_storage.planner.writes.WriteGate`);

and reports what its calls did (:meth:`Planner.read`, :meth:`Planner.query`,
:meth:`Planner.forward`, :meth:`Planner.done`), which is all it learns from. :meth:`Planner.stats`
counts each decision by the rule that made it, so a bench or a metrics scrape says why pages
were fetched, recomputed, written or shed.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hicache_storage.errors import ConfigError

from .admission import Admission, AdmitAll
from .fetch import fetch_pays
from .rates import CostModel
from .writes import WriteGate, WriteTicket

__all__ = ["FetchPlan", "Planner", "WritePlan"]


@dataclass(frozen=True)
class FetchPlan:
    """How many leading pages to fetch, and why.

    ``rule`` is ``pays`` (reading them beats computing them, or the rates are not measured
    yet: the first reads are how the store is measured), ``recompute`` (computing them is
    cheaper) or ``failing`` (the store's recent calls delivered nothing).
    """

    pages: int
    rule: str
    reason: str


@dataclass(frozen=True)
class WritePlan:
    """Which of the offered pages to write, and why (``admitted[i]`` for the ``i``-th key).

    ``rule`` is the rule that decided the call: ``admission`` (no page was worth writing),
    ``unread`` (reads from this store do not pay, so neither do its writes), or the
    back-pressure rule of :class:`~hicache_storage.planner.writes.WriteGate`. Report the outcome
    with :meth:`Planner.done`.
    """

    admitted: list[bool]
    rule: str
    reason: str
    ticket: WriteTicket | None = None

    @property
    def pages(self) -> int:
        """Pages admitted."""
        return sum(self.admitted)


class Planner:
    """Fetch-or-recompute, admission and back-pressure over measured rates; thread-safe.

    Parameters
    ----------
    page_tokens
        Tokens a page holds: recompute is priced per token.
    admission
        Which pages are worth writing (:class:`~hicache_storage.planner.admission.AdmitAll` by
        default).
    costs
        The measured rates, shared with an engine that measures its forwards itself.
    clock
        Monotonic seconds; a simulated clock in tests.
    """

    def __init__(
        self,
        page_tokens: int,
        *,
        admission: Admission | None = None,
        costs: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
            raise ConfigError(f"page_tokens must be a positive int, got {page_tokens!r}")
        self.page_tokens = page_tokens
        self.admission: Admission = admission if admission is not None else AdmitAll()
        self.costs = costs if costs is not None else CostModel(clock=clock)
        self.gate = WriteGate(self.costs, clock=clock)
        self._lock = threading.Lock()
        self._fetch: Counter[str] = Counter()
        self._write: Counter[str] = Counter()

    # -- decisions --------------------------------------------------------------------------------

    def fetchable(
        self, found: int, *, queued_pages: float = 0.0, in_flight_s_per_page: float = 0.0
    ) -> FetchPlan:
        """Decide how many of ``found`` leading stored pages to fetch.

        ``queued_pages`` are read before these (other fetches in flight); ``in_flight_s_per_page``
        is the slowest read call in flight's seconds so far per page (a store that has not
        answered for a second is known to be slow before its first answer). All or none: both
        sides grow with the pages, and the queue ahead weighs less the more pages share it.
        """
        if found <= 0:
            return FetchPlan(0, "pays", "nothing found")
        if self.costs.failing:
            plan = FetchPlan(0, "failing", "the store's recent calls delivered nothing")
        elif fetch_pays(
            found,
            self.page_tokens,
            queued_pages,
            self.costs,
            in_flight_s_per_page=in_flight_s_per_page,
        ):
            plan = FetchPlan(found, "pays", self._weighed(found, queued_pages))
        else:
            plan = FetchPlan(0, "recompute", self._weighed(found, queued_pages))
        with self._lock:
            self._fetch[plan.rule] += found
        return plan

    def offer(self, keys: Sequence[str], *, queued: int | None = None, room: int = 0) -> WritePlan:
        """Decide which of the pages under ``keys`` to write; never blocks.

        A caller that holds its own queue of writes says how many pages wait behind these
        (``queued``) and how many it lets wait (``room``): the gate's ``backlog`` rule
        (:mod:`~hicache_storage.planner.writes`).
        """
        wanted = self.admission.admit(keys)
        count = sum(wanted)
        none = [False] * len(keys)
        if count == 0:
            plan = WritePlan(none, "admission", f"no page admitted ({self.admission.name})")
        elif not self._reads_pay():
            plan = WritePlan(none, "unread", "reading a page back costs more than computing it")
        else:
            ticket = self.gate.offer(count, queued=queued, room=room)
            admitted = wanted if ticket.admitted else none
            plan = WritePlan(admitted, ticket.rule, ticket.reason, ticket)
        with self._lock:
            if count < len(keys):
                self._write["shed:admission"] += len(keys) - count
            if count:
                self._write["written" if plan.pages else f"shed:{plan.rule}"] += count
        return plan

    def done(self, plan: WritePlan, stored: int) -> None:
        """Record how an admitted write ended: ``stored`` of its pages stored."""
        if plan.ticket is not None:
            self.gate.done(plan.ticket, stored)

    # -- what the engine measured -----------------------------------------------------------------

    def seen(self, keys: Sequence[str]) -> None:
        """Record a lookup of ``keys`` (what frequency admission counts)."""
        self.admission.seen(keys)

    def read(self, pages: int, seconds: float) -> None:
        """Record a read call that delivered ``pages`` pages in ``seconds`` (0 pages: a failure)."""
        if pages > 0:
            self.costs.observe_read(pages, seconds)
        else:
            self.costs.observe_failure()

    def probe(self, seconds: float) -> None:
        """Record a read round trip that moved nothing (a read of a key never stored).

        It prices a page at the round trip until real reads are measured: an adapter that
        probes its store when it starts knows a store answering in a second is slow before any
        request waits a second for it. For a store whose pages come many to a call that
        over-prices a page, which errs toward recomputing only where one round trip costs more
        than computing a page.
        """
        self.costs.observe_read(1, seconds)

    def query(self, seconds: float, *, asked: int, found: int) -> None:
        """Record an existence query of ``asked`` pages that found ``found``."""
        self.costs.observe_query(seconds, asked=asked, found=found)

    def forward(self, tokens: int, seconds: float, *, requests: int = 1) -> None:
        """Record a forward of ``requests`` requests that computed ``tokens`` tokens."""
        self.costs.observe_forward(tokens, seconds, requests=requests)

    def stats(self) -> dict[str, object]:
        """Pages per decision and rule, the write gate's counts, and the measured rates."""
        with self._lock:
            fetch, write = dict(self._fetch), dict(self._write)
        return {
            "fetch_pages": fetch,
            "write_pages": write,
            "gate": self.gate.stats(),
            "rates": self.costs.snapshot(),
        }

    # -- helpers ----------------------------------------------------------------------------------

    def _reads_pay(self) -> bool:
        """Whether a page read back from this store would beat computing it (True unmeasured)."""
        read_s = self.costs.read_s_per_page
        compute = self.costs.recompute_cost_s(self.page_tokens)
        if read_s is None or compute is None or math.isinf(read_s):
            return True  # unmeasured, or failing (which the gate's own rule answers)
        return read_s < compute

    def _weighed(self, found: int, queued: float) -> str:
        read_s = self.costs.read_s_per_page
        compute = self.costs.recompute_cost_s(self.page_tokens)
        if read_s is None or compute is None:
            return "rates not measured yet"
        return (
            f"{found} pages (+{queued:.0f} queued) at {read_s * 1e3:.3g} ms a page against "
            f"{compute * 1e3:.3g} ms a page to compute"
        )
