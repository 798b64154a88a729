"""``close()`` while other threads are inside calls.

:class:`~hicache_storage.kit.CallGate` and :func:`~hicache_storage.kit.closed_guard`: a call in
flight completes or raises ``BackendClosedError``, nothing is released under it, and the
conformance check ``TestCloseRace`` fails a backend that releases under a running call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest
from typing_extensions import Buffer

from hicache_storage import create_backend
from hicache_storage.backend import StorageBackend, copy_into
from hicache_storage.buffers import as_readable
from hicache_storage.conformance.checks.close_race import KEYS, _Race
from hicache_storage.errors import BackendClosedError
from hicache_storage.kit import CallGate, closed_guard
from hicache_storage.layers import ValidationLayer

WAIT_S = 10.0


class _Store(StorageBackend):
    """A dict that close() drops; ``get`` of ``"block"`` waits inside the call until released."""

    name = "close-race-store"

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] | None = {}
        self.entered = threading.Event()
        self.proceed = threading.Event()
        self.released_in: str | None = None

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        if key == "block":
            self.entered.set()
            self.proceed.wait(WAIT_S)
        data = self.data
        assert data is not None, "get ran after close() released the store"
        threading.Event().wait(0.0005)  # a call that takes a while, so close() lands inside
        value = data.get(key)
        if value is None:
            return None
        return value if out is None else copy_into(value, out)

    def exists(self, key: str) -> bool:
        data = self.data
        assert data is not None, "exists ran after close() released the store"
        return key in data

    def set(self, key: str, value: Buffer) -> bool:
        data = self.data
        assert data is not None, "set ran after close() released the store"
        data.setdefault(key, bytes(as_readable(value)))
        return True

    def _close(self) -> None:
        self.released_in = threading.current_thread().name
        self.data = None


@closed_guard
class _GuardedStore(_Store):
    """The same store behind the gate."""

    close_timeout_s = WAIT_S


@pytest.fixture
def store() -> Iterator[_GuardedStore]:
    instance = _GuardedStore()
    yield instance
    instance.proceed.set()
    instance.close()


def _blocked_get(store: _Store) -> tuple[threading.Thread, dict[str, object]]:
    """Start ``get("block")`` in a thread; return once it is inside the call."""
    store.set("block", b"value")
    answer: dict[str, object] = {}

    def call() -> None:
        try:
            answer["value"] = store.get("block")
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            answer["error"] = exc

    thread = threading.Thread(target=call, name="caller")
    thread.start()
    assert store.entered.wait(WAIT_S)
    return thread, answer


def test_close_waits_for_the_call_in_flight_and_refuses_new_ones(store: _GuardedStore) -> None:
    thread, answer = _blocked_get(store)
    closer = threading.Thread(target=store.close, name="closer")
    closer.start()
    while not store.closed:
        threading.Event().wait(0.001)
    assert store.data is not None, "released while a call was inside"
    with pytest.raises(BackendClosedError):
        store.exists("block")
    with pytest.raises(BackendClosedError):
        ValidationLayer(store).get("block")
    store.proceed.set()
    thread.join(WAIT_S)
    closer.join(WAIT_S)
    assert answer == {"value": b"value"}
    assert store.data is None and store.released_in == "closer"


def test_call_running_past_the_timeout_keeps_resources_until_it_leaves(
    store: _GuardedStore, caplog: pytest.LogCaptureFixture
) -> None:
    store.close_timeout_s = 0.01
    thread, answer = _blocked_get(store)
    with caplog.at_level(logging.WARNING, logger="hicache_storage.kit.guard"):
        store.close()
    assert store.closed and store.data is not None
    assert "1 calls still running" in caplog.text
    store.proceed.set()
    thread.join(WAIT_S)
    assert answer == {"value": b"value"}
    assert store.data is None and store.released_in == "caller"


def test_close_from_inside_a_call_releases_when_that_call_returns() -> None:
    @closed_guard
    class ClosingStore(_Store):
        def exists(self, key: str) -> bool:
            self.close()
            return super().exists(key)

    instance = ClosingStore()
    instance.set("a", b"x")
    assert instance.exists("a") is True
    assert instance.closed and instance.data is None
    instance.close()
    with pytest.raises(BackendClosedError):
        instance.get("a")


def test_nested_calls_of_the_default_batches_are_refused_once_closed(
    store: _GuardedStore,
) -> None:
    store.set("k", b"v")
    assert store.batch_get(["k"], [bytearray(1)]) == [True]
    store.close()
    with pytest.raises(BackendClosedError):
        store.batch_get(["k"], [bytearray(1)])


def test_gate_failed_deferred_release_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = CallGate("test gate")

    def release() -> None:
        raise RuntimeError("boom")

    gate.enter()
    assert gate.shut(release, 0.0) is False
    assert gate.shut(release, 0.0) is False
    with pytest.raises(BackendClosedError, match="test gate is closed"):
        gate.enter()
    with caplog.at_level(logging.WARNING, logger="hicache_storage.kit.guard"):
        gate.leave()
    assert "releasing test gate after its last call failed" in caplog.text


def test_gate_releases_at_once_when_nothing_is_inside() -> None:
    gate = CallGate("idle gate")
    released: list[bool] = []
    with gate.inside():
        pass
    assert gate.shut(lambda: released.append(True), 1.0) is True
    assert released == [True] and gate.is_shut


@pytest.mark.parametrize("guarded", [False, True], ids=["racy", "guarded"])
def test_close_race_check_fails_a_backend_that_releases_under_a_call(guarded: bool) -> None:
    """The conformance check's race, run in process: it has teeth, and the guard passes it."""
    problems: list[str] = []
    for seed in range(3):
        instance = _GuardedStore() if guarded else _Store()
        race = _Race(instance, [f"race{seed}-{i}" for i in range(KEYS)], seed=seed)
        race.prepare()
        problems += race.run(instance.close)
    if guarded:
        assert problems == []
    else:
        assert any("after close() released the store" in p for p in problems), problems


def test_memory_backend_through_the_layers_survives_the_race() -> None:
    for seed in range(3):
        instance = create_backend("memory")
        race = _Race(instance, [f"m{seed}-{i}" for i in range(KEYS)], seed=seed)
        race.prepare()
        assert race.run(instance.close) == []
