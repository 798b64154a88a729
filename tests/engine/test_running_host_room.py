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
from hicache_storage.engine.cache_config import PrefetchConfig, WriteConfig
from hicache_storage.engine.policies import PrefetchPolicy, WritePolicy
from hicache_storage.engine.radix import Tier
from hicache_storage.engine.storage_io import Backup

from .test_engine import CONFIG, PAGE, build

PROMPT = 6 * PAGE + 1
"""Six whole pages and the token left to compute."""


@pytest.fixture
def backend() -> Iterator[StorageBackend]:
    store = create_backend("memory")
    yield store
    store.close()


def admit(cache: TierCache, prompt: list[int], generated: int = 3) -> Lease:
    """Look ``prompt`` up, wait for its fetch as the policy says, and admit it (with room for
    ``generated`` more tokens)."""
    lookup = cache.lookup(prompt)
    deadline = time.monotonic() + 10
    while not cache.ready(lookup):
        assert time.monotonic() < deadline, "the fetch never finished"
        time.sleep(0.001)
        cache.poll()
    lease = cache.acquire(lookup, len(prompt) + generated)
    assert lease is not None
    return lease


def release(cache: TierCache, lease: Lease, prompt: list[int]) -> None:
    cache.release(lease, prompt, lease.slots[: len(prompt)])


def stored_prompts(backend: StorageBackend, count: int) -> list[list[int]]:
    """Prompts whose whole pages a first engine wrote to ``backend``."""
    return stored_prompts_on(backend, 64, count=count)


def stored_prompts_on(backend: StorageBackend, host: int, *, count: int = 1) -> list[list[int]]:
    """Prompts of six pages, written to ``backend`` by an engine with ``host`` host tokens.

    With no host the engine writes nothing: the prompts are new to the store.
    """
    rng = random.Random(11)
    prompts = [[rng.randrange(CONFIG.vocab_size) for _ in range(PROMPT)] for _ in range(count)]
    if not host:
        return prompts
    writer = build(64, host, backend)
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
    cache = build(
        64,
        8 * PAGE,
        backend,
        prefetch=PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE, capacity=8 * PAGE),
    )
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


def test_a_node_larger_than_the_free_host_is_staged_in_parts(backend: StorageBackend) -> None:
    """Six computed pages, a host of four: the first four are staged, the last two once the
    first write has given the room back, and a fresh engine finds all six in storage."""
    (prompt,) = stored_prompts_on(backend, 0)
    cache = build(64, 4 * PAGE, backend)
    lease = admit(cache, prompt)
    release(cache, lease, prompt)  # the write-through finds no room for the whole node
    deadline = time.monotonic() + 10
    while cache.stats.pages_stored < 6:
        assert time.monotonic() < deadline, f"{cache.stats.pages_stored} of 6 pages stored"
        time.sleep(0.001)
        cache.poll()
    assert cache.stats.pages_staged == 6 and cache.stats.pages_dropped == 0
    path = [n for n in cache.tree.path(cache.tree.match_prefix(prompt, touch=False).last_node)]
    assert [n.num_tokens for n in path] == [4 * PAGE, 2 * PAGE], "split where the room ended"
    assert all(n.stored for n in path)
    cache.tree.check()
    cache.close()
    fresh = build(
        64,
        8 * PAGE,
        backend,
        prefetch=PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE, capacity=8 * PAGE),
    )
    assert admit(fresh, prompt).storage_hit == 6 * PAGE
    fresh.close()


def test_pages_that_leave_the_device_with_nowhere_to_go_are_counted(
    backend: StorageBackend,
) -> None:
    """Under write-back a page reaches storage only from the host; a host with no room for it
    loses it when the device needs its slots, and ``pages_dropped`` says so."""
    (first, second) = stored_prompts_on(backend, 0, count=2)
    cache = build(8 * PAGE, PAGE, backend, write=WriteConfig(WritePolicy.WRITE_BACK))
    release(cache, admit(cache, first), first)
    assert cache.stats.pages_dropped == 0
    release(cache, admit(cache, second), second)  # its slots are the first prompt's
    assert cache.stats.pages_dropped == 6
    assert cache.stats.pages_stored == 0
    cache.tree.check()
    cache.close()


def test_a_part_the_writer_refused_is_staged_again_before_the_rest(
    backend: StorageBackend,
) -> None:
    """The writer's queue refuses the first part of a node staged in parts: both parts wait
    for room, the first ahead, so storage gets the pages from the start of the prompt."""
    (prompt,) = stored_prompts_on(backend, 0)
    cache = build(64, 4 * PAGE, backend)
    assert cache.io is not None
    queue_backup = cache.io.backup
    refused: list[int] = []

    def refuse_first(job: Backup) -> bool:
        if not refused:
            refused.append(len(job.keys))
            return False
        return queue_backup(job)

    cache.io.backup = refuse_first  # type: ignore[method-assign]
    release(cache, admit(cache, prompt), prompt)
    assert refused == [4], "the first part (four pages) was offered and refused"
    deadline = time.monotonic() + 10
    while cache.stats.pages_stored < 6:
        assert time.monotonic() < deadline, f"{cache.stats.pages_stored} of 6 pages stored"
        time.sleep(0.001)
        cache.poll()
    cache.close()
    fresh = build(
        64,
        8 * PAGE,
        backend,
        prefetch=PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE, capacity=8 * PAGE),
    )
    assert admit(fresh, prompt).storage_hit == 6 * PAGE
    fresh.close()
