"""Bad requests are refused before admission; a request that fails mid-serve fails alone.

After every refusal or failure the tree, the pools and the locks are consistent and the engine
serves the next request with the tokens of recompute.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from hicache_storage import StorageBackend, create_backend
from hicache_storage.engine.cache import TierCache
from hicache_storage.engine.cache_config import PrefetchConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.errors import (
    InvalidRequestError,
    RequestFailedError,
    RequestTypeError,
    StorageBugError,
)
from hicache_storage.engine.model import LlamaModel, Segment
from hicache_storage.engine.policies import PrefetchPolicy
from hicache_storage.engine.radix import Tier
from hicache_storage.engine.scheduler import Request, RequestState, Scheduler
from hicache_storage.layers import ForwardingBackend

from ._child import CONFIG, PAGE, build_cache, conversations

NEW = 4
VOCAB = CONFIG.vocab_size


def assert_consistent(cache: TierCache) -> None:
    """Tree invariants hold, nothing is locked or pinned, and every slot is free or indexed.

    A backup still being written pins its host copy until it is done, so pins are given the
    background writes' time to drain; a pin left after that is a leak.
    """
    cache.poll()
    cache.tree.check()
    assert cache.tree.locked_tokens == 0
    wait_for(
        lambda: not any(node.host_pins for node in cache.tree.nodes()), cache, "host pins gone"
    )
    device = cache.device_alloc.available_size() + cache.tree.tokens_on(Tier.DEVICE)
    assert device == cache.device_pool.size, "a device slot is neither free nor in the tree"
    pool = cache.host_pool
    if pool is not None:
        host = pool.allocator.available_size() + cache.tree.tokens_on(Tier.HOST)
        assert host == pool.size, "a host slot is neither free nor in the tree"


def wait_for(condition: Any, cache: TierCache, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)
        cache.poll()


class GatedReads(ForwardingBackend):
    """Holds every ``batch_get_v1`` until the gate opens."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return self.inner.batch_get_v1(keys, host_indices)


# -- item 4: a short prefetch against a prefix computed meanwhile ---------------------------------


def test_a_short_prefetch_of_a_prefix_computed_meanwhile_is_admitted(model: LlamaModel) -> None:
    """A fetch reads 2 pages while another request computes the same 10 pages, which are then
    evicted to the host: the fetched pages split that host node under the waiting request."""
    prompt = [5, *range(100, 139)]  # 40 tokens: 9 usable pages
    other = [6, *range(200, 239)]
    memory = create_backend("memory")
    with Engine(model, build_cache(256, 256, memory)) as engine:
        engine.generate(prompt, NEW)  # storage holds the prompt's pages
    gated = GatedReads(memory)
    cache = build_cache(
        48, 128, gated, prefetch=PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE, capacity=2 * PAGE)
    )
    scheduler = Engine(model, cache).scheduler
    assert scheduler is not None
    waiting = scheduler.submit(Request(prompt, NEW))
    wait_for(gated.entered.is_set, cache, "the capped prefetch never read its 2 pages")
    twin = scheduler.submit(Request(prompt, NEW))  # no prefetch room left: computes it all
    while twin.state is not RequestState.FINISHED:
        scheduler.step()
    third = scheduler.submit(Request(other, NEW))  # evicts the twin's pages to the host
    while third.state is not RequestState.FINISHED:
        scheduler.step()
    match = cache.tree.match_prefix(prompt[:36], touch=False)
    assert (match.device_len, match.host_len) == (0, 36), "the twin's pages are on the host only"
    assert waiting.state is RequestState.WAITING
    gated.gate.set()
    deadline = time.monotonic() + 10
    while not scheduler.idle:
        assert time.monotonic() < deadline, "the waiting request was never served"
        scheduler.step()
    expected = model.generate_no_cache(prompt, NEW)
    assert waiting.state is RequestState.FINISHED, waiting.error
    assert waiting.output == twin.output == expected
    assert third.output == model.generate_no_cache(other, NEW)
    assert waiting.cached_tokens > 0
    scheduler.close()
    cache.close()
    assert_consistent(cache)
    memory.close()


# -- item 4: an unexpected error fails one request, the others are served -------------------------


def test_an_error_while_admitting_one_request_fails_it_alone(
    model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = conversations(rounds=2, clients=2, seed=31)
    memory = create_backend("memory")
    with Engine(model, build_cache(256, 256, memory)) as engine:
        engine.serve([Request(p, NEW) for p in prompts[:2]])  # storage holds round 1
    cache = build_cache(64, 64, memory)
    real = cache.transfers.alloc_device
    calls = {"n": 0}

    def alloc_device(count: int) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:  # the second device allocation: midway through an admission
            raise RuntimeError("injected allocation failure")
        return real(count)

    monkeypatch.setattr(cache.transfers, "alloc_device", alloc_device)
    with Engine(model, cache) as engine:
        served = engine.serve([Request(p, NEW) for p in prompts[2:]])
        failed = [r for r in served if r.state is RequestState.FAILED]
        assert len(failed) == 1 and isinstance(failed[0].error, RequestFailedError)
        assert "injected allocation failure" in str(failed[0].error)
        assert isinstance(failed[0].error.__cause__, RuntimeError)
        for request in served:
            if request not in failed:
                assert request.output == model.generate_no_cache(request.prompt, NEW)
        assert_consistent(cache)
        again = failed[0].prompt
        assert engine.generate(again, NEW) == model.generate_no_cache(again, NEW)
    assert_consistent(cache)


class PoisonedModel:
    """The model, except that a forward over a segment holding ``poison`` raises."""

    def __init__(self, model: LlamaModel, poison: int) -> None:
        self.model = model
        self.config = model.config
        self.device = model.device
        self.poison = poison

    def forward(self, segments: Sequence[Segment], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        if any(bool((s.tokens == self.poison).any()) for s in segments):
            raise RuntimeError("injected forward failure")
        return self.model.forward(segments, *args, **kwargs)


def test_a_forward_that_fails_for_one_request_fails_only_that_one(model: LlamaModel) -> None:
    prompts = conversations(rounds=1, clients=3, seed=32)
    poison = VOCAB - 1
    bad = [*prompts[1][:5], poison, *prompts[1][5:]]
    cache = build_cache(256, 256, None)
    with Engine(model, cache) as engine:
        assert engine.scheduler is not None
        engine.scheduler.model = PoisonedModel(model, poison)  # type: ignore[assignment]
        served = engine.serve([Request(p, NEW) for p in [prompts[0], bad, prompts[2]]])
        assert [r.state for r in served] == [
            RequestState.FINISHED,
            RequestState.FAILED,
            RequestState.FINISHED,
        ]
        assert served[0].output == model.generate_no_cache(prompts[0], NEW)
        assert served[2].output == model.generate_no_cache(prompts[2], NEW)
        with pytest.raises(RequestFailedError, match="injected forward failure"):
            engine.generate(bad, NEW)
        assert_consistent(cache)
        engine.scheduler.model = model
        assert engine.generate(bad, NEW) == model.generate_no_cache(bad, NEW)
    assert_consistent(cache)


def test_an_error_of_no_single_request_fails_the_batch_and_the_engine_serves_on(
    model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = conversations(rounds=1, clients=2, seed=33)
    cache = build_cache(256, 256, create_backend("memory"))
    real = cache.poll
    calls = {"n": 0}

    def poll() -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected poll failure")
        real()

    monkeypatch.setattr(cache, "poll", poll)
    with Engine(model, cache) as engine:
        requests = [Request(p, NEW) for p in prompts]
        with pytest.raises(RuntimeError, match="injected poll failure"):
            engine.serve(requests)
        assert all(r.state is RequestState.FAILED for r in requests)
        assert engine.scheduler is not None and engine.scheduler.idle
        assert_consistent(cache)
        assert engine.generate(prompts[0], NEW) == model.generate_no_cache(prompts[0], NEW)
    assert_consistent(cache)


def test_a_request_that_can_never_be_admitted_fails_instead_of_hanging(model: LlamaModel) -> None:
    cache = build_cache(32, 0, None)
    with Engine(model, cache) as engine:
        leaked = cache.tree.insert(tuple(range(16)), cache.alloc_device(16)).node
        cache.tree.lock(leaked)  # a lock nobody will release: the pool can never hold 24 slots
        with pytest.raises(RequestFailedError, match="never admit it"):
            engine.generate(list(range(100, 120)), NEW)
        cache.tree.unlock(leaked)
        assert engine.generate(list(range(100, 120)), NEW) == model.generate_no_cache(
            list(range(100, 120)), NEW
        )


# -- item 5: bad input is refused before admission ------------------------------------------------

BAD_PROMPTS: list[tuple[object, type[Exception], str]] = [
    ([1, VOCAB], InvalidRequestError, "lie in \\[0, 512\\)"),
    ([1, -1], InvalidRequestError, "token 1 is -1"),
    ([1, 10**30], InvalidRequestError, "token 1 is 1000000000000000000000000000000"),
    ([1, 2.5], RequestTypeError, "token ids are ints"),
    ([1, True], RequestTypeError, "token 1 is True"),
    ([1, "2"], RequestTypeError, "token ids are ints"),
    ("hello", RequestTypeError, "got str"),
    (42, RequestTypeError, "got int"),
    ([], InvalidRequestError, "empty prompt"),
    ([[1, 2]], RequestTypeError, "token ids are ints"),
    (torch.tensor([[1, 2]]), RequestTypeError, "1-D of an integer dtype"),
    (torch.tensor([1.0, 2.0]), RequestTypeError, "integer dtype"),
    (torch.tensor([True, False]), RequestTypeError, "torch.bool"),
    (np.array([1.0, 2.0]), RequestTypeError, "integer dtype"),
    (list(range(300)), InvalidRequestError, "could never be admitted"),
]

BAD_BOUNDS: list[tuple[object, type[Exception], str]] = [
    (0, InvalidRequestError, "at least 1"),
    (-3, InvalidRequestError, "at least 1"),
    (2.5, RequestTypeError, "must be an int"),
    ("3", RequestTypeError, "must be an int"),
    (None, RequestTypeError, "must be an int"),
    (True, RequestTypeError, "must be an int"),
    (10**9, InvalidRequestError, "could never be admitted"),
]


@pytest.fixture(scope="module")
def engine(model: LlamaModel) -> Iterator[Engine]:
    with Engine(model, build_cache(256, 256, None)) as served:
        yield served


def serves_a_good_request(engine: Engine, model: LlamaModel) -> None:
    prompt = conversations(rounds=1, clients=1, seed=34)[0]
    assert engine.generate(prompt, NEW) == model.generate_no_cache(prompt, NEW)
    assert engine.cache is not None
    assert_consistent(engine.cache)


@pytest.mark.parametrize(("prompt", "error", "message"), BAD_PROMPTS)
def test_a_bad_prompt_is_refused_and_the_engine_serves_on(
    engine: Engine, model: LlamaModel, prompt: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        engine.generate(prompt, NEW)
    serves_a_good_request(engine, model)


@pytest.mark.parametrize(("bound", "error", "message"), BAD_BOUNDS)
def test_a_bad_max_new_tokens_is_refused_and_the_engine_serves_on(
    engine: Engine, model: LlamaModel, bound: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        engine.generate([1, 2, 3], bound)
    serves_a_good_request(engine, model)


def test_a_request_given_twice_or_served_again_is_refused(
    engine: Engine, model: LlamaModel
) -> None:
    prompt = conversations(rounds=1, clients=1, seed=35)[0]
    request = Request(prompt, NEW)
    with pytest.raises(InvalidRequestError, match="given twice"):
        engine.serve([request, Request(prompt, NEW), request])
    assert request.state is RequestState.WAITING and request.lookup is None, "nothing submitted"
    (done,) = engine.serve([request])
    assert done.output == model.generate_no_cache(prompt, NEW)
    with pytest.raises(InvalidRequestError, match="submitted before"):
        engine.serve([request])
    assert engine.scheduler is not None
    with pytest.raises(InvalidRequestError, match="submitted before"):
        engine.scheduler.submit(request)
    with pytest.raises(RequestTypeError, match="seed must be a str"):
        engine.serve([Request(prompt, NEW, seed=7)])  # type: ignore[arg-type]
    serves_a_good_request(engine, model)


@pytest.mark.parametrize(
    "prompt",
    [
        np.array([3, 1, 4, 1, 5, 9, 2, 6, 5], dtype=np.int32),
        torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5]),
        [np.int64(t) for t in (3, 1, 4, 1, 5, 9, 2, 6, 5)],
        range(3, 12),
    ],
    ids=["numpy", "tensor", "numpy-ints", "range"],
)
def test_integer_arrays_tensors_and_numpy_ints_are_accepted(
    engine: Engine, model: LlamaModel, prompt: Any
) -> None:
    tokens = [int(t) for t in prompt]
    (request,) = engine.serve([Request(prompt, np.int64(NEW))])  # type: ignore[arg-type]
    assert request.output == model.generate_no_cache(tokens, NEW)
    assert request.prompt == tuple(tokens) and type(request.max_new_tokens) is int


def test_the_recompute_engine_refuses_bad_input_too(model: LlamaModel) -> None:
    oracle = Engine(model, None)
    with pytest.raises(InvalidRequestError, match="lie in"):
        oracle.generate([VOCAB + 5], NEW)
    with pytest.raises(RequestTypeError, match="must be an int"):
        oracle.generate([1, 2], "3")  # type: ignore[arg-type]
    assert oracle.generate([1, 2], 2) == model.generate_no_cache([1, 2], 2)


def test_the_scheduler_refuses_bad_input_before_taking_anything(model: LlamaModel) -> None:
    cache = build_cache(64, 64, None, prefetch=PrefetchConfig(PrefetchPolicy.BEST_EFFORT))
    scheduler = Scheduler(model, cache)
    with pytest.raises(InvalidRequestError):
        scheduler.submit(Request([1, VOCAB], NEW))
    assert scheduler.idle
    assert_consistent(cache)


class _SetRaises(ForwardingBackend):
    """The first ``times`` backup writes raise ``error`` (outside the default layers)."""

    def __init__(self, inner: StorageBackend, error: Exception, times: int) -> None:
        super().__init__(inner)
        self.error = error
        self.times = times

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        if self.times > 0:
            self.times -= 1
            raise self.error
        return self.inner.batch_set_v1(keys, host_indices)


def test_a_storage_bug_surfaces_through_poll_and_a_store_failure_does_not(
    model: LlamaModel,
) -> None:
    from hicache_storage.engine.errors import StorageBugError
    from hicache_storage.errors import BackendIOError

    prompts = conversations(rounds=1, clients=2, seed=34)
    failing = _SetRaises(create_backend("memory"), BackendIOError("disk full"), 10**6)
    cache = build_cache(256, 256, failing)
    with Engine(model, cache) as engine:
        assert engine.generate(prompts[0], NEW) == model.generate_no_cache(prompts[0], NEW)
        wait_for(lambda: cache.stats.backups_failed > 0, cache, "the backup to fail")
        cache.poll()  # the store failed: counted, never raised
    buggy = _SetRaises(create_backend("memory"), AttributeError("no attribute 'flush'"), 1)
    cache = build_cache(256, 256, buggy)
    with Engine(model, cache) as engine:
        with pytest.raises(StorageBugError, match="raised AttributeError") as bug:
            engine.generate(prompts[0], NEW)
            wait_for(lambda: False, cache, "the bug to surface through poll")
        assert isinstance(bug.value.__cause__, AttributeError)
        cache.poll()  # raised once
        assert engine.generate(prompts[1], NEW) == model.generate_no_cache(prompts[1], NEW)
        assert_consistent(cache)


# ---- a backend's odd answers and exceptions -----------------------------------------------------


class OddExists(ForwardingBackend):
    """``batch_exists`` answered through ``shape`` (a numpy int, a float, a count past the keys)."""

    def __init__(self, inner: StorageBackend, shape: Any) -> None:
        super().__init__(inner)
        self.shape = shape

    def batch_exists(self, keys: Sequence[str]) -> Any:
        return self.shape(self.inner.batch_exists(keys), len(keys))


def stored(store: StorageBackend, prompts: list[list[int]], model: LlamaModel) -> None:
    """Serve ``prompts`` once over ``store`` so that their pages are in it."""
    with Engine(model, build_cache(256, 256, store)) as engine:
        for prompt in prompts:
            engine.generate(prompt, NEW)


def test_a_numpy_count_from_batch_exists_is_a_count(model: LlamaModel) -> None:
    prompts = conversations(rounds=1, clients=3, seed=41)
    store = OddExists(create_backend("memory"), lambda found, _: np.int64(found))
    stored(store, prompts, model)
    cache = build_cache(256, 256, store, prefetch=PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE))
    with Engine(model, cache) as engine:
        requests = engine.serve([Request(p, NEW) for p in prompts])
        assert [r.output for r in requests] == [model.generate_no_cache(p, NEW) for p in prompts]
    assert cache.stats.storage_hit_tokens > 0, "the numpy count was read as one"
    assert_consistent(cache)


@pytest.mark.parametrize(
    "shape",
    [lambda found, _: float(found), lambda _, asked: asked + 1, lambda *_: -1, lambda *_: True],
    ids=["float", "past-the-keys", "negative", "bool"],
)
def test_an_answer_that_is_no_count_is_a_bug_and_the_engine_serves_on(
    model: LlamaModel, shape: Any
) -> None:
    """Each request whose query meets the answer fails with it (a bug is seen, not served
    around); none computes on it, nothing leaks, and once the store answers counts the engine
    serves with storage hits again."""
    prompts = conversations(rounds=1, clients=3, seed=42)
    store = OddExists(create_backend("memory"), shape)
    stored(store.inner, prompts, model)
    cache = build_cache(256, 256, store, prefetch=PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE))
    with Engine(model, cache) as engine:
        for prompt in prompts[:2]:
            with pytest.raises(StorageBugError) as caught:
                engine.generate(prompt, NEW)
            assert "batch_exists answered" in str(caught.value.__cause__)
        assert_consistent(cache)
        store.shape = lambda found, _: found
        for prompt in prompts:
            assert engine.generate(prompt, NEW) == model.generate_no_cache(prompt, NEW)
    assert cache.stats.storage_hit_tokens > 0
    assert_consistent(cache)


class CancelledCalls(ForwardingBackend):
    """Reads or writes that raise a ``BaseException`` that is no ``Exception``."""

    def __init__(self, inner: StorageBackend, call: str) -> None:
        super().__init__(inner)
        self.call = call

    def batch_get_v1(self, keys: Sequence[str], host_indices: Any) -> list[bool]:
        if self.call == "read":
            raise asyncio.CancelledError("a client's cancellation")
        return self.inner.batch_get_v1(keys, host_indices)

    def batch_set_v1(self, keys: Sequence[str], host_indices: Any) -> list[bool]:
        if self.call == "write":
            raise asyncio.CancelledError("a client's cancellation")
        return self.inner.batch_set_v1(keys, host_indices)


@pytest.mark.parametrize("call", ["read", "write"])
def test_a_base_exception_from_a_call_is_a_bug_and_leaks_nothing(
    model: LlamaModel, call: str
) -> None:
    """A ``CancelledError`` from a read or a write is a bug, seen once per request it surfaces
    in; the storage threads live on, no host slot or pin is lost, and once the store answers
    again the engine serves from it."""
    prompts = conversations(rounds=2, clients=2, seed=43)
    inner = create_backend("memory")
    if call == "read":
        stored(inner, prompts, model)
    store = CancelledCalls(inner, call)
    cache = build_cache(64, 48, store)
    bugs = 0
    with Engine(model, cache) as engine:
        for prompt in prompts:
            try:
                assert engine.generate(prompt, NEW) == model.generate_no_cache(prompt, NEW)
            except StorageBugError as exc:
                bugs += 1
                assert isinstance(exc.__cause__, asyncio.CancelledError)
        assert cache.io is not None and cache.io.alive, "the storage threads live on"
        store.call = "none"
        deadline = time.monotonic() + 10
        while True:  # the backups still queued drain; each bug left surfaces once
            assert time.monotonic() < deadline, "backups done"
            try:
                cache.poll()
            except StorageBugError as exc:
                bugs += 1
                assert isinstance(exc.__cause__, asyncio.CancelledError)
                continue
            if not cache.writes.writing:
                break
            time.sleep(0.002)
        assert_consistent(cache)
        for prompt in prompts:
            assert engine.generate(prompt, NEW) == model.generate_no_cache(prompt, NEW)
    assert bugs >= 1
    assert_consistent(cache)


def test_a_bug_surfacing_while_a_batch_is_submitted_fails_the_whole_batch(
    model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = conversations(rounds=1, clients=3, seed=44)
    cache = build_cache(256, 256, create_backend("memory"))
    real = cache.lookup
    calls = {"n": 0}

    def lookup(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise StorageBugError("injected: a bug surfacing at submit")
        return real(*args, **kwargs)

    monkeypatch.setattr(cache, "lookup", lookup)
    with Engine(model, cache) as engine:
        requests = [Request(p, NEW) for p in prompts]
        with pytest.raises(StorageBugError, match="injected"):
            engine.serve(requests)
        assert all(r.state is RequestState.FAILED and r.error is not None for r in requests)
        assert engine.scheduler is not None and engine.scheduler.idle
        monkeypatch.setattr(cache, "lookup", real)
        assert engine.generate(prompts[0], NEW) == model.generate_no_cache(prompts[0], NEW)
    assert_consistent(cache)
