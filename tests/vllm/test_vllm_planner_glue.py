"""The tier's planner glue without an engine: prefill derived from hooks, reads, the detector."""

from __future__ import annotations

import re
import threading

import pytest
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.vllm.config import tier_settings
from hicache_storage.integrations.vllm.planning import TierPlanner
from hicache_storage.integrations.vllm.prefill import PrefillClock
from hicache_storage.integrations.vllm.pressure import PlannerPressure
from hicache_storage.planner import Planner

CHUNK = 32
STEP = 2048


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keys_of(req: ReqContext, first: int, count: int) -> list[OffloadKey]:
    """Chunk keys ``first .. first + count`` of a request, with their end positions."""
    keys = []
    for i in range(first, first + count):
        key = make_offload_key(f"{req.req_id}-{i}".encode().ljust(32, b"."), 0)
        req.set_offload_key_position(key, (i + 1) * CHUNK)
        keys.append(key)
    return keys


def planned(clock: Clock, rate: float | None = None) -> TierPlanner:
    planner = Planner(CHUNK, clock=clock)
    return TierPlanner(
        planner, PrefillClock(planner, CHUNK, STEP, rate=rate, clock=clock), clock=clock
    )


def prefill(plan: TierPlanner, clock: Clock, req: ReqContext, chunks: int, seconds: float) -> None:
    """A request looks up ``chunks`` chunks, is scheduled, and stores them ``seconds`` later."""
    keys = keys_of(req, 0, chunks)
    plan.prefill.started(req.req_id)
    for key in keys:
        plan.prefill.looked_up(key, req.req_id)
    plan.prefill.scheduled([req.req_id])
    clock.now += seconds
    plan.prefill.stored(keys, req)
    plan.prefill.flush()


def test_a_prompt_computed_whole_prices_a_token_at_its_steps_mean() -> None:
    clock = Clock()
    plan = planned(clock)
    assert plan.planner.costs.compute_s_per_token is None  # unpriced: the planner fetches
    prefill(plan, clock, ReqContext("a"), chunks=8, seconds=0.256)
    assert plan.planner.costs.compute_s_per_token == pytest.approx(0.256 / (8 * CHUNK))


def test_a_step_slowed_by_a_busy_cpu_does_not_raise_the_price() -> None:
    """Each derived step is an upper bound of the cost: the least of the recent ones counts."""
    clock = Clock()
    plan = planned(clock)
    prefill(plan, clock, ReqContext("a"), chunks=8, seconds=0.256)
    prefill(plan, clock, ReqContext("b"), chunks=8, seconds=2.56)
    assert plan.planner.costs.compute_s_per_token == pytest.approx(0.256 / (8 * CHUNK))


def test_chunks_not_looked_up_and_later_store_jobs_are_no_samples() -> None:
    clock = Clock()
    plan = planned(clock)
    req = ReqContext("a")
    plan.prefill.started("a")
    asked = keys_of(req, 0, 4)
    for key in asked[:3]:
        plan.prefill.looked_up(key, "a")
    plan.prefill.scheduled(["a"])
    clock.now += 1.0
    plan.prefill.stored(asked, req)  # its last chunk was never asked for: decode filled it
    plan.prefill.flush()
    assert plan.planner.costs.compute_s_per_token is None
    plan.prefill.stored(keys_of(req, 4, 4), req)  # a later job of the request: no sample
    plan.prefill.flush()
    assert plan.planner.costs.compute_s_per_token is None


def test_the_requests_of_one_step_are_one_forward() -> None:
    """Two requests scheduled together share the step's seconds, and count as its sharing."""
    clock = Clock()
    plan = planned(clock)
    reqs = [ReqContext("a"), ReqContext("b")]
    keys = [keys_of(req, 0, 4) for req in reqs]
    for req, own in zip(reqs, keys, strict=True):
        plan.prefill.started(req.req_id)
        for key in own:
            plan.prefill.looked_up(key, req.req_id)
    plan.prefill.scheduled(["a", "b"])
    clock.now += 0.256
    for req, own in zip(reqs, keys, strict=True):
        plan.prefill.stored(own, req)
    plan.prefill.flush()
    costs = plan.planner.costs
    assert costs.compute_s_per_token == pytest.approx(0.256 / (8 * CHUNK))
    assert costs.sharing == 2


def test_a_configured_rate_prices_recompute_before_any_request() -> None:
    clock = Clock()
    plan = planned(clock, rate=1000.0)
    assert plan.planner.costs.compute_s_per_token == pytest.approx(1e-3)
    prefill(plan, clock, ReqContext("a"), chunks=8, seconds=5.0)  # measured time not used
    assert plan.planner.costs.compute_s_per_token == pytest.approx(1e-3)


def test_a_store_slower_than_computing_is_a_miss() -> None:
    """The probe's round trip, spread over the chunks found, against a priced prefill."""
    clock = Clock()
    plan = planned(clock, rate=32_000.0)  # a chunk computes in a millisecond
    keys = [f"k{i}" for i in range(8)]
    assert plan.fetchable(keys, 8, 0.001) == 8  # the store's speed is not known yet

    def slow_read() -> None:
        clock.now += 1.0

    plan.probe(slow_read)
    assert plan.fetchable(keys, 8, 0.001) == 0  # 125 ms a chunk at least
    assert plan.planner.costs.read_s_per_page == pytest.approx(1.0 / 8)
    assert plan.stats()["fetch_pages"] == {"pays": 8, "recompute": 8}


def test_one_round_trip_over_many_chunks_still_pays() -> None:
    """A round trip slower than computing one chunk is not slower than computing all."""
    clock = Clock()
    plan = planned(clock, rate=32_000.0)

    def read() -> None:
        clock.now += 0.004  # 4 ms, four chunks' compute

    plan.probe(read)
    assert plan.fetchable([f"k{i}" for i in range(64)], 64, 0.001) == 64


def test_the_probe_waits_for_a_lookup_that_finds_chunks() -> None:
    """Until then, writes to a store that holds nothing are not shed on its round trip."""
    clock = Clock()
    plan = planned(clock, rate=32_000.0)

    def slow_read() -> None:
        clock.now += 1.0

    plan.probe(slow_read)
    assert plan.fetchable(["a0", "a1"], 0, 0.001) == 0  # nothing found: nothing spent
    assert plan.offer(["a0", "a1"]).pages == 2
    assert plan.fetchable(["b0", "b1"], 2, 0.001) == 0
    shed = plan.offer(["b0", "b1"])
    assert shed.pages == 0 and shed.rule == "unread"


def test_a_read_supersedes_the_probe() -> None:
    clock = Clock()
    plan = planned(clock, rate=32_000.0)
    plan.queue_read(8)
    call = plan.begin_read(8)
    clock.now += 0.0008
    plan.end_read(call, 8)  # 0.1 ms a chunk

    def slow_read() -> None:
        clock.now += 1.0

    plan.probe(slow_read)  # finished after the read: stale
    assert plan.fetchable([f"k{i}" for i in range(8)], 8, 0.001) == 8
    assert plan.planner.costs.read_s_per_page == pytest.approx(0.0001)


def test_the_probe_passes_over_set_up_and_one_stalled_read() -> None:
    """The first read sets up a connection; one of the timed ones stalls on a busy CPU."""
    clock = Clock()
    plan = planned(clock, rate=32_000.0)
    durations = iter([5.0, 0.0008, 2.0, 0.0008])

    def read() -> None:
        clock.now += next(durations)

    plan.probe(read)
    assert plan.fetchable([f"k{i}" for i in range(8)], 8, 0.001) == 8
    assert plan.planner.costs.read_s_per_page == pytest.approx(0.0001)


def test_a_read_running_long_prices_the_store_before_it_returns() -> None:
    clock = Clock()
    plan = planned(clock, rate=32_000.0)
    plan.queue_read(4)
    call = plan.begin_read(4)
    clock.now += 0.5  # 125 ms a chunk so far, against 1 ms to compute one
    assert plan.fetchable([f"k{i}" for i in range(4)], 4, 0.001) == 0
    plan.end_read(call, 4)
    assert plan.planner.costs.read_s_per_page == pytest.approx(0.125)


def test_a_probe_while_running_is_a_read_in_flight() -> None:
    clock = Clock()
    plan = planned(clock, rate=32_000.0)
    started, release = threading.Event(), threading.Event()

    def read() -> None:
        started.set()
        release.wait(10)

    thread = threading.Thread(target=plan.probe, args=(read,))
    thread.start()
    started.wait(10)
    clock.now += 0.5
    assert plan.fetchable(["k0", "k1"], 2, 0.001) == 0
    release.set()
    thread.join()


def test_the_detector_reports_the_planners_shedding() -> None:
    write_s: list[float | None] = [None]
    detector = PlannerPressure(lambda: write_s[0], 2 << 20)
    assert detector.should_store(8) and not detector.is_under_pressure()
    assert detector.stats == {}
    detector.offered("absorb", [3, 1])
    assert detector.is_under_pressure() and detector.should_store(8)
    assert detector.policy.pop_stores_dropped() == (2, 4)
    write_s[0] = 0.004  # 4 ms a 2 MiB chunk
    assert detector.stats == {"store_latency_ema": pytest.approx(0.002)}
    detector.offered(None, [])
    assert not detector.is_under_pressure()
    detector.offered("unread", [5])
    detector.reset()
    assert not detector.is_under_pressure()
    assert detector.policy.pop_stores_dropped() == (0, 0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"planner": "yes"}, "planner must be true or false"),
        ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": float("inf")}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": True}, "prefill_tokens_per_s"),
    ],
)
def test_bad_planner_options_are_refused(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        tier_settings({"backend": "memory", **entry})


def test_the_planner_is_on_by_default() -> None:
    settings = tier_settings({"backend": "memory"})
    assert settings.planner is True and settings.prefill_tokens_per_s is None
    settings = tier_settings({"backend": "memory", "planner": False, "prefill_tokens_per_s": 5e3})
    assert settings.planner is False and settings.prefill_tokens_per_s == 5000.0
