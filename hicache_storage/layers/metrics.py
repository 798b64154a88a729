"""Count and time every operation; readable through ``stats()`` and exported to Prometheus.

Prometheus metrics are created once per process (the client refuses a second registration) and
only when ``prometheus_client`` is importable. Beside the per-call series, two families are read
at scrape time: how full each store is (``hicache_storage_capacity_bytes``) and what became of
each page (``hicache_storage_pages_total``, :mod:`~hicache_storage.layers.outcomes`). Labels are
backend, tier (its place in a chain of tiers, empty for a backend of its own), operation and
outcome, never the key. Under
``PROMETHEUS_MULTIPROC_DIR`` plain counters and histograms keep working.
"""

from __future__ import annotations

import bisect
import functools
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, final

from typing_extensions import Buffer

from ..buffers import as_readable
from ..capacity import MEASURES
from ..errors import BackendError, HiCacheError
from .base import ForwardingBackend
from .outcomes import OutcomeCollector, Snapshot

if TYPE_CHECKING:
    import torch

__all__ = ["LATENCY_BUCKETS_S", "MetricsLayer", "outcome_collector"]

T = TypeVar("T")

LATENCY_BUCKETS_S: tuple[float, ...] = tuple(
    round(mantissa * 10.0**exponent, 9) for exponent in range(-6, 2) for mantissa in (1.0, 2.5, 5.0)
)


class _Prometheus(NamedTuple):
    keys: Any
    calls: Any
    errors: Any
    seconds: Any
    bytes: Any
    scrape: _ScrapeCollector


class _ScrapeCollector:
    """Read each live metrics layer's ``stats()`` once when Prometheus scrapes.

    How full a store is changes without a call through the layer (another process writes, the
    store evicts on its own), so its gauges are read at scrape time, not counted; so are the
    pages' outcomes (:class:`~hicache_storage.layers.outcomes.OutcomeCollector`), from the same
    read: a store's ``stats()`` may ask its servers (Redis's ``INFO``), once a scrape. Instances
    of one backend and tier report one capacity series each: the largest value among them.
    """

    def __init__(self) -> None:
        self.layers: weakref.WeakSet[MetricsLayer] = weakref.WeakSet()
        self.outcomes = OutcomeCollector()

    def snapshots(self) -> list[Snapshot]:
        """Return each live layer's ``(backend, tier, stats())`` (a store that fails: none)."""
        snapshots: list[Snapshot] = []
        for layer in list(self.layers):
            try:
                if layer.closed:
                    continue
                snapshots.append((layer.name, layer.tier, layer.stats()))
            except Exception:  # noqa: BLE001 - a closed or unreachable store has no figures
                continue
        return snapshots

    def collect(self) -> Any:
        """Yield the capacity gauges, the eviction counter and the pages' outcomes."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshots = self.snapshots()
        gauges: dict[tuple[str, str, str], float] = {}
        evictions: dict[tuple[str, str], float] = {}
        for name, tier, stats in snapshots:
            capacity = stats.get("capacity") or {}
            labels = (name, tier)
            for measure, field_name in MEASURES.items():
                value = capacity.get(field_name)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    key = (*labels, measure)
                    gauges[key] = max(gauges.get(key, value), value)
            count = capacity.get("evictions")
            if isinstance(count, int) and not isinstance(count, bool):
                evictions[labels] = max(evictions.get(labels, count), count)
        gauge = GaugeMetricFamily(
            "hicache_storage_capacity_bytes",
            "How full a store is: bytes used, its bound, free-space floor, free bytes",
            labels=["backend", "tier", "measure"],
        )
        for key, value in gauges.items():
            gauge.add_metric(list(key), value)
        counter = CounterMetricFamily(
            "hicache_storage_evictions",
            "Objects removed to make room (by the backend or, scope server, by the store)",
            labels=["backend", "tier"],
        )
        for labels, count in evictions.items():
            counter.add_metric(list(labels), count)
        yield gauge
        yield counter
        yield self.outcomes.family(snapshots)


@functools.cache
def _prometheus() -> _Prometheus | None:
    try:
        import prometheus_client as prom
    except ImportError:
        return None
    scrape = _ScrapeCollector()
    prom.REGISTRY.register(scrape)
    return _Prometheus(
        scrape=scrape,
        keys=prom.Counter(
            "hicache_storage_keys", "Keys handled, by outcome", ["backend", "tier", "op", "outcome"]
        ),
        calls=prom.Counter("hicache_storage_calls", "Backend calls", ["backend", "tier", "op"]),
        errors=prom.Counter(
            "hicache_storage_errors", "Calls that raised", ["backend", "tier", "op", "error"]
        ),
        seconds=prom.Histogram(
            "hicache_storage_call_seconds",
            "Latency of backend calls",
            ["backend", "tier", "op"],
            buckets=LATENCY_BUCKETS_S,
        ),
        bytes=prom.Counter(
            "hicache_storage_bytes", "Bytes moved", ["backend", "tier", "direction"]
        ),
    )


def outcome_collector() -> OutcomeCollector | None:
    """Return the process's collector of page outcomes (None without ``prometheus_client``)."""
    prom = _prometheus()
    return None if prom is None else prom.scrape.outcomes


class _OpStats:
    """Counters and a latency histogram for one operation."""

    __slots__ = ("buckets", "calls", "errors", "outcomes", "seconds")

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)

    def quantile(self, q: float) -> float | None:
        """Return the bucket upper bound below which a fraction ``q`` of calls finished."""
        if self.calls == 0:
            return None
        rank = q * self.calls
        seen = 0
        for index, count in enumerate(self.buckets):
            seen += count
            if seen >= rank:
                return LATENCY_BUCKETS_S[index] if index < len(LATENCY_BUCKETS_S) else None
        return None

    def snapshot(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            **dict(self.outcomes),
            "errors": dict(self.errors),
            "latency_s": {
                "sum": self.seconds,
                "p50": self.quantile(0.5),
                "p99": self.quantile(0.99),
            },
        }


@final
class MetricsLayer(ForwardingBackend):
    """Count keys by outcome (hit/miss, ok/fail), errors by type, bytes moved, and latency.

    ``tier`` is the ``tier`` label of its Prometheus series: the backend's place in a chain of
    tiers (two ``file`` tiers are two series), empty for a backend of its own.
    """

    def __init__(self, inner: Any, *, tier: str = "") -> None:
        super().__init__(inner)
        self.tier = tier
        self._lock = threading.Lock()
        self._ops: dict[str, _OpStats] = {}
        self._bytes = {"read": 0, "written": 0}
        self._prom = _prometheus()
        self._children: dict[tuple[str, str], Any] = {}
        if self._prom is not None:
            self._prom.scrape.layers.add(self)

    def _record(
        self,
        op: str,
        seconds: float,
        outcomes: dict[str, int],
        moved: tuple[str, int] | None,
        error: str | None = None,
    ) -> None:
        with self._lock:
            stats = self._ops.get(op)
            if stats is None:  # not setdefault: that builds a new one on every call
                stats = self._ops[op] = _OpStats()
            stats.calls += 1
            stats.seconds += seconds
            stats.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            stats.outcomes.update(outcomes)
            if error is not None:
                stats.errors[error] += 1
            if moved is not None:
                self._bytes[moved[0]] += moved[1]
        if self._prom is not None:
            self._export(op, seconds, outcomes, moved, error)

    def _export(
        self,
        op: str,
        seconds: float,
        outcomes: dict[str, int],
        moved: tuple[str, int] | None,
        error: str | None,
    ) -> None:
        """Update the Prometheus series; labelled children are looked up once and kept."""
        prom = self._prom
        assert prom is not None
        self._child(("calls", op), prom.calls, op).inc()
        self._child(("seconds", op), prom.seconds, op).observe(seconds)
        if error is not None:
            prom.errors.labels(self.name, self.tier, op, error).inc()
        for outcome, count in outcomes.items():
            if count:
                self._child((op, outcome), prom.keys, op, outcome).inc(count)
        if moved is not None and moved[1]:
            self._child(("bytes", moved[0]), prom.bytes, moved[0]).inc(moved[1])

    def _child(self, key: tuple[str, str], metric: Any, *labels: str) -> Any:
        """Return the labelled child of ``metric``, created once (threads may race to it)."""
        child = self._children.get(key)
        if child is None:
            child = metric.labels(self.name, self.tier, *labels)
            with self._lock:
                child = self._children.setdefault(key, child)
        return child

    def _timed(
        self,
        op: str,
        call: Callable[[], T],
        outcome: Callable[[T], tuple[dict[str, int], tuple[str, int] | None]],
        keys: int = 1,
    ) -> T:
        start = time.perf_counter()
        try:
            result = call()
        except HiCacheError as exc:
            failed = {"failed": keys} if isinstance(exc, BackendError) else {}
            self._record(op, time.perf_counter() - start, failed, None, type(exc).__name__)
            raise
        outcomes, moved = outcome(result)
        self._record(op, time.perf_counter() - start, outcomes, moved)
        return result

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Forward :meth:`StorageBackend.get`, counting a hit or a miss."""
        return self._timed(
            "get",
            lambda: self.inner.get(key, out),
            lambda r: (
                ({"hit": 1}, ("read", len(as_readable(r))))
                if r is not None
                else ({"miss": 1}, None)
            ),
        )

    def exists(self, key: str) -> bool:
        """Forward :meth:`StorageBackend.exists`, counting a hit or a miss."""
        return self._timed("exists", lambda: self.inner.exists(key), lambda r: (_hits([r]), None))

    def set(self, key: str, value: Buffer) -> bool:
        """Forward :meth:`StorageBackend.set`, counting success and bytes offered."""
        size = len(as_readable(value))
        return self._timed(
            "set",
            lambda: self.inner.set(key, value),
            lambda r: (_oks([r]), ("written", size if r else 0)),
        )

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_get`, counting hits and misses per key."""
        sizes = [len(as_readable(out)) for out in outs]
        return self._timed(
            "batch_get",
            lambda: self.inner.batch_get(keys, outs),
            lambda r: (_hits(r), ("read", sum(s for s, hit in zip(sizes, r, strict=True) if hit))),
            len(keys),
        )

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_set`, counting success per key."""
        sizes = [len(as_readable(value)) for value in values]
        return self._timed(
            "batch_set",
            lambda: self.inner.batch_set(keys, values),
            lambda r: (_oks(r), ("written", sum(s for s, ok in zip(sizes, r, strict=True) if ok))),
            len(keys),
        )

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Forward :meth:`StorageBackend.batch_exists`, counting the prefix hit and the rest."""
        return self._timed(
            "batch_exists",
            lambda: self.inner.batch_exists(keys),
            lambda r: ({"hit": r, "miss": len(keys) - r}, None),
            len(keys),
        )

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_get_v1`, counting hits, misses and bytes."""
        return self._timed(
            "batch_get_v1",
            lambda: self.inner.batch_get_v1(keys, host_indices),
            lambda r: (_hits(r), ("read", sum(r) * self.inner.host_pool.page_nbytes)),
            len(keys),
        )

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_set_v1`, counting success and bytes."""
        return self._timed(
            "batch_set_v1",
            lambda: self.inner.batch_set_v1(keys, host_indices),
            lambda r: (_oks(r), ("written", sum(r) * self.inner.host_pool.page_nbytes)),
            len(keys),
        )

    def delete(self, key: str) -> bool:
        """Forward :meth:`StorageBackend.delete`, counting a hit or a miss."""
        return self._timed("delete", lambda: self.inner.delete(key), lambda r: (_hits([r]), None))

    def stats(self) -> dict[str, Any]:
        """Return the inner stats plus a ``metrics`` section."""
        with self._lock:
            section = {
                "ops": {op: stats.snapshot() for op, stats in sorted(self._ops.items())},
                "bytes_read": self._bytes["read"],
                "bytes_written": self._bytes["written"],
            }
        return {**self.inner.stats(), "metrics": section}


def _hits(results: Sequence[bool]) -> dict[str, int]:
    hits = sum(1 for r in results if r)
    return {"hit": hits, "miss": len(results) - hits}


def _oks(results: Sequence[bool]) -> dict[str, int]:
    oks = sum(1 for r in results if r)
    return {"ok": oks, "fail": len(results) - oks}
