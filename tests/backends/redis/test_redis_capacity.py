"""The Redis backend reads its servers' limits: how full they are, the bound and the evictions."""

from __future__ import annotations

import time
from pathlib import Path

import prometheus_client

from hicache_storage import create_backend
from hicache_storage.backends.redis import provision
from hicache_storage.doctor import ServingPlan, diagnose
from hicache_storage.kit.services import LocalService

VALUE = 256 * 1024


def test_a_bounded_server_reports_its_bound_fill_and_evictions(tmp_path: Path) -> None:
    with provision.standalone(tmp_path / "redis", maxmemory="8mb") as service:
        backend = create_backend("redis", {**service.options, "prefix": "cap"})
        try:
            before = backend.stats()["capacity"]
            assert before["scope"] == "server" and before["bound_bytes"] == 8 * 2**20
            assert before["policy"] == "allkeys-lru" and before["evictions"] == 0
            for i in range(64):  # 16 MiB into a server bounded at 8
                backend.set(f"k{i}", bytes([i]) * VALUE)
            after = backend.stats()["capacity"]
            assert after["evictions"] > 0 and after["used_bytes"] > before["used_bytes"]
            assert after["used_bytes"] <= after["bound_bytes"] + VALUE
            labels = {"backend": "redis", "tier": "", "measure": "bound"}
            gauge = prometheus_client.REGISTRY.get_sample_value(
                "hicache_storage_capacity_bytes", labels
            )
            assert gauge is not None and gauge >= 8 * 2**20
        finally:
            backend.close()


def test_a_cluster_sums_its_primaries_and_has_no_bound(redis_cluster: LocalService) -> None:
    backend = create_backend("redis", {**redis_cluster.options, "prefix": "capsum"})
    try:
        for i in range(12):
            backend.set(f"k{i}", bytes(64 * 1024))
        capacity = backend.stats()["capacity"]
        assert capacity["scope"] == "server" and capacity["bound_bytes"] is None
        assert capacity["used_bytes"] > 12 * 64 * 1024
    finally:
        backend.clear()
        backend.close()


def test_a_stopped_server_leaves_stats_answering_with_the_reason(tmp_path: Path) -> None:
    with provision.standalone(tmp_path / "redis", deadline_s=1.0) as service:
        backend = create_backend("redis", {**service.options, "prefix": "capdown"})
        try:
            service.stop()
            start = time.monotonic()
            stats = backend.stats()
            assert time.monotonic() - start < 1.0 + 1.0
            assert "capacity" not in stats and stats["capacity_error"]
        finally:
            backend.close()


def test_doctor_names_a_server_without_a_bound_and_one_that_refuses_when_full(
    tmp_path: Path,
) -> None:
    import redis

    plan = ServingPlan(bytes_per_token=1024, prefetch_tokens=512, repeats=1)
    with provision.standalone(tmp_path / "redis") as service:
        found = {f.check: f for f in diagnose("redis", service.options, plan)}["capacity"]
        assert found.status == "warn" and "no bound" in found.detail
        assert found.fix is not None and "maxmemory" in found.fix
        client = redis.Redis.from_url(service.options["url"], password=service.options["password"])
        client.config_set("maxmemory", "64mb")
        client.config_set("maxmemory-policy", "noeviction")
        found = {f.check: f for f in diagnose("redis", service.options, plan)}["capacity"]
        assert found.status == "warn" and "noeviction" in found.detail
        client.config_set("maxmemory-policy", "allkeys-lru")
        found = {f.check: f for f in diagnose("redis", service.options, plan)}["capacity"]
        assert found.status == "ok" and "of 64.0 MiB" in found.detail
        client.close()
