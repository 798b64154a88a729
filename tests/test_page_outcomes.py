"""What became of each page, as one Prometheus family: every outcome counted where it is decided."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import prometheus_client

from hicache_storage import create_backend
from hicache_storage.config import LayerConfig, QuotaConfig
from hicache_storage.layers import watch_planner
from hicache_storage.layers.metrics import outcome_collector
from hicache_storage.layers.outcomes import OUTCOMES
from hicache_storage.layers.verify import record_key
from hicache_storage.planner import Planner

from .helpers import make_pool, page_indices


def _pages(backend: str, tier: str, outcome: str) -> float:
    labels = {"backend": backend, "tier": tier, "outcome": outcome}
    value = prometheus_client.REGISTRY.get_sample_value("hicache_storage_pages_total", labels)
    return 0.0 if value is None else value


def test_reads_writes_corrupt_pages_and_evictions_are_counted(tmp_path: Path) -> None:
    pool = make_pool("mha", "page_first", pages=8)
    backend = create_backend(
        "file", {"root": str(tmp_path / "f"), "max_bytes": 3 * pool.page_nbytes + 1}
    )
    backend.register_host_pool(pool)
    before = {outcome: _pages("file", "", outcome) for outcome in OUTCOMES}
    keys = ["p0", "p1", "p2", "p3"]
    assert backend.batch_set_v1(keys, page_indices(pool, range(4))) == [True] * 4
    assert backend.batch_get_v1(["p3", "nope"], page_indices(pool, [4, 5])) == [True, False]
    backend.unwrap().set(record_key("p3"), bytes(32))  # p3's record no longer matches it
    assert backend.unwrap().delete(record_key("p3")) is True
    assert backend.batch_get_v1(["p3"], page_indices(pool, [6])) == [False]
    after = {outcome: _pages("file", "", outcome) for outcome in OUTCOMES}
    gained = {outcome: after[outcome] - before[outcome] for outcome in OUTCOMES}
    assert gained["written"] == 4 and gained["hit"] == 1 and gained["miss"] == 2
    assert gained["corrupt"] == 1 and gained["evicted"] >= 1
    backend.close()


def test_a_quota_sheds_and_a_planner_prices_out_under_the_backends_series(tmp_path: Path) -> None:
    quota = QuotaConfig(bytes=1024, ledger=str(tmp_path / "ledger.sqlite"))
    backend = create_backend("memory", layers=LayerConfig(quota=quota))
    shed = _pages("memory", "", "shed")
    assert backend.set("big", bytes(2048)) is False
    assert _pages("memory", "", "shed") == shed + 1

    planner = Planner(16)
    watch_planner(planner, "memory", "7")
    planner.forward(16, 10.0)  # a page computes in 10 s ...
    planner.read(1, 0.001)  # ... and reads in 1 ms: fetches pay
    planner.forward(1024, 0.001)  # now computing is far cheaper than any read
    planner.read(1, 5.0)
    plan = planner.fetchable(4)
    assert plan.pages == 0 and plan.rule == "recompute"
    assert _pages("memory", "7", "priced_out") == 4
    collector = outcome_collector()
    assert collector is not None and planner in collector.planners
    backend.close()


def test_a_scrape_reads_each_store_s_stats_once(tmp_path: Path) -> None:
    """A store's ``stats()`` may ask its servers (Redis's ``INFO``): the capacity gauges and the
    pages' outcomes of one scrape come from one read."""
    backend = create_backend("file", {"root": str(tmp_path / "once"), "max_bytes": 1 << 20})
    inner = backend.unwrap()
    assert backend.set("k", b"v") is True
    with mock.patch.object(inner, "stats", wraps=inner.stats) as asked:
        text = prometheus_client.generate_latest().decode()
    assert asked.call_count == 1
    assert 'hicache_storage_pages_total{backend="file",outcome="written",tier=""}' in text
    assert 'hicache_storage_capacity_bytes{backend="file",measure="bound",tier=""}' in text
    backend.close()
