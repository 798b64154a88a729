"""Layers: degrade-to-miss, metrics, fault injection and their order in the default stack."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from typing_extensions import Buffer

from hicache_storage import (
    BackendTimeoutError,
    BackendUnavailableError,
    FaultConfig,
    FaultRule,
    InvalidKeyError,
    LayerConfig,
    StorageBackend,
    apply_layers,
)
from hicache_storage.backends.memory import MemoryBackend
from hicache_storage.layers import DegradeLayer, FaultInjectionLayer, ValidationLayer

from .helpers import make_pool


class DownBackend(StorageBackend):
    """A backend whose server is gone: every call raises an infrastructure error."""

    name = "down"

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        raise BackendUnavailableError("connection refused")

    def exists(self, key: str) -> bool:
        raise BackendTimeoutError("timed out after 0.1 s")

    def set(self, key: str, value: Buffer) -> bool:
        raise BackendUnavailableError("connection refused")


def test_degrade_turns_outages_into_counted_misses(caplog: pytest.LogCaptureFixture) -> None:
    # Without health, which would shed every call after the first (tests/test_health.py).
    backend = apply_layers(DownBackend(), LayerConfig(health=None))
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            assert backend.get("k") is None
        assert backend.exists("k") is False
        assert backend.set("k", b"v") is False
        assert backend.batch_exists(["a", "b"]) == 0
        assert backend.batch_get(["a", "b"], [bytearray(1), bytearray(1)]) == [False, False]
    degraded = backend.stats()["degraded"]
    assert degraded["errors"]["get"] == {"BackendUnavailableError": 5}
    assert degraded["errors"]["exists"] == {"BackendTimeoutError": 1}
    assert degraded["total"] == 5 + 1 + 1 + 1 + 1
    # metrics (inside degrade) saw the errors too: an outage is not reported as a miss
    assert backend.stats()["metrics"]["ops"]["get"]["errors"] == {"BackendUnavailableError": 5}
    assert "miss" not in backend.stats()["metrics"]["ops"]["get"]
    # logging is rate limited: one line for five identical failures
    assert sum("down get failed" in r.getMessage() for r in caplog.records) == 1


def test_caller_mistakes_pass_through_degrade() -> None:
    backend = apply_layers(DownBackend())
    with pytest.raises(InvalidKeyError):
        backend.get("../etc/passwd")


def test_without_degrade_errors_are_typed_and_builtin() -> None:
    backend = apply_layers(DownBackend(), LayerConfig(degrade=False))
    with pytest.raises(ConnectionError):
        backend.get("k")
    with pytest.raises(TimeoutError):
        backend.exists("k")


def test_fault_injection_is_seeded_per_thread() -> None:
    def run(seed: int) -> list[bool]:
        backend = FaultInjectionLayer(
            MemoryBackend(), FaultConfig(seed=seed, default=FaultRule(failure_rate=0.5))
        )
        out: list[bool] = []
        for i in range(64):
            try:
                backend.set(f"k{i}", b"v")
                out.append(True)
            except BackendUnavailableError:
                out.append(False)
        return out

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert 10 < sum(run(1)) < 54

    results: dict[str, list[bool]] = {}

    def worker() -> None:
        results[threading.current_thread().name] = run(1)

    threads = [threading.Thread(target=worker, name=f"t{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["t0"] != results["t1"], "threads must diverge"


def test_batch_faults_are_per_key_and_never_wrong_bytes() -> None:
    memory = MemoryBackend()
    keys = [f"k{i}" for i in range(200)]
    memory.batch_set(keys, [bytes([i % 256]) * 8 for i in range(200)])
    backend = apply_layers(
        memory,
        LayerConfig(faults=FaultConfig(seed=7, ops={"batch_get": FaultRule(failure_rate=0.3)})),
    )
    assert backend.batch_exists(keys) == 200
    outs = [bytearray(8) for _ in keys]
    hits = backend.batch_get(keys, outs)
    assert 0 < hits.count(False) < 200
    for i, (hit, out) in enumerate(zip(hits, outs, strict=True)):
        assert bytes(out) == (bytes([i % 256]) * 8 if hit else bytes(8))
    assert backend.stats()["faults"]["batch_get"] == hits.count(False)


def test_v1_faults_leave_failed_pages_untouched() -> None:
    pool = make_pool("mha", "page_first")
    memory = MemoryBackend()
    backend = apply_layers(
        memory,
        LayerConfig(faults=FaultConfig(seed=3, ops={"batch_get_v1": FaultRule(failure_rate=0.5)})),
    )
    backend.register_host_pool(pool)
    page = pool.page_size
    pool.kv_buffer.fill_(1.0)
    keys = [f"p{i}" for i in range(8)]
    assert backend.batch_set_v1(keys, list(range(8 * page))) == [True] * 8
    pool.kv_buffer.fill_(0.0)
    hits = backend.batch_get_v1(keys, list(range(8 * page)))
    assert 0 < sum(hits) < 8
    for i, hit in enumerate(hits):
        assert bool((pool.get_data_page(i * page) == (1.0 if hit else 0.0)).all())


def test_fault_delay_applies() -> None:
    backend = FaultInjectionLayer(
        MemoryBackend(), FaultConfig(ops={"exists": FaultRule(delay_s=0.05)})
    )
    import time

    start = time.perf_counter()
    backend.exists("k")
    assert time.perf_counter() - start >= 0.05


def test_default_stack_order() -> None:
    backend = apply_layers(MemoryBackend(), LayerConfig(faults=FaultConfig()))
    chain: list[str] = []
    node: Any = backend
    while hasattr(node, "inner"):
        chain.append(type(node).__name__)
        node = node.inner
    assert chain == [
        "ValidationLayer",
        "DegradeLayer",
        "HealthLayer",
        "MetricsLayer",
        "VerifyLayer",
        "FaultInjectionLayer",
    ]
    assert isinstance(backend, ValidationLayer)
    assert isinstance(backend.inner, DegradeLayer)
    assert backend.unwrap() is node  # type: ignore[attr-defined]
    assert backend.capabilities == MemoryBackend.capabilities


def test_prometheus_export() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    backend = apply_layers(MemoryBackend())
    backend.set("promkey", b"v")
    backend.get("promkey")
    text = prometheus_client.generate_latest().decode()
    assert 'hicache_storage_keys_total{backend="memory",op="get",outcome="hit",tier=""}' in text
    assert "hicache_storage_call_seconds_bucket" in text


def test_latency_quantiles_are_reported() -> None:
    backend = apply_layers(MemoryBackend())
    for i in range(20):
        backend.set(f"q{i}", b"v")
    latency = backend.stats()["metrics"]["ops"]["set"]["latency_s"]
    assert latency["p50"] is not None and latency["p99"] >= latency["p50"]


def test_first_calls_from_many_threads_never_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14 item 6: the label cache was filled without the lock (KeyError on a fresh backend).

    A slow ``labels()`` widens the window between creating a call's children so that the race
    happens on every run rather than by chance.
    """
    from hicache_storage.layers import metrics

    prom = metrics._prometheus()
    assert prom is not None, "prometheus-client is a test dependency"
    real = type(prom.seconds).labels

    def slow_labels(self: Any, *labels: str) -> Any:
        time.sleep(0.01)
        return real(self, *labels)

    monkeypatch.setattr(type(prom.seconds), "labels", slow_labels)
    backend = apply_layers(MemoryBackend())
    barrier = threading.Barrier(16)
    errors: list[BaseException] = []

    def first_call(i: int) -> None:
        barrier.wait()
        try:
            backend.get(f"fresh{i}")
        except BaseException as exc:  # noqa: BLE001 - every failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert backend.stats()["metrics"]["ops"]["get"]["calls"] == 16
