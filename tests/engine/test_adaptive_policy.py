"""The ``adaptive`` prefetch policy: fetch what reads faster than it computes, wait while it pays.

The decision itself is a pure function of what the engine measured (:class:`CostModel`) and of
one fetch (:class:`FetchView`); the engine tests hold storage calls at gates, so what is asserted
is who waited for what, never how long anything took.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from hicache_storage import StorageBackend
from hicache_storage.engine.cache import TierCache
from hicache_storage.engine.cache_config import PrefetchConfig, ThreadConfig, WriteConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.model import LlamaModel
from hicache_storage.engine.policies import PrefetchPolicy
from hicache_storage.engine.radix import Tier
from hicache_storage.engine.scheduler import Request, RequestState, Scheduler
from hicache_storage.engine.storage_io import PrefetchState
from hicache_storage.errors import ConfigError
from hicache_storage.keys import page_hashes
from hicache_storage.layers import ForwardingBackend
from hicache_storage.planner import rates as costs_module
from hicache_storage.planner.fetch import FetchView, adaptive_wait_s, fetch_pays
from hicache_storage.planner.rates import MIN_FOUND, READ_SAMPLES, READ_TTL_S, CostModel

from ._child import CONFIG, PAGE, build_cache, serve, stored_prompt

WAIT_S = 10.0


def costs(
    *, read_s_per_page: float | None, compute_s_per_token: float | None, requests: int = 1
) -> CostModel:
    model = CostModel(weight=1.0)
    if read_s_per_page is not None:
        model.observe_read(10, read_s_per_page * 10)
    if compute_s_per_token is not None:
        model.observe_forward(100, compute_s_per_token * 100, requests=requests)
    return model


def view(**fields: object) -> FetchView:
    base: dict[str, object] = {
        "queried": True,
        "finished": False,
        "target_pages": 10,
        "read_pages": 0,
        "elapsed_s": 0.0,
    }
    return FetchView(**{**base, **fields})  # type: ignore[arg-type]


def decide(fetch: FetchView, model: CostModel, *, block_s: float = 1.0, step_s: float = 0.0):  # type: ignore[no-untyped-def]
    return adaptive_wait_s(fetch, model, page_size=4, block_s=block_s, next_step_s=step_s)


# ---- the cost model ------------------------------------------------------------------------------


def test_cost_model_knows_nothing_before_its_first_sample() -> None:
    model = CostModel()
    assert model.snapshot() == {
        "read_s_per_page": None,
        "write_s_per_page": None,
        "query_s": None,
        "found_share": 1.0,
        "compute_s_per_token": None,
        "forward_s": None,
        "sharing": 1.0,
    }
    assert model.recompute_s(100) is None and model.recompute_cost_s(100) is None


def test_the_share_queries_find_follows_them_down_to_its_floor() -> None:
    model = CostModel(weight=0.5)
    model.observe_query(0.01)  # a query that says nothing of pages leaves the share alone
    assert model.found_share == 1.0
    model.observe_query(0.01, asked=8, found=2)
    assert model.found_share == pytest.approx(0.25)
    model.observe_query(0.01, asked=8, found=8)
    assert model.found_share == pytest.approx(0.625)
    for _ in range(20):
        model.observe_query(0.01, asked=4, found=0)
    assert model.found_share == MIN_FOUND


def test_cost_model_follows_its_samples() -> None:
    model = CostModel(weight=0.5)
    model.observe_read(4, 0.4)
    assert model.read_s_per_page == pytest.approx(0.1)
    model.observe_read(2, 0.6)
    assert model.read_s_per_page == pytest.approx(0.2)  # the median of 0.1 and 0.3
    model.observe_query(0.01)
    assert model.query_s == pytest.approx(0.01)
    model.observe_forward(200, 0.2)
    assert model.compute_s_per_token == pytest.approx(0.001)
    assert model.recompute_s(50) == pytest.approx(0.05)


def test_one_stalled_read_call_does_not_make_the_store_slow() -> None:
    """The read rate is the median of the last calls: one call stalled behind a long forward on
    a busy CPU moves it nowhere; a store that stays slow moves it within a few calls."""
    model = CostModel()
    for _ in range(READ_SAMPLES):
        model.observe_read(32, 32 * 0.0005)
    model.observe_read(4, 4 * 0.04)  # 80 times the others
    assert model.read_s_per_page == pytest.approx(0.0005)
    model.observe_read(4, 4 * 0.04)
    assert model.read_s_per_page == pytest.approx(0.0005)
    model.observe_read(4, 4 * 0.04)
    assert model.read_s_per_page == pytest.approx(0.04), "most calls slow: the store is slow"


def test_a_read_rate_no_read_has_renewed_for_long_is_forgotten() -> None:
    now = [100.0]
    model = CostModel(weight=0.5, clock=lambda: now[0])
    model.observe_read(1, 1.0)  # a store measured slow: one second a page
    now[0] += READ_TTL_S
    assert model.read_s_per_page == pytest.approx(1.0)
    now[0] += 0.001
    assert model.read_s_per_page is None  # so a fetch may measure the store again
    model.observe_read(1, 0.01)
    assert model.read_s_per_page == pytest.approx(0.01)  # a fresh rate, not a mean with 1 s


def test_recompute_is_priced_at_the_marginal_cost_of_a_token() -> None:
    model = CostModel()
    for tokens in (64, 8192, 200, 4096, 64, 1024):  # 20 ms a forward + 0.1 ms a token
        model.observe_forward(tokens, 0.02 + 1e-4 * tokens)
    assert model.compute_s_per_token == pytest.approx(1e-4)
    assert model.recompute_s(1000) == pytest.approx(0.1)
    assert model.forward_time_s(8192) == pytest.approx(0.02 + 0.8192)


def test_recompute_costs_every_request_that_shares_its_forward() -> None:
    model = CostModel(weight=1.0)
    model.observe_forward(1000, 0.1, requests=4)  # a prefill beside three decodes
    assert model.sharing == 4.0
    assert model.recompute_s(1000) == pytest.approx(0.1), "what it costs the request itself"
    assert model.recompute_cost_s(1000) == pytest.approx(0.4), "what the batch waits in all"
    model.observe_forward(1000, 0.1)
    assert model.sharing == 1.0 and model.recompute_cost_s(1000) == pytest.approx(0.1)


def test_a_fetch_that_beats_recomputing_for_the_batch_is_read_and_waited_for() -> None:
    """Reading 10 pages (40 ms) loses to one request's recompute (20 ms), not to four's (80)."""
    alone = costs(read_s_per_page=4e-3, compute_s_per_token=5e-4)
    assert not fetch_pays(10, 4, 0, alone) and decide(view(), alone) is None
    shared = costs(read_s_per_page=4e-3, compute_s_per_token=5e-4, requests=4)
    assert fetch_pays(10, 4, 0, shared)
    assert decide(view(), shared) == pytest.approx(0.04)
    assert decide(view(elapsed_s=0.05), shared) is None, "never longer than the batch's recompute"


def test_a_decode_step_times_the_forward_but_does_not_price_prefill() -> None:
    model = CostModel()
    model.observe_forward(8, 0.05)
    assert model.forward_s == pytest.approx(0.05)
    assert model.compute_s_per_token is None
    model.observe_read(0, 1.0)  # an empty read says nothing
    assert model.read_s_per_page is None


@pytest.mark.parametrize("weight", [0, -0.1, 1.5, True, "0.5", float("nan")])
def test_cost_model_refuses_a_weight_outside_zero_one(weight: object) -> None:
    with pytest.raises(ConfigError, match="weight"):
        CostModel(weight)  # type: ignore[arg-type]


# ---- the decision --------------------------------------------------------------------------------


def test_before_any_forward_was_measured_nothing_is_waited_for() -> None:
    assert decide(view(), costs(read_s_per_page=1e-6, compute_s_per_token=None)) is None


def test_a_finished_fetch_is_never_waited_for() -> None:
    assert decide(view(finished=True), costs(read_s_per_page=0, compute_s_per_token=1)) is None


def test_a_fast_store_is_waited_for_as_long_as_its_pages_take() -> None:
    # 10 pages of 4 tokens: 40 ms to recompute, 1 ms to read.
    model = costs(read_s_per_page=1e-4, compute_s_per_token=1e-3)
    assert decide(view(), model) == pytest.approx(1e-3)
    assert decide(view(read_pages=6), model) == pytest.approx(4e-4)


def test_a_slow_store_is_not_waited_for() -> None:
    model = costs(read_s_per_page=0.1, compute_s_per_token=1e-3)  # a page: 100 ms vs 4 ms
    assert decide(view(), model) is None
    assert not fetch_pays(10, 4, 0, model)


def test_a_read_in_flight_for_long_prices_an_unmeasured_store() -> None:
    model = costs(read_s_per_page=None, compute_s_per_token=1e-3)
    assert decide(view(call_s=0.001, call_pages=10), model) is not None
    assert decide(view(call_s=0.05, call_pages=10), model) is None  # one call > all of it


def test_a_fetch_queued_behind_a_slow_call_in_flight_is_not_waited_for() -> None:
    model = costs(read_s_per_page=None, compute_s_per_token=1e-3)  # 4 ms to compute a page
    # Its own read has not started: the call ahead of it, in flight for 10 ms a page so far,
    # prices the store before any read has returned.
    assert decide(view(queued_pages=5, in_flight_s_per_page=1e-4), model) is not None
    assert decide(view(queued_pages=5, in_flight_s_per_page=0.01), model) is None


def test_reads_queued_ahead_count_against_the_fetch() -> None:
    model = costs(read_s_per_page=1e-3, compute_s_per_token=1e-3)  # 1 ms vs 4 ms a page
    assert decide(view(), model) is not None
    assert decide(view(queued_pages=40), model) is None
    assert fetch_pays(10, 4, 0, model)
    assert not fetch_pays(10, 4, 40, model)


def test_a_wait_longer_than_the_scheduler_blocks_also_costs_the_next_step() -> None:
    model = costs(read_s_per_page=1e-3, compute_s_per_token=1e-3)  # 10 ms to read, 40 to compute
    assert decide(view(), model, block_s=0.02, step_s=1.0) == pytest.approx(0.01)  # blocks
    assert decide(view(), model, block_s=0.0, step_s=0.02) == pytest.approx(0.01)  # next step
    assert decide(view(), model, block_s=0.0, step_s=0.05) is None  # a step costs more


def test_no_request_waits_longer_than_recomputing_all_it_is_after() -> None:
    model = costs(read_s_per_page=None, compute_s_per_token=1e-3)  # 40 ms for the 10 pages
    assert decide(view(elapsed_s=0.039), model) is not None
    assert decide(view(elapsed_s=0.04), model) is None
    assert decide(view(queried=False, elapsed_s=0.041), model) is None


def test_an_unanswered_query_is_priced_by_the_queries_measured() -> None:
    model = costs(read_s_per_page=1e-4, compute_s_per_token=1e-3)
    model.observe_query(0.5)  # queries take half a second: longer than computing 10 pages
    assert decide(view(queried=False), model) is None
    quick = costs(read_s_per_page=1e-4, compute_s_per_token=1e-3)
    quick.observe_query(0.002)
    assert decide(view(queried=False, elapsed_s=0.001), quick) == pytest.approx(0.002)


def test_an_unanswered_query_is_waited_for_only_as_far_as_queries_find_pages() -> None:
    finding = costs(read_s_per_page=1e-4, compute_s_per_token=1e-3)  # 40 ms for the 10 pages
    missing = costs(read_s_per_page=1e-4, compute_s_per_token=1e-3)
    for model, found in ((finding, 10), (missing, 0)):
        model.observe_query(0.006, asked=10, found=found)
    # Waiting 6 ms for the answer pays when queries find their pages (40 ms to gain), not when
    # they find none (the floor: 4 ms to gain): that request is computed at once.
    assert decide(view(queried=False), finding) == pytest.approx(0.006 + 10 * 1e-4)  # + reads
    assert decide(view(queried=False), missing) is None
    # Once the query has answered, its hits are what counts, whatever earlier queries found.
    assert decide(view(queried=True), missing) is not None


def test_a_read_in_flight_for_long_stops_new_fetches_before_any_read_returned() -> None:
    model = costs(read_s_per_page=None, compute_s_per_token=1e-3)  # 4 ms to compute a page
    assert fetch_pays(10, 4, 0, model, in_flight_s_per_page=0.001)
    assert not fetch_pays(10, 4, 0, model, in_flight_s_per_page=0.01)


def test_unmeasured_rates_let_a_fetch_start() -> None:
    assert fetch_pays(10, 4, 0, CostModel())
    assert fetch_pays(10, 4, 0, costs(read_s_per_page=None, compute_s_per_token=1.0))


# ---- in the engine -------------------------------------------------------------------------------


class Gated(ForwardingBackend):
    """Hold ``batch_exists``, ``batch_get_v1`` or ``batch_set_v1`` calls until their gate opens;
    count them."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.query_gate = threading.Event()
        self.read_gate = threading.Event()
        self.write_gate = threading.Event()
        self.query_gate.set()
        self.read_gate.set()
        self.write_gate.set()
        self.reading = threading.Event()
        self.reads = 0
        self.queries = 0
        self.writes = 0
        self.query_delay_s = 0.0

    def batch_exists(self, keys: Sequence[str]) -> int:
        self.queries += 1
        time.sleep(self.query_delay_s)
        assert self.query_gate.wait(WAIT_S), "the test never opened the query gate"
        return self.inner.batch_exists(keys)

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        self.reads += 1
        self.reading.set()
        assert self.read_gate.wait(WAIT_S), "the test never opened the read gate"
        return self.inner.batch_get_v1(keys, host_indices)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        self.writes += 1
        assert self.write_gate.wait(WAIT_S), "the test never opened the write gate"
        return self.inner.batch_set_v1(keys, host_indices)


@pytest.fixture(scope="module")
def model() -> Iterator[LlamaModel]:
    yield LlamaModel(CONFIG)


@pytest.fixture
def stored(model: LlamaModel) -> Iterator[tuple[StorageBackend, list[int], list[int]]]:
    """A memory store holding a 200-token prompt's pages, the prompt and its oracle output."""
    memory, prompt, expected = stored_prompt(model, 200, 31)
    yield memory, prompt, expected
    memory.close()


def adaptive_cache(backend: StorageBackend) -> TierCache:
    return build_cache(512, 512, backend, prefetch=PrefetchConfig(PrefetchPolicy.ADAPTIVE))


def warm(scheduler: Scheduler) -> None:
    """Serve a prompt sharing nothing with the stored one, so a forward's cost is measured."""
    request = scheduler.submit(Request([1] * 130, 2))
    run(scheduler, request)
    assert scheduler.cache.costs.compute_s_per_token is not None


def run(scheduler: Scheduler, request: Request) -> None:
    serve(scheduler, request, wait_s=WAIT_S)


def unaccounted(cache: TierCache) -> int:
    """Host slots neither free nor held by the tree: those a prefetch holds."""
    pool = cache.host_pool
    assert pool is not None
    return pool.size - pool.allocator.available_size() - cache.tree.tokens_on(Tier.HOST)


def wait_slots_back(cache: TierCache, whose: str) -> None:
    """Poll until no prefetch holds host slots."""
    deadline = time.monotonic() + WAIT_S
    while unaccounted(cache):
        assert time.monotonic() < deadline, f"{whose} host slots never came back"
        time.sleep(0.005)
        cache.poll()


@pytest.fixture
def reading_pays(
    model: LlamaModel, stored: tuple[StorageBackend, list[int], list[int]]
) -> Iterator[tuple[Gated, TierCache, Scheduler]]:
    """A gated store over ``stored``, with computing priced at 1 ms a token: reading pays."""
    backend = Gated(stored[0])
    cache = adaptive_cache(backend)
    scheduler = Scheduler(model, cache)
    cache.costs.observe_forward(1000, 1.0)
    yield backend, cache, scheduler
    backend.read_gate.set()
    scheduler.close()
    cache.close()


def test_a_fast_store_is_used(
    model: LlamaModel, stored: tuple[StorageBackend, list[int], list[int]]
) -> None:
    memory, prompt, expected = stored
    cache = adaptive_cache(memory)
    scheduler = Scheduler(model, cache)
    # The tiny model computes a page faster than Python reads one, so recompute is priced as a
    # large model's would be, and steeply (0.1 s a token): a loaded machine, where a memory
    # store's page can take 20 ms to read, still finds reading it cheaper.
    cache.costs.observe_forward(1000, 100.0)
    request = scheduler.submit(Request(prompt, 4))
    run(scheduler, request)
    assert request.output == expected
    assert request.storage_hit == (len(prompt) - 1) // PAGE * PAGE
    assert cache.costs.read_s_per_page is not None
    scheduler.close()
    cache.close()


class Vanished(ForwardingBackend):
    """Storage that answers its queries but whose pages are gone when read."""

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        return [False] * len(keys)


def test_pages_that_fail_to_read_are_the_store_s_misses_not_cuts(
    model: LlamaModel, stored: tuple[StorageBackend, list[int], list[int]]
) -> None:
    memory, prompt, expected = stored
    cache = adaptive_cache(Vanished(memory))
    scheduler = Scheduler(model, cache)
    cache.costs.observe_forward(1000, 100.0)  # reading pays: computing priced at 0.1 s a token
    try:
        request = scheduler.submit(Request(prompt, 4))
        run(scheduler, request)
        assert request.output == expected and request.storage_hit == 0
        assert request.storage_found == (len(prompt) - 1) // PAGE * PAGE
        assert cache.stats.storage_misses * PAGE == request.storage_found
        assert cache.stats.prefetch_pages_cut == 0
    finally:
        scheduler.close()
        cache.close()


def test_reads_start_inside_the_forward_that_runs_when_a_query_answers(
    model: LlamaModel,
    stored: tuple[StorageBackend, list[int], list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory, prompt, expected = stored
    backend = Gated(memory)
    cache = adaptive_cache(backend)
    scheduler = Scheduler(model, cache)
    cache.costs.observe_forward(1000, 1.0)  # computing priced at 1 ms a token: reading pays
    # Held far above it: this test's real forwards (a tiny model) would price computing below
    # what reading costs on a loaded machine, and a fetch that a busy machine's reads made
    # slower than recomputing would rightly be cut (its pages computed, no storage hit).
    monkeypatch.setattr(cache.costs, "recompute_cost_s", lambda tokens: tokens * 0.05)
    running = scheduler.submit(Request([3 + i % 50 for i in range(300)], 2))
    first = running.lookup
    assert first is not None
    deadline = time.monotonic() + WAIT_S
    while first.fetch is not None and first.fetch.state is PrefetchState.QUERYING:
        assert time.monotonic() < deadline, "the first request's query never answered"
        time.sleep(0.005)
    for _ in range(20):  # queries take 50 ms (asked on a query thread) and find what is asked
        cache.costs.observe_query(0.05, asked=1, found=1)
    backend.query_gate.clear()
    waiting = scheduler.submit(Request(prompt, 4))  # its query is held while the step admits
    fetch = waiting.lookup.fetch if waiting.lookup is not None else None
    assert fetch is not None
    real = model.forward
    states: list[PrefetchState] = []

    def forward(*args: object, **kwargs: object) -> list[torch.Tensor]:
        if not states:  # the query answers after admission, while this forward runs
            backend.query_gate.set()
            until = time.monotonic() + WAIT_S
            while fetch.state is PrefetchState.QUERYING:
                assert time.monotonic() < until, "the held query never answered"
                time.sleep(0.001)
            states.append(fetch.state)
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        states.append(fetch.state)
        return out

    monkeypatch.setattr(model, "forward", forward)
    scheduler.step()
    assert running.state is not RequestState.WAITING and waiting.state is RequestState.WAITING
    assert states[0] is PrefetchState.QUERIED
    assert states[1] in (PrefetchState.READING, PrefetchState.FINISHED), (
        "the reads start between the forward's layers, not at the next step"
    )
    run(scheduler, waiting)
    assert waiting.output == expected
    assert waiting.storage_hit == (len(prompt) - 1) // PAGE * PAGE
    run(scheduler, running)
    scheduler.close()
    cache.close()


def served_with_reads_held(
    prompt: list[int], reading_pays: tuple[Gated, TierCache, Scheduler]
) -> Request:
    """Serve ``prompt`` while the store holds every read: its fetch is cut, its pages computed."""
    backend, _, scheduler = reading_pays
    backend.read_gate.clear()
    request = scheduler.submit(Request(prompt, 4))
    run(scheduler, request)  # finishes while its read is held
    return request


def test_a_slow_store_is_not_waited_for_and_its_cut_fetch_hands_back_its_slots(
    model: LlamaModel,
    stored: tuple[StorageBackend, list[int], list[int]],
    reading_pays: tuple[Gated, TierCache, Scheduler],
) -> None:
    _, prompt, expected = stored
    backend, cache, _ = reading_pays
    request = served_with_reads_held(prompt, reading_pays)
    assert backend.reading.is_set(), "the first read is how the store's speed is learnt"
    assert request.output == expected
    assert request.storage_hit == 0 and request.computed == len(prompt)
    assert unaccounted(cache) > 0, "the read in flight still holds its slots"
    time.sleep(0.3)  # the store answers late: 10 ms a page, more than computing one
    backend.read_gate.set()
    wait_slots_back(cache, "the cut fetch's")
    reads = backend.reads
    slow = cache.costs.read_s_per_page
    assert slow is not None and slow > 0.004, "measured slower than computing a page (4 ms)"
    # Now the store is known to be slow: a cache that knows so (and holds nothing of the
    # prompt itself) reads nothing of what storage could serve it. Known at 10 ms a page, not
    # so much slower than computing one that storage is bypassed (then it is not even asked).
    known = adaptive_cache(backend)
    known.costs.observe_forward(1000, 1.0)
    known.costs.observe_read(1, 0.01)
    known.costs.observe_query(1e-4, asked=1, found=1)  # quick: asked inline, answered at once
    again_scheduler = Scheduler(model, known)
    try:
        again = again_scheduler.submit(Request(list(prompt), 4))
        run(again_scheduler, again)
        assert again.output == expected
        assert again.storage_hit == 0 and backend.reads == reads
        assert again.storage_found >= len(prompt) // PAGE * PAGE - PAGE, "found, not read"
        assert known.stats.prefetch_priced_out == 1 and known.stats.prefetch_no_room == 0
        assert known.stats.storage_misses == 0, "a fetch priced out is cut, not a store's miss"
        assert known.stats.prefetch_pages_cut * PAGE == again.storage_found
        assert unaccounted(known) == 0
    finally:
        again_scheduler.close()
        known.close()


def test_pages_recomputed_over_a_cut_fetch_are_known_stored_and_not_written_again(
    stored: tuple[StorageBackend, list[int], list[int]],
    reading_pays: tuple[Gated, TierCache, Scheduler],
) -> None:
    _, prompt, expected = stored
    backend, cache, _ = reading_pays
    request = served_with_reads_held(prompt, reading_pays)  # computes pages storage holds
    assert request.storage_hit == 0 and request.output == expected
    pages = (len(prompt) - 1) // PAGE
    assert cache.stats.pages_known_stored == pages
    match = cache.tree.match_prefix(prompt[: pages * PAGE], touch=False)
    path = [n for n in cache.tree.path(match.last_node) if not n.is_root]
    assert match.matched_len == pages * PAGE and all(n.stored for n in path)
    backend.read_gate.set()
    wait_slots_back(cache, "the cut fetch's")
    cache.close()  # every queued backup is written now
    written = cache.stats.pages_stored
    assert written < len([*prompt, *expected]) // PAGE - pages + 1, (
        f"{written} pages written: the pages storage holds were written again"
    )


@pytest.mark.parametrize(
    "host_tokens, others_held",
    [(128, False), (256, True)],
    ids=["host-smaller-than-the-prefix", "host-full-of-pending-writes"],
)
def test_pages_after_a_recomputed_stored_prefix_reach_storage_through_staging(
    model: LlamaModel,
    stored: tuple[StorageBackend, list[int], list[int]],
    host_tokens: int,
    others_held: bool,
) -> None:
    memory, prompt, _ = stored
    backend = Gated(memory)
    adaptive = PrefetchConfig(PrefetchPolicy.ADAPTIVE)
    cache = build_cache(512, host_tokens, backend, prefetch=adaptive)
    scheduler = Scheduler(model, cache)
    cache.costs.observe_forward(1000, 1.0)
    # Known slow: 10 ms a page against 4 to compute one, so the stored prompt is recomputed;
    # not so slow that storage is bypassed (its pages would not be written at all). The
    # planner sheds the writes of a store whose reads do not pay: its writer here has none.
    assert cache.io is not None
    cache.io.planner = None
    cache.costs.observe_read(1, 0.01)
    cache.costs.observe_query(1e-4, asked=1, found=1)
    tail = [3 + (i * 7) % (CONFIG.vocab_size - 3) for i in range(40)]
    tokens = [*prompt, *tail]
    pool = cache.host_pool
    assert pool is not None
    backend.write_gate.clear()  # writes are held until the request has ended
    try:
        held = 0
        if others_held:  # another conversation's pages wait for storage on the host
            other = [5 + (i * 13) % (CONFIG.vocab_size - 5) for i in range(120)]
            run(scheduler, scheduler.submit(Request(other, 4)))
            held = cache.write_backlog_tokens
        assert pool.allocator.available_size() < len(prompt), "no room for the stored prompt"
        request = scheduler.submit(Request(tokens, 4))
        run(scheduler, request)
        assert request.storage_hit == 0 and cache.stats.prefetch_priced_out == 1
        staged = (len(tokens) - len(prompt)) // PAGE
        assert cache.stats.pages_staged == staged
        assert cache.write_backlog_tokens == held + staged * PAGE
        assert unaccounted(cache) == staged * PAGE, "the staging slots are outside the tree"
        backend.write_gate.set()
        deadline = time.monotonic() + WAIT_S
        while unaccounted(cache) or cache.write_backlog_tokens:
            assert time.monotonic() < deadline, "the staging slots never came back"
            time.sleep(0.005)
            cache.poll()
        match = cache.tree.match_prefix(tokens, touch=False)
        assert match.matched_len == len(tokens) and all(
            n.stored for n in cache.tree.path(match.last_node) if not n.is_root
        ), "the staged pages are known stored once written"
    finally:
        backend.write_gate.set()
        scheduler.close()
        cache.close()
    keys = cache.scheme.keys(page_hashes(tokens, PAGE))
    assert memory.batch_exists(keys) == len(keys), (
        "the pages computed after the stored prefix never reached storage"
    )


def test_a_store_far_slower_than_recompute_is_neither_asked_nor_written_until_forgotten(
    model: LlamaModel,
    stored: tuple[StorageBackend, list[int], list[int]],
    reading_pays: tuple[Gated, TierCache, Scheduler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, prompt, expected = stored
    backend, cache, scheduler = reading_pays  # 4 ms to compute a page
    cache.costs.observe_read(1, 1.0)  # a second to read one: 250 times slower
    tail = [3 + (i * 7) % (CONFIG.vocab_size - 3) for i in range(40)]
    request = scheduler.submit(Request([*prompt, *tail], 4))
    run(scheduler, request)
    assert request.output[:1] and request.storage_found == request.storage_hit == 0
    assert cache.stats.prefetch_priced_out == 1 == cache.stats.prefetches
    assert cache.stats.writes_shed >= 1
    cache.close()  # the storage threads finish what was handed to them
    assert backend.queries == 0 and backend.reads == 0, "a store that cannot pay is not asked"
    assert backend.writes == 0 and cache.stats.pages_stored == 0, "nor written to"
    # Once the slow spell is forgotten, the store is asked and read again: it is fast.
    monkeypatch.setattr(costs_module, "READ_TTL_S", 0.05)
    again_cache = adaptive_cache(backend)
    again_scheduler = Scheduler(model, again_cache)
    again_cache.costs.observe_forward(1000, 1.0)
    again_cache.costs.observe_read(1, 1.0)
    # Computing held far above a loaded machine's reads (as in the test of reads inside the
    # forward): the tiny model's real forwards would price it below them, and cut the fetch.
    monkeypatch.setattr(again_cache.costs, "recompute_cost_s", lambda tokens: tokens * 0.05)
    time.sleep(0.1)
    try:
        again = again_scheduler.submit(Request(list(prompt), 4))
        run(again_scheduler, again)
        assert again.output == expected
        assert backend.queries >= 1 and again.storage_hit == (len(prompt) - 1) // PAGE * PAGE
        assert again_cache.stats.prefetch_priced_out == 0
    finally:
        again_scheduler.close()
        again_cache.close()


def test_one_slow_read_among_measured_fast_ones_bypasses_nothing(
    model: LlamaModel,
    stored: tuple[StorageBackend, list[int], list[int]],
    reading_pays: tuple[Gated, TierCache, Scheduler],
) -> None:
    _, prompt, expected = stored
    backend, cache, scheduler = reading_pays
    for _ in range(READ_SAMPLES):
        cache.costs.observe_read(1, 1e-5)  # measured fast
    for _ in range(60):
        cache.costs.observe_forward(1000, 0.1)  # a page computes in about 0.4 ms
    backend.read_gate.clear()
    held = scheduler.submit(Request(prompt, 4))
    deadline = time.monotonic() + WAIT_S
    while not backend.reading.is_set():
        assert time.monotonic() < deadline, "the fetch never started reading"
        scheduler.step()
    time.sleep(1.0)  # calls of 32 pages in flight for a second: 15-30 ms a page
    other = scheduler.submit(
        Request([5 + (i * 13) % (CONFIG.vocab_size - 5) for i in range(60)], 4)
    )
    run(scheduler, other)
    assert cache.stats.writes_shed == 0 and cache.stats.prefetch_priced_out == 0
    backend.read_gate.set()
    run(scheduler, held)
    assert held.output == expected
    cache.close()
    assert cache.stats.pages_stored >= 60 // PAGE, "the other request's pages were written"


def test_an_unmeasured_store_is_probed_by_one_fetch_at_a_time(
    stored: tuple[StorageBackend, list[int], list[int]],
    reading_pays: tuple[Gated, TierCache, Scheduler],
) -> None:
    _, prompt, expected = stored
    backend, cache, scheduler = reading_pays
    backend.read_gate.clear()
    first = scheduler.submit(Request(prompt, 4))
    second = scheduler.submit(Request(prompt, 4))
    for request in (first, second):
        run(scheduler, request)  # both served while the first read is held
        assert request.output == expected and request.storage_hit == 0
    batches = -(-len(prompt) // (PAGE * cache.config.prefetch.read_batch_pages))
    assert 1 <= backend.reads <= batches, (
        "only the first fetch's batches were read: the second waited for them to measure the store"
    )
    backend.read_gate.set()
    wait_slots_back(cache, "the probe's")
    assert cache.costs.read_s_per_page is not None


def test_a_measured_store_is_read_by_several_fetches_at_once(
    model: LlamaModel,
    stored: tuple[StorageBackend, list[int], list[int]],
    reading_pays: tuple[Gated, TierCache, Scheduler],
) -> None:
    _, prompt, _ = stored
    prompt = prompt[:100]  # two fetches of 24 pages fit the 64 pages of prefetch capacity
    expected = Engine(model, None).generate(prompt, 4)
    backend, cache, scheduler = reading_pays
    cache.costs.observe_read(10, 0.001)  # measured: 0.1 ms a page, far quicker than computing
    backend.read_gate.clear()
    backend.query_gate.clear()
    first = scheduler.submit(Request(prompt, 4))
    second = scheduler.submit(Request(prompt, 4))
    backend.query_gate.set()
    deadline = time.monotonic() + WAIT_S
    for request in (first, second):  # both answered before a step starts any read
        fetch = request.lookup.fetch if request.lookup is not None else None
        assert fetch is not None
        while fetch.state is PrefetchState.QUERYING:
            assert time.monotonic() < deadline, "a query never answered"
            time.sleep(0.001)
    while backend.reads < 2:
        assert time.monotonic() < deadline, "the second fetch waited for the first's read"
        scheduler.step()
        time.sleep(0.001)
    backend.read_gate.set()
    for request in (first, second):
        run(scheduler, request)
        assert request.output == expected


def test_a_fetch_waits_for_prefetch_capacity_instead_of_reading_a_part(
    model: LlamaModel,
    stored: tuple[StorageBackend, list[int], list[int]],
    reading_pays: tuple[Gated, TierCache, Scheduler],
) -> None:
    memory, prompt, expected = stored
    other = [11 + (i * 17) % (CONFIG.vocab_size - 11) for i in range(len(prompt))]
    with Engine(model, build_cache(512, 512, memory)) as engine:
        other_expected = engine.generate(other, 4)
    backend, cache, scheduler = reading_pays
    assert cache.host_pool is not None
    memory.register_host_pool(cache.host_pool)  # the engine above registered its own
    pages = (len(prompt) - 1) // PAGE
    assert pages * PAGE <= cache.prefetches.capacity < 2 * pages * PAGE, "one fetch fits, not two"
    for _ in range(READ_SAMPLES):  # measured: 0.1 ms a page, far quicker than computing; the
        cache.costs.observe_read(10, 0.001)  # gated read below is one slow sample, not the median
    # Computing priced at about 50 ms a token: the second request waits for its turn however
    # slowly a loaded machine runs the first one's read and forwards.
    cache.costs.observe_forward(1000, 100.0)
    backend.read_gate.clear()
    first = scheduler.submit(Request(prompt, 4))
    second = scheduler.submit(Request(other, 4))
    fetch = second.lookup.fetch if second.lookup is not None else None
    assert fetch is not None
    deadline = time.monotonic() + WAIT_S
    while not backend.reading.is_set() or fetch.state is PrefetchState.QUERYING:
        assert time.monotonic() < deadline, "the first read or the second query never came"
        scheduler.step()
        time.sleep(0.001)
    scheduler.step()
    assert fetch.state is PrefetchState.QUERIED, "the second fetch waits for the capacity"
    backend.read_gate.set()
    for request, oracle in ((first, expected), (second, other_expected)):
        run(scheduler, request)
        assert request.output == oracle
    assert second.storage_hit == pages * PAGE, "it read every page once the first had finished"
    wait_slots_back(cache, "the fetches'")


def test_a_request_storage_cannot_serve_does_not_wait_for_the_query(
    model: LlamaModel, stored: tuple[StorageBackend, list[int], list[int]]
) -> None:
    memory, _, _ = stored
    backend = Gated(memory)
    cache = adaptive_cache(backend)
    scheduler = Scheduler(model, cache)
    # Queries measured slow are asked on a query thread (a quick store's would be asked in the
    # scheduler's own thread, which would then hold for the gate): what is tested here.
    backend.query_delay_s = 0.1
    warm(scheduler)
    query_s = cache.costs.query_s  # None when warm was served before its query was asked
    assert query_s is None or query_s >= 0.05
    backend.query_delay_s = 0.0
    backend.query_gate.clear()
    fresh = [2 + (i * 17) % (CONFIG.vocab_size - 2) for i in range(160)]
    request = scheduler.submit(Request(fresh, 3))
    run(scheduler, request)  # served while its existence query is held
    assert request.state is RequestState.FINISHED and request.storage_hit == 0
    assert request.output == model.generate_no_cache(fresh, 3)
    assert unaccounted(cache) == 0, "no host slot was taken for an unanswered query"
    backend.query_gate.set()
    scheduler.close()
    cache.close()
    assert not any(t.is_alive() for t in cache.threads)


def test_a_storage_tier_lowers_the_switch_interval_while_it_runs(
    stored: tuple[StorageBackend, list[int], list[int]],
) -> None:
    memory, _, _ = stored
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        cache = build_cache(64, 64, memory, threads=ThreadConfig(switch_interval_s=0.0005))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        cache.close()
        assert sys.getswitchinterval() == pytest.approx(0.005), "close gives it back"
        untouched = build_cache(64, 64, memory, threads=ThreadConfig(switch_interval_s=None))
        assert sys.getswitchinterval() == pytest.approx(0.005)
        untouched.close()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        without_storage = build_cache(64, 64, None)
        assert sys.getswitchinterval() == pytest.approx(0.005), "no storage threads, no change"
        without_storage.close()
    finally:
        sys.setswitchinterval(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread niceness is Linux's")
def test_storage_threads_run_at_the_configured_niceness(
    stored: tuple[StorageBackend, list[int], list[int]],
) -> None:
    memory, _, _ = stored
    own = os.getpriority(os.PRIO_PROCESS, 0)
    for nice, expected in ((max(own, 7), max(own, 7)), (None, own)):
        cache = build_cache(64, 64, memory, threads=ThreadConfig(nice=nice))
        threads = [t for t in cache.threads if isinstance(t, threading.Thread)]
        assert threads
        deadline = time.monotonic() + WAIT_S
        for thread in threads:
            assert thread.native_id is not None
            while os.getpriority(os.PRIO_PROCESS, thread.native_id) != expected:
                assert time.monotonic() < deadline, f"{thread.name} never took niceness {nice}"
                time.sleep(0.001)
        assert os.getpriority(os.PRIO_PROCESS, 0) == own, "the scheduler's thread keeps its own"
        cache.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("idle", [True, False])
def test_the_writer_alone_runs_under_sched_idle_unless_turned_off(
    stored: tuple[StorageBackend, list[int], list[int]], idle: bool
) -> None:
    memory, _, _ = stored
    cache = build_cache(64, 64, memory, threads=ThreadConfig(idle_writes=idle))
    try:
        threads = [t for t in cache.threads if isinstance(t, threading.Thread)]
        policies = {}
        deadline = time.monotonic() + WAIT_S
        for thread in threads:
            assert thread.native_id is not None
            writer = "write" in thread.name
            expected = os.SCHED_IDLE if idle and writer else os.SCHED_OTHER
            while (policy := os.sched_getscheduler(thread.native_id)) != expected:
                assert time.monotonic() < deadline, f"{thread.name} runs under policy {policy}"
                time.sleep(0.001)
            policies[thread.name] = policy
        assert sum("write" in name for name in policies) == 1 and len(policies) > 1
    finally:
        cache.close()


@pytest.mark.parametrize("value", [1, "true", None])
def test_idle_writes_that_is_not_a_bool_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"threads\.idle_writes"):
        build_cache(64, 64, None, threads=ThreadConfig(idle_writes=value))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, 20, True, 1.5, "3"])
def test_a_storage_niceness_outside_0_19_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"threads\.nice"):
        build_cache(64, 64, None, threads=ThreadConfig(nice=value))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -0.001, float("inf"), True, "0.001"])
def test_a_switch_interval_that_is_not_a_positive_number_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"threads\.switch_interval_s"):
        build_cache(64, 64, None, threads=ThreadConfig(switch_interval_s=value))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-0.01, 1, float("nan"), True, "0.02", None])
def test_a_write_linger_outside_zero_to_one_second_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"write\.linger_s"):
        build_cache(64, 64, None, write=WriteConfig(linger_s=value))  # type: ignore[arg-type]
