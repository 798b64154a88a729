from __future__ import annotations

import ctypes
import itertools
import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_storage.errors import (
    AllocatorError,
    BufferSizeError,
    HostPoolError,
    IndexAlignmentError,
    InvalidValueError,
)
from hicache_storage.hostpool import (
    HostKVPool,
    Layout,
    MHAHostPool,
    MLAHostPool,
    PageAllocator,
    mla_buffer_shape,
    mla_page_shape,
)

SIZE, PAGE, LAYERS, HEADS, HEAD_DIM, KV_DIM = 32, 4, 3, 2, 8, 16
LAYOUTS = list(Layout)
MLA_LAYOUTS = [layout for layout in LAYOUTS if layout is not Layout.PAGE_HEAD]
KINDS = ["mha", "mla"]
POOL_KINDS = [("mha", layout) for layout in LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]
DTYPES = [torch.bfloat16, torch.float32]


def make_pool(kind: str, layout: Layout, dtype: torch.dtype = torch.float32) -> HostKVPool:
    if kind == "mha":
        return MHAHostPool(SIZE, PAGE, LAYERS, HEADS, HEAD_DIM, dtype, layout, pin_memory=False)
    return MLAHostPool(SIZE, PAGE, LAYERS, KV_DIM, dtype, layout, pin_memory=False)


def pool_bytes(pool: HostKVPool) -> np.ndarray:
    return pool.kv_buffer.view(-1).view(torch.uint8).numpy()


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def page(start: int) -> list[int]:
    return list(range(start, start + PAGE))


def fill_random(pool: HostKVPool, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    pool_bytes(pool)[:] = rng.integers(0, 256, pool.kv_buffer.nbytes, dtype=np.uint8)


@pytest.fixture(params=[(k, lay, dt) for k, lay in POOL_KINDS for dt in DTYPES])
def pool(request: pytest.FixtureRequest) -> HostKVPool:
    kind, layout, dtype = request.param
    return make_pool(kind, layout, dtype)


EXPECTED_SHAPES = {
    ("mha", Layout.LAYER_FIRST): (
        (2, LAYERS, SIZE, HEADS, HEAD_DIM),
        (2, LAYERS, PAGE, HEADS, HEAD_DIM),
    ),
    ("mha", Layout.PAGE_FIRST): (
        (2, SIZE, LAYERS, HEADS, HEAD_DIM),
        (2, PAGE, LAYERS, HEADS, HEAD_DIM),
    ),
    ("mha", Layout.PAGE_FIRST_DIRECT): (
        (2, SIZE // PAGE, LAYERS, PAGE, HEADS, HEAD_DIM),
        (2, LAYERS, PAGE, HEADS, HEAD_DIM),
    ),
    ("mha", Layout.PAGE_HEAD): (
        (2, SIZE // PAGE, HEADS, PAGE, LAYERS, HEAD_DIM),
        (2, HEADS, PAGE, LAYERS, HEAD_DIM),
    ),
    ("mla", Layout.LAYER_FIRST): ((LAYERS, SIZE, 1, KV_DIM), (LAYERS, PAGE, KV_DIM)),
    ("mla", Layout.PAGE_FIRST): ((SIZE, LAYERS, 1, KV_DIM), (PAGE, LAYERS, KV_DIM)),
    ("mla", Layout.PAGE_FIRST_DIRECT): (
        (SIZE // PAGE, LAYERS, PAGE, 1, KV_DIM),
        (LAYERS, PAGE, KV_DIM),
    ),
}


# --- shapes and metadata ----------------------------------------------------------------------


def test_shapes_and_attributes(pool: HostKVPool) -> None:
    kind = "mla" if pool.is_mla else "mha"
    buffer_shape, page_shape = EXPECTED_SHAPES[(kind, pool.layout)]
    itemsize = pool.kv_buffer.element_size()
    assert tuple(pool.kv_buffer.shape) == buffer_shape
    assert pool.page_shape == page_shape
    assert pool.page_nbytes == math.prod(page_shape) * itemsize
    assert pool.num_pages == SIZE // PAGE
    assert (pool.size, pool.page_size, pool.layer_num) == (SIZE, PAGE, LAYERS)
    assert pool.base_ptr == pool.kv_buffer.data_ptr()
    assert not pool.kv_buffer.is_pinned()
    assert bool((pool.kv_buffer == 0).all())
    assert tuple(pool.get_data_page(0).shape) == page_shape
    if isinstance(pool, MHAHostPool):
        assert pool.k_buffer.data_ptr() == pool.kv_buffer.data_ptr()
        assert pool.v_buffer.data_ptr() == pool.kv_buffer[1].data_ptr()
        assert tuple(pool.k_buffer.shape) == buffer_shape[1:]
    else:
        assert isinstance(pool, MLAHostPool)
        assert pool.kv_cache_dim == KV_DIM


@pytest.mark.parametrize(("kind", "layout"), POOL_KINDS)
def test_buffers_per_page(kind: str, layout: Layout) -> None:
    pool = make_pool(kind, layout)
    expected = {
        ("mha", Layout.LAYER_FIRST): 2 * LAYERS,
        ("mla", Layout.LAYER_FIRST): LAYERS,
        ("mha", Layout.PAGE_FIRST): 2,
        ("mha", Layout.PAGE_FIRST_DIRECT): 2,
        ("mha", Layout.PAGE_HEAD): 2,
        ("mla", Layout.PAGE_FIRST): 1,
        ("mla", Layout.PAGE_FIRST_DIRECT): 1,
    }[(kind, layout)]
    (meta,) = pool.page_buffer_meta(page(8))
    assert len(meta) == expected
    assert {nbytes for _, nbytes in meta} == {pool.page_nbytes // expected}


def test_meta_inside_buffer_and_disjoint(pool: HostKVPool) -> None:
    meta = pool.page_buffer_meta(torch.arange(SIZE))
    assert len(meta) == pool.num_pages
    base, end = pool.base_ptr, pool.base_ptr + pool.kv_buffer.nbytes
    regions = sorted(region for buffers in meta for region in buffers)
    for addr, nbytes in regions:
        assert base <= addr and addr + nbytes <= end
    for (addr, nbytes), (next_addr, _) in itertools.pairwise(regions):
        assert addr + nbytes <= next_addr
    assert all(sum(n for _, n in buffers) == pool.page_nbytes for buffers in meta)
    assert sum(n for _, n in regions) == pool.kv_buffer.nbytes


def test_views_and_meta_match_data_page(pool: HostKVPool) -> None:
    fill_random(pool)
    starts = [0, 12, SIZE - PAGE]
    indices = [i for start in starts for i in page(start)]
    views = pool.page_buffer_views(indices)
    meta = pool.page_buffer_meta(indices)
    for start, page_views, page_meta in zip(starts, views, meta, strict=True):
        expected = tensor_bytes(pool.get_data_page(start))
        assert b"".join(bytes(view) for view in page_views) == expected
        assert b"".join(ctypes.string_at(addr, n) for addr, n in page_meta) == expected
        for view, (_, nbytes) in zip(page_views, page_meta, strict=True):
            assert (view.format, view.ndim, view.readonly, view.nbytes) == ("B", 1, False, nbytes)


def test_write_through_views_changes_pool(pool: HostKVPool) -> None:
    views = pool.page_buffer_views(page(8))[0]
    for view in views:
        view[:] = b"\x01" * view.nbytes
    expected = np.full(pool.page_nbytes, 1, dtype=np.uint8)
    assert tensor_bytes(pool.get_data_page(8)) == expected.tobytes()
    assert int((pool_bytes(pool) != 0).sum()) == pool.page_nbytes


# --- generic copy path --------------------------------------------------------------------------


def test_write_read_round_trip_leaves_other_pages(pool: HostKVPool) -> None:
    fill_random(pool, seed=1)
    before = pool_bytes(pool).copy()
    start = 12
    data = np.random.default_rng(2).integers(0, 256, pool.page_nbytes, dtype=np.uint8)
    pool.write_page(start, data.tobytes())

    out = bytearray(pool.page_nbytes)
    pool.read_page(start, out)
    assert bytes(out) == data.tobytes()
    out_np = np.empty(pool.page_nbytes // 4, dtype=np.float32)
    pool.read_page(start, out_np)
    assert out_np.tobytes() == data.tobytes()
    assert tensor_bytes(pool.get_data_page(start)) == data.tobytes()

    after = pool_bytes(pool)
    in_page = np.zeros(after.size, dtype=bool)
    written = []
    for addr, nbytes in pool.page_buffer_meta(page(start))[0]:
        offset = addr - pool.base_ptr
        in_page[offset : offset + nbytes] = True
        written.append(after[offset : offset + nbytes])
    assert int(in_page.sum()) == pool.page_nbytes
    np.testing.assert_array_equal(after[~in_page], before[~in_page])
    np.testing.assert_array_equal(np.concatenate(written), data)


def test_write_page_accepts_buffer_kinds(pool: HostKVPool) -> None:
    data = np.random.default_rng(3).integers(0, 256, pool.page_nbytes, dtype=np.uint8)
    for value in (data, bytearray(data.tobytes()), memoryview(data.tobytes()), data.view(np.int32)):
        pool.write_page(4, value)
        assert tensor_bytes(pool.get_data_page(4)) == data.tobytes()
        pool.write_page(4, bytes(pool.page_nbytes))


def test_set_data_page_round_trip(pool: HostKVPool) -> None:
    fill_random(pool, seed=4)
    before = pool_bytes(pool).copy()
    source = make_pool("mla" if pool.is_mla else "mha", pool.layout, pool.dtype)
    fill_random(source, seed=5)
    value = source.get_data_page(20)
    pool.set_data_page(8, value)
    assert tensor_bytes(pool.get_data_page(8)) == tensor_bytes(value)
    pool.set_data_page(8, value.reshape(-1))
    assert tensor_bytes(pool.get_data_page(8)) == tensor_bytes(value)
    strided = value.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    pool.set_data_page(8, strided)
    assert tensor_bytes(pool.get_data_page(8)) == tensor_bytes(value)
    changed = np.nonzero(pool_bytes(pool) != before)[0]
    in_page = {
        offset
        for addr, nbytes in pool.page_buffer_meta(page(8))[0]
        for offset in range(addr - pool.base_ptr, addr - pool.base_ptr + nbytes)
    }
    assert set(changed.tolist()) <= in_page


# --- canonical order ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_canonical_order_mha(layout: Layout) -> None:
    pool = make_pool("mha", layout)
    assert isinstance(pool, MHAHostPool)
    pool.kv_buffer.copy_(
        torch.arange(pool.kv_buffer.numel(), dtype=torch.float32).view_as(pool.kv_buffer)
    )
    k, v = pool.k_buffer, pool.v_buffer
    for start in (0, 8, SIZE - PAGE):
        end = start + PAGE
        if layout is Layout.LAYER_FIRST:
            expected = torch.stack([k[:, start:end], v[:, start:end]])
        elif layout is Layout.PAGE_FIRST:
            expected = torch.stack([k[start:end], v[start:end]])
        else:  # page_first_direct, page_head: the page's slice of K, then of V
            expected = torch.stack([k[start // PAGE], v[start // PAGE]])
        assert torch.equal(pool.get_data_page(start), expected)
        if layout is Layout.PAGE_HEAD:
            # SGLang's MHATokenToKVPoolHost.get_data_page(start, flat=True) for page_head.
            sglang_page = pool.kv_buffer[:, start // PAGE : start // PAGE + 1].flatten()
            assert torch.equal(pool.get_data_page(start).flatten(), sglang_page)
        out = bytearray(pool.page_nbytes)
        pool.read_page(start, out)
        assert bytes(out) == tensor_bytes(expected)
        views = pool.page_buffer_views(page(start))[0]
        assert b"".join(bytes(view) for view in views) == tensor_bytes(expected)


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_canonical_order_mla(layout: Layout) -> None:
    pool = make_pool("mla", layout)
    kv = pool.kv_buffer
    kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view_as(kv))
    for start in (0, 8, SIZE - PAGE):
        end = start + PAGE
        if layout is Layout.LAYER_FIRST:
            expected = kv[:, start:end, 0]
        elif layout is Layout.PAGE_FIRST:
            expected = kv[start:end, :, 0]
        else:
            expected = kv[start // PAGE, :, :, 0]
        assert torch.equal(pool.get_data_page(start), expected)
        out = np.empty(pool.page_nbytes, dtype=np.uint8)
        pool.read_page(start, out)
        assert out.tobytes() == tensor_bytes(expected)


# --- index validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "indices",
    [
        [1, 2, 3, 4],  # misaligned start
        page(SIZE),  # out of range
        [-4, -3, -2, -1],  # negative
        [0, 1, 3, 2],  # not consecutive
        [*page(0), 5, 6, 7, 8],  # second page misaligned
        [*page(0), 4, 5, 6, 8],  # second page not consecutive
        [0, 1, 2],  # not whole pages
        [0.0, 1.0, 2.0, 3.0],  # floats
        torch.arange(4, dtype=torch.float32),
        torch.arange(8).view(2, 4),  # not 1-D
        torch.ones(4, dtype=torch.bool),
        [[0, 1], [2]],  # ragged
    ],
)
def test_bad_host_indices(indices: object) -> None:
    pool = make_pool("mha", Layout.LAYER_FIRST)
    with pytest.raises(IndexAlignmentError):
        pool.page_buffer_meta(indices)  # type: ignore[arg-type]
    with pytest.raises(IndexAlignmentError):
        pool.page_buffer_views(indices)  # type: ignore[arg-type]


def test_host_index_forms() -> None:
    pool = make_pool("mla", Layout.PAGE_FIRST)
    expected = [4, 16]
    forms: list[object] = [
        [*page(4), *page(16)],
        (*page(4), *page(16)),
        torch.tensor([*page(4), *page(16)], dtype=torch.int32),
        np.array([*page(4), *page(16)], dtype=np.uint16),
    ]
    for form in forms:
        assert pool.page_starts(form) == expected  # type: ignore[arg-type]
    assert pool.page_starts([]) == []
    assert pool.page_buffer_meta(torch.empty(0, dtype=torch.int64)) == []


@pytest.mark.parametrize("start", [1, SIZE, -PAGE, SIZE + PAGE, 2.0])
def test_bad_page_start(start: object) -> None:
    pool = make_pool("mha", Layout.PAGE_FIRST)
    with pytest.raises(IndexAlignmentError):
        pool.read_page(start, bytearray(pool.page_nbytes))  # type: ignore[arg-type]
    with pytest.raises(IndexAlignmentError):
        pool.write_page(start, bytes(pool.page_nbytes))  # type: ignore[arg-type]
    with pytest.raises(IndexAlignmentError):
        pool.get_data_page(start)  # type: ignore[arg-type]


def test_bad_buffers() -> None:
    pool = make_pool("mha", Layout.LAYER_FIRST, torch.bfloat16)
    n = pool.page_nbytes
    for size in (0, n - 1, n + 1, 2 * n):
        with pytest.raises(BufferSizeError):
            pool.read_page(0, bytearray(size))
        with pytest.raises(BufferSizeError):
            pool.write_page(0, bytes(size))
    with pytest.raises(InvalidValueError):
        pool.read_page(0, bytes(n))
    with pytest.raises(InvalidValueError):
        pool.read_page(0, np.zeros((n, 2), dtype=np.uint8)[:, 0])
    with pytest.raises(InvalidValueError):
        pool.write_page(0, "x" * n)
    with pytest.raises(InvalidValueError):
        pool.set_data_page(0, torch.zeros(pool.page_shape, dtype=torch.float32))
    with pytest.raises(BufferSizeError):
        pool.set_data_page(0, torch.zeros(3, dtype=torch.bfloat16))


# --- construction -------------------------------------------------------------------------------


def test_bad_construction() -> None:
    with pytest.raises(HostPoolError, match="multiple of page_size"):
        MHAHostPool(30, 4, 2, 2, 8, pin_memory=False)
    with pytest.raises(HostPoolError, match="multiple of page_size"):
        MLAHostPool(30, 4, 2, 16, pin_memory=False)
    for bad in [(0, 4, 2, 2, 8), (8, 0, 2, 2, 8), (8, 4, 0, 2, 8), (8, 4, 2, -1, 8)]:
        with pytest.raises(HostPoolError):
            MHAHostPool(*bad, pin_memory=False)
    with pytest.raises(HostPoolError, match="'layer_first', 'page_first', 'page_first_direct'"):
        MHAHostPool(8, 4, 2, 2, 8, layout="row_major", pin_memory=False)
    with pytest.raises(HostPoolError):
        MHAHostPool(8, 4, 2, 2, 8, dtype="bf16", pin_memory=False)  # type: ignore[arg-type]


def test_page_head_is_mha_only() -> None:
    with pytest.raises(HostPoolError, match="page_head is MHA-only"):
        MLAHostPool(SIZE, PAGE, LAYERS, KV_DIM, layout="page_head", pin_memory=False)
    with pytest.raises(HostPoolError, match="page_head is MHA-only"):
        mla_buffer_shape(Layout.PAGE_HEAD, SIZE, PAGE, LAYERS, KV_DIM)
    with pytest.raises(HostPoolError, match="page_head is MHA-only"):
        mla_page_shape(Layout.PAGE_HEAD, PAGE, LAYERS, KV_DIM)
    with pytest.raises(HostPoolError, match="page_head is MHA-only"):
        MLAHostPool.from_buffer(
            torch.zeros(SIZE // PAGE, 1, PAGE, LAYERS, KV_DIM), PAGE, "page_head"
        )


def test_page_head_element_address() -> None:
    pool = make_pool("mha", Layout.PAGE_HEAD)
    assert isinstance(pool, MHAHostPool)
    pool.kv_buffer.copy_(
        torch.arange(pool.kv_buffer.numel(), dtype=torch.float32).view_as(pool.kv_buffer)
    )
    flat_k = pool.k_buffer.reshape(-1)
    for token, layer, head in [(0, 0, 0), (5, 2, 1), (SIZE - 1, 1, 0)]:
        page, offset = divmod(token, PAGE)
        at = ((page * HEADS + head) * PAGE + offset) * LAYERS * HEAD_DIM + layer * HEAD_DIM
        expected = pool.k_buffer[page, head, offset, layer]
        assert torch.equal(flat_k[at : at + HEAD_DIM], expected)


def test_layout_parse() -> None:
    assert Layout.parse("PAGE_FIRST") is Layout.PAGE_FIRST
    assert Layout.parse(Layout.LAYER_FIRST) is Layout.LAYER_FIRST
    assert Layout.parse("page_first_direct") == "page_first_direct"
    with pytest.raises(HostPoolError, match="valid layouts"):
        Layout.parse(3)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_pin_memory_without_accelerator() -> None:
    assert not MLAHostPool(8, 4, 2, 16).kv_buffer.is_pinned()
    with pytest.raises(HostPoolError, match="pin_memory=False"):
        MLAHostPool(8, 4, 2, 16, pin_memory=True)


def test_pool_alloc_free_delegate() -> None:
    pool = make_pool("mha", Layout.PAGE_FIRST_DIRECT)
    indices = pool.alloc(2 * PAGE)
    assert indices is not None
    assert pool.allocator.available_size() == SIZE - 2 * PAGE
    assert pool.page_starts(indices) == [0, PAGE]
    pool.free(indices)
    assert pool.allocator.available_size() == SIZE


# --- adopting an existing tensor -----------------------------------------------------------------


def adopt(kind: str, tensor: object, layout: Layout | str, page_size: int = PAGE) -> HostKVPool:
    cls = MHAHostPool if kind == "mha" else MLAHostPool
    return cls.from_buffer(tensor, page_size, layout)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
@pytest.mark.parametrize(("kind", "layout"), POOL_KINDS)
def test_from_buffer_adopts_the_tensor_in_place(
    kind: str, layout: Layout, dtype: torch.dtype
) -> None:
    buffer_shape, page_shape = EXPECTED_SHAPES[(kind, layout)]
    # A view into a larger buffer, as an engine's pool may be: only its own bytes are the pool.
    storage = torch.zeros(math.prod(buffer_shape) + 16, dtype=dtype)
    tensor = storage[8:-8].view(buffer_shape)
    pool = adopt(kind, tensor, layout.value.upper())
    reference = make_pool(kind, layout, dtype)
    assert pool.kv_buffer is tensor and pool.base_ptr == tensor.data_ptr()
    assert (pool.dtype, pool.layout, pool.page_shape) == (dtype, layout, page_shape)
    assert (pool.size, pool.page_size, pool.num_pages, pool.layer_num) == (SIZE, PAGE, 8, LAYERS)
    assert (pool.page_nbytes, pool.allocator.available_size()) == (reference.page_nbytes, SIZE)
    if isinstance(pool, MHAHostPool):
        assert (pool.head_num, pool.head_dim) == (HEADS, HEAD_DIM)
        assert pool.k_buffer.data_ptr() == tensor.data_ptr()
        assert pool.v_buffer.data_ptr() == tensor[1].data_ptr()
    else:
        assert isinstance(pool, MLAHostPool) and pool.kv_cache_dim == KV_DIM

    # Writes through the tensor show in the pool's pages...
    fill_random(reference, seed=6)
    tensor.copy_(reference.kv_buffer)
    for start in (0, 12, SIZE - PAGE):
        out = bytearray(pool.page_nbytes)
        pool.read_page(start, out)
        expected = tensor_bytes(reference.get_data_page(start))
        assert bytes(out) == expected
        assert b"".join(bytes(view) for view in pool.page_buffer_views(page(start))[0]) == expected
    # ...and writes through the pool show in the tensor, and nowhere else in its storage.
    data = np.random.default_rng(7).integers(0, 256, pool.page_nbytes, dtype=np.uint8)
    pool.write_page(8, data)
    reference.write_page(8, data)
    for view in pool.page_buffer_views(page(20))[0]:
        view[:] = b"\x05" * view.nbytes
    for view in reference.page_buffer_views(page(20))[0]:
        view[:] = b"\x05" * view.nbytes
    assert torch.equal(tensor.view(torch.uint8), reference.kv_buffer.view(torch.uint8))
    assert not storage[:8].view(torch.uint8).any() and not storage[-8:].view(torch.uint8).any()


def test_from_buffer_keeps_pinned_and_unpinned_tensors_as_they_are() -> None:
    tensor = torch.zeros(2, LAYERS, SIZE, HEADS, HEAD_DIM)
    pool = MHAHostPool.from_buffer(tensor, PAGE, Layout.LAYER_FIRST)
    assert not pool.kv_buffer.is_pinned()
    assert pool.kv_buffer is tensor


MHA_LAYER_FIRST = (2, LAYERS, SIZE, HEADS, HEAD_DIM)


@pytest.mark.parametrize(
    ("kind", "tensor", "layout", "message"),
    [
        ("mha", np.zeros(MHA_LAYER_FIRST), "layer_first", "MHA layer_first .* torch.Tensor"),
        ("mla", [[0.0]], "page_first", "MLA page_first .* torch.Tensor"),
        (
            "mha",
            torch.zeros(MHA_LAYER_FIRST, device="meta"),
            "layer_first",
            "MHA layer_first .* CPU tensor, got one on meta",
        ),
        (
            "mha",
            torch.zeros(2, LAYERS, HEADS, SIZE, HEAD_DIM).transpose(2, 3),
            "layer_first",
            "MHA layer_first .* contiguous",
        ),
        (
            "mla",
            torch.zeros(SIZE, LAYERS, 1, 2 * KV_DIM)[..., ::2],
            "page_first",
            "MLA page_first .* contiguous",
        ),
        (
            "mha",
            torch.zeros(LAYERS, SIZE, HEADS, HEAD_DIM),
            "layer_first",
            r"MHA layer_first pool \(2, L, size, H, D\) .* 4 dimensions, the layout has 5",
        ),
        (
            "mha",
            torch.zeros(3, LAYERS, SIZE, HEADS, HEAD_DIM),
            "layer_first",
            "MHA layer_first .* K/V axis has length 3",
        ),
        (
            "mha",
            torch.zeros(2, 30, LAYERS, HEADS, HEAD_DIM),
            "page_first",
            "MHA page_first .* 30 token slots are not a whole number of pages",
        ),
        (
            "mha",
            torch.zeros(2, 8, LAYERS, PAGE + 1, HEADS, HEAD_DIM),
            "page_first_direct",
            r"MHA page_first_direct pool \(2, pages, L, page, H, D\) .* in-page axis has length 5",
        ),
        (
            "mha",
            torch.zeros(2, 8, HEADS, 2 * PAGE, LAYERS, HEAD_DIM),
            "page_head",
            r"MHA page_head pool \(2, pages, H, page, L, D\) .* in-page axis has length 8",
        ),
        (
            "mha",
            torch.zeros(2, 0, SIZE, HEADS, HEAD_DIM),
            "layer_first",
            "MHA layer_first .* every axis must be non-empty",
        ),
        (
            "mla",
            torch.zeros(LAYERS, SIZE, 2, KV_DIM),
            "layer_first",
            r"MLA layer_first pool \(L, size, 1, d\) .* head axis has length 2, not 1",
        ),
        (
            "mla",
            torch.zeros(8, LAYERS, PAGE, 4, KV_DIM),
            "page_first_direct",
            "MLA page_first_direct .* head axis has length 4, not 1",
        ),
        (
            "mla",
            torch.zeros(2, LAYERS, SIZE, 1, KV_DIM),
            "layer_first",
            "MLA layer_first .* 5 dimensions, the layout has 4",
        ),
        ("mla", torch.zeros(30, LAYERS, 1, KV_DIM), "page_first", "not a whole number of pages"),
        ("mla", torch.zeros(8, 1, PAGE, LAYERS, KV_DIM), "page_head", "page_head is MHA-only"),
        ("mha", torch.zeros(MHA_LAYER_FIRST), "row_major", "unknown host pool layout"),
    ],
)
def test_from_buffer_refuses(kind: str, tensor: object, layout: str, message: str) -> None:
    with pytest.raises(HostPoolError, match=message):
        adopt(kind, tensor, layout)


@pytest.mark.parametrize("page_size", [0, -4, 2.0, True])
def test_from_buffer_needs_a_positive_page_size(page_size: object) -> None:
    with pytest.raises(HostPoolError, match="page_size must be a positive int"):
        adopt("mha", torch.zeros(MHA_LAYER_FIRST), "layer_first", page_size)  # type: ignore[arg-type]


# --- allocator ----------------------------------------------------------------------------------


def test_allocator_round_trip() -> None:
    alloc = PageAllocator(16, 4)
    first = alloc.alloc(8)
    assert first is not None and first.dtype == torch.int64
    assert first.tolist() == list(range(8))
    second = alloc.alloc(8)
    assert second is not None and second.tolist() == list(range(8, 16))
    assert alloc.available_size() == 0
    assert alloc.alloc(4) is None
    alloc.free(first)
    alloc.free(second.tolist())
    assert alloc.available_size() == 16
    again = alloc.alloc(16)
    assert again is not None and again.tolist() == list(range(16))
    alloc.clear()
    assert alloc.available_size() == 16


@pytest.mark.parametrize("need", [0, -4, 3, 6, 4.0, True])
def test_allocator_alignment(need: object) -> None:
    with pytest.raises(IndexAlignmentError):
        PageAllocator(16, 4).alloc(need)  # type: ignore[arg-type]


def test_allocator_bad_size() -> None:
    with pytest.raises(HostPoolError):
        PageAllocator(10, 4)


def test_allocator_free_errors() -> None:
    alloc = PageAllocator(16, 4)
    indices = alloc.alloc(8)
    assert indices is not None
    alloc.free(indices[:4])
    with pytest.raises(AllocatorError, match="page 0 "):
        alloc.free(indices[:4])
    with pytest.raises(AllocatorError, match="page 3 "):
        alloc.free(page(12))
    with pytest.raises(AllocatorError, match=r"page 1 .*twice"):
        alloc.free([*indices[4:].tolist(), *indices[4:].tolist()])
    with pytest.raises(IndexAlignmentError):
        alloc.free([4, 5, 6])
    with pytest.raises(IndexAlignmentError):
        alloc.free([5, 6, 7, 8])
    # A failed free changes nothing: page 1 is still allocated and frees once.
    assert alloc.available_size() == 12
    alloc.free(indices[4:])
    assert alloc.available_size() == 16


def test_allocator_defers_merging_freed_pages() -> None:
    alloc = PageAllocator(32, 4)
    head = alloc.alloc(8)
    assert head is not None
    alloc.free(head)
    assert alloc.available_size() == 32
    # The free list still holds pages 2..7, so the freed pages 0..1 wait in the release list.
    middle = alloc.alloc(16)
    assert middle is not None and middle.tolist() == list(range(8, 24))
    # Pages 6..7 remain; asking for three pages merges the release list back in, sorted.
    tail = alloc.alloc(12)
    assert tail is not None and tail.tolist() == [*range(0, 8), *range(24, 28)]
    assert alloc.available_size() == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 8)), max_size=40))
def test_allocator_random_sequences(ops: list[tuple[bool, int]]) -> None:
    size, page_size = 64, 4
    alloc = PageAllocator(size, page_size)
    held: list[torch.Tensor] = []
    for is_alloc, n in ops:
        if is_alloc and n:
            available = alloc.available_size()
            got = alloc.alloc(n * page_size)
            assert (got is None) == (n * page_size > available)
            if got is not None:
                held.append(got)
        elif held:
            alloc.free(held.pop(n % len(held)))
        in_use = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert torch.unique(in_use).numel() == in_use.numel()
        assert bool(((in_use >= 0) & (in_use < size)).all())
        assert alloc.available_size() + in_use.numel() == size


def test_allocator_threads_never_share_slots() -> None:
    alloc = PageAllocator(4096, 4)
    results: list[list[int]] = [[] for _ in range(8)]

    def worker(slot: list[int]) -> None:
        for _ in range(200):
            got = alloc.alloc(8)
            if got is not None:
                slot.extend(got.tolist())
                if len(slot) > 64:
                    alloc.free(slot[:8])
                    del slot[:8]

    threads = [threading.Thread(target=worker, args=(slot,)) for slot in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held = [i for slot in results for i in slot]
    assert len(held) == len(set(held))
    assert alloc.available_size() + len(held) == 4096


def test_one_v1_call_checks_its_host_indices_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache_storage import create_backend
    from hicache_storage.hostpool import allocator

    pool = MHAHostPool(64, 8, 2, 2, 4, torch.float16, "page_first", False)
    backend = create_backend("memory")
    backend.register_host_pool(pool)
    calls = []
    real = allocator.page_ids

    def counted(*args: object) -> torch.Tensor:
        calls.append(args)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(allocator, "page_ids", counted)
    indices = torch.arange(16)
    assert backend.batch_set_v1(["a", "b"], indices) == [True, True]
    assert len(calls) == 1  # the validation layer's check serves the backend's views too
    assert backend.batch_get_v1(["a", "b"], torch.arange(16, 32)) == [True, True]
    assert len(calls) == 2
    backend.close()


def test_page_starts_sees_a_tensor_changed_in_place() -> None:
    from hicache_storage.hostpool.allocator import page_starts

    indices = torch.arange(16)
    assert page_starts(indices, 8, 64) == [0, 8]
    indices[8:] += 8  # the same tensor object, now pages 0 and 16
    assert page_starts(indices, 8, 64) == [0, 16]
    indices[:8] += 3  # misaligned: must be checked again, not answered from memory
    with pytest.raises(IndexAlignmentError):
        page_starts(indices, 8, 64)
    view = indices[8:]
    assert page_starts(view, 8, 64) == [16]
    view.fill_(100)  # out of range, through a view of a remembered tensor
    with pytest.raises(IndexAlignmentError):
        page_starts(indices[8:], 8, 64)
    with pytest.raises(IndexAlignmentError):
        page_starts(view, 8, 64)
    assert page_starts(torch.arange(8), 8, 16) == [0]
    assert page_starts(list(range(8, 16)), 8, 16) == [8]
