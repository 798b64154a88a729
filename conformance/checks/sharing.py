"""One store, several instances: other processes and reopened instances see the values."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable
from typing import Any

import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import (
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

__all__ = ["TestMultiProcess", "TestPersistence"]


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
