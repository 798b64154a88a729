"""Taking values out: eviction keeps a bounded store under its bound; ``delete``; ``clear``."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest

from hicache_storage.backend import StorageBackend
from hicache_storage.capabilities import Capabilities
from hicache_storage.conformance.checks.common import MiB, _bytes, requires
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.workers import make_value
from hicache_storage.errors import UnsupportedOperationError

__all__ = ["TestBounded", "TestClear", "TestDelete"]


def _bound_of(instance: StorageBackend, factory: BackendFactory) -> int | None:
    for source in (instance.stats(), factory.options):
        value = source.get("max_bytes")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _stat_int(stats: dict[str, Any], name: str) -> int:
    value = stats.get(name)
    assert isinstance(value, int) and not isinstance(value, bool), (
        f"a bounded backend must report {name!r} as an int in stats(); got {value!r} "
        f"(required: max_bytes, bytes, objects, evictions)"
    )
    return value


def _reporting(fn: Any, i: int, problems: list[str], lock: threading.Lock) -> None:
    """Run ``fn(i)`` on a check's thread; what it raises becomes one of the check's problems."""
    try:
        fn(i)
    except BaseException as exc:  # noqa: BLE001 - reported as a problem
        with lock:
            problems.append(f"{fn.__name__} {i} raised {type(exc).__name__}: {exc}")


class TestBounded:
    """Usage stays under the configured bound while recent values stay readable."""

    @requires("bounded")
    def test_usage_stays_under_bound_recent_readable(
        self, backend: StorageBackend, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        bound = _bound_of(backend, hicache_factory)
        assert bound is not None, "a bounded backend must report max_bytes in stats() or options"
        if bound > 256 * MiB:
            pytest.skip(f"bound of {bound} bytes is too large to overfill quickly")
        chunk = max(1, bound // 16)
        keys = k.many("fill", 40)
        for key in keys:
            backend.set(key, make_value(key, chunk))
            usage = _stat_int(backend.stats(), "bytes")
            assert usage <= bound, f"after set({key!r}), stats()['bytes'] {usage} exceeds {bound}"
        last = backend.get(keys[-1])
        assert last is not None and _bytes(last) == make_value(keys[-1], chunk), (
            f"get({keys[-1]!r}), the value just written, did not return it"
        )
        assert sum(backend.exists(key) for key in keys) < len(keys), "nothing was evicted"

    @requires("bounded")
    def test_stats_report_usage_bound_and_evictions(
        self, backend: StorageBackend, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """``stats()`` reports max_bytes, bytes, objects and evictions, and they add up.

        After every ``set``: ``bytes <= max_bytes``, ``bytes`` covers the values still readable,
        ``objects`` counts at least them, and ``evictions`` grew by at least the number of
        values that went away.
        """
        bound = _bound_of(backend, hicache_factory)
        if bound is not None and bound > 256 * MiB:
            pytest.skip(f"bound of {bound} bytes is too large to overfill quickly")
        stats = backend.stats()
        bound = _stat_int(stats, "max_bytes")
        evictions = _stat_int(stats, "evictions")
        first = evictions
        chunk = max(1, bound // 16)
        keys = k.many("acct", 40)
        present: list[str] = []
        for key in keys:
            assert backend.set(key, make_value(key, chunk)), f"set({key!r}) of {chunk} bytes failed"
            present.append(key)
            still = [name for name in present if backend.exists(name)]
            gone = len(present) - len(still)
            present = still
            stats = backend.stats()
            usage = _stat_int(stats, "bytes")
            objects = _stat_int(stats, "objects")
            now = _stat_int(stats, "evictions")
            assert _stat_int(stats, "max_bytes") == bound, "stats()['max_bytes'] changed"
            assert usage <= bound, (
                f"after set({key!r}): stats()['bytes'] is {usage}, over max_bytes {bound}"
            )
            assert usage >= chunk * len(present), (
                f"after set({key!r}): stats()['bytes'] is {usage}, but {len(present)} values of "
                f"{chunk} bytes are readable ({chunk * len(present)} bytes)"
            )
            assert objects >= len(present), (
                f"after set({key!r}): stats()['objects'] is {objects}, but {len(present)} "
                f"objects are readable"
            )
            assert now - evictions >= gone, (
                f"after set({key!r}): {gone} values went away but stats()['evictions'] grew "
                f"from {evictions} to {now}"
            )
            evictions = now
        assert len(present) < len(keys), f"{len(keys)} values of {chunk} bytes all stayed"
        assert evictions > first, f"values were evicted but stats()['evictions'] stayed at {first}"

    @requires("bounded")
    def test_readers_racing_eviction_none_or_whole(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """Readers read values near eviction while a writer overfills the bound; None or whole.

        Evictions run while reads of the evicted keys are in flight: a read must not return
        bytes of the space's next owner, nor part of a value, nor raise.
        """
        layers = msgspec.structs.replace(hicache_factory.layers, degrade=False, faults=None)
        with hicache_factory(layers) as instance:
            bound = _bound_of(instance, hicache_factory)
            assert bound is not None, "a bounded backend must report max_bytes in stats()"
            if bound > 64 * MiB:
                pytest.skip(f"bound of {bound} bytes is too large to overfill quickly")
            chunk = max(1, min(bound // 8, MiB))
            written: list[str] = []
            problems: list[str] = []
            lock = threading.Lock()
            stop = threading.Event()
            target = max(3 * bound // chunk, 64)

            def writer(w: int) -> None:
                i, start = 0, time.monotonic()
                while not stop.is_set() and not problems:
                    elapsed = time.monotonic() - start
                    if elapsed > 3.0 or (elapsed > 0.8 and i >= target):
                        return
                    key = k(f"ev{w}-{i}")
                    instance.set(key, make_value(key, chunk))
                    with lock:
                        written.append(key)
                    i += 1

            def reader(r: int) -> None:
                out = bytearray(chunk)
                while not stop.is_set():
                    with lock:
                        recent = written[-12:]  # evicted, next to go, and new
                    for key in recent:
                        if r == 0:
                            got = instance.get(key)
                        elif r == 1:
                            got = out if instance.get(key, out) is not None else None
                        else:
                            outs = [bytearray(chunk)]
                            got = outs[0] if instance.batch_get([key], outs) == [True] else None
                        if got is not None and _bytes(got) != make_value(key, chunk):
                            with lock:
                                problems.append(
                                    f"reader {r}: a read of {key!r} racing evictions returned "
                                    f"{chunk} bytes that are not its value (another key's, or "
                                    f"part of it)"
                                )

            def run(fn: Any, i: int) -> None:
                try:
                    _reporting(fn, i, problems, lock)
                finally:
                    if fn is writer:
                        stop.set()

            threads = [threading.Thread(target=run, args=(writer, 0))]
            threads += [threading.Thread(target=run, args=(reader, r)) for r in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            cleanup(hicache_factory, instance, k)
        assert not problems, f"{len(problems)} bad reads racing eviction; first: {problems[0]}"

    @requires("bounded")
    def test_bound_holds_under_concurrent_writers(
        self, backend: StorageBackend, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """8 writers overfill the bound together; ``stats()['bytes']`` never passes it.

        A watcher reads ``stats()`` while they write: writers that each check the bound and
        then write can pass it together, which one writer at a time never shows. Each writer's
        last value, where it is still stored, reads back whole.
        """
        bound = _bound_of(backend, hicache_factory)
        assert bound is not None, "a bounded backend must report max_bytes in stats() or options"
        if bound > 64 * MiB:
            pytest.skip(f"bound of {bound} bytes is too large to overfill quickly")
        writers, chunk = 8, max(1, min(bound // 16, MiB))
        rounds = max(2 * bound // (chunk * writers), 4)
        problems: list[str] = []
        lock = threading.Lock()
        done = threading.Event()
        last: dict[int, str] = {}

        def write(w: int) -> None:
            for i in range(rounds):
                key = k(f"cb{w}-{i}")
                if backend.set(key, make_value(key, chunk)):
                    last[w] = key

        def watch(_: int) -> None:
            while not done.is_set():
                usage = _stat_int(backend.stats(), "bytes")
                if usage > bound:
                    with lock:
                        problems.append(f"stats()['bytes'] was {usage}, over max_bytes {bound}")
                    return

        watcher = threading.Thread(target=_reporting, args=(watch, 0, problems, lock))
        threads = [
            threading.Thread(target=_reporting, args=(write, w, problems, lock))
            for w in range(writers)
        ]
        watcher.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        done.set()
        watcher.join(timeout=30)
        assert not problems, f"{len(problems)} problems while 8 writers filled: {problems[0]}"
        usage = _stat_int(backend.stats(), "bytes")
        assert usage <= bound, f"after 8 writers: stats()['bytes'] {usage} over {bound}"
        for w, key in last.items():
            value = backend.get(key)
            if value is not None:
                assert _bytes(value) == make_value(key, chunk), (
                    f"writer {w}'s last value {key!r} read back as other bytes"
                )
        cleanup(hicache_factory, backend, k)


class TestDelete:
    """``delete`` removes a key, reports whether it existed, and frees it for a new value."""

    @requires("delete")
    def test_delete_existing_removes_key(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.set(k("d"), b"value")
        assert backend.delete(k("d")) is True
        assert backend.exists(k("d")) is False and backend.get(k("d")) is None
        assert backend.batch_exists([k("d")]) == 0

    @requires("delete")
    def test_delete_missing_false(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.delete(k("absent")) is False

    @requires("delete")
    def test_set_after_delete_stores_new_value(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.set(k("d"), b"old value")
        assert backend.delete(k("d"))
        assert backend.set(k("d"), b"new")
        got = backend.get(k("d"))
        assert got is not None and _bytes(got) == b"new"

    def test_delete_unclaimed_raises_unsupported(
        self, backend: StorageBackend, capabilities: Capabilities, k: Keyspace
    ) -> None:
        if capabilities.delete:
            assert backend.delete(k("absent")) is False
        else:
            with pytest.raises(UnsupportedOperationError):
                backend.delete(k("absent"))


class TestClear:
    """``clear()`` removes every key set before it, and none set after it."""

    def test_clear_removes_keys_set_before_keeps_keys_set_after(
        self, hicache_factory: BackendFactory, capabilities: Capabilities, k: Keyspace
    ) -> None:
        """Keys set before ``clear()`` are gone from every read path; keys set after it stay.

        The keys before it are set by this instance and, when the store is shared or
        persistent, by another instance (which a clear of only this instance's index misses);
        with ``persistent`` a new instance must agree.
        """
        before = {key: make_value(key, 700) for key in k.many("before", 4)}
        by_other: dict[str, bytes] = {}
        if capabilities.shared or capabilities.persistent:
            by_other = {key: make_value(key, 500) for key in k.many("other", 2)}
            with hicache_factory() as other:
                for key, value in by_other.items():
                    assert other.set(key, value), f"set({key!r}) on another instance failed"
        names = list(before)
        renewed = make_value(f"{names[0]}:new", 900)
        kept = {**{key: make_value(key, 300) for key in k.many("after", 3)}, names[0]: renewed}
        gone = {**{n: before[n] for n in names[1:]}, **by_other}
        try:
            with hicache_factory() as instance:
                for key in names[:2]:
                    assert instance.set(key, before[key]), f"set({key!r}) failed"
                assert instance.batch_set(names[2:], [before[n] for n in names[2:]]) == [True] * 2
                for key in by_other:
                    instance.get(key)  # let it index or cache the other instance's keys
                try:
                    instance.clear()
                except UnsupportedOperationError:
                    pytest.skip("backend does not support clear()")
                _assert_cleared(instance, {**before, **by_other}, "", by_other)
                for key, value in kept.items():
                    assert instance.set(key, value), f"set({key!r}) after clear() failed"
                _assert_present(instance, kept, "after clear()")
            if capabilities.persistent:
                with hicache_factory() as reopened:
                    _assert_cleared(reopened, gone, "read by a new instance", by_other)
                    _assert_present(reopened, kept, "after clear(), by a new instance")
        finally:
            cleanup(hicache_factory, None, k)


def _assert_cleared(
    instance: StorageBackend, values: dict[str, bytes], where: str, by_other: dict[str, bytes]
) -> None:
    for key, value in values.items():
        who = "another instance" if key in by_other else "this instance"
        context = f"{key!r}, set by {who} before clear(){', ' + where if where else ''}"
        reads = {
            "exists": instance.exists(key),
            "get": instance.get(key) is not None,
            "get into": instance.get(key, bytearray(len(value))) is not None,
            "batch_exists": instance.batch_exists([key]) == 1,
            "batch_get": instance.batch_get([key], [bytearray(len(value))]) == [True],
        }
        found = sorted(op for op, hit in reads.items() if hit)
        assert not found, (
            f"{', '.join(found)} still found {context}: clear() must remove every object the "
            f"instance owns, on the medium and in any index or cache"
        )


def _assert_present(instance: StorageBackend, values: dict[str, bytes], when: str) -> None:
    for key, value in values.items():
        got = instance.get(key)
        assert got is not None and _bytes(got) == value, (
            f"get({key!r}) {when} returned "
            f"{'None' if got is None else f'{len(_bytes(got))} other bytes'}; a key set after "
            f"clear() must keep its value"
        )
        assert instance.exists(key), f"exists({key!r}) {when} is False"
