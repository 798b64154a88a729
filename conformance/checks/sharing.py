"""One store, several instances: other processes and reopened instances see the values.

How fresh one instance's view is of another's writes and deletes is part of the contract: a
value ``set`` on one instance is readable on every other at once; after a ``delete``, ``get``
on every other instance misses at once, and ``exists`` may go on reporting the key for at most
``Capabilities.exists_stale_s`` seconds (the lifetime of an existence cache; 0 by default).
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.capabilities import Capabilities
from hicache_storage.conformance.checks.common import (
    SLACK_S,
    KiB,
    _bytes,
    _expected_after_load,
    _indices,
    _pool,
    _random_fill,
    _raw,
    _sentinel_fill,
    requires,
)
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.workers import digest, make_value, read_digests, write_values

__all__ = ["TestMultiProcess", "TestPersistence", "TestStaleViews"]


def _spawn_call(fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
    """Run ``fn(*args)`` in a fresh spawned process and return its result."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)


class TestMultiProcess:
    """Processes with their own instances over one store see each other's complete values."""

    @requires("shared")
    def test_processes_disjoint_and_overlapping_keys(
        self, backend: StorageBackend, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        overlap = k.many("both", 4)
        jobs = []
        for w in range(2):
            items = [(key, f"{key}:{w}:mine", 40 * KiB) for key in k.many(f"w{w}-", 6)]
            items += [(key, f"{key}:{w}:both", 40 * KiB) for key in overlap]
            jobs.append(items)
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
            futures = [pool.submit(write_values, hicache_factory, items) for items in jobs]
            results = [f.result(timeout=120) for f in futures]
        assert all(all(r) for r in results), results
        for w, items in enumerate(jobs):
            for key, tag, size in items[:6]:
                got = backend.get(key)
                assert got is not None and _bytes(got) == make_value(tag, size), (w, key)
        for key in overlap:
            got = backend.get(key)
            assert got is not None
            candidates = {digest(make_value(f"{key}:{w}:both", 40 * KiB)) for w in range(2)}
            assert digest(got) in candidates, f"{key} holds neither writer's complete value"

    @requires("shared")
    def test_process_writes_exits_other_process_reads(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        keys = k.many("handoff", 3)
        items = [(key, key, 100 * KiB + i) for i, key in enumerate(keys)]
        assert _spawn_call(write_values, hicache_factory, items) == [True] * 3
        digests = _spawn_call(read_digests, hicache_factory, keys)
        assert digests == [digest(make_value(tag, size)) for _, tag, size in items]


class TestPersistence:
    """Values survive ``close()``: a new instance over the same store reads them."""

    @requires("persistent")
    def test_value_survives_close_reopen(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        value = make_value(k("p"), 70 * KiB)
        with hicache_factory() as first:
            assert first.set(k("p"), value)
            first.register_host_pool(pool := _pool("mha", "page_first"))
            _random_fill(pool, seed=5)
            assert first.batch_set_v1([k("page")], _indices(pool, [2])) == [True]
        with hicache_factory() as second:
            got = second.get(k("p"))
            assert got is not None and _bytes(got) == value
            assert second.batch_exists([k("p"), k("page")]) == 2
            target = _pool("mha", "page_first")
            _sentinel_fill(target)
            expected_raw = _expected_after_load(target, pool, [(2, 2)], "mha")
            second.register_host_pool(target)
            assert second.batch_get_v1([k("page")], _indices(target, [2])) == [True]
            assert torch.equal(_raw(target), expected_raw)
            cleanup(hicache_factory, second, k)


_STALE_LIMIT_S = 10.0
"""The longest stated staleness bound the suite waits out; a longer one is skipped."""


def _two(factory: BackendFactory) -> tuple[StorageBackend, StorageBackend]:
    return factory(), factory()


class TestStaleViews:
    """Two instances over one store: how soon each sees the other's writes and deletes."""

    @requires("shared")
    def test_set_on_one_instance_visible_on_another_at_once(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """A value ``set`` on A is read by B at once, even right after B saw the key missing.

        B's get, exists and batch_exists see it as soon as A's set returned (no cached misses),
        and a second ``set`` on B keeps A's value.
        """
        key = k("fresh")
        value = make_value(key, 3 * KiB + 1)
        a, b = _two(hicache_factory)
        with a, b:
            try:
                assert b.get(key) is None and not b.exists(key), f"{key!r} exists before set"
                assert b.batch_exists([key]) == 0
                assert a.set(key, value), f"set({key!r}) on instance A failed"
                got = b.get(key)
                assert got is not None and _bytes(got) == value, (
                    f"get({key!r}) on instance B right after A's set returned "
                    f"{'None' if got is None else 'other bytes'}: a write is visible to every "
                    f"instance once set returns (do not cache misses)"
                )
                assert b.exists(key), (
                    f"exists({key!r}) on instance B is False right after A's set returned"
                )
                assert b.batch_exists([key]) == 1, (
                    f"batch_exists([{key!r}]) on instance B is 0 right after A's set returned"
                )
                assert b.set(key, make_value(f"{key}:b", 2 * KiB)), f"B's set({key!r}) failed"
                for name, instance in (("A", a), ("B", b)):
                    got = instance.get(key)
                    assert got is not None and _bytes(got) == value, (
                        f"after B set {key!r} again with another value, get on {name} did not "
                        f"return A's first value: set is first-wins across instances"
                    )
            finally:
                cleanup(hicache_factory, a, k)

    @requires("shared", "delete")
    def test_delete_on_one_instance_get_on_another_misses_at_once(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """After A's ``delete`` returns, B's get, get into and batch_get miss at once."""
        key = k("gone")
        value = make_value(key, 5 * KiB)
        a, b = _two(hicache_factory)
        with a, b:
            try:
                assert a.set(key, value), f"set({key!r}) on instance A failed"
                got = b.get(key)  # B has read it: any value or metadata cache of B is warm
                assert got is not None and _bytes(got) == value, f"B cannot read {key!r}"
                assert b.exists(key) and b.batch_get([key], [bytearray(len(value))]) == [True]
                assert a.delete(key) is True, f"delete({key!r}) on instance A returned False"
                reads = {
                    "get": b.get(key) is not None,
                    "get into": b.get(key, bytearray(len(value))) is not None,
                    "batch_get": b.batch_get([key], [bytearray(len(value))]) == [True],
                }
                served = sorted(op for op, hit in reads.items() if hit)
                assert not served, (
                    f"after instance A deleted {key!r}, {', '.join(served)} on instance B still "
                    f"returned the deleted value: get is never stale (a value cache must be "
                    f"invalidated, or not kept across instances)"
                )
            finally:
                cleanup(hicache_factory, a, k)

    @requires("shared", "delete")
    def test_exists_after_delete_on_another_instance_within_stated_bound(
        self, hicache_factory: BackendFactory, capabilities: Capabilities, k: Keyspace
    ) -> None:
        """After A deletes a key B saw, B's exists turns False within ``exists_stale_s``.

        ``exists`` and ``batch_exists`` on B may say True for the stated bound (plus slack), no
        longer; then a ``set`` on B stores a new value again.
        """
        bound = float(capabilities.exists_stale_s)
        if bound > _STALE_LIMIT_S:
            pytest.skip(f"exists_stale_s of {bound:g} s is longer than the suite waits")
        limit = bound + (SLACK_S / 2 if bound else 0.25)
        key = k("stale")
        a, b = _two(hicache_factory)
        with a, b:
            try:
                assert a.set(key, b"old value"), f"set({key!r}) on instance A failed"
                assert b.exists(key) and b.batch_exists([key]) == 1, f"B does not see {key!r}"
                assert a.delete(key) is True, f"delete({key!r}) on instance A returned False"
                start = time.monotonic()
                while b.exists(key) or b.batch_exists([key]):
                    waited = time.monotonic() - start
                    assert waited <= limit, (
                        f"exists({key!r}) on instance B still True {waited:.2f}s after instance "
                        f"A deleted it; the backend states exists_stale_s={bound:g} (checked "
                        f"with {limit - bound:g}s of slack)"
                    )
                    time.sleep(0.02)
                new = make_value(f"{key}:new", 2 * KiB)
                assert b.set(key, new), f"set({key!r}) on B after the delete failed"
                for name, instance in (("B", b), ("A", a)):
                    got = instance.get(key)
                    assert got is not None and _bytes(got) == new, (
                        f"after A deleted {key!r} and B's exists turned False, B's set of a new "
                        f"value was not stored: get on {name} returned "
                        f"{'None' if got is None else 'other bytes'}"
                    )
            finally:
                cleanup(hicache_factory, a, k)
