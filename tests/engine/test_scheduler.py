"""The scheduler: batching, chunked prefill, admission by device room, TTFT, layer-wise loads."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from hicache_storage import StorageBackend, create_backend
from hicache_storage.engine.cache import TierCache
from hicache_storage.engine.cache_config import PrefetchConfig, WriteConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.errors import InvalidRequestError
from hicache_storage.engine.loading import LayerLoad
from hicache_storage.engine.model import LlamaModel, Segment
from hicache_storage.engine.policies import PrefetchPolicy, WritePolicy
from hicache_storage.engine.radix import Tier
from hicache_storage.engine.scheduler import Request, RequestState, Scheduler
from hicache_storage.errors import ConfigError
from hicache_storage.kernels import DevicePool, KVTransfer
from hicache_storage.layers import ForwardingBackend

from ._child import CONFIG, build_cache, conversations, host_pool

NEW = 4


def oracle(model: LlamaModel, prompts: Sequence[Sequence[int]], new: int = NEW) -> list[list[int]]:
    return [model.generate_no_cache(prompt, new) for prompt in prompts]


def distinct_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Prompts that share no page (each starts with its own token)."""
    rng = random.Random(seed)
    return [
        [i] + [rng.randrange(CONFIG.vocab_size) for _ in range(length - 1)] for i in range(count)
    ]


def drive(scheduler: Scheduler, each_step: Callable[[Scheduler], None] | None = None) -> None:
    """Step until idle, calling ``each_step`` after every step; fail if it never ends.

    A step with nothing running (a request waiting for its prefetch) yields to the storage
    threads, and the bound is time, not steps, so a slow machine does not fail it.
    """
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if scheduler.idle:
            return
        scheduler.step()
        if not scheduler.running:
            time.sleep(0.001)
        if each_step is not None:
            each_step(scheduler)
    pytest.fail("the scheduler never became idle")


class RecordingModel:
    """Forward to a model, recording how many new tokens each forward took."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.config = model.config
        self.device = model.device
        self.new_tokens: list[int] = []

    def forward(self, segments: Sequence[Segment], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        self.new_tokens.append(sum(int(s.tokens.numel()) for s in segments))
        return self.model.forward(segments, *args, **kwargs)


def assert_clean(cache: TierCache) -> None:
    cache.tree.check()
    assert cache.tree.locked_tokens == 0
    assert all(node.host_pins == 0 for node in cache.tree.nodes())


# ---- batching and chunked prefill --------------------------------------------------------------


def test_requests_submitted_together_run_batched_and_give_the_tokens_of_recompute(
    model: LlamaModel,
) -> None:
    prompts = conversations(rounds=2, clients=3, seed=1)
    expected = oracle(model, prompts)
    cache = build_cache(256, 256, None)
    scheduler = Scheduler(model, cache)
    requests = [scheduler.submit(Request(p, NEW)) for p in prompts]
    running: list[int] = []
    drive(scheduler, lambda s: running.append(len(s.running)))
    assert [r.output for r in requests] == expected
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert max(running) > 1, "several requests shared a forward"
    assert scheduler.forwards < len(prompts) * NEW
    assert_clean(cache)


def test_engine_serve_runs_a_round_of_three_clients_at_once(model: LlamaModel) -> None:
    rounds = conversations(rounds=2, clients=3, seed=2)
    expected = oracle(model, rounds)
    cache = build_cache(128, 128, None)
    with Engine(model, cache) as engine:
        first = engine.serve([Request(p, NEW) for p in rounds[:3]])
        second = engine.serve([Request(p, NEW) for p in rounds[3:]])
    assert [r.output for r in first + second] == expected
    assert sum(r.device_hit + r.host_hit for r in second) > 0, "round 2 reused round 1"
    assert_clean(cache)


def test_chunked_prefill_of_three_tokens_takes_several_forwards(model: LlamaModel) -> None:
    (prompt,) = distinct_prompts(1, 20, seed=3)
    cache = build_cache(64, 0, None)
    with Engine(model, cache, chunk_tokens=3) as engine:
        assert engine.generate(prompt, 3) == model.generate_no_cache(prompt, 3)
        assert engine.scheduler is not None
        assert engine.scheduler.forwards == 7 + 2  # ceil(20 / 3) prefill steps, then 2 decodes


def test_chunked_prefill_shares_each_forward_with_decoding_requests(model: LlamaModel) -> None:
    prompts = distinct_prompts(4, 13, seed=4)
    cache = build_cache(256, 0, None)
    scheduler = Scheduler(model, cache, chunk_tokens=3)
    recorder = RecordingModel(model)
    scheduler.model = recorder  # type: ignore[assignment]
    requests = [scheduler.submit(Request(p, NEW)) for p in prompts]
    drive(scheduler)
    assert [r.output for r in requests] == oracle(model, prompts)
    # No forward takes more than 3 new tokens, unless more than 3 requests decode at once.
    assert all(n <= max(3, len(prompts)) for n in recorder.new_tokens)
    assert sum(n <= 3 for n in recorder.new_tokens) >= sum(len(p) for p in prompts) // 3
    assert_clean(cache)


# ---- admission ---------------------------------------------------------------------------------


def test_admission_is_bounded_by_device_room_and_evicts(model: LlamaModel) -> None:
    # Each request holds 20 + 4 - 1 = 23 slots, 24 in whole pages: the pool fits two.
    prompts = distinct_prompts(6, 20, seed=5)
    cache = build_cache(48, 256, None, write=WriteConfig(WritePolicy.WRITE_BACK))
    scheduler = Scheduler(model, cache)
    requests = [scheduler.submit(Request(p, NEW)) for p in prompts]
    running: list[int] = []

    def check(s: Scheduler) -> None:
        running.append(len(s.running))
        held = sum(int(r.lease.slots.numel()) for r in s.running if r.lease is not None)
        assert held <= cache.device_pool.size

    drive(scheduler, check)
    assert [r.output for r in requests] == oracle(model, prompts)
    assert max(running) == 2
    # Write-back copies a page to the host only when it is evicted from the device.
    assert cache.stats.pages_backed_up > 0 and cache.tree.tokens_on(Tier.HOST) > 0
    assert_clean(cache)


def test_max_running_bounds_the_batch(model: LlamaModel) -> None:
    prompts = distinct_prompts(3, 9, seed=6)
    scheduler = Scheduler(model, build_cache(256, 0, None), max_running=1)
    requests = [scheduler.submit(Request(p, NEW)) for p in prompts]
    running: list[int] = []
    drive(scheduler, lambda s: running.append(len(s.running)))
    assert [r.output for r in requests] == oracle(model, prompts)
    assert max(running) == 1
    assert scheduler.forwards == 3 * NEW


def test_a_request_that_can_never_fit_is_refused_at_submit(model: LlamaModel) -> None:
    scheduler = Scheduler(model, build_cache(16, 0, None))
    with pytest.raises(InvalidRequestError, match="needs 24 device slots; the pool has 16"):
        scheduler.submit(Request(list(range(20)), 4))
    with pytest.raises(InvalidRequestError, match="at least 1"):
        scheduler.submit(Request([1, 2, 3], 0))
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        scheduler.submit(Request([], 2))
    assert scheduler.idle
    fits = scheduler.submit(Request(list(range(12)), 4))  # 15 slots: 16 in whole pages
    drive(scheduler)
    assert fits.output == model.generate_no_cache(list(range(12)), 4)


@pytest.mark.parametrize("option", ["chunk_tokens", "max_running"])
@pytest.mark.parametrize("value", [0, -1, True])
def test_scheduler_refuses_a_bound_that_is_not_a_positive_int(
    model: LlamaModel, option: str, value: object
) -> None:
    with pytest.raises(ConfigError, match=option):
        Scheduler(model, build_cache(16, 0, None), **{option: value})  # type: ignore[arg-type]


# ---- TTFT stamps -------------------------------------------------------------------------------


def test_ttft_stamps_are_set_and_ordered(model: LlamaModel) -> None:
    ticks = iter(range(1, 1_000_000))
    scheduler = Scheduler(
        model, build_cache(256, 0, None), chunk_tokens=4, clock=lambda: float(next(ticks))
    )
    prompts = distinct_prompts(3, 10, seed=7)
    requests = [scheduler.submit(Request(p, NEW)) for p in prompts]
    single = scheduler.submit(Request(prompts[0][:5], 1))
    late = scheduler.submit(Request(prompts[1][:6], 2), arrival=0.5)
    assert late.arrival == 0.5
    assert all(r.first_token_at is None and r.ttft_s is None for r in requests)
    drive(scheduler)
    for r in [*requests, single, late]:
        assert r.first_token_at is not None and r.finished_at is not None
        assert r.arrival <= r.first_token_at <= r.finished_at
        assert r.ttft_s == r.first_token_at - r.arrival
    for r in requests:
        assert r.first_token_at is not None and r.finished_at is not None
        assert r.first_token_at > r.arrival, "a 10-token prompt in 4-token chunks takes steps"
        assert r.finished_at > r.first_token_at, "three more tokens take three more steps"
    assert single.finished_at == single.first_token_at, "one token: done with the first"
    firsts = [r.first_token_at or 0.0 for r in requests]
    assert firsts == sorted(firsts), "admitted in arrival order, prefilled in that order"


def test_a_wait_after_the_fetch_finished_is_queue_not_storage(model: LlamaModel) -> None:
    """A query that found nothing ends the storage wait; waiting for the scheduler's turn after
    it (a forward in flight, here a sleep) counts as queue."""
    cache = build_cache(256, 256, create_backend("memory"))
    scheduler = Scheduler(model, cache)
    request = scheduler.submit(Request(distinct_prompts(1, 12, seed=11)[0], NEW))
    fetch = None if request.lookup is None else request.lookup.fetch
    assert fetch is not None, "a prompt of whole pages asks storage"
    deadline = time.monotonic() + 10
    while fetch.finished_at is None:
        assert time.monotonic() < deadline, "the existence query never answered"
        time.sleep(0.001)
    busy_s = 0.2
    time.sleep(busy_s)  # the scheduler is busy elsewhere
    drive(scheduler)
    timings = request.timings
    assert timings is not None and fetch.hit_pages == 0
    assert timings["storage_query"] + timings["storage_read"] < busy_s / 2
    assert timings["queue"] >= busy_s * 0.9
    cache.close()


@pytest.mark.parametrize(
    ("states", "budget_s"),
    [
        ((RequestState.PREFILL, RequestState.PREFILL, RequestState.DECODE), 0.3 / 3),
        ((RequestState.DECODE, RequestState.DECODE), 0.3),
        ((), 0.005),
    ],
    ids=["two-prefilling", "only-decodes", "idle"],
)
def test_the_block_for_landing_fetches_is_the_forward_they_would_miss_shared_by_first_tokens(
    model: LlamaModel,
    monkeypatch: pytest.MonkeyPatch,
    states: tuple[RequestState, ...],
    budget_s: float,
) -> None:
    """Missing a step costs a fetching request the next forward; blocking for it costs each
    prefilling request as much first-token time (decodes have had theirs); one budget a step."""
    cache = build_cache(256, 256, create_backend("memory"))
    scheduler = Scheduler(model, cache)
    prompts = distinct_prompts(2 + len(states), 12, seed=12)
    for prompt, state in zip(prompts, states, strict=False):
        running = Request(prompt, NEW)
        running.state = state
        scheduler.running.append(running)
    first, second = (scheduler.submit(Request(p, NEW)) for p in prompts[len(states) :])
    monkeypatch.setattr(scheduler, "_next_forward_s", lambda: 0.3)
    offered: list[tuple[int, float]] = []

    def ready(lookup: object, *, block_s: float = 0.0, next_step_s: float = 0.0) -> bool:
        offered.append((1 if lookup is first.lookup else 2, block_s))
        if lookup is first.lookup:
            time.sleep(budget_s / 2)  # the first waiting request blocks for half the budget
        return False

    monkeypatch.setattr(scheduler.cache, "ready", ready)
    scheduler._admit()

    assert [who for who, _ in offered] == [1, 2]
    assert budget_s * 0.9 <= offered[0][1] <= budget_s
    assert offered[1][1] <= budget_s / 2
    assert list(scheduler.waiting) == [first, second]
    scheduler.running.clear()
    cache.close()


# ---- layer-wise loads --------------------------------------------------------------------------


def _rows(pool: DevicePool, layer: int, slots: torch.Tensor) -> list[torch.Tensor]:
    return [pool.rows(kv, layer)[slots] for kv in range(pool.num_kv)]


def test_a_cpu_layer_load_copies_exactly_the_layer_waited_for() -> None:
    c = CONFIG
    device = DevicePool.mha(32, c.layers, c.kv_heads, c.head_dim, c.dtype)
    reference = DevicePool.mha(32, c.layers, c.kv_heads, c.head_dim, c.dtype)
    for pool in (device, reference):
        for part in pool.buffers:
            for tensor in part:
                tensor.zero_()
    host = host_pool(32)
    generator = torch.Generator().manual_seed(0)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=generator))
    host_slots = torch.arange(8, 16)
    device_slots = torch.tensor([20, 21, 22, 23, 4, 5, 6, 7])
    KVTransfer(reference, host).load(host_slots, device_slots)
    assert c.layers == 3

    load = LayerLoad(KVTransfer(device, host), host_slots, device_slots)
    assert load.tokens == 8 and load.layers == 3
    everything = torch.arange(32)
    untouched = torch.tensor([i for i in range(32) if i not in set(device_slots.tolist())])

    def loaded(layer: int) -> bool:
        return all(
            torch.equal(a, b)
            for a, b in zip(
                _rows(device, layer, everything), _rows(reference, layer, everything), strict=True
            )
        )

    def empty(layer: int) -> bool:
        return all(not rows.any() for rows in _rows(device, layer, everything))

    assert all(empty(layer) for layer in range(3)), "nothing is copied before the model asks"
    load.wait(0)
    assert loaded(0) and empty(1) and empty(2)
    load.wait(0)  # a layer already waited for is not copied again
    load.wait(1)
    assert loaded(0) and loaded(1) and empty(2)
    timing = load.timing()  # finishes the load
    assert loaded(2)
    assert timing.layers == 3 and len(timing.per_layer_exposed_s) == 3
    assert timing.load_s == timing.exposed_s == pytest.approx(sum(timing.per_layer_exposed_s))
    assert all(not rows.any() for layer in range(3) for rows in _rows(device, layer, untouched))


def test_a_layer_wait_skipping_ahead_copies_every_layer_up_to_it() -> None:
    c = CONFIG
    device = DevicePool.mha(16, c.layers, c.kv_heads, c.head_dim, c.dtype)
    for part in device.buffers:
        for tensor in part:
            tensor.zero_()
    host = host_pool(16)
    host.kv_buffer.fill_(1.0)
    load = LayerLoad(KVTransfer(device, host), torch.arange(4), torch.arange(4, 8))
    load.wait(1)
    assert [bool(device.rows(0, layer)[4:8].all()) for layer in range(3)] == [True, True, False]
    assert len(load.timing().per_layer_exposed_s) == 3


def test_host_hits_are_loaded_layer_by_layer_into_the_forward(model: LlamaModel) -> None:
    prompts = distinct_prompts(3, 20, seed=8)
    again = [*prompts[0], 7, 7, 7, 7]  # prompt 0 and more: its prefix is on the host by now
    cache = build_cache(48, 256, None)
    waits: list[list[int]] = []
    take_load = cache.take_load

    def recording_take_load() -> LayerLoad | None:
        load = take_load()
        if load is not None:
            layers: list[int] = []
            waits.append(layers)
            wait = load.wait

            def recording_wait(layer: int) -> None:
                layers.append(layer)
                wait(layer)

            load.wait = recording_wait  # type: ignore[method-assign]
        return load

    cache.take_load = recording_take_load  # type: ignore[method-assign]
    with Engine(model, cache) as engine:
        outputs = [engine.generate(p, NEW) for p in prompts]
        assert cache.stats.loads == 0 and cache.stats.host_hit_tokens == 0
        outputs.append(engine.generate(again, NEW))
    assert outputs == oracle(model, [*prompts, again])
    stats = cache.stats
    assert stats.host_hit_tokens > 0 and stats.pages_loaded > 0
    assert stats.loads == len(waits) >= 1
    assert stats.layer_loads == CONFIG.layers * stats.loads
    assert all(layers == list(range(CONFIG.layers)) for layers in waits), "one wait per layer"
    assert stats.load_s >= 0 and stats.exposed_load_s >= 0


# ---- close -------------------------------------------------------------------------------------


class GatedReads(ForwardingBackend):
    """Hold every ``batch_get_v1`` until the gate opens."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return self.inner.batch_get_v1(keys, host_indices)


def test_close_cancels_waiting_prefetches_and_frees_their_host_slots(model: LlamaModel) -> None:
    (prompt,) = distinct_prompts(1, 40, seed=9)
    memory = create_backend("memory")
    with Engine(model, build_cache(256, 256, memory)) as engine:
        engine.generate(prompt, NEW)  # storage holds the prompt's pages once this engine closes

    backend = GatedReads(memory)
    cache = build_cache(
        256, 256, backend, prefetch=PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE, read_batch_pages=1)
    )
    assert cache.host_pool is not None
    scheduler = Scheduler(model, cache)
    head = scheduler.submit(Request(prompt[:12], NEW))  # brings the first pages to the host
    drive(scheduler)
    assert head.storage_hit > 0
    pool = cache.host_pool

    def unaccounted() -> int:
        """Host slots neither free nor held by the tree: those a prefetch holds."""
        return pool.size - pool.allocator.available_size() - cache.tree.tokens_on(Tier.HOST)

    assert unaccounted() == 0
    deadline = time.monotonic() + 10
    while any(node.host_pins for node in cache.tree.nodes()):  # the head's backups are written
        assert time.monotonic() < deadline, "a backup never finished"
        time.sleep(0.005)
        cache.poll()

    backend.gate.clear()
    backend.entered.clear()
    waiting = scheduler.submit(Request(prompt, NEW))
    lookup = waiting.lookup
    assert lookup is not None and lookup.fetch is not None and not lookup.anchor.is_root
    assert lookup.anchor.host_pins == 0, "nothing is pinned before storage says what it holds"
    assert unaccounted() == 0, "no host slot is taken before storage says what it holds"
    deadline = time.monotonic() + 10
    while unaccounted() == 0:  # the query answers; the next poll gives the hit pages slots
        assert time.monotonic() < deadline, "the existence query never answered"
        time.sleep(0.005)
        cache.poll()
    assert unaccounted() == (len(prompt) - 1) // 4 * 4 - 12, "the pages after the anchor"
    assert lookup.anchor.host_pins == 1, "the prefetch pins the node it continues"
    assert backend.entered.wait(10)  # the read thread is inside the first read
    other = scheduler.submit(Request(distinct_prompts(2, 9, seed=10)[1], NEW))
    deadline = time.monotonic() + 10
    while other.state is not RequestState.FINISHED:  # a later request passes the waiting one
        assert time.monotonic() < deadline
        scheduler.step()
    assert waiting.state is RequestState.WAITING

    scheduler.close()
    assert scheduler.idle and lookup.fetch is None
    assert lookup.anchor.host_pins == 0, "the anchor is unpinned"
    backend.gate.set()  # the read in flight returns; its slots come back once it has
    deadline = time.monotonic() + 10
    while unaccounted():
        assert time.monotonic() < deadline, "the prefetch's host slots never came back"
        time.sleep(0.005)
        cache.poll()
    cache.close()
    assert not any(t.is_alive() for t in cache.threads)
    assert_clean(cache)
    memory.close()
