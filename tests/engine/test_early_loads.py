"""Early loads: a waiting request's fetched pages reach the device while its later pages are read.

Storage reads are let through one call at a time, so what is asserted is which pages were on
the device at which point, that every early slot ends in the tree or back in the allocator,
and that the tokens are those of recompute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from hicache_storage import StorageBackend
from hicache_storage.engine.cache import TierCache
from hicache_storage.engine.cache_config import PrefetchConfig, TransferConfig
from hicache_storage.engine.model import LlamaModel
from hicache_storage.engine.policies import PrefetchPolicy
from hicache_storage.engine.radix import Tier
from hicache_storage.engine.scheduler import Request, RequestState, Scheduler
from hicache_storage.engine.storage_io import PrefetchState
from hicache_storage.errors import ConfigError
from hicache_storage.layers import ForwardingBackend

from ._child import CONFIG, PAGE, build_cache, serve, stored_prompt

WAIT_S = 10.0
BATCH = 3
"""Pages per storage read: the prompt below is read in several calls."""


class Stepped(ForwardingBackend):
    """Let ``batch_get_v1`` calls through only as the test hands out permits."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.permits = threading.Semaphore(0)
        self.open = threading.Event()

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        while not self.open.is_set():
            if self.permits.acquire(timeout=0.01):
                break
        return self.inner.batch_get_v1(keys, host_indices)


@pytest.fixture(scope="module")
def model() -> Iterator[LlamaModel]:
    yield LlamaModel(CONFIG)


@pytest.fixture
def stored(model: LlamaModel) -> Iterator[tuple[StorageBackend, list[int], list[int]]]:
    """A memory store holding a 60-token prompt's pages, the prompt and its oracle output."""
    memory, prompt, expected = stored_prompt(model, 61, 29)
    yield memory, prompt, expected
    memory.close()


def fresh_cache(
    backend: StorageBackend, device_tokens: int = 512, *, early_loads: bool = True
) -> TierCache:
    prefetch = PrefetchConfig(
        PrefetchPolicy.WAIT_COMPLETE, read_batch_pages=BATCH, early_loads=early_loads
    )
    return build_cache(device_tokens, 512, backend, prefetch=prefetch)


def device_unaccounted(cache: TierCache) -> int:
    """Device slots neither free nor the tree's: those early loads and leases hold."""
    free = cache.device_alloc.available_size()
    return cache.device_pool.size - free - cache.tree.tokens_on(Tier.DEVICE)


def wait_read(cache: TierCache, request: Request, pages: int) -> None:
    """Poll the cache until ``request``'s fetch has read ``pages`` pages, then once more."""
    deadline = time.monotonic() + WAIT_S
    assert request.lookup is not None
    fetch = request.lookup.fetch
    assert fetch is not None
    while fetch.read_pages < pages:
        assert time.monotonic() < deadline, f"the fetch never read {pages} pages"
        cache.poll()  # gives the answered query its host slots
        time.sleep(0.002)
    cache.poll()


def device_kv(cache: TierCache, slots: torch.Tensor) -> list[torch.Tensor]:
    pool = cache.device_pool
    return [pool.rows(0, layer)[slots] for layer in range(pool.layer_num)]


def test_pages_read_while_the_request_waits_reach_the_device_before_it_is_admitted(
    model: LlamaModel, stored: tuple[StorageBackend, list[int], list[int]]
) -> None:
    memory, prompt, expected = stored
    backend = Stepped(memory)
    cache = fresh_cache(backend)
    scheduler = Scheduler(model, cache)
    pages = (len(prompt) - 1) // PAGE
    request = scheduler.submit(Request(prompt, 4))
    backend.permits.release()
    wait_read(cache, request, BATCH)
    scheduler.step()
    assert request.state is RequestState.WAITING
    assert request.lookup is not None and request.lookup.fetch is not None
    assert request.lookup.fetch.state is PrefetchState.READING, "later pages are still unread"
    early = request.lookup.early
    assert early is not None and early.tokens == BATCH * PAGE
    assert cache.stats.pages_loaded_early == BATCH
    host = cache.host_pool
    assert host is not None
    fetched = request.lookup.fetch.host_indices
    assert fetched is not None
    for layer, on_device in enumerate(device_kv(cache, early.slots)):
        on_host = host.k_buffer[layer][fetched[: BATCH * PAGE]]
        assert torch.equal(on_device, on_host.reshape(on_device.shape))
    backend.open.set()
    wait_read(cache, request, pages)
    serve(scheduler, request)
    assert request.output == expected
    assert request.storage_hit == pages * PAGE
    assert cache.stats.pages_loaded_early == pages, "every page read went to the device early"
    assert cache.stats.pages_loaded == 0, "nothing was left to load layer by layer"
    assert cache.stats.early_pages_dropped == 0
    scheduler.close()
    cache.close()
    assert device_unaccounted(cache) == 0
    cache.tree.check()


def test_without_early_loads_the_pages_load_layer_by_layer_to_the_same_tokens(
    model: LlamaModel, stored: tuple[StorageBackend, list[int], list[int]]
) -> None:
    memory, prompt, expected = stored
    cache = fresh_cache(memory, early_loads=False)
    scheduler = Scheduler(model, cache)
    request = scheduler.submit(Request(prompt, 4))
    serve(scheduler, request)
    assert request.output == expected
    pages = (len(prompt) - 1) // PAGE
    assert (cache.stats.pages_loaded_early, cache.stats.pages_loaded) == (0, pages)
    scheduler.close()
    cache.close()


def test_a_cancelled_request_gives_its_early_slots_back(
    model: LlamaModel, stored: tuple[StorageBackend, list[int], list[int]]
) -> None:
    memory, prompt, _ = stored
    backend = Stepped(memory)
    cache = fresh_cache(backend)
    scheduler = Scheduler(model, cache)
    free = cache.device_alloc.available_size()
    request = scheduler.submit(Request(prompt, 4))
    backend.permits.release()
    wait_read(cache, request, BATCH)
    assert cache.device_alloc.available_size() == free - BATCH * PAGE
    scheduler.fail(request, RuntimeError("the client went away"))
    assert cache.device_alloc.available_size() == free
    assert cache.stats.early_pages_dropped == BATCH
    backend.open.set()
    scheduler.close()
    cache.close()
    assert device_unaccounted(cache) == 0


def test_an_admission_that_needs_the_room_takes_it_from_a_waiting_requests_early_loads(
    model: LlamaModel, stored: tuple[StorageBackend, list[int], list[int]]
) -> None:
    memory, prompt, expected = stored
    backend = Stepped(memory)
    cache = fresh_cache(backend, device_tokens=96)
    scheduler = Scheduler(model, cache)
    waiting = scheduler.submit(Request(prompt, 4))
    backend.permits.release()
    wait_read(cache, waiting, BATCH)
    assert cache.stats.pages_loaded_early == BATCH
    other = [3 + (i * 13) % (CONFIG.vocab_size - 3) for i in range(89)]
    admitted = scheduler.submit(Request(other, 4))  # needs 92 of the 96 slots: more than are free
    serve(scheduler, admitted)
    assert admitted.output == model.generate_no_cache(other, 4)
    assert cache.stats.early_pages_dropped >= BATCH, "the early copies gave their room back"
    backend.open.set()
    serve(scheduler, waiting)
    assert waiting.output == expected
    scheduler.close()
    cache.close()
    assert device_unaccounted(cache) == 0
    cache.tree.check()


def test_pages_the_device_gained_meanwhile_give_their_early_slots_back(
    model: LlamaModel, stored: tuple[StorageBackend, list[int], list[int]]
) -> None:
    memory, prompt, _ = stored
    cache = fresh_cache(memory)
    cache.bind_model(model.identity)  # the stored pages' keys name the model
    pages = (len(prompt) - 1) // PAGE
    first, second = cache.lookup(prompt), cache.lookup(prompt)
    deadline = time.monotonic() + WAIT_S
    for lookup in (first, second):
        assert lookup.fetch is not None
        while lookup.fetch.state is not PrefetchState.FINISHED:
            assert time.monotonic() < deadline, "a fetch never finished"
            cache.poll()
            time.sleep(0.002)
    cache.poll()
    assert cache.stats.pages_loaded_early == 2 * pages
    total = len(prompt) + 3
    first_lease = cache.acquire(first, total)
    second_lease = cache.acquire(second, total)
    assert first_lease is not None and second_lease is not None
    assert cache.take_load() is None
    assert second_lease.device_hit == pages * PAGE, "the first's early copies serve the second"
    assert cache.stats.early_pages_dropped == pages
    for lease in (first_lease, second_lease):
        cache.release(lease, prompt[: lease.cached], lease.slots[: lease.cached])
    cache.close()
    assert device_unaccounted(cache) == 0
    cache.tree.check()


@pytest.mark.parametrize(
    ("group", "name", "value"),
    [(PrefetchConfig, "early_loads", 1), (TransferConfig, "sms", 0), (TransferConfig, "sms", True)],
)
def test_bad_early_load_options_are_refused(group: type, name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=name):
        group(**{name: value})
