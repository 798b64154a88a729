"""End to end: through the layers engines use, a page hit is the page written for its key.

A backend's ``True`` is not proof (a lost completion, slots never filled, another key's
bytes). Engines run the verify layer (:mod:`hicache_storage.layers.verify`), which checks each
page a v1 read answers as a hit against the record its writer stored. These checks run any
backend under it: pages written and read back are all verified hits, and a page whose stored
bytes were replaced behind the writer's back is a counted miss, no longer trusted.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import msgspec
import pytest

from hicache_storage.backend import StorageBackend
from hicache_storage.config import LayerConfig
from hicache_storage.conformance.checks.common import (
    SENTINEL,
    _bytes,
    _indices,
    _pool,
    _random_fill,
    _raw,
    _sentinel_fill,
    requires,
)
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, capabilities_of, cleanup
from hicache_storage.layers import ForwardingBackend

__all__ = ["TestEndToEnd"]

PAGES = 8


def _layers(factory: BackendFactory) -> LayerConfig:
    return msgspec.structs.replace(factory.layers, verify=True, faults=None)


def _skip_foreign(factory: BackendFactory) -> None:
    if capabilities_of(factory).foreign_names:
        pytest.skip(
            "backend stores foreign names: pages carry no verify record (the store is laid out "
            "for a writer that writes none)"
        )


def _verify_counts(instance: StorageBackend) -> dict[str, int]:
    counts: dict[str, int] = instance.stats().get("verify", {})
    assert counts, "the verify layer is not in the stack (stats() has no 'verify')"
    return counts


class TestEndToEnd:
    """Every page a v1 read answers as a hit is checked against the bytes written for its key."""

    def test_v1_hits_are_verified_written_pages(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        _skip_foreign(hicache_factory)
        with hicache_factory(_layers(hicache_factory)) as instance:
            try:
                source = _pool("mha", "layer_first", pages=PAGES)
                _random_fill(source, seed=31)
                keys = k.many("e2e", PAGES)
                instance.register_host_pool(source)
                stored = instance.batch_set_v1(keys, _indices(source, range(PAGES)))
                assert stored == [True] * PAGES, f"batch_set_v1 through the layers: {stored}"
                target = _pool("mha", "layer_first", pages=PAGES)
                _sentinel_fill(target)
                instance.register_host_pool(target)
                order = list(reversed(range(PAGES)))
                hits = instance.batch_get_v1(keys, _indices(target, order))
                assert hits == [True] * PAGES, (
                    f"pages just written read back as {hits} through the verify layer: a hit "
                    f"must fill the page with the bytes written for its key"
                )
                for page, slot in enumerate(order):
                    assert _bytes(target.get_data_page(slot * target.page_size)) == _bytes(
                        source.get_data_page(page * source.page_size)
                    ), f"page {page} read back other bytes"
                counts = _verify_counts(instance)
                assert counts["verified"] >= PAGES and counts["mismatched"] == 0, counts
            finally:
                cleanup(hicache_factory, instance, k)

    @requires("delete")
    def test_other_bytes_under_a_key_are_a_counted_miss(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        _skip_foreign(hicache_factory)
        with hicache_factory(_layers(hicache_factory)) as instance:
            try:
                pool = _pool("mha", "layer_first", pages=2)
                _random_fill(pool, seed=41)
                key = k("e2e-replaced")
                instance.register_host_pool(pool)
                assert instance.batch_set_v1([key], _indices(pool, [0])) == [True]
                bare = instance.unwrap() if isinstance(instance, ForwardingBackend) else instance
                # Replaced behind the writer's back: another engine's bytes, a restored backup.
                other = bytes(255 - b for b in _bytes(pool.get_data_page(0)))
                assert bare.delete(key) and bare.set(key, other)
                _raw(pool)[pool.page_nbytes :].fill_(SENTINEL)
                before = _verify_counts(instance)["mismatched"]
                assert instance.batch_get_v1([key], _indices(pool, [1])) == [False], (
                    "a page whose stored bytes are not the ones written for its key was a hit"
                )
                assert _verify_counts(instance)["mismatched"] == before + 1
                assert instance.batch_exists([key]) == 0, "a page that failed is still trusted"
            finally:
                cleanup(hicache_factory, instance, k)
