"""The verify layer: a page reaches the caller only if its bytes are those written for its key."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from hicache_storage import BackendUnavailableError, StorageBackend
from hicache_storage.backends.memory import MemoryBackend
from hicache_storage.hostpool import HostKVPool
from hicache_storage.layers import ForwardingBackend
from hicache_storage.layers.verify import VerifyLayer, record_key

from .helpers import make_pool

PAGES = 4


def _filled(seed: int) -> HostKVPool:
    pool = make_pool("mha", "page_first", pages=2 * PAGES)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return pool


def _pages(pool: HostKVPool, pages: Sequence[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages])


def _page(pool: HostKVPool, page: int) -> bytes:
    return pool.get_data_page(page * pool.page_size).view(-1).view(torch.uint8).numpy().tobytes()


class AnswersTrueUnfilled(ForwardingBackend):
    """A store whose v1 reads claim every page without filling its slots."""

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        return [True] * len(keys)


class SwapsPages(ForwardingBackend):
    """A store that hands back the next key's page for each key (another key's bytes)."""

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        rotated = [*keys[1:], keys[0]]
        return self.inner.batch_get_v1(rotated, host_indices)


def _stored(store: StorageBackend, pool: HostKVPool, keys: list[str]) -> VerifyLayer:
    layer = VerifyLayer(store)
    layer.register_host_pool(pool)
    assert layer.batch_set_v1(keys, _pages(pool, range(PAGES))) == [True] * PAGES
    return layer


def test_written_pages_read_back_verified() -> None:
    pool = _filled(1)
    keys = [f"p{i}" for i in range(PAGES)]
    layer = _stored(MemoryBackend(), pool, keys)
    written = [_page(pool, i) for i in range(PAGES)]
    assert layer.batch_get_v1(keys, _pages(pool, range(PAGES, 2 * PAGES))) == [True] * PAGES
    assert [_page(pool, PAGES + i) for i in range(PAGES)] == written
    counts = layer.stats()["verify"]
    assert counts["verified"] == PAGES and counts["mismatched"] == 0
    # The page objects are unchanged: a reader without the layer reads the same bytes.
    value = layer.inner.get("p0")
    assert value is not None and bytes(value) == written[0]


def test_true_without_filled_slots_is_a_counted_miss_and_distrusted() -> None:
    pool = _filled(2)
    keys = [f"p{i}" for i in range(PAGES)]
    store = MemoryBackend()
    _stored(store, pool, keys)
    layer = VerifyLayer(AnswersTrueUnfilled(store))
    layer.register_host_pool(pool)
    assert layer.batch_get_v1(keys, _pages(pool, range(PAGES, 2 * PAGES))) == [False] * PAGES
    counts = layer.stats()["verify"]
    assert counts["mismatched"] == PAGES and counts["distrusted"] == PAGES
    # No longer trusted: exists and the prefix stop there, and the bad objects are gone.
    assert layer.batch_exists(keys) == 0 and layer.exists("p1") is False
    assert store.get("p0") is None and store.get(record_key("p0")) is None


def test_another_keys_bytes_are_a_miss() -> None:
    pool = _filled(3)
    keys = [f"p{i}" for i in range(PAGES)]
    store = MemoryBackend()
    _stored(store, pool, keys)
    layer = VerifyLayer(SwapsPages(store))
    layer.register_host_pool(pool)
    assert layer.batch_get_v1(keys, _pages(pool, range(PAGES, 2 * PAGES))) == [False] * PAGES
    assert layer.stats()["verify"]["mismatched"] == PAGES


def test_a_page_without_a_record_is_a_miss_unless_the_store_is_laid_out_for_another() -> None:
    pool = _filled(4)
    store = MemoryBackend()
    store.register_host_pool(pool)
    assert store.batch_set_v1(["bare"], _pages(pool, [0])) == [True]  # no record written
    layer = VerifyLayer(store)
    layer.register_host_pool(pool)
    assert layer.batch_get_v1(["bare"], _pages(pool, [PAGES])) == [False]
    assert layer.stats()["verify"]["no_record"] == 1
    store.capabilities = dataclasses.replace(store.capabilities, foreign_names=True)
    foreign = VerifyLayer(store)
    foreign.register_host_pool(pool)
    assert foreign.batch_get_v1(["bare"], _pages(pool, [PAGES])) == [True]
    assert foreign.stats()["verify"]["unverified"] == 1
    assert foreign.batch_set_v1(["more"], _pages(pool, [1])) == [True]
    assert store.get(record_key("more")) is None, "no records in a store laid out for another"


class RecordsFail(ForwardingBackend):
    """A store that stores pages but whose small-object writes fail."""

    def batch_set(self, keys: Sequence[str], values: Sequence[object]) -> list[bool]:
        raise BackendUnavailableError("records cannot be written")


def test_a_page_whose_record_cannot_be_stored_is_reported_not_stored() -> None:
    pool = _filled(5)
    layer = VerifyLayer(RecordsFail(MemoryBackend()))
    layer.register_host_pool(pool)
    assert layer.batch_set_v1(["a", "b"], _pages(pool, [0, 1])) == [False, False]
    assert layer.stats()["verify"]["records_failed"] == 2
    assert layer.batch_get_v1(["a"], _pages(pool, [PAGES])) == [False]


def test_a_distrusted_key_stored_again_is_trusted_again() -> None:
    pool = _filled(6)
    keys = [f"p{i}" for i in range(PAGES)]
    store = MemoryBackend()
    _stored(store, pool, keys)
    broken = VerifyLayer(AnswersTrueUnfilled(store))
    broken.register_host_pool(pool)
    broken.batch_get_v1(keys[:1], _pages(pool, [PAGES]))
    assert broken.exists("p0") is False
    assert broken.batch_set_v1(keys[:1], _pages(pool, [0])) == [True]  # deleted, so stored anew
    assert broken.exists("p0") is True
    assert broken.batch_exists(keys) == PAGES


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_every_layout_verifies(layout: str) -> None:
    pool = make_pool("mha", layout, pages=2 * PAGES)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    keys = [f"{layout}-{i}" for i in range(PAGES)]
    layer = _stored(MemoryBackend(), pool, keys)
    assert layer.batch_get_v1(keys, _pages(pool, range(PAGES, 2 * PAGES))) == [True] * PAGES


def test_deleting_a_page_deletes_its_record() -> None:
    pool = _filled(7)
    keys = [f"p{i}" for i in range(PAGES)]
    store = MemoryBackend()
    layer = _stored(store, pool, keys)
    assert layer.delete("p0") is True
    assert not store.exists("p0") and not store.exists(record_key("p0"))
    assert store.exists(record_key("p1")), "other pages keep their records"
    assert layer.delete("p0") is False
    assert layer.batch_get_v1(keys[1:], _pages(pool, range(PAGES, 2 * PAGES - 1))) == [True] * 3
