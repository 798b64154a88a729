"""The planner's three decisions on simulated clocks and rates, each with the rule that made it."""

from __future__ import annotations

import pytest

from hicache_storage.errors import ConfigError
from hicache_storage.planner import AdmitAll, AdmitSeen, Planner
from hicache_storage.planner.rates import READ_SAMPLES

from .test_writes import Clock

PAGE = 16


def planner(clock: Clock, **kwargs: object) -> Planner:
    return Planner(PAGE, clock=clock, **kwargs)  # type: ignore[arg-type]


def measured(
    clock: Clock, *, read_s: float | None, token_s: float | None, **kwargs: object
) -> Planner:
    """A planner that has seen reads at ``read_s`` a page and forwards at ``token_s`` a token."""
    plan = planner(clock, **kwargs)
    for _ in range(READ_SAMPLES):
        if read_s is not None:
            plan.read(8, 8 * read_s)
        if token_s is not None:
            plan.forward(1024, 1024 * token_s)
    return plan


def test_a_fetch_pays_when_the_store_reads_faster_than_the_batch_computes() -> None:
    clock = Clock()
    plan = measured(clock, read_s=0.001, token_s=0.001)  # 1 ms a page against 16 ms
    decision = plan.fetchable(40)
    assert (decision.pages, decision.rule) == (40, "pays")
    assert "ms a page" in decision.reason


def test_a_store_slower_than_computing_is_not_read() -> None:
    clock = Clock()
    plan = measured(clock, read_s=1.0, token_s=0.001)  # 1 s a read against 16 ms to compute
    decision = plan.fetchable(40)
    assert (decision.pages, decision.rule) == (0, "recompute")
    assert plan.stats()["fetch_pages"] == {"recompute": 40}


def test_pages_queued_ahead_count_against_a_fetch() -> None:
    clock = Clock()
    plan = measured(clock, read_s=0.010, token_s=0.001)  # 10 ms a page against 16 ms
    assert plan.fetchable(10).pages == 10
    assert plan.fetchable(10, queued_pages=10).pages == 0, "20 pages of reads for 10 pages"
    assert plan.fetchable(10, in_flight_s_per_page=0.5).pages == 0, "a read stuck in flight"


def test_unmeasured_rates_let_the_first_reads_measure_the_store() -> None:
    plan = planner(Clock())
    assert plan.fetchable(12).pages == 12
    assert plan.fetchable(0).pages == 0


def test_a_failing_store_is_not_read() -> None:
    clock = Clock()
    plan = measured(clock, read_s=None, token_s=0.001)
    for _ in range(READ_SAMPLES):
        plan.read(0, 1.0)
    assert plan.fetchable(10).rule == "failing"


@pytest.mark.parametrize(
    ("failed", "good", "failing"), [(1, 1, False), (2, 2, False), (2, 1, True), (3, 2, True)]
)
def test_a_store_is_failing_only_once_most_recent_reads_failed(
    failed: int, good: int, failing: bool
) -> None:
    """Half the reads failed (the start-up probe beside one read of an evicted page) is not
    most: the good reads still price the store."""
    clock = Clock()
    plan = measured(clock, read_s=None, token_s=0.001)
    for _ in range(good):
        plan.read(1, 0.001)
    for _ in range(failed):
        plan.read(0, 0.001)
    assert plan.costs.failing is failing
    assert plan.fetchable(10).rule == ("failing" if failing else "pays")


def test_writes_to_a_store_whose_reads_do_not_pay_are_shed() -> None:
    clock = Clock()
    plan = measured(clock, read_s=1.0, token_s=0.001)
    decision = plan.offer(["a", "b"])
    assert decision.admitted == [False, False] and decision.rule == "unread"
    assert plan.stats()["write_pages"] == {"shed:unread": 2}


def test_frequency_admission_writes_what_was_asked_for_twice() -> None:
    clock = Clock()
    plan = planner(clock, admission=AdmitSeen(2))
    plan.seen(["a", "b"])
    plan.seen(["a"])
    decision = plan.offer(["a", "b", "c"])
    assert decision.admitted == [True, False, False]
    clock.now += 0.001
    plan.done(decision, 1)
    assert plan.stats()["write_pages"] == {"shed:admission": 2, "written": 1}


def test_admission_forgets_the_least_recently_counted_key_first() -> None:
    admission = AdmitSeen(1, capacity=2)
    admission.seen(["a", "b"])
    admission.seen(["a", "c"])
    assert admission.admit(["a", "b", "c"]) == [True, False, True]
    assert AdmitAll().admit(["x", "y"]) == [True, True]


def test_a_backlogged_writer_is_answered_at_once_with_its_writes_shed() -> None:
    clock = Clock()
    plan = measured(clock, read_s=0.001, token_s=0.001)
    first = plan.offer(["k0"])
    clock.now += 0.5  # the store takes half a second a page
    plan.done(first, 1)
    shed = [plan.offer([f"k{i}"]) for i in range(1, 50)]  # queued: offered back to back
    assert sum(d.pages for d in shed) <= 1
    assert {d.rule for d in shed if not d.pages} == {"absorb"}


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_page_tokens_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match="page_tokens"):
        Planner(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="times"):
        AdmitSeen(bad)  # type: ignore[arg-type]


def test_a_probe_round_trip_prices_the_store_before_any_read() -> None:
    clock = Clock()
    plan = measured(clock, read_s=None, token_s=0.001)
    plan.probe(1.0)
    assert plan.fetchable(10).rule == "recompute", "a second a round trip is slow"
    fast = measured(Clock(), read_s=None, token_s=0.001)
    fast.probe(0.0005)
    assert fast.fetchable(10).rule == "pays"
