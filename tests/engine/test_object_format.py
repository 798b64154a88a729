"""Stored pages say what their bytes mean: another model, layout or geometry misses, never hits.

And the unified key scheme stores multi-object pages from the engine end to end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import StorageBackend, create_backend
from hicache_storage.config import Deployment, UnifiedKeys
from hicache_storage.engine.cache import CacheConfig, TierCache
from hicache_storage.engine.cache_config import PrefetchConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.errors import PoolMismatchError
from hicache_storage.engine.model import LlamaModel, ModelConfig
from hicache_storage.engine.policies import PrefetchPolicy
from hicache_storage.errors import ConfigError
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.kernels import DevicePool
from hicache_storage.keys import ObjectFormat, RankSuffixScheme, UnifiedPlan

from ._child import CONFIG, PAGE, conversations

NEW = 4


def cache(
    backend: StorageBackend | None,
    *,
    layout: str = "layer_first",
    host_geometry: tuple[int, int] | None = None,
    scheme: Any = None,
    tokens: int = 256,
    **config: Any,
) -> TierCache:
    c = CONFIG
    heads, dim = host_geometry or (c.kv_heads, c.head_dim)
    device = DevicePool.mha(tokens, c.layers, c.kv_heads, c.head_dim, c.dtype)
    host = MHAHostPool(tokens, PAGE, c.layers, heads, dim, c.dtype, layout, False)
    config.setdefault("prefetch", PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE))
    return TierCache(device, host, backend, CacheConfig(PAGE, **config), scheme=scheme)


def serve(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Serve fresh copies of multi-turn prompts one by one (each answer joins its history)."""
    outs = []
    histories = [list(p) for p in prompts]
    with engine:
        for prompt in histories:
            out = engine.generate(prompt, NEW)
            prompt.extend(out)
            outs.append(out)
    return outs


def file_store(root: Path) -> StorageBackend:
    return create_backend("file", {"root": str(root)})


# -- model identity and layout in the keys ---------------------------------------------------------


def test_an_engine_of_another_model_never_reads_the_first_ones_pages(
    model: LlamaModel, tmp_path: Path
) -> None:
    prompts = conversations(rounds=2, clients=2, seed=21)
    first = cache(file_store(tmp_path))
    serve(Engine(model, first), prompts)
    assert first.stats.pages_stored > 0
    other = LlamaModel(ModelConfig.tiny(seed=1))  # same shape and dtype, other weights
    assert other.identity != model.identity
    second = cache(file_store(tmp_path))
    assert serve(Engine(other, second), prompts) == serve(Engine(other, None), prompts)
    assert second.stats.storage_hit_tokens == 0 and second.stats.pages_fetched == 0
    again = cache(file_store(tmp_path))  # the first model still finds its own pages
    assert serve(Engine(model, again), prompts) == serve(Engine(model, None), prompts)
    assert again.stats.storage_hit_tokens > 0


def test_a_page_first_engine_misses_the_pages_of_a_layer_first_one(
    model: LlamaModel, tmp_path: Path
) -> None:
    prompts = conversations(rounds=2, clients=2, seed=22)
    expected = serve(Engine(model, None), prompts)
    assert serve(Engine(model, cache(file_store(tmp_path))), prompts) == expected
    reader = cache(file_store(tmp_path), layout="page_first")
    assert serve(Engine(model, reader), prompts) == expected
    assert reader.stats.storage_hit_tokens == 0


def test_keys_end_in_the_format_of_the_model_and_the_host_pool(model: LlamaModel) -> None:
    given = RankSuffixScheme(model_name="acme")
    built = cache(create_backend("memory"), scheme=given)
    with Engine(model, built):
        assert built.host_pool is not None
        fmt = ObjectFormat.of_pool(built.host_pool, model=model.identity)
        assert built.scheme == RankSuffixScheme(model_name="acme", object_format=fmt.tag)
        assert built.scheme.keys(["0" * 64]) == ["0" * 64 + f"_acme_0_1_f{fmt.tag}"]


def test_a_scheme_with_another_object_format_is_refused(model: LlamaModel) -> None:
    foreign = ObjectFormat.of_pool(
        MHAHostPool(16, PAGE, CONFIG.layers, 2, 16, CONFIG.dtype, "layer_first", False),
        model="another-model",
    )
    built = cache(create_backend("memory"), scheme=RankSuffixScheme(object_format=foreign.tag))
    with pytest.raises(ConfigError, match=r"object_format .* is not the format"):
        Engine(model, built)
    built.close()


def test_one_cache_cannot_serve_two_models(model: LlamaModel) -> None:
    built = cache(None)
    Engine(model, built)
    with pytest.raises(ConfigError, match="needs a cache of its own"):
        Engine(LlamaModel(ModelConfig.tiny(seed=2)), built)


# -- pools that do not match -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("what", "host"),
    [
        ("4 heads x 8 over 2 x 16", dict(head_num=4, head_dim=8)),
        ("dtype", dict(dtype=torch.float16)),
        ("layers", dict(layer_num=CONFIG.layers + 1)),
        ("page size", dict(page_size=2 * PAGE)),
    ],
)
def test_a_host_pool_that_does_not_hold_the_device_pools_kv_is_refused(
    what: str, host: dict[str, Any]
) -> None:
    c = CONFIG
    facts: dict[str, Any] = dict(
        size=64,
        page_size=PAGE,
        layer_num=c.layers,
        head_num=c.kv_heads,
        head_dim=c.head_dim,
        dtype=c.dtype,
        layout="page_head",
        pin_memory=False,
    )
    pool = MHAHostPool(**{**facts, **host})
    device = DevicePool.mha(64, c.layers, c.kv_heads, c.head_dim, c.dtype)
    with pytest.raises(PoolMismatchError, match=r"host pool .* does not hold the device pool"):
        TierCache(device, pool, None, CacheConfig(PAGE))
    with pytest.raises(ConfigError):  # also a ConfigError, as the start-up check promises
        TierCache(device, pool, None, CacheConfig(PAGE))


def test_a_device_pool_that_does_not_hold_the_models_kv_is_refused(model: LlamaModel) -> None:
    c = CONFIG
    device = DevicePool.mha(64, c.layers, 4, c.head_dim // 2, c.dtype)  # same bytes per row
    with pytest.raises(ConfigError, match=r"device pool's .* do not hold the model's"):
        Engine(model, TierCache(device, None, None, CacheConfig(PAGE)))


# -- the unified key scheme ------------------------------------------------------------------------


def deployment(page_size: int = PAGE, tp_size: int = 1, **unified: Any) -> Deployment:
    settings: dict[str, Any] = {
        "dtype": "float32",
        "num_layers": CONFIG.layers,
        "layer_partition": 1,
        "local_kv_heads": CONFIG.kv_heads,
        "head_group": 1,
        **unified,
    }
    return Deployment(
        model_name="tiny-seed-0",
        page_size=page_size,
        tp_size=tp_size,
        key_scheme="unified",
        unified=UnifiedKeys(**settings),
    )


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_unified_scheme_stores_multi_object_pages_for_a_fresh_engine(
    model: LlamaModel, tmp_path: Path, backend: str
) -> None:
    dep = deployment()
    plan = dep.unified_plan()
    assert isinstance(plan, UnifiedPlan) and plan.keys_per_page == 6  # 3 layers x 2 heads
    options = {"root": str(tmp_path)} if backend == "file" else {}
    writer = create_backend(backend, options, deployment=dep)
    prompts = conversations(rounds=2, clients=2, seed=23)
    expected = serve(Engine(model, None), prompts)
    first = cache(writer, scheme=plan)
    assert serve(Engine(model, first), prompts) == expected
    assert first.stats.pages_stored > 0 and first.stats.backups_failed == 0
    # Unified objects have one byte order, so a reader of another host layout hits them too.
    reader = writer if backend == "memory" else create_backend(backend, options, deployment=dep)
    fresh = cache(reader, scheme=plan, layout="page_first")
    assert serve(Engine(model, fresh), prompts) == expected
    assert fresh.stats.storage_hit_tokens > 0 and fresh.stats.pages_fetched > 0
    for opened in {id(writer): writer, id(reader): reader}.values():
        opened.close()


@pytest.mark.parametrize(
    ("facts", "problem"),
    [
        ({"dtype": "bfloat16"}, "dtype bfloat16"),
        ({"page_size": 2 * PAGE}, "page_size"),
        ({"num_layers": CONFIG.layers + 1}, "layers"),
        ({"tp_size": 2, "local_kv_heads": 1}, "KV heads"),  # one rank's half of the heads
    ],
)
def test_a_unified_namespace_of_another_geometry_is_refused(
    facts: dict[str, Any], problem: str
) -> None:
    plan = deployment(**facts).unified_plan()
    with pytest.raises(ConfigError, match=f"namespace .*{problem}"):
        cache(create_backend("memory"), scheme=plan)
