"""End to end: TP4 ranks write a model's KV under the unified scheme; TP2, TP1 and PP2 read it.

The writers and readers use different host layouts on purpose: unified objects have one byte
order, so a page written from one layout loads bit-identically into another. Readers whose
namespace differs (dtype, object layout, head grid) must miss, never receive bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache_storage import StorageBackend, create_backend
from hicache_storage.config import Deployment, UnifiedKeys
from hicache_storage.hostpool import HostKVPool, MHAHostPool, MLAHostPool, UnifiedObjectPool
from hicache_storage.keys import chain_hashes

from .unified_helpers import fill_pages, read_pages

__all__ = [
    "StoreFactory",
    "model",
    "shared_store",
    "test_fp8_e4m3_and_e5m2_never_exchange_bytes",
    "test_mla_ranks_share_one_copy_written_by_rank_zero",
    "test_readers_of_another_namespace_miss",
    "test_tp2_tp1_and_pp2_readers_load_bit_identical_kv",
]
"""What a backend's test folder imports to run these tests; it defines its own ``store``."""

LAYERS, HEADS, HEAD_DIM, PAGE, PAGES = 4, 8, 16, 4, 6
TOKENS = PAGE * PAGES
SENTINEL = 0x5A

StoreFactory = Callable[[Deployment], StorageBackend]


def shared_store(name: str, options: dict[str, Any]) -> Iterator[StoreFactory]:
    """Yield a factory of backends ``name`` over one store (one per rank); close them after."""
    built: list[StorageBackend] = []

    def make(deployment: Deployment) -> StorageBackend:
        backend = create_backend(name, options, deployment=deployment)
        built.append(backend)
        return backend

    yield make
    for backend in built:
        backend.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreFactory]:
    """Backends of one shared store. The networked backends' test folders override this fixture
    and import the tests below, so every backend runs them against its real server."""
    yield from shared_store("file", {"root": str(tmp_path / "store")})


def deployment(
    tp_rank: int, tp_size: int, *, stage: tuple[int, int] = (0, LAYERS), **unified: Any
) -> Deployment:
    settings: dict[str, Any] = {
        "dtype": "bfloat16",
        "num_layers": LAYERS,
        "layer_start": stage[0],
        "layer_end": stage[1],
        "layer_partition": 2,
        "local_kv_heads": HEADS // tp_size,
        "tp_lcm_size": 4,
        **unified,
    }
    return Deployment(
        model_name="acme/llm-8h",
        tp_rank=tp_rank,
        tp_size=tp_size,
        page_size=PAGE,
        key_scheme="unified",
        unified=UnifiedKeys(**settings),
    )


def mha_pool(
    heads: int, layout: str, layers: int = LAYERS, dtype: torch.dtype = torch.bfloat16
) -> HostKVPool:
    return MHAHostPool(
        size=2 * TOKENS,
        page_size=PAGE,
        layer_num=layers,
        head_num=heads,
        head_dim=HEAD_DIM,
        dtype=dtype,
        layout=layout,
        pin_memory=False,
    )


class Rank:
    """A simulated rank: its deployment, backend, host pool and pages."""

    def __init__(self, store: StoreFactory, dep: Deployment, pool: HostKVPool) -> None:
        self.plan = dep.unified_plan()
        self.backend = store(dep)
        self.objects = UnifiedObjectPool(pool, self.plan)
        self.backend.register_host_pool(self.objects)
        self.pool = pool
        self.pages = [PAGES + p for p in range(PAGES)]  # not where the writers keep them
        self.indices = torch.tensor([p * PAGE + t for p in self.pages for t in range(PAGE)])

    def keys(self, hashes: list[str]) -> list[str]:
        return self.plan.keys(hashes)

    def write(self, hashes: list[str]) -> list[bool]:
        return self.backend.batch_set_v1(
            self.keys(hashes), self.objects.object_indices(self.indices)
        )

    def load(self, hashes: list[str]) -> list[bool]:
        return self.backend.batch_get_v1(
            self.keys(hashes), self.objects.object_indices(self.indices)
        )


@pytest.fixture
def model() -> tuple[torch.Tensor, list[str]]:
    """The model's KV for one prompt, ``(2, L, tokens, heads, dim)``, and its page hashes."""
    generator = torch.Generator().manual_seed(7)
    kv = torch.randn((2, LAYERS, TOKENS, HEADS, HEAD_DIM), generator=generator).to(torch.bfloat16)
    tokens = torch.randint(0, 150_000, (TOKENS,), generator=generator).tolist()
    return kv, chain_hashes(tokens, page_size=PAGE)


def write_with_tp4(store: StoreFactory, kv: torch.Tensor, hashes: list[str]) -> None:
    for rank in range(4):
        pool = mha_pool(2, "page_first_direct")
        heads = slice(2 * rank, 2 * rank + 2)
        fill_pages(pool, list(range(PAGES)), kv[:, :, :, heads])
        writer = Rank(store, deployment(rank, 4), pool)
        writer.pages, writer.indices = list(range(PAGES)), torch.arange(TOKENS)
        assert writer.plan.keys_per_page == 2
        assert writer.write(hashes) == [True] * (2 * PAGES)


def poisoned(pool: HostKVPool) -> HostKVPool:
    pool.kv_buffer.view(torch.uint8).fill_(SENTINEL)
    return pool


def test_tp2_tp1_and_pp2_readers_load_bit_identical_kv(
    store: StoreFactory, model: tuple[torch.Tensor, list[str]]
) -> None:
    kv, hashes = model
    write_with_tp4(store, kv, hashes)

    for rank in range(2):
        reader = Rank(store, deployment(rank, 2), poisoned(mha_pool(4, "page_first")))
        assert reader.backend.batch_exists(reader.keys(hashes)) == 4 * PAGES
        assert reader.load(hashes) == [True] * (4 * PAGES)
        got = read_pages(reader.pool, reader.pages)
        assert torch.equal(
            got.view(torch.int16), kv[:, :, :, 4 * rank : 4 * rank + 4].view(torch.int16)
        )

    reader = Rank(store, deployment(0, 1), poisoned(mha_pool(8, "layer_first")))
    assert reader.load(hashes) == [True] * (8 * PAGES)
    assert torch.equal(
        read_pages(reader.pool, reader.pages).view(torch.int16), kv.view(torch.int16)
    )

    for first, end in [(0, 2), (2, 4)]:
        pool = poisoned(mha_pool(8, "page_first", layers=end - first))
        stage = Rank(store, deployment(0, 1, stage=(first, end)), pool)
        assert stage.load(hashes) == [True] * (4 * PAGES)
        expected = kv[:, first:end]
        assert torch.equal(
            read_pages(stage.pool, stage.pages).view(torch.int16), expected.view(torch.int16)
        )


@pytest.mark.parametrize(
    ("change", "dtype"),
    [
        ({"dtype": "float16"}, torch.float16),
        ({"object_layout": "page-unified-layer-major-v1"}, torch.bfloat16),
        ({"tp_lcm_size": None, "head_group": 4}, torch.bfloat16),
        ({"model_id": "acme/other-model"}, torch.bfloat16),
    ],
    ids=["dtype", "object-layout", "head-grid", "model"],
)
def test_readers_of_another_namespace_miss(
    store: StoreFactory,
    model: tuple[torch.Tensor, list[str]],
    change: dict[str, Any],
    dtype: torch.dtype,
) -> None:
    kv, hashes = model
    write_with_tp4(store, kv, hashes)
    reader = Rank(
        store, deployment(0, 2, **change), poisoned(mha_pool(4, "page_first", dtype=dtype))
    )
    assert reader.backend.batch_exists(reader.keys(hashes)) == 0
    assert reader.load(hashes) == [False] * (reader.plan.keys_per_page * PAGES)
    assert bool((reader.pool.kv_buffer.view(torch.uint8) == SENTINEL).all())


def test_fp8_e4m3_and_e5m2_never_exchange_bytes(store: StoreFactory) -> None:
    generator = torch.Generator().manual_seed(3)
    kv = torch.randint(
        0, 256, (2, LAYERS, TOKENS, HEADS, HEAD_DIM), generator=generator, dtype=torch.uint8
    )
    hashes = chain_hashes(list(range(TOKENS)), page_size=PAGE)
    writer_pool = mha_pool(8, "layer_first", dtype=torch.uint8)
    fill_pages(writer_pool, list(range(PAGES)), kv)
    writer = Rank(store, deployment(0, 1, dtype="float8_e4m3fn"), writer_pool)
    writer.pages, writer.indices = list(range(PAGES)), torch.arange(TOKENS)
    assert all(writer.write(hashes))

    same = Rank(
        store,
        deployment(0, 1, dtype="fp8_e4m3"),
        poisoned(mha_pool(8, "page_first", dtype=torch.uint8)),
    )
    assert all(same.load(hashes))
    assert torch.equal(read_pages(same.pool, same.pages), kv)
    other = Rank(
        store,
        deployment(0, 1, dtype="float8_e5m2"),
        poisoned(mha_pool(8, "page_first", dtype=torch.uint8)),
    )
    assert not any(other.load(hashes))
    assert bool((other.pool.kv_buffer == SENTINEL).all())


def test_mla_ranks_share_one_copy_written_by_rank_zero(store: StoreFactory) -> None:
    generator = torch.Generator().manual_seed(5)
    latent = torch.randn((LAYERS, TOKENS, 1, 40), generator=generator).to(torch.bfloat16)
    hashes = chain_hashes(list(range(100, 100 + TOKENS)), page_size=PAGE)

    def mla_rank(rank: int, layout: str) -> Rank:
        dep = Deployment(
            model_name="acme/mla",
            tp_rank=rank,
            tp_size=4,
            is_mla=True,
            page_size=PAGE,
            key_scheme="unified",
            unified=UnifiedKeys(dtype="bf16", num_layers=LAYERS, layer_partition=2),
        )
        pool = MLAHostPool(
            size=2 * TOKENS,
            page_size=PAGE,
            layer_num=LAYERS,
            kv_cache_dim=40,
            layout=layout,
            pin_memory=False,
        )
        return Rank(store, dep, pool)

    ranks = [mla_rank(r, "page_first") for r in range(4)]
    assert [r.plan.is_writer for r in ranks] == [True, False, False, False]
    fill_pages(ranks[0].pool, ranks[0].pages, latent)
    assert all(ranks[0].write(hashes))
    reader = mla_rank(0, "layer_first")
    reader.pool.kv_buffer.view(torch.uint8).fill_(SENTINEL)
    assert all(reader.load(hashes))
    assert np.array_equal(
        read_pages(reader.pool, reader.pages).view(torch.int16).numpy(),
        latent.view(torch.int16).numpy(),
    )
