"""What became of each page the storage tier decided about: one Prometheus family, by outcome.

``hicache_storage_pages_total{backend, tier, outcome}`` counts pages by their terminal outcome,
read when Prometheus scrapes from what the parts that decided already count:

========================  ============================================================
outcome                   counted by
========================  ============================================================
``hit``, ``miss``         the metrics layer: pages a read found or did not
``failed``                the metrics layer: pages of calls that raised a backend error; a
                          planner: pages not read from a store whose calls were failing
``written``               the metrics layer: pages a write stored
``write_failed``          the metrics layer: pages a write did not store
``corrupt``               the verify layer: pages whose bytes were not the key's, or that had
                          no record (a miss, deleted)
``evicted``               the backend's ``capacity`` (or the quota layer's): pages removed for
                          room
``shed``                  the quota layer (no room within the quota) and a planner (writes it
                          did not admit)
``priced_out``            a planner: stored pages not read, recomputing them being cheaper
``promoted``              a chain: pages copied into a nearer tier (``tier`` = that tier)
========================  ============================================================

A planner (the tier engine's, the SGLang adapter's, the vLLM tier's) is counted once
:func:`watch_planner` names the backend it decides for. Labels stay bounded: backend names,
tier positions and the outcomes above, never a key. Counts are summed over the live instances
of one backend and tier; a closed instance leaves the sum, which Prometheus reads as a reset.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..planner import Planner

__all__ = ["OUTCOMES", "OutcomeCollector", "Snapshot", "watch_planner"]

Snapshot = tuple[str, str, Mapping[str, Any]]
"""One live layer's ``(backend, tier, stats())``, read once per scrape."""

OUTCOMES = (
    "hit",
    "miss",
    "failed",
    "written",
    "write_failed",
    "corrupt",
    "evicted",
    "shed",
    "priced_out",
    "promoted",
)
"""Every value of the ``outcome`` label."""

_READS = ("get", "batch_get", "batch_get_v1")
_WRITES = ("set", "batch_set", "batch_set_v1")


class OutcomeCollector:
    """Count the pages' outcomes from the live metrics layers' stats and the watched planners.

    It reads no store itself: the scrape reads each layer's ``stats()`` once for every family
    it exports (:mod:`~hicache_storage.layers.metrics`) and hands them here.
    """

    def __init__(self) -> None:
        self.planners: weakref.WeakKeyDictionary[Planner, tuple[str, str]] = (
            weakref.WeakKeyDictionary()
        )

    def counts(self, snapshots: Iterable[Snapshot]) -> Counter[tuple[str, str, str]]:
        """Return the pages by ``(backend, tier, outcome)`` in ``snapshots`` and the planners."""
        counts: Counter[tuple[str, str, str]] = Counter()
        for backend, tier, stats in snapshots:
            _layer_counts(counts, backend, tier, stats)
        for planner, (backend, tier) in list(self.planners.items()):
            _planner_counts(counts, backend, tier, planner.stats())
        return counts

    def family(self, snapshots: Iterable[Snapshot]) -> Any:
        """Return ``hicache_storage_pages`` for ``snapshots`` and the planners."""
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "hicache_storage_pages",
            "Pages the storage tier decided about, by terminal outcome",
            labels=["backend", "tier", "outcome"],
        )
        for labels, count in sorted(self.counts(snapshots).items()):
            family.add_metric(list(labels), count)
        return family


def watch_planner(planner: Planner, backend: str, tier: str = "") -> None:
    """Count ``planner``'s decisions (priced out, shed) under ``backend``'s series.

    Does nothing without ``prometheus_client``; the planner is held weakly.
    """
    from .metrics import outcome_collector

    collector = outcome_collector()
    if collector is not None:
        collector.planners[planner] = (backend, tier)


def _layer_counts(
    counts: Counter[tuple[str, str, str]], backend: str, tier: str, stats: Mapping[str, Any]
) -> None:
    ops = stats.get("metrics", {}).get("ops", {})
    for op in _READS:
        entry = ops.get(op, {})
        counts[backend, tier, "hit"] += entry.get("hit", 0)
        counts[backend, tier, "miss"] += entry.get("miss", 0)
        counts[backend, tier, "failed"] += entry.get("failed", 0)
    for op in _WRITES:
        entry = ops.get(op, {})
        counts[backend, tier, "written"] += entry.get("ok", 0)
        counts[backend, tier, "write_failed"] += entry.get("fail", 0) + entry.get("failed", 0)
    verify = stats.get("verify", {})
    counts[backend, tier, "corrupt"] += verify.get("mismatched", 0) + verify.get("no_record", 0)
    evictions = (stats.get("capacity") or {}).get("evictions")
    if isinstance(evictions, int) and not isinstance(evictions, bool):
        counts[backend, tier, "evicted"] += evictions
    counts[backend, tier, "shed"] += stats.get("quota", {}).get("shed_pages", 0)
    for index, entry in enumerate(stats.get("tiers") or ()):
        if isinstance(entry, Mapping) and "promoted" in entry:
            counts[str(entry.get("backend", "")), str(index), "promoted"] += entry["promoted"]


def _planner_counts(
    counts: Counter[tuple[str, str, str]], backend: str, tier: str, stats: Mapping[str, Any]
) -> None:
    fetch = stats.get("fetch_pages", {})
    counts[backend, tier, "priced_out"] += fetch.get("recompute", 0)
    counts[backend, tier, "failed"] += fetch.get("failing", 0)
    for rule, pages in stats.get("write_pages", {}).items():
        if rule.startswith("shed:"):
            counts[backend, tier, "shed"] += pages
