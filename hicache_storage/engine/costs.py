"""What moving a page costs on this machine, measured while serving: reads, queries, recompute.

The ``adaptive`` prefetch policy (:func:`~hicache_storage.engine.policies.adaptive_done_waiting`)
weighs the time to fetch a request's storage pages against the time to recompute them. Neither is
a constant: a warm local store reads 8 MiB pages at tens of GB/s, a cold disk or a remote store at
one, and prefill of the same model runs at different speeds per device and per batch. So both are
measured by the engine as it serves: :class:`CostModel` keeps exponentially weighted means of

- seconds a ``batch_get_v1`` call takes per page (the storage read threads report every call);
- seconds an existence query takes (``batch_exists``);
- seconds a forward takes per token it computes, and seconds a forward takes.

Every estimate is None until its first sample: the policy then treats what it cannot price as
free to try but bounded by what recomputing costs, so a store is never waited on for longer than
it would take to compute its pages. The storage threads and the scheduler update it concurrently;
a lock makes each update atomic.
"""

from __future__ import annotations

import threading

from hicache_storage.errors import ConfigError

__all__ = ["CostModel"]


class _Mean:
    """An exponentially weighted mean that is None until its first sample."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.value: float | None = None
        self.samples = 0

    def add(self, sample: float) -> None:
        self.samples += 1
        old = self.value
        self.value = sample if old is None else old + self.weight * (sample - old)


class CostModel:
    """Running estimates of read, query and compute times (seconds), shared across threads.

    Parameters
    ----------
    weight
        Weight of a new sample in each mean, in ``(0, 1]``: higher follows changes faster.
    """

    def __init__(self, weight: float = 0.25) -> None:
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1:
            raise ConfigError(f"weight must be a number in (0, 1], got {weight!r}")
        self._lock = threading.Lock()
        self._read = _Mean(weight)
        self._query = _Mean(weight)
        self._token = _Mean(weight)
        self._forward = _Mean(weight)

    # -- samples ----------------------------------------------------------------------------------

    def observe_read(self, pages: int, seconds: float) -> None:
        """Record a read call of ``pages`` pages that took ``seconds``."""
        if pages > 0 and seconds >= 0:
            with self._lock:
                self._read.add(seconds / pages)

    def observe_query(self, seconds: float) -> None:
        """Record an existence query that took ``seconds``."""
        if seconds >= 0:
            with self._lock:
                self._query.add(seconds)

    def observe_forward(self, tokens: int, seconds: float) -> None:
        """Record a forward that computed ``tokens`` new tokens in ``seconds``.

        Only forwards of many tokens price recompute (a decode step's time per token says
        nothing about prefill); every forward counts toward :attr:`forward_s`.
        """
        if seconds < 0 or tokens < 1:
            return
        with self._lock:
            self._forward.add(seconds)
            if tokens >= 64:
                self._token.add(seconds / tokens)

    # -- estimates --------------------------------------------------------------------------------

    @property
    def read_s_per_page(self) -> float | None:
        """Seconds a read takes per page, with the reads that ran alongside it."""
        with self._lock:
            return self._read.value

    @property
    def query_s(self) -> float | None:
        """Seconds an existence query takes."""
        with self._lock:
            return self._query.value

    @property
    def compute_s_per_token(self) -> float | None:
        """Seconds of prefill per token, from forwards of at least 64 new tokens."""
        with self._lock:
            return self._token.value

    @property
    def forward_s(self) -> float | None:
        """Seconds a forward takes: how long a request that misses a step waits for the next."""
        with self._lock:
            return self._forward.value

    def recompute_s(self, tokens: int) -> float | None:
        """Seconds to prefill ``tokens`` tokens, or None before a forward was measured."""
        rate = self.compute_s_per_token
        return None if rate is None else rate * tokens

    def snapshot(self) -> dict[str, float | None]:
        """Return the current estimates by name (for a benchmark's record)."""
        return {
            "read_s_per_page": self.read_s_per_page,
            "query_s": self.query_s,
            "compute_s_per_token": self.compute_s_per_token,
            "forward_s": self.forward_s,
        }
