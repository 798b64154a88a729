"""What moving a page costs on this machine, measured while serving: reads, queries, recompute.

The ``adaptive`` prefetch policy (:func:`~hicache_storage.planner.fetch.adaptive_wait_s`)
weighs the time to fetch a request's storage pages against the time to recompute them. Neither is
a constant: a warm local store reads 8 MiB pages at tens of GB/s, a cold disk or a remote store at
one, and prefill of the same model runs at different speeds per device and per batch. So both are
measured by the engine as it serves: :class:`CostModel` keeps

- the median of the last :data:`READ_SAMPLES` ``batch_get_v1`` calls' seconds per page over the
  calls that ran beside them (the storage read threads report every call): the store's whole
  rate, at which the pages queued ahead of a fetch are read before its own. A median, because
  one call stalled behind a long forward on a busy CPU (measured on two cores: 20 times its
  neighbours) would otherwise price every fetch out, and with no read started nothing would
  measure the store again for :data:`READ_TTL_S`; a store that is slow for good is slow in most
  calls, and a call in flight is priced by its own time meanwhile;

the same median over the last ``batch_set_v1`` calls that stored something, per page: the
store's write rate, against which the planner's back-pressure
(:class:`~hicache_storage.planner.writes.WriteGate`) sheds what the store cannot absorb;

and exponentially weighted means of

- seconds an existence query takes (``batch_exists``), and the share of the pages it asked for
  that storage held: a request whose query has not answered yet stands to gain that share of
  its pages, so where storage rarely holds what is asked (reuse the host pool serves), nobody
  waits for the answer;
- seconds a forward takes, fitted as a fixed part plus a part per token it computes: what
  recomputing ``n`` more tokens in a batch costs is the per-token part (the marginal cost), not a
  forward's mean time per token, which small forwards inflate with their fixed part;
- requests per forward: every request in a batch waits for the batch's forward, so recomputing a
  request's pages costs that many times their compute (:meth:`CostModel.recompute_cost_s`), while
  waiting for its reads delays that request alone.

A call that delivered nothing is a measurement too: a read that brought no page, and, while no
read has delivered one lately, a write that stored nothing (a store in an outage is never read
from, since its queries find nothing, so its failing writes are the only evidence of it). Such a
call counts as a read of no page in its seconds, an infinite rate a page
(:attr:`CostModel.failing`): a store that never succeeds is priced out as surely as a slow one,
where it would otherwise never be measured at all.

Every estimate is None until its first sample: the policy then treats what it cannot price as
free to try but bounded by what recomputing costs, so a store is never waited on for longer than
it would take to compute its pages. The read rate is also forgotten once no read has returned
for :data:`READ_TTL_S`: a store measured slow is not read from, so without forgetting, one slow
spell would turn storage off for good; after it, the next fetch measures the store again. The
storage threads and the scheduler update it concurrently; a lock makes each update atomic.
"""

from __future__ import annotations

import collections
import math
import statistics
import threading
import time
from collections.abc import Callable

from hicache_storage.errors import ConfigError

__all__ = ["MIN_FOUND", "READ_SAMPLES", "READ_TTL_S", "CostModel", "WeightedMean"]

MIN_FOUND = 0.1
"""Least share of an unanswered query's pages the policy expects storage to hold."""

READ_TTL_S = 5.0
"""Seconds after the last read returned that the measured read rate is forgotten."""

READ_SAMPLES = 5
"""Read calls whose median is the measured read rate."""


class WeightedMean:
    """An exponentially weighted mean that is None until its first sample.

    ``weight`` is a new sample's share of the mean; ``samples`` counts the samples seen.
    """

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.value: float | None = None
        self.samples = 0

    def add(self, sample: float) -> None:
        """Fold ``sample`` into the mean."""
        self.samples += 1
        old = self.value
        self.value = sample if old is None else old + self.weight * (sample - old)


class _Fit:
    """A least-squares line through (tokens, seconds) with exponentially decaying weights."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.n = self.x = self.y = self.xx = self.xy = 0.0
        self.large = False

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - self.decay
        self.n = self.n * keep + 1.0
        self.x = self.x * keep + x
        self.y = self.y * keep + y
        self.xx = self.xx * keep + x * x
        self.xy = self.xy * keep + x * y

    def line(self) -> tuple[float, float] | None:
        """Return (fixed seconds, seconds per token), or None before any sample."""
        if self.n == 0 or self.x <= 0:
            return None
        spread = self.n * self.xx - self.x * self.x
        if spread > 1e-9 * self.n * self.xx:
            slope = (self.n * self.xy - self.x * self.y) / spread
            if slope > 0:
                return max((self.y - slope * self.x) / self.n, 0.0), slope
        return 0.0, self.y / self.x  # one size of forward only: its mean per token


_PREFILL_TOKENS = 16
"""Fewest new tokens of a forward that shows prefill (decode steps compute one per request)."""

_FIT_DECAY = 0.05
"""Weight lost per new forward by the older ones in the compute fit (about twenty remembered)."""


class CostModel:
    """Running estimates of read, query and compute times (seconds), shared across threads.

    Parameters
    ----------
    weight
        Weight of a new sample in each mean, in ``(0, 1]``: higher follows changes faster.
    clock
        Monotonic seconds, for the read rate's age (:data:`READ_TTL_S`).
    """

    def __init__(
        self, weight: float = 0.25, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1:
            raise ConfigError(f"weight must be a number in (0, 1], got {weight!r}")
        self._lock = threading.Lock()
        self._clock = clock
        self._reads: collections.deque[float] = collections.deque(maxlen=READ_SAMPLES)
        self._read_at = 0.0
        self._writes: collections.deque[float] = collections.deque(maxlen=READ_SAMPLES)
        self._write_at = 0.0
        self._query = WeightedMean(weight)
        self._found = WeightedMean(weight)
        self._fit = _Fit(_FIT_DECAY)
        self._forward = WeightedMean(weight)
        self._sharing = WeightedMean(weight)

    # -- samples ----------------------------------------------------------------------------------

    def observe_read(self, pages: int, seconds: float) -> None:
        """Record a read call of ``pages`` pages that took ``seconds``."""
        if pages > 0 and seconds >= 0:
            now = self._clock()
            with self._lock:
                if now - self._read_at > READ_TTL_S:
                    self._reads.clear()  # a fresh measurement, not one with the stale samples
                self._reads.append(seconds / pages)
                self._read_at = now

    def observe_write(self, pages: int, seconds: float) -> None:
        """Record a write call that stored ``pages`` pages in ``seconds``."""
        if pages > 0 and seconds >= 0:
            now = self._clock()
            with self._lock:
                if now - self._write_at > READ_TTL_S:
                    self._writes.clear()
                self._writes.append(seconds / pages)
                self._write_at = now

    def observe_failure(self, *, write: bool = False) -> None:
        """Record a call that delivered nothing: a read sample of infinite seconds a page.

        A failed ``write`` counts only while no read has delivered a page within
        :data:`READ_TTL_S`: a store whose reads serve while its writes fail (one mounted
        read-only) is still read from.
        """
        now = self._clock()
        with self._lock:
            stale = now - self._read_at > READ_TTL_S
            if stale:
                self._reads.clear()  # a fresh measurement, not one with the stale samples
            if write and any(math.isfinite(sample) for sample in self._reads):
                return
            self._reads.append(math.inf)
            self._read_at = now

    def observe_query(self, seconds: float, *, asked: int = 0, found: int = 0) -> None:
        """Record an existence query that took ``seconds``, finding ``found`` of ``asked`` pages."""
        if seconds >= 0:
            with self._lock:
                self._query.add(seconds)
                if asked > 0:
                    self._found.add(min(max(found, 0), asked) / asked)

    def observe_forward(self, tokens: int, seconds: float, *, requests: int = 1) -> None:
        """Record a forward of ``requests`` requests that computed ``tokens`` new tokens.

        Recompute is priced once a forward of at least 16 tokens was seen (decode steps alone
        say nothing about prefill); every forward counts toward the fit, :attr:`forward_s` and
        :attr:`sharing`.
        """
        if seconds < 0 or tokens < 1:
            return
        with self._lock:
            self._sharing.add(max(requests, 1))
            self._forward.add(seconds)
            self._fit.add(tokens, seconds)
            self._fit.large = self._fit.large or tokens >= _PREFILL_TOKENS

    # -- estimates --------------------------------------------------------------------------------

    @property
    def read_s_per_page(self) -> float | None:
        """Seconds a page takes at the store's whole rate (a call's share of the calls beside it).

        The median of the last :data:`READ_SAMPLES` calls (a call that delivered nothing counts
        as infinite: :meth:`observe_failure`); of an even count whose upper middle is a failure,
        the lower middle, so the rate is a failure's only when most calls failed (the mean of
        the middle two would make one failure beside one good read infinite). None before the
        first read returned and once none has for :data:`READ_TTL_S`.
        """
        with self._lock:
            if not self._reads or self._clock() - self._read_at > READ_TTL_S:
                return None
            rate = statistics.median(self._reads)
            return rate if math.isfinite(rate) else statistics.median_low(self._reads)

    @property
    def write_s_per_page(self) -> float | None:
        """Seconds the store takes to write a page, at its whole rate.

        The median of the last write calls that stored something; None before the first and
        once none has for :data:`READ_TTL_S`.
        """
        with self._lock:
            if not self._writes or self._clock() - self._write_at > READ_TTL_S:
                return None
            return statistics.median(self._writes)

    @property
    def failing(self) -> bool:
        """Whether the measured rate is a failure's: most (over half) recent calls failed."""
        rate = self.read_s_per_page
        return rate is not None and math.isinf(rate)

    @property
    def query_s(self) -> float | None:
        """Seconds an existence query takes."""
        with self._lock:
            return self._query.value

    @property
    def found_share(self) -> float:
        """Expected share of a query's pages storage holds: measured, at least :data:`MIN_FOUND`.

        1.0 before any query answered. The floor keeps a fetch worth many pages worth waiting
        for after a run of misses (a first round, before anything was stored).
        """
        with self._lock:
            share = self._found.value
        return 1.0 if share is None else max(share, MIN_FOUND)

    @property
    def compute_s_per_token(self) -> float | None:
        """Seconds each more token adds to a forward (the fit's slope), once prefill was seen."""
        with self._lock:
            line = self._fit.line() if self._fit.large else None
        return None if line is None else line[1]

    def forward_time_s(self, tokens: int) -> float | None:
        """Seconds a forward of ``tokens`` new tokens takes on the fit, once prefill was seen."""
        with self._lock:
            line = self._fit.line() if self._fit.large else None
        return None if line is None else line[0] + line[1] * tokens

    @property
    def forward_s(self) -> float | None:
        """Seconds a forward takes: how long a request that misses a step waits for the next."""
        with self._lock:
            return self._forward.value

    def recompute_s(self, tokens: int) -> float | None:
        """Seconds to prefill ``tokens`` tokens, or None before a forward was measured."""
        rate = self.compute_s_per_token
        return None if rate is None else rate * tokens

    @property
    def sharing(self) -> float:
        """Requests a forward serves, on the mean (1.0 before any forward was measured)."""
        with self._lock:
            return self._sharing.value or 1.0

    def recompute_cost_s(self, tokens: int) -> float | None:
        """Seconds that prefilling ``tokens`` tokens costs the requests sharing its forwards.

        Each of the :attr:`sharing` requests of the batch waits as long for the forward as the
        one whose pages are recomputed; None before a forward was measured.
        """
        own = self.recompute_s(tokens)
        return None if own is None else own * self.sharing

    def snapshot(self) -> dict[str, float | None]:
        """Return the current estimates by name (for a benchmark's record)."""
        return {
            "read_s_per_page": self.read_s_per_page,
            "write_s_per_page": self.write_s_per_page,
            "query_s": self.query_s,
            "found_share": self.found_share,
            "compute_s_per_token": self.compute_s_per_token,
            "forward_s": self.forward_s,
            "sharing": self.sharing,
        }
