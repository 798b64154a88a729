"""The conformance checks: ``from hicache_storage.conformance.suite import *`` in a test module.

The module must also define one fixture, ``hicache_factory``, returning a
:class:`~hicache_storage.conformance.factory.BackendFactory` (the pytest plugin provides it when
``--hicache-backend`` is given). Checks tied to a capability carry
``@pytest.mark.hicache_requires(...)`` and skip, naming the capability, when it is not claimed.
A backend that cannot be built makes the checks error, never skip.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import hashlib
import itertools
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hicache_storage.backend import StorageBackend
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import FaultConfig, FaultRule
from hicache_storage.conformance import fixtures as _fixtures
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import *  # noqa: F403
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.server import ServerControl, find_server_control
from hicache_storage.conformance.workers import (
    digest,
    make_value,
    read_digests,
    write_forever,
    write_values,
)
from hicache_storage.errors import (
    BackendClosedError,
    BatchMismatchError,
    BufferSizeError,
    IndexAlignmentError,
    InvalidKeyError,
    InvalidValueError,
    PoolNotRegisteredError,
    UnsupportedOperationError,
)
from hicache_storage.hostpool import HostKVPool, MHAHostPool, MLAHostPool, UnifiedObjectPool
from hicache_storage.keys import plan_unified

__all__ = [
    *_fixtures.__all__,
    "server_control",
    "TestRoundTrip",
    "TestMiss",
    "TestIdempotentSet",
    "TestBatch",
    "TestPrefix",
    "TestZeroCopy",
    "TestUnifiedObjects",
    "TestBufferSize",
    "TestBadInput",
    "TestLifecycle",
    "TestConcurrency",
    "TestMultiProcess",
    "TestPersistence",
    "TestBounded",
    "TestDelete",
    "TestStats",
    "TestCrashSafety",
    "TestFaults",
    "TestServerFaults",
    "TestStateMachine",
]

requires = pytest.mark.hicache_requires

# -- hypothesis profiles (registered, never loaded globally) -------------------------------------

settings.register_profile(
    "hicache-ci",
    derandomize=True,
    deadline=None,
    max_examples=30,
    stateful_step_count=20,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "hicache-nightly",
    deadline=None,
    max_examples=500,
    stateful_step_count=50,
    suppress_health_check=[HealthCheck.too_slow],
)

KiB = 1 << 10
MiB = 1 << 20
SENTINEL = 0xA5
SLACK_S = 2.0


# -- helpers ----------------------------------------------------------------------------------


def _bytes(value: object) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
    return bytes(memoryview(value))  # type: ignore[arg-type]


def _leading_run(hits: Sequence[bool]) -> int:
    return next((i for i, hit in enumerate(hits) if not hit), len(hits))


def _pool(
    kind: str, layout: str, pages: int = 8, page_size: int = 4, layers: int = 2
) -> HostKVPool:
    size = pages * page_size
    if kind == "mha":
        return MHAHostPool(
            size, page_size, layers, 2, 8, dtype=torch.float16, layout=layout, pin_memory=False
        )
    return MLAHostPool(
        size, page_size, layers, 16, dtype=torch.float16, layout=layout, pin_memory=False
    )


def _raw(pool: HostKVPool) -> torch.Tensor:
    return pool.kv_buffer.view(-1).view(torch.uint8)


def _random_fill(pool: HostKVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = _raw(pool)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _sentinel_fill(pool: HostKVPool) -> None:
    _raw(pool).fill_(SENTINEL)


def _indices(pool: HostKVPool, pages: Sequence[int]) -> torch.Tensor:
    parts = [torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _expected_after_load(
    target: HostKVPool, source: HostKVPool, moves: Sequence[tuple[int, int]], kind: str
) -> torch.Tensor:
    """Bytes ``target`` must hold after loading source page ``s`` into target page ``t``."""
    expected = _pool(kind, target.layout.value, target.num_pages, target.page_size)
    _raw(expected).copy_(_raw(target))
    for src, dst in moves:
        expected.set_data_page(dst * target.page_size, source.get_data_page(src * target.page_size))
    return _raw(expected).clone()


def _options_root(factory: BackendFactory) -> str | None:
    root = factory.options.get("root")
    return str(root) if isinstance(root, str) else None


def _names_under(root: str) -> set[str]:
    found: set[str] = set()
    parent = os.path.dirname(os.path.abspath(root))
    with contextlib.suppress(OSError):
        found.update(os.path.join(parent, n) for n in os.listdir(parent))
    for dirpath, dirnames, filenames in os.walk(root):
        found.update(os.path.join(dirpath, n) for n in dirnames + filenames)
    return found


def _spawn_call(fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
    """Run ``fn(*args)`` in a fresh spawned process and return its result."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)


def _bound_of(instance: StorageBackend, factory: BackendFactory) -> int | None:
    for source in (instance.stats(), factory.options):
        value = source.get("max_bytes")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


INVALID_KEYS: dict[str, Callable[[str], object]] = {
    "traversal": lambda p: f"../{p}x",
    "separator": lambda p: f"{p}a/b",
    "dotdot": lambda p: "..",
    "empty": lambda p: "",
    "nul": lambda p: f"{p}a\x00b",
    "too_long": lambda p: p + "a" * (201 - len(p)),
    "non_str": lambda p: 12345,
    "leading_dot": lambda p: f".{p}x",
}

KEY_OPS: dict[str, Callable[[StorageBackend, Any], object]] = {
    "set": lambda b, key: b.set(key, b"x"),
    "get": lambda b, key: b.get(key),
    "get_into": lambda b, key: b.get(key, bytearray(1)),
    "exists": lambda b, key: b.exists(key),
    "batch_set": lambda b, key: b.batch_set([key], [b"x"]),
    "batch_get": lambda b, key: b.batch_get([key], [bytearray(1)]),
    "batch_exists": lambda b, key: b.batch_exists([key]),
    "delete": lambda b, key: b.delete(key),
}


def _value_inputs() -> dict[str, Callable[[bytes], object]]:
    return {
        "bytes": lambda raw: raw,
        "bytearray": lambda raw: bytearray(raw),
        "memoryview": lambda raw: memoryview(raw),
        "numpy_uint8": lambda raw: np.frombuffer(raw, dtype=np.uint8).copy(),
        "numpy_float32_2d": lambda raw: np.frombuffer(raw, dtype=np.float32).reshape(4, -1).copy(),
        "torch_uint8": lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.uint8),
        "torch_float16_2d": lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.float16).view(
            8, -1
        ),
    }


def _out_buffers() -> dict[str, Callable[[int], object]]:
    return {
        "bytearray": lambda n: bytearray(n),
        "memoryview": lambda n: memoryview(bytearray(n)),
        "numpy": lambda n: np.zeros(n, dtype=np.uint8),
        "torch": lambda n: torch.zeros(n, dtype=torch.uint8),
    }


# -- core contract ----------------------------------------------------------------------------


ROUND_TRIP_SIZES = [1, 2, 255, 4 * KiB, 64 * KiB + 3, 1 * MiB, 4 * MiB]


class TestRoundTrip:
    """What is stored is what is read back, byte for byte, for every accepted input."""

    @pytest.mark.parametrize("size", ROUND_TRIP_SIZES, ids=lambda s: f"{s}B")
    def test_roundtrip_get_matches_sha256(
        self, backend: StorageBackend, k: Keyspace, size: int
    ) -> None:
        value = make_value(k("v"), size)
        assert backend.set(k("v"), value) is True
        got = backend.get(k("v"))
        assert got is not None
        assert digest(got) == digest(value)

    @pytest.mark.parametrize("size", ROUND_TRIP_SIZES, ids=lambda s: f"{s}B")
    def test_roundtrip_get_into_out_matches_sha256(
        self, backend: StorageBackend, k: Keyspace, size: int
    ) -> None:
        value = make_value(k("v"), size)
        assert backend.set(k("v"), value)
        out = bytearray(size)
        assert backend.get(k("v"), out) is out
        assert digest(out) == digest(value)

    @pytest.mark.parametrize("kind", list(_value_inputs()))
    def test_roundtrip_input_type_accepted(
        self, backend: StorageBackend, k: Keyspace, kind: str
    ) -> None:
        raw = make_value(k("v"), 4 * KiB)
        assert backend.set(k("v"), _value_inputs()[kind](raw))  # type: ignore[arg-type]
        got = backend.get(k("v"))
        assert got is not None and _bytes(got) == raw

    @pytest.mark.parametrize("kind", list(_out_buffers()))
    def test_roundtrip_out_type_filled(
        self, backend: StorageBackend, k: Keyspace, kind: str
    ) -> None:
        raw = make_value(k("v"), 4 * KiB)
        assert backend.set(k("v"), raw)
        out = _out_buffers()[kind](len(raw))
        assert backend.get(k("v"), out) is out  # type: ignore[arg-type]
        assert _bytes(out) == raw

    def test_exists_agrees_with_get_after_set(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.exists(k("v")) is False and backend.get(k("v")) is None
        assert backend.set(k("v"), b"value")
        assert backend.exists(k("v")) is True
        assert backend.get(k("v")) is not None


class TestMiss:
    """A miss is a value (None / False / 0), never an exception."""

    def test_get_missing_returns_none(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.get(k("absent")) is None

    def test_get_into_missing_returns_none_out_untouched(
        self, backend: StorageBackend, k: Keyspace
    ) -> None:
        out = bytearray(b"\x5a" * 64)
        assert backend.get(k("absent"), out) is None
        assert out == bytearray(b"\x5a" * 64)

    def test_exists_missing_false(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.exists(k("absent")) is False

    def test_batch_exists_missing_zero(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.batch_exists(k.many("absent", 3)) == 0

    def test_batch_get_missing_all_false(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("absent", 3)
        assert backend.batch_get(keys, [bytearray(8) for _ in keys]) == [False] * 3


class TestIdempotentSet:
    """Writing a key twice leaves one complete value, equal to one of those written."""

    def test_set_twice_keeps_one_complete_value(self, backend: StorageBackend, k: Keyspace) -> None:
        first, second = make_value("first", 3000), make_value("second", 5000)
        assert backend.set(k("v"), first)
        assert backend.set(k("v"), second)
        got = backend.get(k("v"))
        assert got is not None and _bytes(got) in (first, second)

    def test_set_same_value_twice_true(self, backend: StorageBackend, k: Keyspace) -> None:
        value = make_value("same", 1000)
        assert backend.set(k("v"), value) is True
        assert backend.set(k("v"), value) is True
        got = backend.get(k("v"))
        assert got is not None and _bytes(got) == value


# -- batches ----------------------------------------------------------------------------------


class TestBatch:
    """Batch calls: one answer per key, in order, for every batch shape."""

    def test_batch_get_preserves_order(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("o", 6)
        values = [make_value(key, 100 + 37 * i) for i, key in enumerate(keys)]
        assert backend.batch_set(keys, values) == [True] * 6
        order = [4, 0, 5, 2, 1, 3]
        outs = [bytearray(len(values[i])) for i in order]
        assert backend.batch_get([keys[i] for i in order], outs) == [True] * 6
        for i, out in zip(order, outs, strict=True):
            assert bytes(out) == values[i]

    def test_batch_results_length_matches_keys(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("l", 5)
        set_result = backend.batch_set(keys, [b"abc"] * 5)
        get_result = backend.batch_get(keys, [bytearray(3) for _ in keys])
        assert len(set_result) == 5 and len(get_result) == 5

    def test_batch_empty_returns_empty(self, backend: StorageBackend) -> None:
        assert backend.batch_set([], []) == []
        assert backend.batch_get([], []) == []
        assert backend.batch_exists([]) == 0

    def test_batch_duplicate_keys_consistent(self, backend: StorageBackend, k: Keyspace) -> None:
        one, two = make_value("dup1", 64), make_value("dup2", 64)
        assert backend.batch_set([k("d"), k("d")], [one, two]) == [True, True]
        outs = [bytearray(64), bytearray(64)]
        assert backend.batch_get([k("d"), k("d")], outs) == [True, True]
        assert bytes(outs[0]) in (one, two) and outs[0] == outs[1]
        assert backend.batch_exists([k("d"), k("d")]) == 2

    def test_batch_long_300_keys(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("long", 300)
        values = [make_value(key, 64 + i % 7) for i, key in enumerate(keys)]
        assert backend.batch_set(keys, values) == [True] * 300
        assert backend.batch_exists(keys) == 300
        outs = [bytearray(len(v)) for v in values]
        assert backend.batch_get(keys, outs) == [True] * 300
        assert all(bytes(o) == v for o, v in zip(outs, values, strict=True))

    def test_batch_get_per_key_hit_miss(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("hm", 6)
        for key in keys[::2]:
            assert backend.set(key, make_value(key, 128))
        outs = [bytearray(128) for _ in keys]
        assert backend.batch_get(keys, outs) == [True, False] * 3
        for key, out in zip(keys[::2], outs[::2], strict=True):
            assert bytes(out) == make_value(key, 128)

    def test_batch_get_wrong_size_is_miss(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.set(k("a"), b"x" * 100) and backend.set(k("b"), b"y" * 10)
        outs = [bytearray(99), bytearray(10)]
        assert backend.batch_get([k("a"), k("b")], outs) == [False, True]
        assert bytes(outs[1]) == b"y" * 10

    def test_batch_mismatched_lengths_refused(self, backend: StorageBackend, k: Keyspace) -> None:
        with pytest.raises(BatchMismatchError):
            backend.batch_set([k("a"), k("b")], [b"x"])
        with pytest.raises(BatchMismatchError):
            backend.batch_get([k("a")], [bytearray(1), bytearray(1)])
        assert backend.exists(k("a")) is False


class TestPrefix:
    """``batch_exists`` counts the leading run of hits and stops at the first gap."""

    def test_batch_exists_first_missing_zero(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("p", 4)
        for key in keys[1:]:
            assert backend.set(key, b"v")
        assert backend.batch_exists(keys) == 0

    def test_batch_exists_all_hit_n(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("p", 7)
        assert backend.batch_set(keys, [b"v"] * 7) == [True] * 7
        assert backend.batch_exists(keys) == 7

    def test_batch_exists_stops_at_gap(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("p", 6)
        for i, key in enumerate(keys):
            if i != 2:
                assert backend.set(key, b"v")
        assert backend.batch_exists(keys) == 2
        assert backend.batch_exists(keys[3:]) == 3


# -- zero-copy page I/O -----------------------------------------------------------------------

POOL_CASES = [
    pytest.param(kind, layout, id=f"{kind}-{layout}")
    for kind in ("mha", "mla")
    for layout in ("layer_first", "page_first", "page_first_direct")
]


class TestZeroCopy:
    """The v1 calls move exactly one page per key and never touch a byte outside it."""

    @pytest.mark.parametrize(("kind", "layout"), POOL_CASES)
    def test_v1_roundtrip_canary_bytes_intact(
        self, backend: StorageBackend, k: Keyspace, kind: str, layout: str
    ) -> None:
        source = _pool(kind, layout)
        _random_fill(source, seed=7)
        keys = k.many(f"{kind}-{layout}-", 3)
        backend.register_host_pool(source)
        assert backend.batch_set_v1(keys, _indices(source, [1, 3, 6])) == [True] * 3
        for key, page in zip(keys, [1, 3, 6], strict=True):
            stored = backend.get(key)
            assert stored is not None, "a page written with batch_set_v1 must be readable by get"
            expected = _bytes(source.get_data_page(page * source.page_size))
            assert _bytes(stored) == expected, "object bytes must be the page in canonical order"

        target = _pool(kind, layout)
        _sentinel_fill(target)
        expected_raw = _expected_after_load(target, source, [(1, 2), (3, 0), (6, 7)], kind)
        backend.register_host_pool(target)
        assert backend.batch_get_v1(keys, _indices(target, [2, 0, 7])) == [True] * 3
        assert torch.equal(_raw(target), expected_raw), "bytes outside the loaded pages changed"

    @pytest.mark.parametrize(("kind", "layout"), POOL_CASES)
    def test_v1_get_of_set_value_fills_page(
        self, backend: StorageBackend, k: Keyspace, kind: str, layout: str
    ) -> None:
        source = _pool(kind, layout)
        _random_fill(source, seed=11)
        page = source.get_data_page(4 * source.page_size)
        assert backend.set(k("page"), page.contiguous())  # type: ignore[arg-type]
        target = _pool(kind, layout)
        _sentinel_fill(target)
        expected_raw = _expected_after_load(target, source, [(4, 5)], kind)
        backend.register_host_pool(target)
        assert backend.batch_get_v1([k("page")], _indices(target, [5])) == [True]
        assert torch.equal(_raw(target), expected_raw)

    def test_v1_miss_leaves_page_untouched(self, backend: StorageBackend, k: Keyspace) -> None:
        pool = _pool("mha", "layer_first")
        _sentinel_fill(pool)
        backend.register_host_pool(pool)
        assert backend.batch_get_v1([k("absent")], _indices(pool, [3])) == [False]
        assert bool((_raw(pool) == SENTINEL).all())

    def test_v1_size_mismatch_is_miss_page_untouched(
        self, backend: StorageBackend, k: Keyspace
    ) -> None:
        pool = _pool("mha", "page_first")
        _sentinel_fill(pool)
        assert backend.set(k("short"), b"z" * (pool.page_nbytes - 1))
        backend.register_host_pool(pool)
        assert backend.batch_get_v1([k("short")], _indices(pool, [2])) == [False]
        assert bool((_raw(pool) == SENTINEL).all())

    def test_v1_disjoint_pages_one_pool(self, backend: StorageBackend, k: Keyspace) -> None:
        source = _pool("mla", "page_first")
        _random_fill(source, seed=3)
        keys = k.many("dj", 4)
        backend.register_host_pool(source)
        assert backend.batch_set_v1(keys, _indices(source, [0, 1, 2, 3])) == [True] * 4
        target = _pool("mla", "page_first")
        _sentinel_fill(target)
        expected_raw = _expected_after_load(target, source, [(0, 6), (1, 1), (2, 4), (3, 3)], "mla")
        backend.register_host_pool(target)
        assert backend.batch_get_v1(keys[:2], _indices(target, [6, 1])) == [True, True]
        assert backend.batch_get_v1(keys[2:], _indices(target, [4, 3])) == [True, True]
        assert torch.equal(_raw(target), expected_raw)

    def test_v1_unregistered_pool_refused(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        with hicache_factory() as fresh:
            with pytest.raises(PoolNotRegisteredError):
                fresh.batch_get_v1([k("a")], list(range(4)))
            with pytest.raises(PoolNotRegisteredError):
                fresh.batch_set_v1([k("a")], list(range(4)))

    @pytest.mark.parametrize(
        "indices",
        [
            pytest.param([1, 2, 3, 4], id="unaligned_start"),
            pytest.param([0, 1, 2], id="partial_page"),
            pytest.param([0, 1, 2, 3, 4, 5, 6, 7], id="extra_page"),
            pytest.param([0, 2, 1, 3], id="non_consecutive"),
            pytest.param([1000, 1001, 1002, 1003], id="out_of_range"),
        ],
    )
    def test_v1_misaligned_indices_refused(
        self, backend: StorageBackend, k: Keyspace, indices: list[int]
    ) -> None:
        pool = _pool("mha", "layer_first")
        _sentinel_fill(pool)
        backend.register_host_pool(pool)
        with pytest.raises(IndexAlignmentError):
            backend.batch_get_v1([k("a")], indices)
        with pytest.raises(IndexAlignmentError):
            backend.batch_set_v1([k("a")], indices)
        assert backend.exists(k("a")) is False
        assert bool((_raw(pool) == SENTINEL).all())


class TestUnifiedObjects:
    """Unified-scheme objects (several per page, of two sizes, in many spans) move intact."""

    @pytest.mark.parametrize(("kind", "layout"), POOL_CASES)
    def test_unified_objects_move_between_layouts(
        self, backend: StorageBackend, k: Keyspace, kind: str, layout: str
    ) -> None:
        plan = plan_unified(
            model_id="conformance",
            dtype="float16",
            page_size=4,
            num_layers=3,
            layer_partition=2,
            is_mla=kind == "mla",
            local_kv_heads=0 if kind == "mla" else 2,
            head_group=None if kind == "mla" else 1,
        )
        layouts = ["layer_first", "page_first", "page_first_direct"]
        other = layouts[(layouts.index(layout) + 1) % 3]
        source = UnifiedObjectPool(_pool(kind, layout, layers=3), plan)
        _random_fill(source.pool, seed=5)
        target = UnifiedObjectPool(_pool(kind, other, layers=3), plan)
        _sentinel_fill(target.pool)
        hashes = [hashlib.sha256(k(f"unified{i}").encode()).hexdigest() for i in range(2)]
        keys = plan.keys(hashes)
        k.used.update(keys)
        count = len(keys)
        backend.register_host_pool(source)
        assert (
            backend.batch_set_v1(keys, source.object_indices(_indices(source.pool, [1, 6])))
            == [True] * count
        )
        backend.register_host_pool(target)
        got = backend.batch_get_v1(keys, target.object_indices(_indices(target.pool, [3, 0])))
        assert got == [True] * count
        for src_page, dst_page in [(1, 3), (6, 0)]:
            src = source.object_indices(_indices(source.pool, [src_page]))
            dst = target.object_indices(_indices(target.pool, [dst_page]))
            for a, b in zip(src[::4].tolist(), dst[::4].tolist(), strict=True):
                n = source.object_nbytes((a // 4) % plan.keys_per_page)
                want, have = bytearray(n), bytearray(n)
                source.read_object(a, want)
                target.read_object(b, have)
                assert have == want, "a unified object arrived with different bytes"
        untouched = [p for p in range(target.pool.num_pages) if p not in (3, 0)]
        rest = target.page_buffer_views(target.object_indices(_indices(target.pool, untouched)))
        assert all(set(bytes(v)) <= {SENTINEL} for spans in rest for v in spans)


class TestBufferSize:
    """An output buffer of the wrong size is refused and left untouched."""

    @pytest.mark.parametrize("delta", [-1, 1], ids=["smaller", "larger"])
    def test_get_wrong_size_out_refused_untouched(
        self, backend: StorageBackend, k: Keyspace, delta: int
    ) -> None:
        assert backend.set(k("v"), b"q" * 100)
        out = bytearray(b"\x5a" * (100 + delta))
        with pytest.raises(BufferSizeError):
            backend.get(k("v"), out)
        assert out == bytearray(b"\x5a" * (100 + delta))


# -- caller mistakes --------------------------------------------------------------------------


class TestBadInput:
    """Malformed keys and values are refused with a typed error and nothing is written."""

    @pytest.mark.parametrize("op", list(KEY_OPS))
    @pytest.mark.parametrize("case", list(INVALID_KEYS))
    def test_invalid_key_refused(
        self,
        backend: StorageBackend,
        hicache_factory: BackendFactory,
        k: Keyspace,
        case: str,
        op: str,
    ) -> None:
        key = INVALID_KEYS[case](k.prefix)
        root = _options_root(hicache_factory)
        before_names = _names_under(root) if root else set()
        before_objects = backend.stats().get("objects")
        with pytest.raises(InvalidKeyError):
            KEY_OPS[op](backend, key)
        if root:
            added = {p for p in _names_under(root) - before_names if k.prefix in p}
            assert not added, f"refused key left files behind: {sorted(added)}"
        assert backend.stats().get("objects") == before_objects

    @pytest.mark.parametrize(
        "case",
        ["str", "int", "list", "none", "numpy_noncontiguous", "torch_noncontiguous"],
    )
    def test_invalid_value_refused(self, backend: StorageBackend, k: Keyspace, case: str) -> None:
        values: dict[str, object] = {
            "str": "text",
            "int": 12345,
            "list": [1, 2, 3],
            "none": None,
            "numpy_noncontiguous": np.arange(64, dtype=np.uint8)[::2],
            "torch_noncontiguous": torch.arange(64, dtype=torch.uint8).view(8, 8).t(),
        }
        with pytest.raises(InvalidValueError):
            backend.set(k("v"), values[case])  # type: ignore[arg-type]
        with pytest.raises(InvalidValueError):
            backend.batch_set([k("v")], [values[case]])  # type: ignore[list-item]
        assert backend.exists(k("v")) is False

    def test_get_into_readonly_out_refused(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.set(k("v"), b"abcd")
        with pytest.raises(InvalidValueError):
            backend.get(k("v"), b"\x00" * 4)

    @pytest.mark.parametrize(
        "op",
        [
            *KEY_OPS,
            "clear",
            "register_host_pool",
            "batch_get_v1",
            "batch_set_v1",
        ],
    )
    def test_use_after_close_refused(
        self, hicache_factory: BackendFactory, k: Keyspace, op: str
    ) -> None:
        instance = hicache_factory()
        pool = _pool("mha", "layer_first")
        instance.register_host_pool(pool)
        instance.close()
        calls: dict[str, Callable[[], object]] = {
            **{name: functools.partial(f, instance, k("v")) for name, f in KEY_OPS.items()},
            "clear": instance.clear,
            "register_host_pool": lambda: instance.register_host_pool(pool),
            "batch_get_v1": lambda: instance.batch_get_v1([k("v")], _indices(pool, [0])),
            "batch_set_v1": lambda: instance.batch_set_v1([k("v")], _indices(pool, [0])),
        }
        with pytest.raises(BackendClosedError):
            calls[op]()

    def test_double_close_harmless(self, hicache_factory: BackendFactory) -> None:
        instance = hicache_factory()
        instance.close()
        instance.close()
        assert instance.closed is True
        assert isinstance(instance.stats(), dict)


# -- lifecycle --------------------------------------------------------------------------------


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _exercise(factory: BackendFactory, k: Keyspace) -> None:
    with factory() as instance:
        pool = _pool("mla", "layer_first", pages=2)
        instance.register_host_pool(pool)
        assert instance.set(k("life"), b"lifecycle")
        assert instance.get(k("life")) is not None
        assert instance.get(k("life"), bytearray(9)) is not None
        instance.exists(k("life"))
        instance.batch_exists([k("life"), k("none")])
        instance.batch_get([k("life")], [bytearray(9)])
        instance.batch_set_v1([k("life-page")], _indices(pool, [0]))
        instance.batch_get_v1([k("life-page")], _indices(pool, [1]))
        cleanup(factory, instance, k)


class TestLifecycle:
    """Instances release what they hold: context managers close, no fds or threads leak."""

    def test_context_manager_closes(self, hicache_factory: BackendFactory) -> None:
        with hicache_factory() as instance:
            assert instance.closed is False
        assert instance.closed is True

    @pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc/self/fd here")
    def test_no_fd_leak_after_open_use_close(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        _exercise(hicache_factory, k)  # warm-up: lazy imports, caches, loggers
        gc.collect()
        before = _fd_count()
        for _ in range(3):
            _exercise(hicache_factory, k)
        gc.collect()
        assert _fd_count() == before, "open file descriptors grew across open/use/close cycles"

    def test_no_thread_leak_after_open_use_close(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        _exercise(hicache_factory, k)
        baseline = threading.active_count()
        for _ in range(3):
            _exercise(hicache_factory, k)
        deadline = time.monotonic() + 2.0
        while threading.active_count() > baseline and time.monotonic() < deadline:
            time.sleep(0.02)
        assert threading.active_count() <= baseline, [t.name for t in threading.enumerate()]


# -- concurrency ------------------------------------------------------------------------------


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


# -- several processes (shared) ---------------------------------------------------------------


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
            stats = backend.stats()
            usage = stats.get("bytes")
            if not isinstance(usage, int):
                usage = sum(chunk for key2 in keys if backend.exists(key2))
            assert usage <= bound, f"usage {usage} exceeds bound {bound}"
        last = backend.get(keys[-1])
        assert last is not None and _bytes(last) == make_value(keys[-1], chunk)
        assert sum(backend.exists(key) for key in keys) < len(keys), "nothing was evicted"


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


class TestStats:
    """The metrics layer's counters agree with the operations made."""

    def test_metrics_counters_match_ops(self, hicache_factory: BackendFactory, k: Keyspace) -> None:
        layers = msgspec.structs.replace(hicache_factory.layers, metrics=True, faults=None)
        with hicache_factory(layers) as instance:
            keys = k.many("m", 5)
            for key in keys:
                assert instance.set(key, b"metric")
            hits = [instance.get(key) is not None for key in keys[:3]]
            misses = [instance.get(k(f"miss{i}")) is None for i in range(2)]
            assert all(hits) and all(misses)
            assert instance.exists(keys[0]) and not instance.exists(k("miss0"))
            assert instance.batch_exists([*keys[:2], k("miss1"), keys[3]]) == 2
            ops = instance.stats()["metrics"]["ops"]
            cleanup(hicache_factory, instance, k)
        assert ops["set"]["calls"] == 5 and ops["set"].get("ok", 0) == 5
        assert ops["get"]["calls"] == 5
        assert ops["get"].get("hit", 0) == 3 and ops["get"].get("miss", 0) == 2
        assert ops["exists"].get("hit", 0) == 1 and ops["exists"].get("miss", 0) == 1
        assert ops["batch_exists"]["calls"] == 1
        assert ops["batch_exists"].get("hit", 0) == 2 and ops["batch_exists"].get("miss", 0) == 2


class TestCrashSafety:
    """A writer killed mid-``set`` leaves every key absent or complete."""

    @requires("crash_safe_writes", "shared")
    def test_killed_writer_leaves_absent_or_complete(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        size = 2 * MiB
        ctx = multiprocessing.get_context("spawn")
        for attempt, delay in enumerate((0.05, 0.15)):
            prefix = k(f"crash{attempt}-")
            started = ctx.Event()
            child = ctx.Process(
                target=write_forever, args=(hicache_factory, prefix, size, started), daemon=True
            )
            child.start()
            try:
                assert started.wait(60), "the writer process did not start"
                time.sleep(delay)
            finally:
                if child.pid is not None:
                    os.kill(child.pid, signal.SIGKILL)
                child.join(30)
            keys = [k(f"crash{attempt}-{i}") for i in range(400)]
            with hicache_factory() as reader:
                for key in keys:
                    got = reader.get(key)
                    if got is not None:
                        assert digest(got) == digest(make_value(key, size)), f"{key} is partial"
                cleanup(hicache_factory, reader, k)


# -- faults -----------------------------------------------------------------------------------


class TestFaults:
    """With injected load failures, every key loads correctly or reports a miss; never bad bytes."""

    def test_v1_faults_never_wrong_bytes(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        faults = FaultConfig(seed=1234, ops={"batch_get_v1": FaultRule(failure_rate=0.5)})
        layers = msgspec.structs.replace(hicache_factory.layers, faults=faults)
        with hicache_factory(layers) as instance:
            source = _pool("mha", "layer_first", pages=16)
            _random_fill(source, seed=99)
            keys = k.many("fault", 16)
            instance.register_host_pool(source)
            assert instance.batch_set_v1(keys, _indices(source, range(16))) == [True] * 16
            assert instance.batch_exists(keys) == 16
            target = _pool("mha", "layer_first", pages=16)
            _sentinel_fill(target)
            instance.register_host_pool(target)
            order = list(reversed(range(16)))
            hits = instance.batch_get_v1(keys, _indices(target, order))
            moves = [
                (src, dst) for src, dst, hit in zip(range(16), order, hits, strict=True) if hit
            ]
            assert torch.equal(_raw(target), _expected_after_load(target, source, moves, "mha"))
            cleanup(hicache_factory, instance, k)


def _server_timeout(control: ServerControl, options: dict[str, Any]) -> float:
    value = getattr(control, "timeout_s", None)
    if isinstance(value, (int, float)):
        return float(value)
    for name in ("timeout_s", "op_timeout_s", "request_timeout_s", "timeout"):
        option = options.get(name)
        if isinstance(option, (int, float)) and not isinstance(option, bool):
            return float(option)
    return 5.0


@pytest.fixture
def server_control(hicache_factory: BackendFactory) -> Iterator[ServerControl]:
    """Yield the plugin-provided server control; skip when no plugin provides one."""
    control = find_server_control(hicache_factory.name, hicache_factory.options)
    if control is None:
        pytest.skip(
            f"no server control for backend {hicache_factory.name} "
            f"(provide the hicache_conformance_server hook)"
        )
    try:
        yield control
    finally:
        control.start()


class TestServerFaults:
    """With the server down every call answers a miss in time; after a restart it works again."""

    def test_server_down_calls_miss_within_timeout(
        self,
        server_control: ServerControl,
        hicache_factory: BackendFactory,
        backend: StorageBackend,
        k: Keyspace,
    ) -> None:
        layers = msgspec.structs.replace(hicache_factory.layers, degrade=True, faults=None)
        limit = _server_timeout(server_control, hicache_factory.options) + SLACK_S
        pool = _pool("mha", "layer_first")
        with hicache_factory(layers) as instance:
            instance.register_host_pool(pool)
            assert instance.set(k("up"), b"before the outage")
            server_control.stop()
            _sentinel_fill(pool)
            calls: dict[str, tuple[Callable[[], object], object]] = {
                "get": (lambda: instance.get(k("up")), None),
                "get_into": (lambda: instance.get(k("up"), bytearray(17)), None),
                "exists": (lambda: instance.exists(k("up")), False),
                "set": (lambda: instance.set(k("down"), b"x"), False),
                "batch_get": (lambda: instance.batch_get([k("up")], [bytearray(17)]), [False]),
                "batch_set": (lambda: instance.batch_set([k("down")], [b"x"]), [False]),
                "batch_exists": (lambda: instance.batch_exists([k("up")]), 0),
                "batch_get_v1": (
                    lambda: instance.batch_get_v1([k("up")], _indices(pool, [1])),
                    [False],
                ),
                "batch_set_v1": (
                    lambda: instance.batch_set_v1([k("down")], _indices(pool, [2])),
                    [False],
                ),
            }
            for op, (call, miss) in calls.items():
                start = time.monotonic()
                result = call()
                elapsed = time.monotonic() - start
                assert elapsed <= limit, f"{op} took {elapsed:.2f}s with the server down"
                assert result == miss, f"{op} returned {result!r} with the server down"
            assert bool((_raw(pool) == SENTINEL).all()), "a failed load wrote into the pool"

    def test_server_restart_recovers(
        self,
        server_control: ServerControl,
        hicache_factory: BackendFactory,
        backend: StorageBackend,
        k: Keyspace,
    ) -> None:
        limit = _server_timeout(server_control, hicache_factory.options) + SLACK_S
        server_control.stop()
        backend.get(k("r"))
        server_control.start()
        deadline = time.monotonic() + 2 * limit
        while not backend.set(k("r"), b"after restart") and time.monotonic() < deadline:
            time.sleep(0.1)
        got = backend.get(k("r"))
        assert got is not None and _bytes(got) == b"after restart"


# -- model-based ------------------------------------------------------------------------------

_NAMES = st.sampled_from(["a", "b", "c", "d", "e"])
_VALUES = st.binary(min_size=1, max_size=96)
_MACHINES = itertools.count()


class _DictModelMachine(RuleBasedStateMachine):
    """The backend against a dict of candidate values per key."""

    factory: BackendFactory
    caps: Capabilities
    prefix: str

    def __init__(self) -> None:
        super().__init__()
        self.ks = Keyspace(f"{self.prefix}{next(_MACHINES)}-")
        self.backend = self.factory()
        self.model: dict[str, set[bytes]] = {}
        self.can_clear = True

    def _key(self, name: str) -> str:
        return self.ks(name)

    @rule(name=_NAMES, value=_VALUES)
    def set_value(self, name: str, value: bytes) -> None:
        key = self._key(name)
        assert self.backend.set(key, value) is True
        self.model.setdefault(key, set()).add(value)

    @rule(name=_NAMES)
    def get(self, name: str) -> None:
        key = self._key(name)
        got = self.backend.get(key)
        if key in self.model:
            assert got is not None and _bytes(got) in self.model[key]
        else:
            assert got is None

    @rule(name=_NAMES)
    def get_into(self, name: str) -> None:
        key = self._key(name)
        got = self.backend.get(key)
        if got is None:
            assert key not in self.model
            assert self.backend.get(key, bytearray(4)) is None
            return
        out = bytearray(len(_bytes(got)))
        assert self.backend.get(key, out) is out
        assert bytes(out) in self.model[key]

    @rule(name=_NAMES)
    def exists(self, name: str) -> None:
        key = self._key(name)
        assert self.backend.exists(key) is (key in self.model)

    @rule(names=st.lists(_NAMES, max_size=6))
    def batch_exists_prefix(self, names: list[str]) -> None:
        keys = [self._key(n) for n in names]
        expected = _leading_run([key in self.model for key in keys])
        assert self.backend.batch_exists(keys) == expected

    @rule(names=st.lists(_NAMES, max_size=6))
    def batch_get(self, names: list[str]) -> None:
        keys = [self._key(n) for n in names]
        sizes = []
        for key in keys:
            got = self.backend.get(key)
            sizes.append(8 if got is None else len(_bytes(got)))
        outs = [bytearray(size) for size in sizes]
        hits = self.backend.batch_get(keys, outs)
        assert hits == [key in self.model for key in keys]
        for key, out, hit in zip(keys, outs, hits, strict=True):
            if hit:
                assert bytes(out) in self.model[key]

    @precondition(lambda self: self.caps.delete)
    @rule(name=_NAMES)
    def delete(self, name: str) -> None:
        key = self._key(name)
        assert self.backend.delete(key) is (key in self.model)
        self.model.pop(key, None)

    @precondition(lambda self: self.can_clear)
    @rule()
    def clear(self) -> None:
        try:
            self.backend.clear()
        except UnsupportedOperationError:
            self.can_clear = False
            return
        self.model.clear()

    @precondition(lambda self: self.caps.persistent)
    @rule()
    def reopen(self) -> None:
        self.backend.close()
        self.backend = self.factory()

    def teardown(self) -> None:
        try:
            cleanup(self.factory, self.backend, self.ks)
        finally:
            self.backend.close()


class TestStateMachine:
    """Random sequences of operations agree with a dictionary model."""

    def test_state_machine_matches_dict_model(
        self,
        hicache_factory: BackendFactory,
        capabilities: Capabilities,
        k: Keyspace,
        request: pytest.FixtureRequest,
    ) -> None:
        profile = str(request.config.getoption("hicache_profile", default="ci") or "ci")
        machine = type(
            "DictModelMachine",
            (_DictModelMachine,),
            {"factory": hicache_factory, "caps": capabilities, "prefix": k.prefix},
        )
        run_state_machine_as_test(
            machine, settings=settings(parent=settings.get_profile(f"hicache-{profile}"))
        )
