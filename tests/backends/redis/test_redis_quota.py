"""Namespace quotas on a real Redis (one server and a 3-node cluster): tenants share the server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from hicache_storage import StorageBackend, create_backend
from hicache_storage.backends.redis.backend import connect
from hicache_storage.backends.redis.config import RedisConfig
from hicache_storage.config import LayerConfig, QuotaConfig
from hicache_storage.kit.services import LocalService

VALUE = 64 * 1024
QUOTA = 16 * VALUE


@pytest.fixture
def tenants(redis_service: LocalService) -> Iterator[Any]:
    built: list[StorageBackend] = []

    def tenant(prefix: str, quota: int = QUOTA) -> StorageBackend:
        layers = LayerConfig(quota=QuotaConfig(bytes=quota))
        options = {**redis_service.options, "prefix": prefix}
        backend = create_backend("redis", options, layers=layers)
        built.append(backend)
        return backend

    yield tenant
    for backend in built:
        backend.clear()
        backend.close()


def _stored(service: LocalService, prefix: str) -> int:
    """Bytes of the values stored under ``prefix``, read from the servers (not the ledger)."""
    client = connect(RedisConfig(**service.options), pass_through=False)
    try:
        names = [
            n
            for n in client.scan_iter(match=f"{prefix}:*", count=1000)
            if b":" not in n[len(prefix) + 1 :]
        ]
        return sum(int(client.strlen(name)) for name in names)
    finally:
        client.close()


def test_writers_sharing_a_namespace_never_pass_its_quota(
    tenants: Any, redis_service: LocalService
) -> None:
    writers = [tenants("shared") for _ in range(2)]  # two clients, as two processes would be
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _stored(redis_service, "shared"))

    accepted = [0] * 8

    def write(w: int) -> None:
        backend = writers[w % 2]
        for i in range(24):
            accepted[w] += bool(backend.set(f"w{w}-{i}", bytes([w]) * VALUE))

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=write, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()
    quota = writers[0].stats()["quota"]
    assert quota["used_bytes"] == _stored(redis_service, "shared") <= QUOTA
    assert 0 < peak <= QUOTA + VALUE
    assert quota["held_bytes"] == 0
    # A set may fail under load (a miss, within its deadline); every page accepted is either
    # still stored or was evicted to make room.
    assert sum(accepted) > 8 * 24 // 2
    evicted = sum(w.stats()["quota"].get("evicted_pages", 0) for w in writers)
    assert evicted >= sum(accepted) - QUOTA // VALUE
    assert not any(w.stats()["quota"].get("shed_pages") for w in writers)  # room was waited for


def test_one_tenant_filling_its_quota_never_evicts_or_clears_another(tenants: Any) -> None:
    quiet, loud = tenants("quiet"), tenants("loud")
    for i in range(8):
        assert quiet.set(f"q{i}", bytes([i]) * VALUE)
    for i in range(64):
        assert loud.set(f"l{i}", bytes([i]) * VALUE)
    assert all(quiet.get(f"q{i}") == bytes([i]) * VALUE for i in range(8))
    loud.clear()
    assert loud.stats()["quota"]["pages"] == 0
    assert quiet.stats()["quota"]["pages"] == 8 and quiet.exists("q7")


def test_the_ledger_is_never_taken_for_pages(tenants: Any, redis_service: LocalService) -> None:
    backend = tenants("led")
    backend.set("a", bytes(VALUE))
    backend.clear()  # clears the pages; the ledger's keys are not the namespace's pages
    assert backend.batch_exists(["a"]) == 0
    assert backend.stats()["quota"]["used_bytes"] == 0
    assert _stored(redis_service, "led") == 0


def test_a_delete_leaves_the_ledger_before_the_store(
    tenants: Any, redis_service: LocalService
) -> None:
    backend = tenants("del")
    assert backend.set("a", bytes(VALUE)) and backend.set("b", bytes(VALUE))
    assert backend.delete("a")
    quota = backend.stats()["quota"]
    assert (quota["used_bytes"], quota["pages"]) == (VALUE, 1) and _stored(redis_service, "del")
    ledger = backend.unwrap().quota_ledger()
    try:
        assert ledger.forget(["b", "gone"]) == [("b", VALUE)]  # what a failed delete puts back
    finally:
        ledger.close()
    assert backend.stats()["quota"]["used_bytes"] == 0
