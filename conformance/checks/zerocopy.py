"""Zero-copy page I/O (the v1 calls, unified objects) and the size of output buffers."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import hashlib

import pytest
import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import (
    SENTINEL,
    _bytes,
    _expected_after_load,
    _indices,
    _pool,
    _random_fill,
    _raw,
    _sentinel_fill,
)
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace
from hicache_storage.errors import BufferSizeError, IndexAlignmentError, PoolNotRegisteredError
from hicache_storage.hostpool import UnifiedObjectPool
from hicache_storage.keys import plan_unified

__all__ = ["TestZeroCopy", "TestUnifiedObjects", "TestBufferSize"]

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
