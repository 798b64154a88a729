"""The unified key scheme: grids tile, the namespace digest covers every field, bad shards fail."""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache_storage import ConfigError
from hicache_storage.config import Deployment, UnifiedKeys, load_config
from hicache_storage.errors import UnsupportedOperationError
from hicache_storage.keys import (
    OBJECT_LAYOUTS,
    KeySchemeError,
    KVNamespace,
    UnifiedPlan,
    lcm_of,
    logical_dtype,
    plan_unified,
)

HASHES = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]


def mha(tp_rank: int, tp_size: int, *, heads: int = 8, **facts: Any) -> UnifiedPlan:
    base: dict[str, Any] = {
        "model_id": "meta-llama/Llama-3.1-8B",
        "dtype": "bfloat16",
        "page_size": 64,
        "num_layers": 32,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "local_kv_heads": heads // tp_size,
        "tp_lcm_size": 8,
    }
    return plan_unified(**{**base, **facts})


def fleet_keys(tp_size: int, ranks: range | None = None, **facts: Any) -> set[str]:
    ranks = range(tp_size) if ranks is None else ranks
    return {key for r in ranks for key in mha(r, tp_size, **facts).keys(HASHES)}


@pytest.mark.parametrize(("big", "small"), [(4, 2), (2, 1), (8, 4), (8, 1)])
def test_smaller_tp_rank_holds_the_union_of_larger_tp_ranks(big: int, small: int) -> None:
    ratio = big // small
    for rank in range(small):
        mine = set(mha(rank, small).keys(HASHES))
        theirs = fleet_keys(big, range(rank * ratio, (rank + 1) * ratio))
        assert mine == theirs
    assert fleet_keys(big) == fleet_keys(small)


def test_tp_ranks_hold_disjoint_objects_with_the_right_heads() -> None:
    plans = [mha(r, 4) for r in range(4)]
    keys = [set(p.keys(HASHES)) for p in plans]
    for a, b in itertools.combinations(keys, 2):
        assert not a & b
    for rank, plan in enumerate(plans):
        assert plan.is_writer
        heads = sorted({h for obj in plan.objects for h in obj.heads})
        assert heads == [2 * rank, 2 * rank + 1]
        assert all(
            obj.pool_heads == range(obj.heads.start - 2 * rank, obj.heads.stop - 2 * rank)
            for obj in plan.objects
        )


@given(
    heads=st.sampled_from([1, 2, 4, 8, 16]),
    sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=3, unique=True),
    pages=st.integers(1, 3),
)
def test_every_tp_size_of_a_fleet_derives_the_same_objects(
    heads: int, sizes: list[int], pages: int
) -> None:
    lcm = lcm_of(sizes)
    sizes = [s for s in sizes if s <= heads]
    if lcm > heads or not sizes:
        return
    hashes = HASHES[:pages]
    fleets = [
        {k for r in range(s) for k in mha(r, s, heads=heads, tp_lcm_size=lcm).keys(hashes)}
        for s in sizes
    ]
    assert all(f == fleets[0] for f in fleets)
    assert len(fleets[0]) == pages * (32 // 32) * lcm


def test_pipeline_stages_tile_the_layer_range() -> None:
    full = mha(0, 1, layer_partition=8)
    stages = [(0, 8), (8, 24), (24, 32)]
    plans = [mha(0, 1, layer_partition=8, layer_range=stage) for stage in stages]
    covered = sorted(
        layer for p in plans for o in p.objects if o.heads.start == 0 for layer in o.layers
    )
    assert covered == list(range(32))
    assert {k for p in plans for k in p.keys(HASHES)} == set(full.keys(HASHES))
    for (first, end), plan in zip(stages, plans, strict=True):
        assert {o.pool_layers.start for o in plan.objects} == set(range(0, end - first, 8))
        assert all(o.layers.start - first == o.pool_layers.start for o in plan.objects)


def test_last_stage_may_end_off_the_grid() -> None:
    plan = plan_unified(
        model_id="deepseek-ai/DeepSeek-V3",
        dtype="bf16",
        page_size=64,
        num_layers=61,
        layer_range=(56, 61),
        layer_partition=8,
        is_mla=True,
    )
    assert [o.layers for o in plan.objects] == [range(56, 61)]
    assert plan.objects[0].suffix.endswith("_L56-61")


def test_keys_are_layer_major_head_minor_and_well_formed() -> None:
    plan = mha(1, 2, layer_partition=16, tp_lcm_size=4)
    digest = plan.digest
    assert digest.startswith("ukv1-") and len(digest) == 5 + 16
    assert plan.page_keys(HASHES[0]) == [
        f"{HASHES[0]}_{digest}_L0-16_H2",
        f"{HASHES[0]}_{digest}_L0-16_H3",
        f"{HASHES[0]}_{digest}_L16-32_H2",
        f"{HASHES[0]}_{digest}_L16-32_H3",
    ]
    assert plan.keys(HASHES[:2]) == plan.page_keys(HASHES[0]) + plan.page_keys(HASHES[1])
    assert plan.keys_per_page == 4


def test_mla_ranks_share_objects_and_only_rank_zero_writes() -> None:
    plans = [
        plan_unified(
            model_id="m",
            dtype="bf16",
            page_size=64,
            num_layers=61,
            tp_rank=r,
            tp_size=8,
            is_mla=True,
        )
        for r in range(8)
    ]
    assert all(p.keys(HASHES) == plans[0].keys(HASHES) for p in plans)
    assert [p.is_writer for p in plans] == [True] + [False] * 7
    assert all("_H" not in key[64:] for key in plans[0].keys(HASHES))
    assert plans[0].namespace.rank_replicated and plans[0].namespace.total_kv_heads == 0


def test_replicated_heads_share_objects_with_one_writer_each() -> None:
    plans = [
        mha(r, 4, heads=2, local_kv_heads=1, total_kv_heads=2, tp_lcm_size=None, head_group=1)
        for r in range(4)
    ]
    assert plans[0].keys(HASHES) == plans[1].keys(HASHES) != plans[2].keys(HASHES)
    assert [p.is_writer for p in plans] == [True, False, True, False]
    assert set(plans[0].keys(HASHES)) | set(plans[2].keys(HASHES)) == set(
        mha(0, 1, heads=2, tp_lcm_size=None, head_group=1).keys(HASHES)
    )


def test_owns_only_own_object_keys() -> None:
    plan, other = mha(0, 2), mha(1, 2)
    assert all(plan.owns(k) for k in plan.keys(HASHES))
    assert not any(plan.owns(k) for k in other.keys(HASHES))
    key = plan.keys(HASHES)[0]
    assert (
        not plan.owns(key.upper()) and not plan.owns(key + "x") and not plan.owns("a" + key[1:65])
    )


NAMESPACE = KVNamespace(
    schema_version=1,
    model_id="m",
    dtype="bfloat16",
    page_size=64,
    rank_replicated=False,
    total_kv_heads=8,
    head_group=2,
    layer_partition=8,
    object_layout="page-unified-v1",
)
CHANGED: dict[str, Any] = {
    "schema_version": 2,
    "model_id": "m2",
    "dtype": "float16",
    "page_size": 32,
    "rank_replicated": True,
    "total_kv_heads": 16,
    "head_group": 4,
    "layer_partition": 4,
    "object_layout": "page-unified-layer-major-v1",
}


def test_every_namespace_field_changes_the_digest() -> None:
    assert set(CHANGED) == set(NAMESPACE.__struct_fields__)
    digests = {NAMESPACE.digest()}
    for field, value in CHANGED.items():
        digests.add(msgspec.structs.replace(NAMESPACE, **{field: value}).digest())
    assert len(digests) == 1 + len(CHANGED)


def test_digest_is_sha256_of_the_msgpack_record_in_field_order() -> None:
    record = {name: getattr(NAMESPACE, name) for name in NAMESPACE.__struct_fields__}
    encoded = msgspec.msgpack.encode(record)
    assert NAMESPACE.digest() == "ukv1-" + hashlib.sha256(encoded).hexdigest()[:16]
    assert list(msgspec.msgpack.decode(encoded)) == list(NAMESPACE.__struct_fields__)


def test_fp8_variants_do_not_share_a_keyspace() -> None:
    e4m3 = mha(0, 1, dtype="fp8_e4m3")
    e5m2 = mha(0, 1, dtype="float8_e5m2")
    assert e4m3.namespace.dtype == "float8_e4m3fn" and e5m2.namespace.dtype == "float8_e5m2"
    assert not set(e4m3.keys(HASHES)) & set(e5m2.keys(HASHES))
    assert logical_dtype(torch.float8_e5m2) == "float8_e5m2"
    assert logical_dtype(torch.bfloat16) == logical_dtype("bf16") == "bfloat16"


REJECTIONS: list[tuple[dict[str, Any], str]] = [
    ({"model_id": ""}, "model_id must name the model"),
    ({"page_size": 0}, "page_size must be a positive int"),
    ({"page_size": -64}, "page_size must be a positive int"),
    ({"dtype": "int4"}, "unknown KV dtype"),
    ({"object_layout": "page-v9"}, "unknown object_layout"),
    ({"tp_rank": 4}, r"tp_rank must be in \[0, tp_size=4\)"),
    ({"tp_lcm_size": None}, "set head_group .* or tp_lcm_size"),
    ({"tp_lcm_size": None, "head_group": 3}, "head_group=3 must divide total_kv_heads=8"),
    ({"tp_lcm_size": None, "head_group": 4}, "does not divide this rank's 2 KV heads"),
    ({"head_group": 1}, "set head_group or tp_lcm_size, not both"),
    ({"tp_lcm_size": 6}, "must be a multiple of this deployment's tp_size=4"),
    ({"layer_partition": 8, "layer_range": (4, 16)}, "starts at layer 4, off the layer grid"),
    ({"layer_partition": 8, "layer_range": (8, 20)}, "ends at layer 20, off the layer grid"),
    ({"layer_partition": 0}, "layer_partition must be a positive int"),
    ({"layer_range": (16, 40)}, "must be a non-empty range within"),
    ({"layer_range": (8, 8)}, "must be a non-empty range within"),
    ({"total_kv_heads": 6}, "do not tile 6 total KV heads"),
    ({"local_kv_heads": 0}, "local_kv_heads must be a positive int"),
    ({"is_mla": True}, "has no head axis"),
    (
        {"is_mla": True, "tp_lcm_size": None, "local_kv_heads": 0, "head_group": 1},
        "has no head axis",
    ),
]


@pytest.mark.parametrize(("facts", "message"), REJECTIONS, ids=[m for _, m in REJECTIONS])
def test_shards_off_the_grid_are_refused(facts: dict[str, Any], message: str) -> None:
    with pytest.raises(KeySchemeError, match=message) as info:
        facts = dict(facts)
        mha(facts.pop("tp_rank", 1), 4, **facts)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_context_parallelism_is_unsupported() -> None:
    with pytest.raises(UnsupportedOperationError, match="use key_scheme 'rank_suffix'"):
        mha(0, 2, cp_size=2)


def test_object_layouts_are_documented() -> None:
    assert set(OBJECT_LAYOUTS) == {"page-unified-v1", "page-unified-layer-major-v1"}


def test_deployment_builds_the_plan_from_config() -> None:
    config = load_config(
        {
            "backend": "file",
            "deployment": {
                "model_name": "Qwen/Qwen3-8B",
                "tp_rank": 1,
                "tp_size": 2,
                "page_size": 64,
                "key_scheme": "unified",
                "unified": {
                    "dtype": "bf16",
                    "num_layers": 36,
                    "local_kv_heads": 4,
                    "tp_lcm_size": 4,
                },
            },
        },
        env={"HICACHE_DEPLOYMENT__UNIFIED__LAYER_PARTITION": "12"},
    )
    scheme = config.deployment.scheme()
    assert isinstance(scheme, UnifiedPlan)
    assert scheme.namespace.model_id == "Qwen/Qwen3-8B" and scheme.namespace.layer_partition == 12
    assert scheme == mha(
        1, 2, heads=8, model_id="Qwen/Qwen3-8B", num_layers=36, tp_lcm_size=4, layer_partition=12
    )
    assert Deployment().scheme().keys_per_page == 1


def test_deployment_rejects_incomplete_unified_settings() -> None:
    with pytest.raises(ConfigError, match=r"needs deployment\.unified settings"):
        Deployment(key_scheme="unified")
    with pytest.raises(ConfigError, match="set head_group"):
        Deployment(
            key_scheme="unified",
            model_name="m",
            tp_size=2,
            unified=UnifiedKeys(dtype="bf16", num_layers=4, local_kv_heads=2),
        )
    with pytest.raises(ConfigError, match="model_id must name the model"):
        load_config(
            {
                "backend": "file",
                "deployment": {
                    "key_scheme": "unified",
                    "unified": {
                        "dtype": "bf16",
                        "num_layers": 4,
                        "local_kv_heads": 2,
                        "head_group": 1,
                    },
                },
            }
        )
