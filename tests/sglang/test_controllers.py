"""SGLang's real cache controllers move pages through the adapter: attach, backup, prefetch."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.utils import get_hash_str

from hicache_storage.backends.redis import provision as redis_provision
from hicache_storage.integrations.sglang import SGLangStorage, adopt_host_pool
from hicache_storage.keys import ObjectFormat
from hicache_storage.layers.verify import RECORD_PREFIX

from .helpers import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE,
    TIMEOUT_S,
    backup,
    canonical_mha_page,
    controller,
    fill_random,
    hybrid_controller,
    make_pools,
    prefetch,
    read_pages,
    set_rank,
)

LAYOUTS = [("mha", x) for x in MHA_LAYOUTS] + [("mla", x) for x in MLA_LAYOUTS]


@pytest.fixture(autouse=True)
def single_rank() -> None:
    set_rank()


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS)
def test_controller_backs_up_and_prefetches_every_layout_byte_identical(
    kind: str, layout: str, tmp_path: Path
) -> None:
    pools = make_pools(kind, layout)
    cc = controller(pools, {"backend": "file", "options": {"root": str(tmp_path)}})
    adapter = cc.storage_backend
    assert isinstance(adapter, SGLangStorage)
    assert cc.page_get_func.__name__ == "_page_get_zero_copy"
    tokens = list(range(1000, 1000 + 5 * PAGE))
    src = pools.host.alloc(len(tokens))
    pages = fill_random(pools.host, src, seed=7)
    assert backup(cc, src, tokens) == len(tokens)
    loaded, dst = prefetch(cc, pools.host, tokens)
    assert loaded == len(tokens)
    assert all(torch.equal(a, b) for a, b in zip(read_pages(pools.host, dst), pages, strict=True))
    # A request sharing only the first three pages hits exactly those.
    loaded, _ = prefetch(cc, pools.host, [*tokens[: 3 * PAGE], *range(7, 7 + 2 * PAGE)])
    assert loaded == 3 * PAGE
    cc.detach_storage_backend()
    assert adapter.backend.closed, "detach closes the backend"


def test_every_backend_serves_the_controller(backend_config: Any) -> None:
    for name in ("memory", "redis", "s3", "mooncake", "3fs"):
        pools = make_pools("mha", "page_first")
        cc = controller(pools, backend_config(name))
        tokens = list(range(3 * PAGE))
        src = pools.host.alloc(len(tokens))
        pages = fill_random(pools.host, src, seed=11)
        assert backup(cc, src, tokens) == len(tokens), name
        loaded, dst = prefetch(cc, pools.host, tokens)
        assert loaded == len(tokens), name
        assert all(
            torch.equal(a, b) for a, b in zip(read_pages(pools.host, dst), pages, strict=True)
        )
        cc.storage_backend.clear()
        cc.detach_storage_backend()


def test_mla_tp2_ranks_share_one_object_per_page_and_only_rank_0_writes(tmp_path: Path) -> None:
    extra = {"backend": "file", "options": {"root": str(tmp_path), "fanout": False}}
    tokens = list(range(4 * PAGE))
    set_rank(0, 2)
    rank0 = make_pools("mla", "page_first_direct")
    cc0 = controller(rank0, extra)
    src = rank0.host.alloc(len(tokens))
    pages = fill_random(rank0.host, src, seed=5)
    assert backup(cc0, src, tokens) == len(tokens)
    names = sorted(p.name for p in tmp_path.iterdir())
    hashes = get_hash_str(tokens, None, page_size=PAGE)
    tag = ObjectFormat.of_pool(adopt_host_pool(rank0.host), model="org/model").tag
    expected = sorted(f"{h}_org-model_f{tag}" for h in hashes)
    pages_only = [n for n in names if not n.startswith((".", RECORD_PREFIX))]
    assert pages_only == expected, "one object per page, tagged"
    assert len(names) - len(pages_only) >= len(expected), "each page has its verify record"

    set_rank(1, 2)
    rank1 = make_pools("mla", "page_first_direct")
    cc1 = controller(rank1, extra)
    other = rank1.host.alloc(len(tokens))
    fill_random(rank1.host, other, seed=6)
    backup(cc1, other, tokens)  # not the writer: SGLang skips its backup
    loaded, dst = prefetch(cc1, rank1.host, tokens)
    assert loaded == len(tokens)
    assert all(torch.equal(a, b) for a, b in zip(read_pages(rank1.host, dst), pages, strict=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == names, "rank 1 must not write"
    cc0.detach_storage_backend()
    cc1.detach_storage_backend()


def test_mha_tp2_ranks_keep_their_own_objects(tmp_path: Path) -> None:
    extra = {"backend": "file", "options": {"root": str(tmp_path)}}
    tokens = list(range(2 * PAGE))
    loaded_pages = []
    for rank in (0, 1):
        set_rank(rank, 2)
        pools = make_pools("mha", "page_head")
        cc = controller(pools, extra)
        src = pools.host.alloc(len(tokens))
        pages = fill_random(pools.host, src, seed=20 + rank)
        backup(cc, src, tokens)
        loaded, dst = prefetch(cc, pools.host, tokens)
        assert loaded == len(tokens)
        got = read_pages(pools.host, dst)
        assert all(torch.equal(a, b) for a, b in zip(got, pages, strict=True))
        loaded_pages.append(got)
        cc.detach_storage_backend()
    assert not torch.equal(loaded_pages[0][0], loaded_pages[1][0])


@pytest.mark.parametrize(
    "layouts", [("page_first", "layer_first"), ("page_head", "page_first_direct")]
)
def test_hybrid_controller_moves_kv_and_a_sidecar_pool(
    layouts: tuple[str, str], tmp_path: Path
) -> None:
    kv = make_pools("mha", layouts[0])
    side = make_pools("mha", layouts[1], layers=2)
    cc = hybrid_controller(
        kv, side, {"backend": "file", "options": {"root": str(tmp_path), "fanout": False}}
    )
    adapter = cc.storage_backend
    assert set(adapter.registered_pools) == {PoolName.KV, PoolName.INDEXER}
    tokens = list(range(3 * PAGE))
    src = kv.host.alloc(len(tokens))
    kv_pages = fill_random(kv.host, src, seed=1)
    side_pages = fill_random(side.host, src, seed=2)
    hashes = get_hash_str(tokens, None, page_size=PAGE)
    sidecar = [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]
    cc.write_storage(src, tokens, hash_value=hashes, prefix_keys=None, extra_pools=sidecar)
    assert cc.ack_backup_queue.get(timeout=TIMEOUT_S).completed_tokens == len(tokens)
    names = {p.name for p in tmp_path.iterdir()}
    assert {f"{h}.indexer_org-model_0_1" for h in hashes} <= names, "HiCacheFile's sidecar names"
    loaded, dst = prefetch(
        cc,
        kv.host,
        tokens,
        extra_pools=[PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)],
    )
    assert loaded == len(tokens)
    assert all(torch.equal(a, b) for a, b in zip(read_pages(kv.host, dst), kv_pages, strict=True))
    assert all(
        torch.equal(a, b) for a, b in zip(read_pages(side.host, dst), side_pages, strict=True)
    )
    cc.detach_storage_backend()


def test_a_missing_sidecar_page_shortens_the_usable_prefix(tmp_path: Path) -> None:
    kv = make_pools("mha", "page_first")
    side = make_pools("mha", "page_first", layers=1)
    cc = hybrid_controller(kv, side, {"backend": "memory"})
    adapter = cc.storage_backend
    tokens = list(range(4 * PAGE))
    hashes = get_hash_str(tokens, None, page_size=PAGE)
    src = kv.host.alloc(len(tokens))
    fill_random(kv.host, src, seed=3)
    assert adapter.batch_set_v1(hashes, src) == [True] * 4
    sidecar_keys = adapter._sidecar_keys("indexer", hashes)
    adapter.backend.set(sidecar_keys[0], b"\0" * adapter._pools["indexer"].pool.page_nbytes)
    adapter.backend.set(sidecar_keys[1], b"\0" * adapter._pools["indexer"].pool.page_nbytes)
    adapter.backend.set(sidecar_keys[3], b"\0" * adapter._pools["indexer"].pool.page_nbytes)
    all_pages = adapter.batch_exists_v2(hashes, [PoolTransfer(name=PoolName.INDEXER)])
    assert all_pages.kv_hit_pages == 2 and all_pages.extra_pool_hit_pages[PoolName.KV] == 4
    trailing = adapter.batch_exists_v2(
        hashes,
        [
            PoolTransfer(
                name=PoolName.INDEXER, keys=hashes[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES
            )
        ],
    )
    assert trailing.kv_hit_pages == 4 and trailing.restorable_prefix_pages == [1, 2, 4]
    cc.detach_storage_backend()


def test_prefetch_of_nothing_stored_is_a_clean_miss(tmp_path: Path) -> None:
    pools = make_pools("mla", "layer_first")
    cc = controller(pools, {"backend": "file", "options": {"root": str(tmp_path)}})
    loaded, dst = prefetch(cc, pools.host, list(range(3 * PAGE)))
    assert loaded == 0 and dst.numel() == 0
    cc.detach_storage_backend()


def test_threads_stop_on_detach() -> None:
    before = {t.ident for t in threading.enumerate()}
    pools = make_pools("mha", "layer_first")
    cc = controller(pools, {"backend": "memory"})
    cc.detach_storage_backend()
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before


UNIFIED = {
    "key_scheme": "unified",
    "unified": {"dtype": "float16", "num_layers": 3, "local_kv_heads": 2, "head_group": 1},
}


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_unified_keys_through_the_controller_read_across_layouts(
    layout: str, tmp_path: Path
) -> None:
    # One object per page and head (head_group 1), named by what it holds: a reader whose host
    # pool has another layout loads what this one wrote. The page size comes from SGLang's pool.
    extra = {"backend": "file", "options": {"root": str(tmp_path)}, "deployment": UNIFIED}
    writer = make_pools("mha", layout)
    cc = controller(writer, extra)
    tokens = list(range(3 * PAGE))
    src = writer.host.alloc(len(tokens))
    fill_random(writer.host, src, seed=9)
    pages = [canonical_mha_page(writer.host, s) for s in src[::PAGE].tolist()]
    assert backup(cc, src, tokens) == len(tokens)
    keys = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    keys = {k for k in keys if not k.startswith(RECORD_PREFIX)}
    assert len(keys) == 3 * 2 and all("_ukv1-" in k and "_H" in k for k in keys)
    cc.detach_storage_backend()
    reader = make_pools("mha", "page_first")
    cc = controller(reader, extra)
    loaded, dst = prefetch(cc, reader.host, tokens)
    assert loaded == len(tokens)
    got = [canonical_mha_page(reader.host, s) for s in dst[::PAGE].tolist()]
    assert all(torch.equal(a, b) for a, b in zip(got, pages, strict=True))
    cc.detach_storage_backend()


def test_unified_dtype_must_agree_with_the_pool(tmp_path: Path) -> None:
    wrong = {**UNIFIED, "unified": {**UNIFIED["unified"], "dtype": "bfloat16"}}
    pools = make_pools("mha", "page_first")
    with pytest.raises(
        Exception, match=r"unified\.dtype is bfloat16 but SGLang's host pool holds float16"
    ):
        controller(pools, {"backend": "memory", "deployment": wrong})


@pytest.mark.parametrize("fault", ["stop", "pause"])
def test_a_server_lost_mid_run_turns_into_misses_within_the_deadline(
    fault: str, tmp_path: Path
) -> None:
    # DESIGN §3 through SGLang: storage never fails a request and never hangs it.
    service = redis_provision.standalone(tmp_path / "redis")
    with service:
        options = {**service.options, "deadline_s": 2.0}
        pools = make_pools("mha", "page_first")
        cc = controller(pools, {"backend": "redis", "options": options})
        tokens = list(range(2 * PAGE))
        src = pools.host.alloc(len(tokens))
        fill_random(pools.host, src, seed=4)
        assert backup(cc, src, tokens) == len(tokens)
        getattr(service, fault)()
        try:
            start = time.monotonic()
            loaded, _ = prefetch(cc, pools.host, tokens)
            assert loaded == 0
            assert backup(cc, src, list(range(50, 50 + 2 * PAGE))) == 0
            assert time.monotonic() - start < 10
            stats = cc.storage_backend.backend.stats()
            # failures, or calls the health layer answered once the store stopped answering
            assert stats["degraded"]["total"] + stats["health"]["shed_total"] >= 2
        finally:
            if fault == "pause":
                service.resume()
        cc.detach_storage_backend()
