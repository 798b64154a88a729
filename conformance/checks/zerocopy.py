"""Zero-copy page I/O (the v1 calls, unified objects) and the size of output buffers."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import hashlib
import tracemalloc
from collections.abc import Callable

import pytest
import torch

from hicache_storage.backend import HostPool, StorageBackend
from hicache_storage.conformance.checks.common import (
    SENTINEL,
    MiB,
    _bytes,
    _expected_after_load,
    _indices,
    _pool,
    _random_fill,
    _raw,
    _sentinel_fill,
    fill_random,
    mismatch,
    model_pool,
    page_bytes,
    pages_mismatch,
    pool_pages,
    requires,
    value_limit,
)
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace
from hicache_storage.conformance.workers import make_value
from hicache_storage.errors import BufferSizeError, IndexAlignmentError, PoolNotRegisteredError
from hicache_storage.hostpool import HostKVPool, UnifiedObjectPool
from hicache_storage.keys import UnifiedPlan, plan_unified
from hicache_storage.kit.vectored import IOV_MAX

__all__ = [
    "TestModelPages",
    "TestNativeZeroCopy",
    "TestZeroCopy",
    "TestUnifiedObjects",
    "TestBufferSize",
]

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

    @pytest.mark.parametrize(("kind", "layout"), POOL_CASES)
    def test_v1_hits_and_misses_every_page(
        self, backend: StorageBackend, k: Keyspace, kind: str, layout: str
    ) -> None:
        """One v1 read of stored pages, absent keys and a wrong size, in a mixed order.

        Each key is answered for itself, after the first miss too, and every page of the pool
        is compared: a hit's page holds its object, the page of a miss (before or after the
        first one) and every page outside the batch keep their sentinel bytes.
        """
        shape = "HMHSHMH"  # H: a stored page, M: an absent key, S: an object of another size
        source = _pool(kind, layout)
        _random_fill(source, seed=13)
        keys = k.many(f"mixed-{kind}-{layout}-", len(shape))
        stored = [i for i, kind_ in enumerate(shape) if kind_ == "H"]
        backend.register_host_pool(source)
        oks = backend.batch_set_v1([keys[i] for i in stored], _indices(source, stored))
        assert oks == [True] * len(stored), f"batch_set_v1 of {len(stored)} pages returned {oks}"
        for key, kind_ in zip(keys, shape, strict=True):
            if kind_ == "S":
                assert backend.set(key, make_value(key, source.page_nbytes // 2))
        want = page_bytes(source, _indices(source, range(len(shape))))
        target = _pool(kind, layout)
        _sentinel_fill(target)
        expected = pool_pages(target)
        pages = [5, 0, 7, 2, 6, 3, 1]  # page 4 is outside the batch
        for i, page in enumerate(pages):
            if shape[i] == "H":
                expected[page] = want[i]
        backend.register_host_pool(target)
        got = backend.batch_get_v1(keys, _indices(target, pages))
        hits = [kind_ == "H" for kind_ in shape]
        assert got == hits, (
            f"batch_get_v1 of keys {shape} (H a stored page, M absent, S an object of half a "
            f"page) returned {got}, expected {hits}: one answer per key, after a miss too"
        )
        problem = pages_mismatch(
            f"batch_get_v1 of keys {shape} into pages {pages}", target, expected
        )
        assert problem is None, problem

    @pytest.mark.parametrize("size", ["shorter", "longer", "double"])
    @pytest.mark.parametrize(
        ("kind", "layout"), [("mla", "page_first"), ("mha", "layer_first")], ids=["one", "many"]
    )
    def test_v1_size_mismatch_is_miss_page_untouched(
        self, backend: StorageBackend, k: Keyspace, kind: str, layout: str, size: str
    ) -> None:
        # one / many: a page of one buffer (read in place) or of many; the neighbours must
        # stay untouched too, so a read of the whole object into the page's memory shows.
        pool = _pool(kind, layout)
        _sentinel_fill(pool)
        before = pool_pages(pool)
        nbytes = {"shorter": pool.page_nbytes - 1, "longer": pool.page_nbytes + 1}.get(
            size, 2 * pool.page_nbytes
        )
        assert backend.set(k("odd"), make_value(k("odd"), nbytes))
        backend.register_host_pool(pool)
        got = backend.batch_get_v1([k("odd")], _indices(pool, [3]))
        assert got == [False], (
            f"batch_get_v1 of a {nbytes}-byte object into a {pool.page_nbytes}-byte page "
            f"returned {got}, expected [False] (a size mismatch is a miss)"
        )
        problem = pages_mismatch(f"a {size} object's batch_get_v1 into page 3", pool, before)
        assert problem is None, problem

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


def _three_layer_plan(kind: str, *, head_group: int) -> UnifiedPlan:
    """Three layers in chunks of two (two objects per page, the last one shorter), 4 tokens."""
    mla = kind == "mla"
    return plan_unified(
        model_id="conformance",
        dtype="float16",
        page_size=4,
        num_layers=3,
        layer_partition=2,
        is_mla=mla,
        local_kv_heads=0 if mla else 2,
        head_group=None if mla else head_group,
    )


class TestUnifiedObjects:
    """Unified-scheme objects (several per page, of two sizes, in many spans) move intact."""

    @pytest.mark.parametrize(("kind", "layout"), POOL_CASES)
    def test_unified_objects_move_between_layouts(
        self, backend: StorageBackend, k: Keyspace, kind: str, layout: str
    ) -> None:
        plan = _three_layer_plan(kind, head_group=1)
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

    @pytest.mark.parametrize("size", ["largest", "plus_one", "minus_one"])
    def test_unified_object_size_mismatch_is_miss(
        self, backend: StorageBackend, k: Keyspace, size: str
    ) -> None:
        # Two objects per page: layers 0-1 and a shorter last chunk, layer 2. The pool's
        # page_nbytes is the larger object's size; each object's own size is its spans' sum.
        plan = _three_layer_plan("mha", head_group=2)
        objects = UnifiedObjectPool(_pool("mha", "page_first", layers=3), plan)
        _sentinel_fill(objects.pool)
        before = pool_pages(objects.pool)
        big, small = objects.object_nbytes(0), objects.object_nbytes(1)
        assert objects.page_nbytes == big > small
        keys = plan.keys([hashlib.sha256(k("sized").encode()).hexdigest()])
        k.used.update(keys)
        wrong = {"largest": objects.page_nbytes, "plus_one": small + 1}.get(size, small - 1)
        right = make_value(keys[0], big)
        assert backend.set(keys[0], right) and backend.set(keys[1], make_value(keys[1], wrong))
        backend.register_host_pool(objects)
        indices = objects.object_indices(_indices(objects.pool, [2]))
        got = backend.batch_get_v1(keys, indices)
        assert got == [True, False], (
            f"batch_get_v1 of unified objects of {big} bytes (right size) and {wrong} bytes "
            f"(its object has {small}; the pool's page_nbytes is {objects.page_nbytes}) returned "
            f"{got}, expected [True, False]: compare each object with its own buffers' size"
        )
        have = page_bytes(objects, indices[: objects.page_size])[0]
        problem = mismatch("batch_get_v1", keys[0], have, right)
        assert problem is None, problem
        expected = list(before)
        expected[2] = pool_pages(objects.pool)[2]  # object 0 loaded; checked just above
        problem = pages_mismatch(
            f"batch_get_v1 with a {size} unified object", objects.pool, expected
        )
        assert problem is None, problem
        untouched = page_bytes(objects, indices[objects.page_size :])[0]
        assert set(untouched) == {SENTINEL}, (
            f"batch_get_v1 of a {wrong}-byte object into a {small}-byte unified object wrote it"
        )


class TestModelPages:
    """Pages of real models (MiB-sized, many buffers) move between store and pool byte-exact."""

    @pytest.mark.parametrize(
        ("kind", "layout", "geometry"),
        [
            # (page_size, layers, heads, head_dim): 6, 5 and 4.5 MiB MHA pages, a 4.3 MiB
            # MLA page (DeepSeek-like: 61 layers of 576-element latents).
            pytest.param("mha", "layer_first", (128, 12, 8, 128), id="mha-layer_first-6MiB"),
            pytest.param("mha", "page_first", (128, 10, 8, 128), id="mha-page_first-5MiB"),
            pytest.param(
                "mha", "page_first_direct", (128, 9, 8, 128), id="mha-page_first_direct-4.5MiB"
            ),
            pytest.param("mla", "page_first_direct", (64, 61, 1, 576), id="mla-direct-4.3MiB"),
        ],
    )
    def test_v1_model_page_sizes_every_byte(
        self,
        backend: StorageBackend,
        hicache_factory: BackendFactory,
        k: Keyspace,
        kind: str,
        layout: str,
        geometry: tuple[int, int, int, int],
    ) -> None:
        page_size, layers, heads, head_dim = geometry
        pool = model_pool(
            kind,
            layout,
            pages=4,
            page_size=page_size,
            layers=layers,
            heads=heads,
            head_dim=head_dim,
        )
        assert pool.page_nbytes > 4 * MiB, "the check needs pages larger than 4 MiB"
        if pool.page_nbytes > value_limit(backend, hicache_factory.options, pool.page_nbytes):
            pytest.skip(f"a {pool.page_nbytes}-byte page exceeds max_value_size or the capacity")
        fill_random(pool, seed=23)
        _check_pages_move(backend, k, pool, f"{kind}-{layout}")

    @pytest.mark.parametrize("shape", ["layer_first", "unified"])
    def test_v1_more_buffers_than_iov_max(
        self, backend: StorageBackend, k: Keyspace, shape: str
    ) -> None:
        if shape == "layer_first":
            # 2 * layers buffers of 16 bytes per page: more than two IOV_MAX chunks.
            layers = IOV_MAX + 11
            host = model_pool(
                "mha", "layer_first", pages=4, page_size=2, layers=layers, heads=1, head_dim=4
            )
            fill_random(host, seed=29)
            pool: HostPool = host
            keys = k.many("iov", 2)
        else:
            # One unified object per page spanning 2 * layers * page_size = 1536 pieces.
            plan = plan_unified(
                model_id="conformance",
                dtype="float16",
                page_size=32,
                num_layers=24,
                local_kv_heads=2,
                head_group=2,
            )
            pool = UnifiedObjectPool(_pool("mha", "page_first", page_size=32, layers=24), plan)
            fill_random(pool.pool, seed=31)
            keys = plan.keys([hashlib.sha256(k(f"iov{i}").encode()).hexdigest() for i in range(2)])
            k.used.update(keys)
        spans = len(pool.page_buffer_views(_page_indices(pool, [0]))[0])
        assert spans > IOV_MAX, f"the check needs more than {IOV_MAX} buffers per page"
        _check_pages_move(backend, k, pool, f"{spans}-buffer", keys=keys)


def _page_indices(pool: HostPool, pages: list[int]) -> torch.Tensor:
    if isinstance(pool, UnifiedObjectPool):
        return pool.object_indices(_indices(pool.pool, pages))
    return _indices(pool, pages)  # type: ignore[arg-type]


def _check_pages_move(
    backend: StorageBackend,
    k: Keyspace,
    pool: HostPool,
    what: str,
    keys: list[str] | None = None,
) -> None:
    """Write pages 0 and 2 with batch_set_v1, read them back with get and into pages 3 and 1."""
    keys = keys if keys is not None else k.many(f"{what}-", 2)
    backend.register_host_pool(pool)
    source = _page_indices(pool, [0, 2])
    want = page_bytes(pool, source)
    oks = backend.batch_set_v1(keys, source)
    assert oks == [True, True], f"batch_set_v1 of two {what} pages returned {oks}"
    for key, expected in zip(keys, want, strict=True):
        stored = backend.get(key)
        assert stored is not None, f"get of {key!r} written by batch_set_v1 missed"
        problem = mismatch(f"get after batch_set_v1 of a {what} page", key, stored, expected)
        assert problem is None, problem
    host = pool.pool if isinstance(pool, UnifiedObjectPool) else pool
    assert isinstance(host, HostKVPool)
    before = pool_pages(host)
    target = _page_indices(pool, [3, 1])
    hits = backend.batch_get_v1(keys, target)
    assert hits == [True, True], f"batch_get_v1 of two {what} pages returned {hits}"
    for key, have, expected in zip(keys, page_bytes(pool, target), want, strict=True):
        problem = mismatch(f"batch_get_v1 of a {what} page", key, have, expected)
        assert problem is None, problem
    after = pool_pages(host)
    expected_pages = [after[p] if p in (3, 1) else before[p] for p in range(host.num_pages)]
    problem = pages_mismatch(f"batch_get_v1 of two {what} pages into 3 and 1", host, expected_pages)
    assert problem is None, f"{problem}: a read changed a page it was not given"


class TestNativeZeroCopy:
    """A backend that claims ``native_zero_copy`` moves pages without staging them in Python."""

    @requires("native_zero_copy")
    def test_native_zero_copy_no_page_sized_staging(
        self, backend: StorageBackend, k: Keyspace
    ) -> None:
        bare = type(backend.unwrap()) if hasattr(backend, "unwrap") else type(backend)
        for name in ("batch_get_v1", "batch_set_v1"):
            assert getattr(bare, name) is not getattr(StorageBackend, name), (
                f"{bare.__name__} claims native_zero_copy but inherits StorageBackend.{name}, "
                "the default that stages multi-buffer pages through a page-sized temporary"
            )
        # A 16 MiB page of 64 buffers of 256 KiB (layer_first, 32 layers of 8 heads of 128).
        pool = model_pool("mha", "layer_first", pages=2, page_size=128, layers=32)
        fill_random(pool, seed=37)
        backend.register_host_pool(pool)
        keys = [k("zc")]
        want = page_bytes(pool, _indices(pool, [0]))[0]
        peak, oks = _peak_python_bytes(lambda: backend.batch_set_v1(keys, _indices(pool, [0])))
        assert oks == [True], f"batch_set_v1 of a 16 MiB page returned {oks}"
        assert pool.page_nbytes == 16 * MiB
        assert peak < pool.page_nbytes // 4, (
            f"batch_set_v1 of a {pool.page_nbytes}-byte page allocated {peak} bytes of Python "
            "memory at its peak: a native_zero_copy backend writes from the page's buffers"
        )
        peak, hits = _peak_python_bytes(lambda: backend.batch_get_v1(keys, _indices(pool, [1])))
        assert hits == [True], f"batch_get_v1 of a 16 MiB page returned {hits}"
        assert peak < pool.page_nbytes // 4, (
            f"batch_get_v1 of a {pool.page_nbytes}-byte page allocated {peak} bytes of Python "
            "memory at its peak: a native_zero_copy backend reads into the page's buffers"
        )
        problem = mismatch("batch_get_v1", keys[0], page_bytes(pool, _indices(pool, [1]))[0], want)
        assert problem is None, problem


def _peak_python_bytes(call: Callable[[], list[bool]]) -> tuple[int, list[bool]]:
    """Run ``call``; return its peak of Python allocations (``tracemalloc``) and its result."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        result = call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if started:
            tracemalloc.stop()
    return peak - base, result


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
