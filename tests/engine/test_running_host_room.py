"""Host room held by a running request's prefix: given up once it is on the device and stored.

A request computes from the device copies of its prefix. Where the same pages are in storage,
their host copies are a third copy: on a host smaller than the prefixes in flight (histories
that outgrow it, documents twice its size) keeping them left fetches no room, and their requests
recomputed what storage held. Until its copy to the device has run, a loaded page's host copy
is still read, and stays.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from hicache_storage import StorageBackend, create_backend
from hicache_storage.engine.cache import Lease, TierCache
from hicache_storage.engine.radix import Tier

from .test_engine import CONFIG, PAGE, build

PROMPT = 6 * PAGE + 1
"""Six whole pages and the token left to compute."""


@pytest.fixture
def backend() -> Iterator[StorageBackend]:
    store = create_backend("memory")
    yield store
    store.close()


def admit(cache: TierCache, prompt: list[int]) -> Lease:
    """Look ``prompt`` up, wait for its fetch as the policy says, and admit it."""
    lookup = cache.lookup(prompt)
    deadline = time.monotonic() + 10
    while not cache.ready(lookup):
        assert time.monotonic() < deadline, "the fetch never finished"
        time.sleep(0.001)
        cache.poll()
    lease = cache.acquire(lookup, len(prompt) + 3)
    assert lease is not None
    return lease


def release(cache: TierCache, lease: Lease, prompt: list[int]) -> None:
    cache.release(lease, prompt, lease.slots[: len(prompt)])


def stored_prompts(backend: StorageBackend, count: int) -> list[list[int]]:
    """Prompts whose whole pages a first engine wrote to ``backend``."""
    rng = random.Random(11)
    prompts = [[rng.randrange(CONFIG.vocab_size) for _ in range(PROMPT)] for _ in range(count)]
    writer = build(64, 64, backend)
    for prompt in prompts:
        release(writer, admit(writer, prompt), prompt)
    writer.close()
    assert writer.stats.pages_stored == count * 6
    return prompts


@pytest.mark.parametrize("loaded", [True, False])
def test_a_running_requests_stored_prefix_gives_its_host_room_to_a_fetch(
    backend: StorageBackend, loaded: bool
) -> None:
    """A host of 8 pages, a request running on 6 fetched pages, another fetching 6 more.

    Once the first request's pages are on the device their host copies are given up for the
    second fetch; before the copy to the device has run (``loaded`` false) they are kept and
    the second request finds no room.
    """
    first, second = stored_prompts(backend, 2)
    cache = build(64, 8 * PAGE, backend, prefetch_capacity=8 * PAGE)
    running = admit(cache, first)
    assert running.storage_hit == 6 * PAGE
    if loaded:
        load = cache.take_load()
        assert load is not None
        load.finish()
        cache.poll()
    other = admit(cache, second)
    if loaded:
        assert other.storage_hit == 6 * PAGE, "the running prefix's host copies made room"
        assert cache.stats.prefetch_no_room == 0
        path = [n for n in cache.tree.path(running.node) if not n.is_root]
        assert all(n.tiers == {Tier.DEVICE, Tier.STORAGE} for n in path)
        assert all(n.lock_ref for n in path), "still the running request's"
    else:
        assert other.storage_hit == 0, "host copies a load still reads were given away"
        assert cache.stats.prefetch_no_room == 1
    cache.tree.check()
    release(cache, running, first)
    release(cache, other, second)
    load = cache.take_load()
    if load is not None:
        load.finish()
    cache.poll()
    assert all(n.lock_ref == 0 and n.host_pins == 0 for n in cache.tree.nodes())
    cache.tree.check()
    cache.close()
