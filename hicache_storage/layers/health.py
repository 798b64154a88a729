"""Shed calls to a store that stopped answering: after one timeout, misses at once until it answers.

A store that hangs (a partition: no refusal, no answer) costs each call its whole deadline, and
callers that wait on storage one after another (an engine's lookups) queue behind each other:
eight requests wait eight deadlines. Once a call fails with
:class:`~hicache_storage.errors.BackendTimeoutError` or
:class:`~hicache_storage.errors.BackendUnavailableError`, this layer marks the store down. While
it is down every call is answered at once without reaching the store, reads as misses and writes
as ``False`` (counted per operation in ``stats()["health"]["shed"]``, logged once per outage),
and a daemon thread probes the store with ``exists()`` on a fixed key, waiting
``probe_interval_s`` after the first failed probe and doubling up to ``max_probe_interval_s``.
The probe's deadline is the backend's own. The first probe the store answers (a hit, a miss or
any error other than those two) marks it up again. Calls already in flight when the store goes
down finish as they would have.

A miss never trips it, nor does a refusal a retry cannot change (an error whose ``retryable``
is false: a bad login, a missing bucket), nor an
:class:`~hicache_storage.errors.InjectedFaultError`: a fault rule draws each call's failure on
its own, and a breaker opened by one would turn a failure rate into an outage. The layer sits
inside degrade: the call that trips it still raises on to degrade (an absorbed error, counted
there), while the calls it sheds never reach the backend and are counted here instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, final

from ..backend import StorageBackend
from ..config import HealthConfig
from ..errors import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    InjectedFaultError,
)
from .base import AnsweringLayer

if TYPE_CHECKING:
    pass

__all__ = ["PROBE_KEY", "HealthLayer", "not_answering"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

PROBE_KEY = "hicache-health-probe"
"""The key the probe asks ``exists()`` about; nothing is ever stored under it."""


def not_answering(exc: BaseException) -> bool:
    """Whether ``exc`` says the store did not answer (a timeout or no connection).

    A refusal a retry cannot change (``retryable`` false: a bad login, a missing bucket) is
    an answer, and so is an injected fault.
    """
    return (
        isinstance(exc, (BackendTimeoutError, BackendUnavailableError))
        and exc.retryable
        and not isinstance(exc, InjectedFaultError)
    )


@final
class HealthLayer(AnsweringLayer):
    """Answer misses at once while the store is down; probe it in the background until it answers.

    Parameters
    ----------
    inner
        The backend (or layer) to guard.
    config
        Probe timing; defaults to :class:`~hicache_storage.config.HealthConfig`'s.
    """

    def __init__(self, inner: StorageBackend, config: HealthConfig | None = None) -> None:
        super().__init__(inner)
        self._config = config or HealthConfig()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._down = False
        self._down_since = 0.0
        self._down_s = 0.0
        self._trips = 0
        self._probes = 0
        self._shed: Counter[str] = Counter()
        self._shed_this_outage = 0
        self._last_error = ""
        self._prober: threading.Thread | None = None

    # -- the breaker --------------------------------------------------------------------------

    def _answer(self, op: str, call: Callable[[], T], shed: T) -> T:
        if self._down:
            with self._lock:
                if self._down:
                    self._shed[op] += 1
                    self._shed_this_outage += 1
                    return shed
        try:
            return call()
        except BackendError as exc:
            if not_answering(exc):
                self._trip(op, exc)
            raise

    def _trip(self, op: str, exc: BackendError) -> None:
        with self._lock:
            self._last_error = f"{op}: {type(exc).__name__}: {exc}"
            if self._down or self._stop.is_set():
                return
            self._down = True
            self._down_since = time.monotonic()
            self._trips += 1
            self._shed_this_outage = 0
            self._prober = threading.Thread(
                target=self._probe_until_up, name=f"hicache-health-{self.name}", daemon=True
            )
            self._prober.start()
        logger.warning(
            "storage %s did not answer (%s %s: %s); answering misses at once and probing it "
            "in the background until it answers",
            self.name,
            op,
            type(exc).__name__,
            exc,
        )

    def _probe_until_up(self) -> None:
        """Probe with backoff until the store answers or the layer closes (the prober thread)."""
        wait = 0.0
        interval = self._config.probe_interval_s
        while not self._stop.wait(wait):
            with self._lock:
                self._probes += 1
            try:
                self.inner.exists(PROBE_KEY)
            except Exception as exc:  # noqa: BLE001 - any failure is a failed probe, recorded
                if self._stop.is_set():
                    return
                if not_answering(exc):
                    with self._lock:
                        self._last_error = f"probe: {type(exc).__name__}: {exc}"
                    wait, interval = interval, min(2 * interval, self._config.max_probe_interval_s)
                    continue
            self._recover()
            return

    def _recover(self) -> None:
        with self._lock:
            if not self._down:
                return
            self._down = False
            down_s = time.monotonic() - self._down_since
            self._down_s += down_s
            shed = self._shed_this_outage
        logger.warning(
            "storage %s answers again after %.1f s down; %d calls were answered as misses "
            "meanwhile",
            self.name,
            down_s,
            shed,
        )

    @property
    def down(self) -> bool:
        """Whether the store is treated as down (calls are being shed)."""
        return self._down

    # -- the calls ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Return the inner stats plus a ``health`` section: state, trips, probes, calls shed."""
        with self._lock:
            down_s = self._down_s + (time.monotonic() - self._down_since if self._down else 0.0)
            section = {
                "state": "down" if self._down else "up",
                "trips": self._trips,
                "probes": self._probes,
                "shed": dict(sorted(self._shed.items())),
                "shed_total": sum(self._shed.values()),
                "down_s": round(down_s, 3),
                "last_error": self._last_error,
            }
        return {**self.inner.stats(), "health": section}

    def close(self) -> None:
        """Stop the prober and close the inner backend.

        Closing the inner backend first cuts a probe in flight short where the backend can; the
        join then waits at most for the backend's own deadline.
        """
        self._stop.set()
        with self._lock:
            prober = self._prober
        try:
            self.inner.close()
        finally:
            if prober is not None:
                prober.join()
