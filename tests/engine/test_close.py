"""``Engine.close`` is bounded by ``close_timeout_s`` and leaves nothing that acts afterwards.

A storage call that never returns (a read, or a write with more queued behind it) must not hang
close: close gives up on it once ``close_timeout_s`` has passed, counts it, and when the call
finally returns, its thread applies nothing (no fetch progress, no cost sample, no backup
outcome, no further backend call) and exits.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from hicache_storage import StorageBackend, create_backend
from hicache_storage.engine.cache import TierCache
from hicache_storage.engine.cache_config import PrefetchConfig, WriteConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.model import LlamaModel
from hicache_storage.engine.policies import PrefetchPolicy
from hicache_storage.engine.radix import Tier
from hicache_storage.engine.scheduler import Request, RequestState
from hicache_storage.engine.storage_io import PrefetchState
from hicache_storage.errors import ConfigError
from hicache_storage.layers import ForwardingBackend

from ._child import CONFIG, PAGE, build_cache, stored_prompt

CLOSE_S = 1.0
"""The caches' ``close_timeout_s``."""

SLACK_S = 10.0
"""What close may take past it on a loaded two-core machine (applying outcomes, joins)."""


class Stuck(ForwardingBackend):
    """Reads (or writes) wait for ``release``, an event only the test sets; then claim success
    without touching a slot, so anything that changes afterwards changed in the engine."""

    def __init__(self, inner: StorageBackend, *, reads: bool, writes: bool) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.stuck_reads = reads
        self.stuck_writes = writes
        self.write_calls = 0

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        if not self.stuck_reads:
            return self.inner.batch_get_v1(keys, host_indices)
        self.entered.set()
        self.release.wait()
        return [True] * len(keys)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        if not self.stuck_writes:
            return self.inner.batch_set_v1(keys, host_indices)
        self.write_calls += 1
        self.entered.set()
        self.release.wait()
        return [True] * len(keys)


def close_within(engine: Engine, backend: Stuck) -> float:
    """Close ``engine`` in a thread; return its seconds, failing (then releasing) if it hangs."""
    done = threading.Event()
    began = time.monotonic()
    closer = threading.Thread(target=lambda: (engine.close(), done.set()), daemon=True)
    closer.start()
    returned = done.wait(CLOSE_S + SLACK_S)
    took = time.monotonic() - began
    if not returned:
        backend.release.set()  # let the hung close end before the test fails
        closer.join(30)
    assert returned, f"Engine.close() did not return within {CLOSE_S + SLACK_S} s"
    return took


def state(cache: TierCache) -> dict[str, Any]:
    """What a storage thread acting after close could change: stats, costs, slots, the tree."""
    pool = cache.host_pool
    assert pool is not None and cache.io is not None
    return {
        "stats": dataclasses.asdict(cache.stats),
        "costs": cache.costs.snapshot(),
        "host_free": pool.allocator.available_size(),
        "device_free": cache.device_alloc.available_size(),
        "tree": sorted(
            (n.id, n.num_tokens, n.stored, tuple(sorted(t.value for t in n.tiers)))
            for n in cache.tree.nodes()
        ),
        "host_tokens": cache.tree.tokens_on(Tier.HOST),
        "unpolled": len(cache.io.poll()),
    }


def assert_threads_end(cache: TierCache) -> None:
    deadline = time.monotonic() + SLACK_S
    while any(thread.is_alive() for thread in cache.io.threads if cache.io is not None):
        assert time.monotonic() < deadline, "a storage thread outlived its released call"
        time.sleep(0.01)


def test_close_returns_while_a_read_never_does_and_the_read_changes_nothing_after(
    model: LlamaModel,
) -> None:
    memory, prompt, _ = stored_prompt(model, 40, 3)
    backend = Stuck(memory, reads=True, writes=False)
    cache = build_cache(256, 256, backend, close_timeout_s=CLOSE_S)
    engine = Engine(model, cache)
    scheduler = engine.scheduler
    assert scheduler is not None
    request = scheduler.submit(Request(prompt, 4))  # waits for its whole fetch (wait_complete)
    fetch = request.lookup.fetch if request.lookup is not None else None
    assert fetch is not None
    deadline = time.monotonic() + SLACK_S
    while not backend.entered.is_set():
        assert time.monotonic() < deadline, "the fetch never started reading"
        scheduler.step()
    assert request.state is RequestState.WAITING
    took = close_within(engine, backend)
    assert took < CLOSE_S + SLACK_S
    assert cache.stats.calls_abandoned == 1, "the stuck read is the one call given up on"
    before = state(cache)
    fetch_before = (fetch.state, fetch.read_pages)
    assert fetch_before == (PrefetchState.READING, 0)
    backend.release.set()  # the read returns "every page read"
    assert_threads_end(cache)
    assert state(cache) == before, "the read's thread acted on its result after close"
    assert (fetch.state, fetch.read_pages) == fetch_before, "the fetch recorded the late read"
    assert cache.costs.read_s_per_page is None, "the late read was measured"
    assert cache.io is not None
    cache.io.check()  # and nothing was kept to raise
    memory.close()


def test_close_returns_while_a_write_never_does_and_no_queued_write_is_made_after(
    model: LlamaModel,
) -> None:
    memory = create_backend("memory")
    backend = Stuck(memory, reads=False, writes=True)
    page_bytes = CONFIG.layers * 2 * CONFIG.kv_heads * CONFIG.head_dim * 4 * PAGE
    cache = build_cache(
        512,
        512,
        backend,
        close_timeout_s=CLOSE_S,
        write=WriteConfig(
            batch_bytes=page_bytes,  # a page a call: the writer has more to write after one
            queue=2,  # and a full queue in front of close's stop
            linger_s=0.0,
        ),
        prefetch=PrefetchConfig(PrefetchPolicy.BEST_EFFORT),
    )
    engine = Engine(model, cache)
    for seed in range(4):
        engine.generate([3 + (i * 7 + seed) % (CONFIG.vocab_size - 3) for i in range(24)], 2)
    assert backend.entered.wait(SLACK_S), "the writer never wrote"
    assert backend.write_calls == 1
    took = close_within(engine, backend)
    assert took < CLOSE_S + SLACK_S
    stats = cache.stats
    assert stats.calls_abandoned == 1
    assert stats.pages_stored == 0 and stats.backups_failed > 0, "unwritten backups are failed"
    assert not any(node.host_pins for node in cache.tree.nodes()), "a backup still pins a page"
    before = state(cache)
    backend.release.set()
    assert_threads_end(cache)
    assert backend.write_calls == 1, "the abandoned writer went on writing queued backups"
    assert state(cache) == before, "the writer acted on its result after close"
    memory.close()


def test_close_timeout_is_a_positive_bounded_number() -> None:
    for bad in (0, -1.0, float("nan"), float("inf"), 1e300, True, "5"):
        with pytest.raises(ConfigError, match="close_timeout_s"):
            build_cache(64, 64, None, close_timeout_s=bad)
