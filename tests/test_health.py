"""The health layer: one timeout, then misses at once while a background probe waits for the store.

A fake store that hangs (every call waits out its deadline, then raises ``BackendTimeoutError``)
stands in for a partitioned server; ``tests/backends/redis/test_redis_health.py`` pauses a real
Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from typing_extensions import Buffer

from hicache_storage import (
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    FaultConfig,
    FaultRule,
    LayerConfig,
    StorageBackend,
    apply_layers,
    load_config,
)
from hicache_storage.backends.memory import MemoryBackend
from hicache_storage.config import HealthConfig
from hicache_storage.layers.health import PROBE_KEY

from .helpers import make_pool, page_indices

DEADLINE_S = 0.5
QUICK_S = DEADLINE_S / 2
"""A shed call returns well within the deadline: a call that reached the hung store takes it all."""
FAST = HealthConfig(probe_interval_s=0.05, max_probe_interval_s=0.2)


class HangingStore(MemoryBackend):
    """A memory store that can hang: while hung, every call waits ``DEADLINE_S``, then times out.

    Counts the calls that reached it, the probe's apart.
    """

    name = "hanging"

    def __init__(self, error: type[Exception] = BackendTimeoutError) -> None:
        super().__init__()
        self.hung = threading.Event()
        self.error = error
        self.calls = 0
        self.probes = 0
        self._count_lock = threading.Lock()

    def _reach(self, key: str) -> None:
        with self._count_lock:
            if key == PROBE_KEY:
                self.probes += 1
            else:
                self.calls += 1
        if self.hung.is_set():
            if self.error is BackendTimeoutError:
                time.sleep(DEADLINE_S)
            raise self.error(f"no answer within {DEADLINE_S}s")

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        self._reach(key)
        return super().get(key, out)

    def exists(self, key: str) -> bool:
        self._reach(key)
        return super().exists(key)

    def set(self, key: str, value: Buffer) -> bool:
        self._reach(key)
        return super().set(key, value)

    def batch_exists(self, keys: Sequence[str]) -> int:
        self._reach(keys[0] if keys else "")
        return super().batch_exists(keys)


@pytest.fixture
def store() -> HangingStore:
    return HangingStore()


@pytest.fixture
def stacked(store: HangingStore) -> Iterator[StorageBackend]:
    backend = apply_layers(store, LayerConfig(health=FAST))
    yield backend
    store.hung.clear()
    backend.close()


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.monotonic()
    result = call()
    return time.monotonic() - start, result


def wait_until(condition: Callable[[], bool], bound_s: float) -> bool:
    until = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > until:
            return False
        time.sleep(0.01)
    return True


def every_call(backend: StorageBackend, n: int) -> dict[str, Callable[[], object]]:
    """One of each call, with what it must answer while the store is down."""
    pool = backend.host_pool
    pages = page_indices(pool, range(2))
    keys = [f"k{n}", f"j{n}"]
    return {
        "get": lambda: backend.get("k") is None,
        "exists": lambda: backend.exists("k") is False,
        "set": lambda: backend.set(f"new{n}", b"x") is False,
        "batch_get": lambda: backend.batch_get(keys, [bytearray(1)] * 2) == [False] * 2,
        "batch_set": lambda: backend.batch_set(keys, [b"x"] * 2) == [False] * 2,
        "batch_exists": lambda: backend.batch_exists(["k", "j"]) == 0,
        "batch_get_v1": lambda: backend.batch_get_v1(keys, pages) == [False] * 2,
        "batch_set_v1": lambda: backend.batch_set_v1(keys, pages) == [False] * 2,
        "delete": lambda: backend.delete("k") is False,
    }


def test_after_one_timeout_every_call_is_a_miss_at_once(
    store: HangingStore, stacked: StorageBackend, caplog: pytest.LogCaptureFixture
) -> None:
    stacked.register_host_pool(make_pool("mha", "layer_first", pages=4))
    assert stacked.set("k", b"v")
    store.hung.set()
    with caplog.at_level(logging.WARNING):
        elapsed, got = timed(lambda: stacked.get("k"))
        assert got is None and elapsed >= DEADLINE_S  # the call that finds the store hung waits
        reached = store.calls
        for n in range(8):
            for op, call in every_call(stacked, n).items():
                elapsed, ok = timed(call)
                assert ok is True, op
                assert elapsed < QUICK_S, f"{op} waited {elapsed:.2f}s for a store known down"
    assert store.calls == reached, "a call reached the store while it was down"
    stats = stacked.stats()
    health = stats["health"]
    assert health["state"] == "down" and health["trips"] == 1
    assert health["shed"] == dict.fromkeys(sorted(every_call(stacked, 0)), 8)
    assert health["shed_total"] == 8 * 9
    # only the call that met the hung store is a backend error; shed calls are not
    assert stats["degraded"]["total"] == 1
    assert stats["degraded"]["errors"] == {"get": {"BackendTimeoutError": 1}}
    assert sum("did not answer" in r.getMessage() for r in caplog.records) == 1


def test_a_probe_that_answers_brings_the_store_back(
    store: HangingStore, stacked: StorageBackend, caplog: pytest.LogCaptureFixture
) -> None:
    assert stacked.set("k", b"v")
    store.hung.set()
    with caplog.at_level(logging.WARNING):
        assert stacked.exists("k") is False
        assert wait_until(lambda: store.probes >= 2, 5 * DEADLINE_S), "no probe in the background"
        assert stacked.get("k") is None
        store.hung.clear()
        assert wait_until(lambda: stacked.stats()["health"]["state"] == "up", 5 * DEADLINE_S)
    assert stacked.get("k") == b"v"
    assert stacked.set("k2", b"w") and stacked.exists("k2")
    health = stacked.stats()["health"]
    assert health["trips"] == 1 and health["probes"] >= 2 and health["down_s"] > 0
    assert sum("answers again" in r.getMessage() for r in caplog.records) == 1


def test_calls_in_flight_when_it_trips_just_finish(
    store: HangingStore, stacked: StorageBackend
) -> None:
    store.hung.set()
    results: list[object] = []
    errors: list[BaseException] = []

    together = threading.Barrier(4)

    def lookup() -> None:
        together.wait()
        try:
            results.append(stacked.batch_exists(["k", "j"]))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=lookup) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and results == [0] * 4
    assert store.calls == 4  # all four were inside the store before the first timed out
    assert stacked.stats()["health"]["trips"] == 1


def test_a_refused_connection_trips_it_too_and_probes_back_off() -> None:
    store = HangingStore(error=BackendUnavailableError)
    slow = HealthConfig(probe_interval_s=0.1, max_probe_interval_s=0.4)
    backend = apply_layers(store, LayerConfig(health=slow))
    try:
        store.hung.set()
        assert backend.get("k") is None
        assert backend.get("k") is None
        assert store.calls == 1
        time.sleep(1.0)
        # waits of 0, 0.1, 0.2, 0.4, 0.4 s: a handful of probes, not a busy loop
        assert 2 <= store.probes <= 8, store.probes
    finally:
        backend.close()


@pytest.mark.parametrize(
    "layers",
    [
        pytest.param(LayerConfig(health=FAST), id="a miss"),
        pytest.param(
            LayerConfig(health=FAST, faults=FaultConfig(ops={"get": FaultRule(failure_rate=1.0)})),
            id="an injected fault",
        ),
    ],
)
def test_what_does_not_trip_it(layers: LayerConfig) -> None:
    backend = apply_layers(MemoryBackend(), layers)
    try:
        for _ in range(3):
            assert backend.get("absent") is None
        health = backend.stats()["health"]
        assert (health["state"], health["trips"], health["shed_total"]) == ("up", 0, 0)
    finally:
        backend.close()


class RefusedLogin(BackendUnavailableError):
    """The store answered: it refuses these credentials, and a retry cannot change that."""

    retryable = False


@pytest.mark.parametrize("error", [BackendIOError, RefusedLogin])
def test_an_answer_that_is_an_error_does_not_trip_it(error: type[Exception]) -> None:
    store = HangingStore(error=error)
    backend = apply_layers(store, LayerConfig(health=FAST))
    try:
        store.hung.set()
        for _ in range(3):
            assert backend.get("k") is None
        assert store.calls == 3 and backend.stats()["health"]["trips"] == 0
    finally:
        backend.close()


def test_close_stops_the_probe(store: HangingStore) -> None:
    backend = apply_layers(store, LayerConfig(health=FAST))
    store.hung.set()
    assert backend.get("k") is None
    assert wait_until(lambda: store.probes >= 1, 5 * DEADLINE_S)
    probers = [t for t in threading.enumerate() if t.name.startswith("hicache-health-")]
    assert len(probers) == 1
    closer = threading.Thread(target=backend.close)
    closer.start()
    closer.join(5 * DEADLINE_S)
    assert not closer.is_alive(), "close() waits for a probe that never stops"
    assert not probers[0].is_alive()
    probes = store.probes
    time.sleep(3 * FAST.max_probe_interval_s)
    assert store.probes == probes


def test_health_config_is_checked_and_can_be_turned_off() -> None:
    with pytest.raises(ConfigError, match="max_probe_interval_s"):
        load_config(
            {"layers": {"health": {"probe_interval_s": 2, "max_probe_interval_s": 1}}}, env={}
        )
    with pytest.raises(ConfigError, match="probe_interval_s"):
        load_config({"layers": {"health": {"probe_interval_s": -1}}}, env={})
    off = load_config({}, env={"HICACHE_LAYERS__HEALTH": "null"})
    assert off.layers.health is None and "health" not in off.layers.layer_stack()
