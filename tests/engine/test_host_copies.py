"""Host copies of pages storage holds: into a full host only while such copies are hit there.

A page on the device that storage also holds gains a host copy only as a shortcut for its next
use. Where the host is full, the copy evicts another page and costs a device→host transfer; in
a workload whose histories cycle through more than the device and host hold, the copies are
evicted unread. The cache counts what became of its recent copies and stops evicting for them
once fewer than a quarter were hit.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from hicache_storage import StorageBackend, create_backend
from hicache_storage.engine.cache import TierCache
from hicache_storage.engine.cache_config import PrefetchConfig
from hicache_storage.engine.policies import PrefetchPolicy
from hicache_storage.engine.radix import Node, Tier

from .test_engine import PAGE, build
from .test_running_host_room import admit, release, stored_prompts


@pytest.fixture
def backend() -> Iterator[StorageBackend]:
    store = create_backend("memory")
    yield store
    store.close()


def outcomes(cache: TierCache, hits: int, misses: int) -> None:
    """Record ``hits`` copies hit on the host and ``misses`` evicted unread."""
    for i, hit in enumerate([True] * hits + [False] * misses):
        node = SimpleNamespace(id=-1 - len(cache.stored_copies.outcomes) - i)
        cache.stored_copies.copied(node)  # type: ignore[arg-type]
        cache.stored_copies.outcome(node, hit=hit)  # type: ignore[arg-type]


def test_copies_pay_until_a_quarter_of_the_measured_ones_is_hit(backend: StorageBackend) -> None:
    cache = build(64, 4 * PAGE, backend)
    assert cache.stored_copies.pay(), "unmeasured: copies are made"
    outcomes(cache, hits=0, misses=7)
    assert cache.stored_copies.pay(), "seven outcomes are too few to judge by"
    outcomes(cache, hits=0, misses=1)
    assert not cache.stored_copies.pay()
    cache.stored_copies.outcome(SimpleNamespace(id=12345), hit=True)  # type: ignore[arg-type]
    assert not cache.stored_copies.pay(), "a hit on a page that was not such a copy is no outcome"
    outcomes(cache, hits=3, misses=0)
    assert cache.stored_copies.pay(), "3 hits of 11"
    cache.close()


def device_only(cache: TierCache, prompt: list[int]) -> Node:
    """The node of ``prompt``, checked to be on the device and in storage but not on the host."""
    node = cache.tree.match_prefix(prompt, touch=False).last_node
    assert node.tiers == {Tier.DEVICE, Tier.STORAGE}
    return node


@pytest.mark.parametrize("paying", [True, False])
def test_a_stored_page_evicts_for_its_host_copy_only_while_copies_pay(
    backend: StorageBackend, paying: bool
) -> None:
    """A host of six pages full of one stored prompt; another stored prompt on the device only.

    Its host copy evicts the first prompt's pages while copies pay, and is not made otherwise;
    with free room it is made either way.
    """
    first, second = stored_prompts(backend, 2)
    cache = build(
        64,
        6 * PAGE,
        backend,
        prefetch=PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE, capacity=6 * PAGE),
    )
    for prompt in (first, second):  # the second fetch takes the host room of the first
        lease = admit(cache, prompt)
        assert lease.storage_hit == 6 * PAGE
        load = cache.take_load()
        assert load is not None
        load.finish()
        cache.poll()
        release(cache, lease, prompt)
    node = device_only(cache, first)
    assert cache.host_pool is not None and cache.host_pool.allocator.available_size() == 0
    outcomes(cache, hits=0 if not paying else 8, misses=8)
    copied = cache.stats.pages_backed_up
    assert cache.transfers.backup(node) is paying
    assert (Tier.HOST in node.tiers) is paying
    assert cache.stats.pages_backed_up - copied == (6 if paying else 0)
    cache.tree.check()
    if not paying:  # free room: the copy is made whatever the outcomes say
        for host_node in [n for n in cache.tree.nodes() if n.host_indices is not None]:
            if not host_node.lock_ref and not host_node.host_pins and host_node.stored:
                cache.host_pool.free(cache.tree.evict_host(host_node))
        assert cache.transfers.backup(node) and Tier.HOST in node.tiers
    cache.tree.check()
    cache.close()
