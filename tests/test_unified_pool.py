"""Unified objects over a host pool: canonical bytes in every layout, zero-copy spans, checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hicache_storage.errors import BufferSizeError, HostPoolError, IndexAlignmentError
from hicache_storage.hostpool import HostKVPool, UnifiedObjectPool
from hicache_storage.keys import UnifiedPlan, plan_unified

from .helpers import LAYOUTS, make_pool
from .unified_helpers import page_view, read_pages

OBJECT_LAYOUTS = ["page-unified-v1", "page-unified-layer-major-v1"]


def plan_for(
    kind: str, *, head_group: int = 1, object_layout: str = "page-unified-v1"
) -> UnifiedPlan:
    if kind == "mla":
        return plan_unified(
            model_id="m",
            dtype="bf16",
            page_size=4,
            num_layers=3,
            layer_partition=2,
            is_mla=True,
            object_layout=object_layout,
        )
    return plan_unified(
        model_id="m",
        dtype="bf16",
        page_size=4,
        num_layers=3,
        layer_partition=2,
        local_kv_heads=2,
        head_group=head_group,
        object_layout=object_layout,
    )


def random_pool(kind: str, layout: str, seed: int = 0) -> HostKVPool:
    pool = make_pool(kind, layout)
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator))
    return pool


def expected_object(pool: HostKVPool, page: int, plan: UnifiedPlan, index: int) -> bytes:
    obj = plan.objects[index]
    logical = page_view(pool, page)
    layers = slice(obj.pool_layers.start, obj.pool_layers.stop)
    if pool.is_mla:
        part = logical[layers]
    else:
        part = logical[:, layers, :, obj.pool_heads.start : obj.pool_heads.stop]
        if plan.namespace.object_layout == "page-unified-layer-major-v1":
            part = part.transpose(0, 1)
    return part.contiguous().view(torch.uint8).numpy().tobytes()


CASES = [
    (kind, layout, object_layout, group)
    for kind, layout, object_layout in itertools.product(["mha", "mla"], LAYOUTS, OBJECT_LAYOUTS)
    for group in ([1, 2] if kind == "mha" else [0])
]


@pytest.mark.parametrize(("kind", "layout", "object_layout", "group"), CASES)
def test_object_bytes_are_canonical_in_every_layout(
    kind: str, layout: str, object_layout: str, group: int
) -> None:
    pool = random_pool(kind, layout)
    plan = plan_for(kind, head_group=group or 1, object_layout=object_layout)
    objects = UnifiedObjectPool(pool, plan)
    indices = objects.object_indices([4, 5, 6, 7, 12, 13, 14, 15])
    views = objects.page_buffer_views(indices)
    meta = objects.page_buffer_meta(indices)
    assert len(views) == 2 * plan.keys_per_page
    for n, (page, index) in enumerate(itertools.product([1, 3], range(plan.keys_per_page))):
        expected = expected_object(pool, page, plan, index)
        assert b"".join(views[n]) == expected
        assert sum(size for _, size in meta[n]) == len(expected) == objects.object_nbytes(index)
        addresses = [np.frombuffer(v, np.uint8).ctypes.data for v in views[n]]
        assert [a for a, _ in meta[n]] == addresses
        out = bytearray(len(expected))
        objects.read_object(indices[n * 4].item(), out)
        assert bytes(out) == expected
    assert objects.page_nbytes == max(objects.object_nbytes(i) for i in range(plan.keys_per_page))


def test_views_write_into_the_pool_and_layouts_exchange_objects() -> None:
    plan = plan_for("mha")
    source = UnifiedObjectPool(random_pool("mha", "page_first"), plan)
    for target_layout in LAYOUTS:
        target = UnifiedObjectPool(make_pool("mha", target_layout), plan)
        src_idx = source.object_indices([8, 9, 10, 11])
        dst_idx = target.object_indices([20, 21, 22, 23])
        for src, dst in zip(
            source.page_buffer_views(src_idx), target.page_buffer_views(dst_idx), strict=True
        ):
            data = b"".join(src)
            offset = 0
            for view in dst:
                view[:] = data[offset : offset + len(view)]
                offset += len(view)
        assert torch.equal(read_pages(source.pool, [2]), read_pages(target.pool, [5]))
        assert not read_pages(target.pool, [0, 1, 2, 3, 4, 6, 7]).any()


@pytest.mark.parametrize("object_layout", OBJECT_LAYOUTS)
@pytest.mark.parametrize("group", [1, 2])
def test_page_head_objects_equal_those_of_other_layouts(object_layout: str, group: int) -> None:
    plan = plan_for("mha", head_group=group, object_layout=object_layout)
    head_pool = random_pool("mha", "page_head")
    direct_pool = make_pool("mha", "page_first_direct")
    # The same KV: page_head (2, pages, H, page, L, D) is page_first_direct's (2, pages, L, page,
    # H, D) with the head and layer axes swapped.
    direct_pool.kv_buffer.copy_(head_pool.kv_buffer.permute(0, 1, 4, 3, 2, 5))
    head_objects = UnifiedObjectPool(head_pool, plan)
    direct_objects = UnifiedObjectPool(direct_pool, plan)
    indices = head_objects.object_indices([*range(4, 8), *range(28, 32)])
    expected = [b"".join(views) for views in direct_objects.page_buffer_views(indices)]
    assert [b"".join(views) for views in head_objects.page_buffer_views(indices)] == expected
    start = int(indices[-4])
    data = np.random.default_rng(1).integers(0, 256, len(expected[-1]), dtype=np.uint8)
    head_objects.write_object(start, data)
    direct_objects.write_object(start, data)
    as_direct = head_pool.kv_buffer.permute(0, 1, 4, 3, 2, 5).contiguous()
    assert torch.equal(direct_pool.kv_buffer.view(torch.uint8), as_direct.view(torch.uint8))


def test_write_object_scatters_and_checks_size() -> None:
    pool = random_pool("mla", "page_first")
    plan = plan_for("mla")
    objects = UnifiedObjectPool(pool, plan)
    data = bytes(range(256)) * (objects.object_nbytes(0) // 256 + 1)
    data = data[: objects.object_nbytes(0)]
    start = objects.object_indices([8, 9, 10, 11])[0].item()
    before = read_pages(pool, [0, 1, 3])
    objects.write_object(start, data)
    assert b"".join(objects.page_buffer_views(range(start, start + 4))[0]) == data
    assert torch.equal(read_pages(pool, [0, 1, 3]), before)
    with pytest.raises(BufferSizeError):
        objects.write_object(start, data[:-1])
    with pytest.raises(BufferSizeError):
        objects.read_object(start, bytearray(len(data) + 1))
    with pytest.raises(IndexAlignmentError):
        objects.read_object(start + 1, bytearray(len(data)))


@pytest.mark.parametrize(
    ("layout", "group", "spans"),
    [
        ("page_first_direct", 2, [2, 2]),
        ("layer_first", 2, [4, 2]),
        ("page_first", 2, [16, 8]),
        ("page_first_direct", 1, [16, 16, 8, 8]),
        ("page_head", 2, [32, 16]),
    ],
)
def test_span_counts_follow_the_layout(layout: str, group: int, spans: list[int]) -> None:
    objects = UnifiedObjectPool(make_pool("mha", layout), plan_for("mha", head_group=group))
    views = objects.page_buffer_views(objects.object_indices([0, 1, 2, 3]))
    assert [len(v) for v in views] == spans


def test_object_indices_map_pages_to_their_objects() -> None:
    objects = UnifiedObjectPool(make_pool("mha", "layer_first"), plan_for("mha"))
    assert objects.objects_per_page == 4 and objects.size == 4 * 32
    mapped = objects.object_indices(torch.tensor([12, 13, 14, 15, 0, 1, 2, 3]))
    assert mapped.tolist() == [*range(48, 64), *range(0, 16)]
    assert objects.page_starts(mapped) == [48, 52, 56, 60, 0, 4, 8, 12]
    with pytest.raises(IndexAlignmentError):
        objects.object_indices([1, 2, 3, 4])
    with pytest.raises(IndexAlignmentError):
        objects.page_starts([128, 129, 130, 131])


@pytest.mark.parametrize(
    ("kind", "plan", "message"),
    [
        (
            "mha",
            plan_unified(
                model_id="m",
                dtype="bf16",
                page_size=8,
                num_layers=3,
                local_kv_heads=2,
                head_group=1,
            ),
            "page_size 4 != 8",
        ),
        (
            "mha",
            plan_unified(
                model_id="m",
                dtype="float32",
                page_size=4,
                num_layers=3,
                local_kv_heads=2,
                head_group=1,
            ),
            "cannot hold float32",
        ),
        (
            "mha",
            plan_unified(
                model_id="m",
                dtype="bf16",
                page_size=4,
                num_layers=4,
                local_kv_heads=2,
                head_group=1,
            ),
            "3 pool layers != 4",
        ),
        (
            "mha",
            plan_unified(
                model_id="m",
                dtype="bf16",
                page_size=4,
                num_layers=3,
                local_kv_heads=4,
                head_group=1,
            ),
            "2 pool heads != 4",
        ),
        (
            "mla",
            plan_unified(
                model_id="m",
                dtype="bf16",
                page_size=4,
                num_layers=3,
                local_kv_heads=2,
                head_group=1,
            ),
            "an MLA pool needs an MLA plan",
        ),
    ],
)
def test_pool_must_match_the_plan(kind: str, plan: UnifiedPlan, message: str) -> None:
    with pytest.raises(HostPoolError, match=message):
        UnifiedObjectPool(make_pool(kind, "page_first"), plan)
