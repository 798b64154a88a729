"""The planner in the SGLang adapter: which stored pages SGLang fetches, and which it writes.

SGLang's ``HiCacheController`` asks its storage backend how many leading pages of a request it
holds (``batch_exists``, on the prefetch thread), reads them (``batch_get_v1``, on the I/O
thread), and writes what the radix tree backs up (``batch_set_v1``, on the backup thread, one
operation after another). It never weighs a fetch against computing the pages, and it waits for
every write: a store that takes a second a read is read from by every prefetch, and a store that
takes a second a write holds the backup thread, and the host pages of every operation queued
behind it, that long. :class:`SGLangPlanner` puts the
:class:`~hicache_storage.planner.Planner`'s decisions between SGLang and the store:

- an existence query answers the leading stored pages only when fetching them pays
  (:meth:`Planner.fetchable <hicache_storage.planner.Planner.fetchable>`: the store's measured
  read rate, with the pages of the reads in flight queued ahead, against what computing the pages
  costs), else 0, and SGLang computes them;
- a write is offered first (:meth:`Planner.offer <hicache_storage.planner.Planner.offer>`):
  shed pages answer ``False`` at once instead of holding the backup thread, and an admitted write
  reports how it ended (:meth:`Planner.done <hicache_storage.planner.Planner.done>`).

What it learns from, since SGLang tells a storage backend nothing but its calls:

- every read call's pages delivered and seconds, and the read calls in flight (a call that has
  run for a second prices the store before it returns);
- a probe when the host pool is registered: one read of a key never stored, which prices a page
  at the store's round trip before any request waits on it (:meth:`Planner.probe
  <hicache_storage.planner.Planner.probe>`);
- the prefill rate, which prices recompute. Given as ``prefill_tokens_per_s`` (the marginal rate
  of one rank's prefill), it is taken as is. Otherwise it is derived from what SGLang does next:
  the pages an existence query did not answer as fetchable are the ones SGLang computes, and its
  write-through writes them once computed. The time from the query to the write of those pages,
  over their tokens, bounds what a token cost from above (the bound also holds the request's
  wait for its turn, the copy to the host and the other requests of its batch, which wait for the
  same forward: so it prices a token as the batch pays for it). Recompute is priced at the
  median of the last :data:`~hicache_storage.planner.rates.READ_SAMPLES` such bounds, once
  :data:`MIN_BOUNDS` were seen. Not a line through them: the requests of one batch end together
  whatever their sizes, and a line through them has a slope near zero. Not the least of them: a
  page another request was computing when this one asked is written soon after the ask, and one
  such bound near zero would price every fetch out. An upper bound errs toward fetching, which is
  what SGLang does without the planner: under ``write_back`` (pages written at eviction) it is
  loose, and storage is fetched from as before. Until then nothing prices recompute, and every
  fetch pays (the planner's rule for rates not yet measured).

The counts (:meth:`SGLangPlanner.stats`) say how many pages each rule decided, and the last
reason each rule gave.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec

from hicache_storage.errors import ConfigError
from hicache_storage.planner import Planner, WritePlan
from hicache_storage.planner.rates import READ_SAMPLES

__all__ = [
    "MIN_BOUNDS",
    "PlannerSettings",
    "ReadCall",
    "SGLangPlanner",
    "WriteCall",
    "planner_settings",
]

logger = logging.getLogger(__name__)

_FORWARD_TOKENS = 1 << 20
"""Tokens of every forward fed to the planner, given or derived: its fit of a single size is the
mean seconds per token fed, whatever the size (above the planner's prefill floor)."""

MIN_BOUNDS = 3
"""Per-token bounds seen before the derived prefill rate prices recompute: the fewest whose
median one wild bound (near zero, or a request that waited long) cannot set."""


class PlannerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The extra config's ``planner`` object (``"planner": false`` is ``enabled: false``).

    Attributes
    ----------
    enabled
        Put the planner between SGLang and the store (default); off, every call reaches the store
        as SGLang makes it.
    prefill_tokens_per_s
        Tokens a second that one rank's prefill computes (the marginal rate, as a prefill
        benchmark measures it); unset, the adapter derives it (module docstring).
    """

    enabled: bool = True
    prefill_tokens_per_s: float | None = None


def planner_settings(extra: Mapping[str, Any] | None) -> PlannerSettings:
    """Read the ``planner`` key of SGLang's extra config.

    Raises
    ------
    ConfigError
        If it is neither a bool nor an object of the fields of :class:`PlannerSettings`, or the
        prefill rate is not a positive finite number.
    """
    raw = (extra or {}).get("planner", True)
    if isinstance(raw, bool):
        return PlannerSettings(enabled=raw)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"planner must be true, false or an object, got {type(raw).__name__}")
    try:
        settings = msgspec.convert(dict(raw), PlannerSettings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"planner: {exc}") from exc
    rate = settings.prefill_tokens_per_s
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ConfigError(f"planner.prefill_tokens_per_s must be positive, got {rate!r}")
    return settings


@dataclass
class ReadCall:
    """A read call in flight: its pages, when it began, and the pages it delivered."""

    pages: int
    started: float
    delivered: int = 0


@dataclass
class WriteCall:
    """A write call's admitted page positions; the caller sets ``stored`` once it returns."""

    positions: list[int]
    stored: int = 0


@dataclass
class _Pending:
    """A hybrid backup's decision, held for the KV pages SGLang writes right after its sidecars."""

    plan: WritePlan
    hashes: set[str] = field(default_factory=set)
    stored: int = 0


class SGLangPlanner:
    """The adapter's planner: fetch-or-recompute and write admission from what SGLang calls.

    Thread-safe: SGLang's prefetch, I/O and backup threads call it concurrently.

    Parameters
    ----------
    settings
        The extra config's ``planner`` object.
    page_tokens
        Tokens a page of SGLang's host pool holds.
    history_pages
        Asked-for pages remembered for the derived prefill rate, oldest forgotten first: the host
        pool's pages, since a page asked for a host pool's worth of pages ago has long been
        computed or dropped.
    clock
        Monotonic seconds; a simulated clock in tests.
    """

    def __init__(
        self,
        settings: PlannerSettings,
        page_tokens: int,
        *,
        history_pages: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.planner = Planner(page_tokens, clock=clock)
        self._page_tokens = page_tokens
        self._history = max(history_pages, 1)
        self._clock = clock
        self._lock = threading.Lock()
        self._reads: dict[int, ReadCall] = {}
        self._asked: OrderedDict[str, float] = OrderedDict()
        self._bounds: deque[float] = deque(maxlen=READ_SAMPLES)
        self._reasons: dict[str, str] = {}
        self._last: dict[str, str] = {}
        self._shared: Counter[str] = Counter()
        self._local = threading.local()
        rate = settings.prefill_tokens_per_s
        if rate is not None:
            self.planner.forward(_FORWARD_TOKENS, _FORWARD_TOKENS / rate)

    # -- reads ------------------------------------------------------------------------------------

    def probe(self, read: Callable[[], object]) -> None:
        """Time ``read``, a read of a key never stored, as the store's round trip."""
        started = self._clock()
        read()
        self.planner.probe(self._clock() - started)

    def fetchable(self, page_hashes: Sequence[str], query: Callable[[], int]) -> int:
        """Run the existence ``query`` of ``page_hashes``; return the leading pages worth fetching.

        All the pages ``query`` found, or none when computing them is cheaper or the store is
        failing. The pages not answered are the ones SGLang computes: their query time is kept
        for the derived prefill rate.
        """
        started = self._clock()
        found = query()
        now = self._clock()
        self.planner.query(now - started, asked=len(page_hashes), found=found)
        queued, slowest = self._in_flight(now)
        plan = self.planner.fetchable(found, queued_pages=queued, in_flight_s_per_page=slowest)
        if found:
            self._note("fetch", plan.rule, plan.reason)
        if self.settings.prefill_tokens_per_s is None:
            self._ask(page_hashes[plan.pages :], started)
        return plan.pages

    @contextmanager
    def reading(self, pages: int) -> Iterator[ReadCall]:
        """Track a read call of ``pages`` pages; the caller sets ``delivered`` before leaving."""
        call = ReadCall(pages, self._clock())
        with self._lock:
            self._reads[id(call)] = call
        try:
            yield call
        finally:
            with self._lock:
                del self._reads[id(call)]
            if pages:
                self.planner.read(call.delivered, self._clock() - call.started)

    def _in_flight(self, now: float) -> tuple[float, float]:
        """Pages of the reads in flight, and the slowest one's seconds so far per page."""
        with self._lock:
            calls = [c for c in self._reads.values() if c.pages]
        queued = float(sum(c.pages for c in calls))
        slowest = max(((now - c.started) / c.pages for c in calls), default=0.0)
        return queued, slowest

    def _ask(self, page_hashes: Sequence[str], when: float) -> None:
        with self._lock:
            for page in page_hashes:
                self._asked.setdefault(page, when)
            while len(self._asked) > self._history:
                self._asked.popitem(last=False)

    def _computed(self, page_hashes: Sequence[str], now: float) -> None:
        """Bound a token's cost by the pages asked for and now written; feed the bounds' median."""
        with self._lock:
            asked = [self._asked.pop(p) for p in page_hashes if p in self._asked]
            if not asked:
                return
            self._bounds.append((now - min(asked)) / (len(asked) * self._page_tokens))
            if len(self._bounds) < MIN_BOUNDS:
                return
            per_token = statistics.median(self._bounds)
        self.planner.forward(_FORWARD_TOKENS, _FORWARD_TOKENS * per_token)

    # -- writes -----------------------------------------------------------------------------------

    @contextmanager
    def writing(
        self, page_hashes: Sequence[str], *, kv_follows: bool = False
    ) -> Iterator[WriteCall]:
        """Decide a write of the pages under ``page_hashes``; yield the positions to write.

        The caller writes the pages at ``positions`` (none when the planner sheds them) and sets
        ``stored``. ``kv_follows`` marks a hybrid model's sidecar write: SGLang's hybrid
        controller writes an operation's sidecar pages, then at once its KV pages, and the gate
        reads two offers that close as a caller that offers pages as fast as it is answered. So
        the KV write that follows on the same thread, of pages among these, shares this decision
        and its write ticket: the operation is offered, timed and counted once.
        """
        if not kv_follows and self.settings.prefill_tokens_per_s is None:
            self._computed(page_hashes, self._clock())
        pending = self._take_pending()
        if pending is not None and not pending.hashes.isdisjoint(page_hashes):
            yield from self._join(pending, page_hashes, kv_follows=kv_follows)
            return
        if pending is not None:
            self.planner.done(pending.plan, pending.stored)
        plan = self.planner.offer(page_hashes)
        self._note("write", "written" if plan.pages else f"shed:{plan.rule}", plan.reason)
        call = WriteCall([i for i, admitted in enumerate(plan.admitted) if admitted])
        held = False
        try:
            yield call
            if kv_follows:
                self._local.pending = _Pending(plan, set(page_hashes), call.stored)
                held = True
        finally:
            if not held:
                self.planner.done(plan, call.stored)

    def _join(
        self, pending: _Pending, page_hashes: Sequence[str], *, kv_follows: bool
    ) -> Iterator[WriteCall]:
        admitted = pending.plan.pages > 0
        call = WriteCall(list(range(len(page_hashes))) if admitted else [])
        with self._lock:
            self._shared["written" if admitted else f"shed:{pending.plan.rule}"] += len(page_hashes)
        try:
            yield call
        finally:
            stored = min(pending.stored, call.stored)
            if kv_follows:
                pending.hashes.update(page_hashes)
                pending.stored = stored
                self._local.pending = pending
            else:
                self.planner.done(pending.plan, stored)

    def _take_pending(self) -> _Pending | None:
        pending: _Pending | None = getattr(self._local, "pending", None)
        self._local.pending = None
        return pending

    # -- counts -----------------------------------------------------------------------------------

    def _note(self, kind: str, rule: str, reason: str) -> None:
        with self._lock:
            self._reasons[rule] = reason
            changed = self._last.get(kind) != rule
            self._last[kind] = rule
        if changed:
            logger.debug("hicache-storage planner: %s now %s (%s)", kind, rule, reason)

    def stats(self) -> dict[str, Any]:
        """Return the planner's counts and rates, the prefill rate and source, the last reasons.

        ``fetch_pages`` counts the pages existence queries found, by the rule that decided them
        (``pays``: answered; ``recompute``, ``failing``: answered 0); ``write_pages`` the pages
        offered, ``written`` or ``shed:<rule>``; ``after_sidecars`` the pages of a hybrid model's
        writes that shared the decision of their operation's first sidecar write (its KV pages,
        mostly: :meth:`writing`). ``gate`` and ``rates`` are the planner's.
        """
        given = self.settings.prefill_tokens_per_s
        per_token = self.planner.costs.compute_s_per_token
        derived = 1 / per_token if per_token else None
        with self._lock:
            reasons, shared = dict(self._reasons), dict(self._shared)
        stats = self.planner.stats()
        for name in ("fetch_pages", "write_pages"):  # the rules that decided some page
            counts = cast(dict[str, int], stats[name])
            stats[name] = {rule: n for rule, n in counts.items() if n}
        return {
            **stats,
            "prefill": {
                "source": "given" if given is not None else "derived",
                "tokens_per_s": given if given is not None else derived,
            },
            "after_sidecars": shared,
            "reasons": reasons,
        }
