"""Concurrency: threads sharing one instance see only complete, correct values."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import threading
import traceback
from collections.abc import Callable

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import KiB, MiB, _bytes, _indices, _pool
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.workers import digest, make_value

__all__ = ["TestConcurrency"]


def _run_threads(n: int, body: Callable[[int], None]) -> list[str]:
    errors: list[str] = []
    lock = threading.Lock()

    def wrapped(i: int) -> None:
        try:
            body(i)
        except BaseException:  # noqa: BLE001 - every failure in a thread is reported
            with lock:
                errors.append(traceback.format_exc())

    threads = [threading.Thread(target=wrapped, args=(i,), name=f"hicache-{i}") for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return errors


def _poll_until_value(
    backend: StorageBackend, key: str, expected: str, done: threading.Event, problems: list[str]
) -> None:
    """Poll ``get(key)`` until a value appears (or the writer is done); record a bad value."""
    try:
        while True:
            finished = done.is_set()
            got = backend.get(key)
            if got is not None:
                if digest(got) != expected:
                    problems.append(f"partial or wrong value of {len(_bytes(got))} bytes")
                return
            if finished:
                return
    except BaseException:  # noqa: BLE001 - every failure in the reader is reported
        problems.append(traceback.format_exc())


class TestConcurrency:
    """Threads sharing one instance see only complete, correct values and no errors."""

    def test_first_calls_from_many_threads_on_a_fresh_instance(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """32 threads start at once on a new instance, each with a different first operation.

        Lazily built state (connections, label caches, pools) must be built under a lock: a
        race there raises only on a fresh instance, after the backend call itself succeeded.
        """
        ops = ("get", "exists", "set", "batch_get", "batch_set", "batch_exists", "v1")
        with hicache_factory() as instance:
            pool = _pool("mha", "layer_first", pages=32)
            instance.register_host_pool(pool)
            barrier = threading.Barrier(32)

            def first_call(i: int) -> None:
                key = k(f"first{i}")
                barrier.wait()
                op = ops[i % len(ops)]
                if op == "get":
                    assert instance.get(key) is None
                elif op == "exists":
                    assert instance.exists(key) is False
                elif op == "set":
                    assert instance.set(key, b"v%d" % i)
                elif op == "batch_get":
                    assert instance.batch_get([key], [bytearray(3)]) == [False]
                elif op == "batch_set":
                    assert instance.batch_set([key], [b"v%d" % i]) == [True]
                elif op == "batch_exists":
                    assert instance.batch_exists([key]) == 0
                else:
                    assert instance.batch_set_v1([key], _indices(pool, [i])) == [True]

            errors = _run_threads(32, first_call)
            cleanup(hicache_factory, instance, k)
        assert not errors, f"{len(errors)} first calls failed; the first:\n{errors[0]}"

    def test_threads_mixed_ops_correct_bytes(self, backend: StorageBackend, k: Keyspace) -> None:
        shared = k.many("shared", 8)
        own = {i: k.many(f"own{i}-", 6) for i in range(8)}

        def size_of(key: str) -> int:
            return 512 + (sum(key.encode()) * 131) % (16 * KiB)

        def check(key: str, got: object) -> None:
            assert got is not None
            assert _bytes(got) == make_value(key, size_of(key)), f"wrong bytes for {key}"

        def body(i: int) -> None:
            for step in range(24):
                key = shared[(i + step) % len(shared)]
                mine = own[i][step % len(own[i])]
                op = step % 6
                if op == 0:
                    assert backend.set(mine, make_value(mine, size_of(mine)))
                    check(mine, backend.get(mine))
                elif op == 1:
                    assert backend.set(key, make_value(key, size_of(key)))
                elif op == 2:
                    got = backend.get(key)
                    if got is not None:
                        check(key, got)
                elif op == 3:
                    out = bytearray(size_of(key))
                    if backend.get(key, out) is not None:
                        check(key, out)
                elif op == 4:
                    outs = [bytearray(size_of(s)) for s in shared]
                    hits = backend.batch_get(shared, outs)
                    for s, out, hit in zip(shared, outs, hits, strict=True):
                        if hit:
                            check(s, out)
                else:
                    n = backend.batch_exists(shared)
                    assert 0 <= n <= len(shared)
                    assert backend.exists(own[i][0]) in (True, False)

        errors = _run_threads(8, body)
        assert not errors, errors[0]
        for key in shared + [key for keys in own.values() for key in keys]:
            got = backend.get(key)
            if got is not None:
                check(key, got)

    def test_reader_racing_writer_sees_none_or_whole(
        self, backend: StorageBackend, k: Keyspace
    ) -> None:
        size = 4 * MiB
        for round_ in range(3):
            key = k(f"race{round_}")
            value = make_value(key, size)
            expected = digest(value)
            done = threading.Event()
            problems: list[str] = []
            thread = threading.Thread(
                target=_poll_until_value, args=(backend, key, expected, done, problems)
            )
            thread.start()
            assert backend.set(key, value)
            done.set()
            thread.join(timeout=30)
            assert not problems, problems[0]
