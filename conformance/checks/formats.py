"""Objects say what their bytes mean: a reader of another model format never gets a hit.

Pages of the same hash written from pools of another layout, dtype or geometry hold other bytes.
The rank-suffix scheme keeps them apart by the :class:`~hicache_storage.keys.ObjectFormat` tag at
the end of every key, so a backend must keep long keys that differ only in their last characters
apart (no truncation, no folding). A backend that stores objects under another system's names
(``foreign_names``) keeps the format itself and must refuse, when a pool is registered, a pool of
another format while objects of the first remain.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import hashlib

import pytest
import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import Deployment
from hicache_storage.conformance.checks.common import (
    SENTINEL,
    SHARED_POOLS,
    _indices,
    _raw,
    _sentinel_fill,
    fill_random,
    page_bytes,
    pool_pages,
    requires,
)
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace
from hicache_storage.errors import ConfigError
from hicache_storage.hostpool import HostKVPool, MHAHostPool
from hicache_storage.keys import ObjectFormat, RankSuffixScheme

__all__ = ["TestObjectFormats"]

MODEL = "conformance/" + "m" * 100
"""A long model name: with 64-digit page hashes, tagged keys are 199 characters, the format tag
in the last 16 of them, where a backend that cuts or folds long keys shows."""

PAGES = 3


def _mha(layout: str, dtype: torch.dtype, heads: int, dim: int) -> HostKVPool:
    return MHAHostPool(
        8 * 4,
        4,
        2,
        heads,
        dim,
        dtype=dtype,
        layout=layout,
        pin_memory=False,
        shared=SHARED_POOLS,
    )


WRITER = ("layer_first", torch.float16, 2, 8)
READERS = {
    "layout": ("page_first", torch.float16, 2, 8),
    "dtype": ("layer_first", torch.bfloat16, 2, 8),
    "head-split": ("layer_first", torch.float16, 4, 4),
}
"""Readers whose pages have exactly the writer's byte size: only the format tells them apart."""


def _hashes(k: Keyspace) -> list[str]:
    """Page hashes private to the test (64 hex digits, as real ones)."""
    return [hashlib.sha256(k(f"h{i}").encode()).hexdigest() for i in range(PAGES)]


def _tagged(pool: HostKVPool, hashes: list[str]) -> list[str]:
    tag = ObjectFormat.of_pool(pool, model=MODEL).tag
    return RankSuffixScheme(model_name=MODEL, object_format=tag).keys(hashes)


class TestObjectFormats:
    """A page written in one format is never a hit for a reader of another."""

    @pytest.mark.parametrize("reader", sorted(READERS))
    def test_tagged_keys_of_other_formats_are_misses(
        self, backend: StorageBackend, k: Keyspace, capabilities: Capabilities, reader: str
    ) -> None:
        if capabilities.foreign_names:
            pytest.skip(
                "backend stores foreign names: keys carry no format tag, so the format is "
                "checked when a pool is registered"
            )
        hashes = _hashes(k)
        writer = _mha(*WRITER)
        fill_random(writer, seed=11)
        written = _tagged(writer, hashes)
        k.used.update(written)
        backend.register_host_pool(writer)
        assert backend.batch_set_v1(written, _indices(writer, [0, 1, 2])) == [True] * PAGES

        other = _mha(*READERS[reader])
        assert other.page_nbytes == writer.page_nbytes
        keys = _tagged(other, hashes)
        k.used.update(keys)
        assert keys != written, "the scheme must give another format other keys"
        _sentinel_fill(other)
        backend.register_host_pool(other)
        assert backend.batch_exists(keys) == 0, (
            f"a page written from a {WRITER[0]} pool exists for a reader of another {reader}: "
            "keys that differ only in their format tag must stay apart"
        )
        got = backend.batch_get_v1(keys, _indices(other, [0, 1, 2]))
        assert got == [False] * PAGES, f"a reader of another {reader} got hits {got}"
        assert bool((_raw(other) == SENTINEL).all()), "a miss must leave the pages untouched"

        same = _mha(*WRITER)
        _sentinel_fill(same)
        backend.register_host_pool(same)
        assert backend.batch_get_v1(written, _indices(same, [2, 1, 0])) == [True] * PAGES
        expected = pool_pages(writer)
        got_pages = page_bytes(same, _indices(same, [2, 1, 0]))
        assert got_pages == expected[:PAGES], "a reader of the writer's format gets its bytes"

    @requires("foreign_names", "persistent")
    def test_foreign_names_refuse_a_pool_of_another_format(
        self, hicache_factory: BackendFactory, backend: StorageBackend, k: Keyspace
    ) -> None:
        scheme = Deployment().rank_suffix()
        keys = scheme.keys(_hashes(k))
        k.used.update(keys)
        writer = _mha(*WRITER)
        fill_random(writer, seed=12)
        backend.register_host_pool(writer)
        assert backend.batch_set_v1(keys, _indices(writer, [0, 1, 2])) == [True] * PAGES
        for reader, shape in sorted(READERS.items()):
            with hicache_factory() as other, pytest.raises(ConfigError):
                other.register_host_pool(_mha(*shape))
                pytest.fail(f"a pool of another {reader} was accepted over stored objects")
        with hicache_factory() as again:
            same = _mha(*WRITER)
            again.register_host_pool(same)
            assert again.batch_get_v1(keys, _indices(same, [0, 1, 2])) == [True] * PAGES
            got_pages = page_bytes(same, _indices(same, [0, 1, 2]))
            assert got_pages == pool_pages(writer)[:PAGES], "the writer's format gets its bytes"
