"""Back-pressure on simulated clocks: writes the store cannot keep up with are shed, not queued."""

from __future__ import annotations

import pytest

from hicache_storage.planner.rates import READ_SAMPLES, READ_TTL_S, CostModel
from hicache_storage.planner.writes import WriteGate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gate_on(clock: Clock) -> WriteGate:
    return WriteGate(CostModel(clock=clock), clock=clock)


def serve(
    gate: WriteGate, clock: Clock, *, offers: int, pages: int, make_s: float, write_s: float
) -> int:
    """A caller on one thread: makes ``pages`` pages in ``make_s`` a page, offers them, and
    writes them itself (``write_s`` a page) when admitted. Returns the pages admitted."""
    admitted = 0
    for _ in range(offers):
        clock.now += make_s * pages
        ticket = gate.offer(pages)
        if ticket.admitted:
            admitted += pages
            clock.now += write_s * pages
            gate.done(ticket, pages)
    return admitted


def test_a_store_faster_than_the_caller_takes_every_write() -> None:
    clock = Clock()
    gate = gate_on(clock)
    admitted = serve(gate, clock, offers=200, pages=4, make_s=0.010, write_s=0.001)
    assert admitted == 800
    assert gate.stats()["shed_pages"] == {}


@pytest.mark.parametrize("ratio", [2, 4, 10])
def test_a_slow_store_takes_the_share_it_can_write(ratio: int) -> None:
    """Pages made every 10 ms for a store that writes one in ``ratio`` x 10 ms: it is offered
    ``ratio`` times what it absorbs, and is given about 1/``ratio`` of the pages."""
    clock = Clock()
    gate = gate_on(clock)
    admitted = serve(gate, clock, offers=2000, pages=4, make_s=0.010, write_s=0.010 * ratio)
    share = admitted / 8000
    assert share == pytest.approx(1 / ratio, rel=0.15)
    shed = gate.stats()["shed_pages"]
    assert isinstance(shed, dict) and shed["absorb"] == 8000 - admitted


@pytest.mark.parametrize("sizes", [[128, 1], [128, 2, 2], [1, 1, 1, 64]])
def test_offers_of_mixed_sizes_take_the_share_the_store_can_write(sizes: list[int]) -> None:
    """Pages made every 5 ms for a store that writes one in 10 ms, offered in calls of varying
    size (a long prompt's pages, then a few of decode): about half the pages are admitted, the
    large offers among them, as with offers of one size."""
    clock = Clock()
    gate = gate_on(clock)
    offered = {size: 0 for size in sizes}
    admitted = dict(offered)
    for i in range(600):
        pages = sizes[i % len(sizes)]
        offered[pages] += pages
        admitted[pages] += serve(gate, clock, offers=1, pages=pages, make_s=0.005, write_s=0.010)
    total = sum(offered.values())
    assert sum(admitted.values()) / total == pytest.approx(0.5, rel=0.1)
    assert sum(admitted.values()) <= total / 2 + max(sizes), "never ahead of the store"
    assert admitted[max(sizes)] >= offered[max(sizes)] / 4, "large offers are admitted too"


def test_a_backlog_offered_back_to_back_is_shed_not_queued() -> None:
    """A caller with writes queued offers them with no time between: a store that writes slowly
    is given almost none of them, so the queue drains at the speed of an answer."""
    clock = Clock()
    gate = gate_on(clock)
    serve(gate, clock, offers=READ_SAMPLES, pages=4, make_s=0.010, write_s=0.100)
    start = clock.now
    admitted = serve(gate, clock, offers=500, pages=4, make_s=0.0, write_s=0.100)
    assert admitted <= 8, "at most a call or two while the caller's own rate is learnt"
    assert clock.now - start <= 8 * 0.100


def test_an_unmeasured_store_is_probed_one_call_at_a_time() -> None:
    clock = Clock()
    gate = gate_on(clock)
    first = gate.offer(4)
    second = gate.offer(4)
    assert first.admitted and first.rule == "probe"
    assert not second.admitted and second.rule == "probe"
    clock.now += 0.01
    gate.done(first, 4)
    assert gate.costs.write_s_per_page == pytest.approx(0.0025)


def test_a_failing_store_is_shed_and_probed_until_it_recovers() -> None:
    clock = Clock()
    gate = gate_on(clock)
    for _ in range(READ_SAMPLES):
        clock.now += 0.01
        ticket = gate.offer(2)
        assert ticket.admitted
        clock.now += 0.5
        gate.done(ticket, 0)
    clock.now += 0.01
    shed = gate.offer(2)
    assert not shed.admitted and shed.rule == "failing"
    clock.now += READ_TTL_S
    probe = gate.offer(2)
    assert probe.admitted and probe.rule == "failing"
    assert not gate.offer(2).admitted, "one probe at a time"
    clock.now += 0.001
    gate.done(probe, 2)
    clock.now += 0.01
    assert gate.offer(2).admitted, "a probe that stored lifts the rule"


def test_concurrent_writes_are_priced_at_the_store_s_whole_rate() -> None:
    """Two calls of 4 pages in flight together for 40 ms: the store writes a page in 5 ms."""
    clock = Clock()
    gate = gate_on(clock)
    warm = gate.offer(1)
    clock.now += 0.001
    gate.done(warm, 1)
    clock.now += 0.1  # the caller made these pages in 100 ms: no backlog
    a, b = gate.offer(4), gate.offer(4)
    assert a.admitted and b.admitted
    clock.now += 0.040
    gate.done(a, 4)
    gate.done(b, 4)
    assert gate.costs.write_s_per_page == pytest.approx(0.005)


def test_every_answer_names_its_rule_and_reason() -> None:
    clock = Clock()
    gate = gate_on(clock)
    serve(gate, clock, offers=50, pages=4, make_s=0.010, write_s=0.050)
    ticket = gate.offer(4)
    assert ticket.rule == "absorb"
    assert "ms" in ticket.reason and "store writes" in ticket.reason


def test_an_operation_split_into_calls_back_to_back_is_not_a_backlog() -> None:
    """SGLang writes an operation 128 pages a call, the calls back to back: the pages were made
    in the time before the first call, so a store that keeps up takes every call."""
    clock = Clock()
    gate = gate_on(clock)
    admitted = 0
    for _ in range(50):
        clock.now += 0.256  # 256 pages made at 1 ms a page
        for _ in range(2):
            ticket = gate.offer(128)
            if ticket.admitted:
                admitted += 128
                clock.now += 128 * 0.0005  # the store writes a page in 0.5 ms
                gate.done(ticket, 128)
    assert admitted == 50 * 256


def queue_run(
    gate: WriteGate,
    clock: Clock,
    *,
    burst: int,
    make_s: float,
    write_s: float,
    room: int | None,
) -> tuple[int, int]:
    """A burst of ``burst`` one-page backups made ``make_s`` apart into a caller's queue, and a
    writer that takes the oldest, offers it (telling the gate its queue when ``room`` is given)
    and writes it in ``write_s``, until the queue is empty. Returns the pages written and the
    most pages that waited behind an admitted write (the host room the queue held)."""
    arrivals = [clock.now + make_s * (i + 1) for i in range(burst)]
    queue: list[float] = []
    written = held = 0
    while arrivals or queue:
        if not queue:
            clock.now = max(clock.now, arrivals[0])
        while arrivals and arrivals[0] <= clock.now:
            queue.append(arrivals.pop(0))
        queue.pop(0)
        waiting = len(queue)
        ticket = gate.offer(1) if room is None else gate.offer(1, queued=waiting, room=room)
        if ticket.admitted:
            clock.now += write_s
            gate.done(ticket, 1)
            written += 1
            held = max(held, waiting)
    return written, held


def test_a_caller_that_tells_its_queue_is_shed_only_beyond_its_room() -> None:
    clock = Clock()
    gate = gate_on(clock)
    warm = gate.offer(1)
    clock.now += 0.01
    gate.done(warm, 1)
    within = gate.offer(4, queued=8, room=8)
    assert within.admitted and within.rule == "backlog"
    clock.now += 0.04
    gate.done(within, 4)
    beyond = gate.offer(4, queued=9, room=8)
    assert not beyond.admitted and beyond.rule == "backlog"
    assert "9 pages wait behind it, room for 8" in beyond.reason
    assert gate.stats()["shed_pages"] == {"backlog": 4}


@pytest.mark.parametrize("ratio", [2, 4, 10])
def test_a_burst_keeps_a_slow_store_busy_within_the_room(ratio: int) -> None:
    """A burst of 400 pages made 10 ms apart for a store ``ratio`` times slower: told the queue,
    the gate keeps the writer busy through the burst and stores what it can while the burst
    lasts and its room drains, never holding more than the room; priced by rate alone, it
    thins the burst to the store's rate and stores less."""
    room = 40
    stored = {}
    for rule, told in (("backlog", room), ("absorb", None)):
        clock = Clock()
        gate = gate_on(clock)
        written, held = queue_run(
            gate, clock, burst=400, make_s=0.010, write_s=0.010 * ratio, room=told
        )
        stored[rule] = written
        if told is not None:
            assert held <= room
            # the writer never idled while pages waited: the burst's time over a write, and the
            # room drained after it, less the one write in flight when it ended
            assert written >= 400 / ratio + room - 1
    assert stored["backlog"] > stored["absorb"]


def test_a_burst_the_store_keeps_up_with_is_written_whole() -> None:
    clock = Clock()
    gate = gate_on(clock)
    written, held = queue_run(gate, clock, burst=300, make_s=0.010, write_s=0.005, room=4)
    assert written == 300 and held <= 1
    assert gate.stats()["shed_pages"] == {}
