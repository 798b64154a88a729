"""SGLang's own factory builds the adapter for every backend; its calls keep SGLang's semantics."""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.observability.metrics_collector import StorageMetrics

from hicache_storage.errors import ConfigError, HostPoolError, InvalidKeyError
from hicache_storage.integrations.sglang import SGLangStorage, adopt_host_pool
from hicache_storage.keys import page_hashes

from .helpers import (
    ADAPTER,
    BACKENDS,
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE,
    SGLANG_VERSION,
    fill_random,
    make_pools,
    read_pages,
    storage_config,
)


def test_the_pinned_sglang_is_the_one_under_test() -> None:
    assert version("sglang") == SGLANG_VERSION


def build(extra: dict[str, Any], host: Any, **fields: Any) -> SGLangStorage:
    """What SGLang's controller does: the factory, then the host pool registration."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config({**ADAPTER, **extra}, **fields), host
    )
    assert isinstance(backend, SGLangStorage) and isinstance(backend, HiCacheStorage)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return backend


@pytest.mark.parametrize("name", BACKENDS)
def test_sglang_factory_builds_the_adapter_and_pages_round_trip(
    name: str, backend_config: Callable[[str], dict[str, Any]]
) -> None:
    pools = make_pools("mha", "page_first_direct")
    backend = build(backend_config(name), pools.host)
    try:
        src = pools.host.alloc(3 * PAGE)
        pages = fill_random(pools.host, src, seed=1)
        hashes = page_hashes(range(3 * PAGE), PAGE)
        assert backend.batch_exists(hashes) == 0
        assert backend.batch_set_v1(hashes, src) == [True, True, True]
        assert backend.batch_exists(hashes) == 3
        assert backend.exists(hashes[1]) and not backend.exists("f" * 64)
        dst = pools.host.alloc(3 * PAGE)
        miss = page_hashes(range(100, 100 + PAGE), PAGE)
        assert backend.batch_get_v1([hashes[0], miss[0], hashes[2]], dst) == [True, False, True]
        got = read_pages(pools.host, dst)
        assert torch.equal(got[0], pages[0]) and torch.equal(got[2], pages[2])
        assert not got[1].any(), "a miss must leave its page untouched"
    finally:
        backend.clear()
        backend.close()


@pytest.mark.parametrize(
    ("kind", "layout"), [("mha", x) for x in MHA_LAYOUTS] + [("mla", x) for x in MLA_LAYOUTS]
)
def test_sglang_host_pools_are_adopted_in_place_with_sglangs_page_bytes(
    kind: str, layout: str
) -> None:
    pools = make_pools(kind, layout)
    ours = adopt_host_pool(pools.host)
    assert ours.kv_buffer.data_ptr() == pools.host.kv_buffer.data_ptr()
    idx = pools.host.alloc(2 * PAGE)
    pages = fill_random(pools.host, idx, seed=2)
    for start, page in zip(idx[::PAGE].tolist(), pages, strict=True):
        out = bytearray(ours.page_nbytes)
        ours.read_page(start, out)
        assert bytes(out) == page.view(torch.uint8).numpy().tobytes()


class _ForeignPool:
    """A host pool of a class the adapter does not map (K and V of different widths)."""

    layout = "layer_first"
    page_size = PAGE
    kv_buffer = (torch.zeros(1), torch.zeros(1))


def test_unmappable_pools_are_refused_at_registration_naming_the_layout() -> None:
    with pytest.raises(HostPoolError, match="_ForeignPool.*layer_first"):  # noqa: RUF043
        adopt_host_pool(_ForeignPool())
    pools = make_pools("mha", "page_first")
    pools.host.layout = "page_unified"  # SGLang's page_unified pool shares no layout with ours
    with pytest.raises(HostPoolError, match="page_unified"):
        adopt_host_pool(pools.host)


def test_generic_calls_have_sglangs_return_types(tmp_path: Path) -> None:
    pools = make_pools("mha", "layer_first")
    # The plain storage path: two writes back to back read to the planner's write gate as a
    # caller that outpaces the store, so it would shed the second (tests/sglang/test_planner.py).
    extra = {"backend": "file", "options": {"root": str(tmp_path)}, "planner": False}
    backend = build(extra, pools.host)
    hashes = page_hashes(range(2 * PAGE), PAGE)
    page = pools.host.get_dummy_flat_data_page()
    page.copy_(torch.arange(page.numel(), dtype=torch.float32).to(page.dtype))
    assert backend.set(hashes[0], page) is True
    assert backend.batch_set(hashes, [page, page + 1]) is True
    target = pools.host.get_dummy_flat_data_page()
    assert backend.get(hashes[0], target) is target and torch.equal(target, page)
    raw = backend.get(hashes[1])
    assert raw is not None and raw.dtype == torch.uint8
    assert torch.equal(raw.view(page.dtype), page + 1)
    targets = [pools.host.get_dummy_flat_data_page() for _ in range(2)]
    got = backend.batch_get([hashes[1], "0" * 64], targets)
    assert got[0] is targets[0] and got[1] is None
    assert backend.get("1" * 64, pools.host.get_dummy_flat_data_page()) is None
    with pytest.raises(InvalidKeyError):
        backend.exists("../../etc/passwd")
    backend.close()


def test_extra_config_forms_and_environment_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools = make_pools("mha", "page_first")
    source = tmp_path / "hicache.json"
    source.write_text(json.dumps({"backend": "file", "options": {"root": str(tmp_path / "a")}}))
    backend = build({"config": f"@{source}"}, pools.host)
    assert backend.config.options["root"] == str(tmp_path / "a")
    backend.close()
    monkeypatch.setenv("HICACHE_OPTIONS__ROOT", str(tmp_path / "b"))
    backend = build({"config": source.read_text()}, pools.host)
    assert backend.config.options["root"] == str(tmp_path / "b")
    backend.close()


@pytest.mark.parametrize(
    ("extra", "fields", "match"),
    [
        ({"backend": "memory", "bakend": "x"}, {}, r"unknown key\(s\) \['bakend'\]"),
        ({"backend": "no-such"}, {}, "no-such"),
        ({"backend": "file", "options": {"root": 3}}, {}, "root"),
        ({"backend": "memory"}, {"should_split_heads": True}, "split heads"),
        ({"backend": "memory", "deployment": {"tp_size": 8}}, {}, "contradicts SGLang"),
        ({"backend": "memory"}, {"model_name": "my model"}, "cannot be part of a key"),
    ],
)
def test_bad_configuration_fails_at_start_up_with_a_clear_error(
    extra: dict[str, Any], fields: dict[str, Any], match: str
) -> None:
    pools = make_pools("mha", "page_first")
    with pytest.raises((ConfigError, ValueError), match=match):
        build(extra, pools.host, **fields)


def test_decode_context_parallelism_is_refused_at_start_up() -> None:
    pools = make_pools("mla", "page_first")
    cfg = storage_config(
        {**ADAPTER, "backend": "memory"},
        is_mla_model=True,
        tp_size=2,
        dcp_size=2,
        dcp_rank=0,
        logical_page_size=2 * PAGE,
    )
    with pytest.raises(ConfigError, match="decode context parallelism"):
        StorageBackendFactory.create_backend("dynamic", cfg, pools.host)


def test_stats_clear_and_close(tmp_path: Path) -> None:
    pools = make_pools("mha", "page_first")
    backend = build({"backend": "memory"}, pools.host, enable_storage_metrics=True)
    src = pools.host.alloc(2 * PAGE)
    fill_random(pools.host, src, seed=3)
    hashes = page_hashes(range(2 * PAGE), PAGE)
    backend.batch_set_v1(hashes, src)
    backend.batch_get_v1(hashes, src)
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [2] and stats.prefetch_pgs == [2]
    assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == [], "SGLang drains the lists on every call"
    backend.clear()
    assert backend.batch_exists(hashes) == 0
    backend.close()
    backend.clear()  # never raises, even on a closed backend
    backend.close()
    quiet = build({"backend": "memory"}, pools.host)
    assert quiet.get_stats() is None
    quiet.close()
