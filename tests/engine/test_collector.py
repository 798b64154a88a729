"""The garbage collector while serving: frozen startup heap, collections between steps only.

The collector's state is process-wide; every test here leaves it as it found it (enabled,
nothing frozen, the default thresholds), which the fixture checks.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hicache_storage import StorageBackend, create_backend
from hicache_storage.engine.collector import CollectorPauses, ManagedCollection
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.model import LlamaModel
from hicache_storage.engine.scheduler import Request, Scheduler, StepRecord
from hicache_storage.errors import ConfigError

from .test_engine import CONFIG, build, conversations


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel(CONFIG)


@pytest.fixture(autouse=True)
def collector_state() -> Iterator[None]:
    """Every test starts and must end with automatic collection on and nothing frozen."""
    assert gc.isenabled() and not ManagedCollection.holding()
    thresholds = gc.get_threshold()
    yield
    try:
        assert not ManagedCollection.holding(), "a hold was left taken"
        assert gc.isenabled(), "automatic collection was left off"
        assert gc.get_freeze_count() == 0, "objects were left frozen"
    finally:
        while ManagedCollection.holding():
            ManagedCollection.release()
        gc.unfreeze()
        gc.enable()
        gc.set_threshold(*thresholds)


@pytest.fixture
def memory_backend() -> Iterator[StorageBackend]:
    backend = create_backend("memory")
    yield backend
    backend.close()


class Cycle:
    """An object that only the cycle collector frees."""

    def __init__(self) -> None:
        self.me = self


def test_a_hold_freezes_the_heap_and_turns_automatic_collection_off_until_released() -> None:
    ManagedCollection.hold()
    assert not gc.isenabled()
    assert gc.get_freeze_count() > 1000, "what was alive is frozen"
    ManagedCollection.hold()  # a second engine in the same process
    ManagedCollection.release()
    assert not gc.isenabled() and gc.get_freeze_count() > 1000, "one holder is left"
    ManagedCollection.release()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    ManagedCollection.release()  # no hold: nothing happens
    assert gc.isenabled()


def test_a_release_leaves_what_it_found_frozen_or_disabled() -> None:
    gc.freeze()
    gc.disable()
    try:
        before = gc.get_freeze_count()
        ManagedCollection.hold()
        ManagedCollection.release()
        assert gc.get_freeze_count() >= before, "the caller's frozen heap is not thawed"
        assert not gc.isenabled(), "the caller's disabled collector is not turned on"
    finally:
        gc.unfreeze()
        gc.enable()


def test_collect_due_runs_the_generation_automatic_collection_would() -> None:
    ManagedCollection.hold()
    try:
        gc.set_threshold(100, 2, 1)
        gc.collect()
        assert ManagedCollection.collect_due() is None, "nothing allocated: nothing due"
        kept = [[] for _ in range(50)]
        assert ManagedCollection.collect_due() is None, "under the youngest threshold"
        done = []
        for _ in range(9):
            kept.extend([] for _ in range(150))
            done.append(ManagedCollection.collect_due())
        # Each collection counts once for the generation above it, which is due once its count
        # passes its threshold: gen 1 after three gen-0 runs (3 > 2), gen 2 after two of gen 1,
        # the oldest due first.
        assert done == [0, 0, 0, 1, 0, 0, 0, 1, 2]
        garbage = Cycle()
        del garbage
        for _ in range(150):
            kept.append([])
        before = gc.get_count()[0]
        assert ManagedCollection.collect_due() == 0 and gc.get_count()[0] < before
    finally:
        ManagedCollection.release()


def test_pauses_count_every_collection_until_closed() -> None:
    pauses = CollectorPauses()
    try:
        assert pauses.take() == 0.0
        objects = [Cycle() for _ in range(20_000)]
        del objects
        gc.collect()
        first = pauses.take()
        assert first > 0 and pauses.full_passes == 1 and 0 < pauses.longest_s <= first
        assert pauses.take() == 0.0, "taken once"
        gc.collect(0)
        assert pauses.take() > 0 and pauses.full_passes == 1
    finally:
        pauses.close()
    gc.collect()
    assert pauses.take() == 0.0, "closed: no longer counting"
    pauses.close()  # idempotent


def test_pauses_nobody_closes_are_freed() -> None:
    import weakref

    pauses = CollectorPauses()
    ref = weakref.ref(pauses)
    callbacks = len(gc.callbacks)
    del pauses
    assert ref() is None, "the callback does not keep it alive"
    gc.collect()  # its callback, left behind, does nothing
    assert len(gc.callbacks) == callbacks


def test_a_managed_scheduler_collects_only_between_its_steps(
    model: LlamaModel, memory_backend: StorageBackend
) -> None:
    where: list[tuple[str, int]] = []

    def observe(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            where.append((threading.current_thread().name, info["generation"]))

    stop = threading.Event()

    def allocate() -> None:  # a storage thread's garbage, made while the scheduler serves
        while not stop.is_set():
            junk = [Cycle() for _ in range(500)]
            del junk
            time.sleep(0.001)

    cache = build(device_tokens=64, host_tokens=48, backend=memory_backend)
    engine = Engine(model, cache, managed_gc=True)
    assert engine.scheduler is not None
    steps: list[StepRecord] = []
    engine.scheduler.on_step = steps.append
    busy = threading.Thread(target=allocate, name="busy")
    gc.callbacks.append(observe)
    try:
        assert not gc.isenabled()
        busy.start()
        engine.serve([Request(prompt, 4) for prompt in conversations(rounds=3, clients=3)])
    finally:
        stop.set()
        busy.join()
        gc.callbacks.remove(observe)
        engine.close()
    assert gc.isenabled(), "closed: the collector is automatic again"
    assert where, "the serving made garbage enough to collect"
    assert {name for name, _ in where} == {threading.current_thread().name}
    assert sum(step.gc_s for step in steps) > 0, "the steps' records carry the pauses"


def test_an_unmanaged_scheduler_leaves_the_collector_alone(
    model: LlamaModel, memory_backend: StorageBackend
) -> None:
    cache = build(device_tokens=64, host_tokens=48, backend=memory_backend)
    with Engine(model, cache) as engine:
        assert gc.isenabled() and gc.get_freeze_count() == 0
        engine.generate(conversations(rounds=1, clients=1)[0], 2)


def test_managed_gc_must_be_a_bool(model: LlamaModel, memory_backend: StorageBackend) -> None:
    cache = build(device_tokens=64, host_tokens=48, backend=memory_backend)
    with pytest.raises(ConfigError, match="managed_gc"):
        Scheduler(model, cache, managed_gc=1)  # type: ignore[arg-type]
    cache.close()
