"""The slot allocator and key map: visibility after commit, first writer wins, LRU, leases, epochs.

Driven through :class:`LocalMetadata` with a fake clock; the metadata service serves the same
object, and its persistence (snapshot + journal) is checked here on files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_storage.backends.threefs.metadata import Geometry, GeometryError
from hicache_storage.backends.threefs.metadata_local import LocalMetadata, _slots
from hicache_storage.backends.threefs.metadata_server import Persistence

NS = "ns"
GEO = Geometry(slot_bytes=100, slots_per_file=5, file_count=2)  # 10 slots, 1000 bytes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def meta(clock: Clock) -> LocalMetadata:
    store = LocalMetadata(lease_s=10.0, clock=clock)
    store.open(NS, GEO)
    return store


def put(meta: LocalMetadata, key: str, nbytes: int) -> int:
    reservation = meta.reserve(NS, GEO, [(key, nbytes)])
    grant = reservation.grants[0]
    assert grant.status == "reserved"
    assert meta.commit(NS, reservation.epoch, [grant.id]) == [True]
    return grant.id


def test_reserved_key_is_invisible_until_commit(meta: LocalMetadata) -> None:
    reservation = meta.reserve(NS, GEO, [("a", 250)])
    grant = reservation.grants[0]
    assert grant.status == "reserved" and grant.extents == [(0, 3)]
    assert meta.lookup(NS, ["a"]).locations == [None]
    assert meta.exists(NS, ["a"]) == 0 and meta.states(NS, ["a"]) == ["reserved"]
    assert meta.commit(NS, reservation.epoch, [grant.id]) == [True]
    location = meta.lookup(NS, ["a"]).locations[0]
    assert location is not None and (location.id, location.length) == (grant.id, 250)
    assert meta.exists(NS, ["a", "b"]) == 1 and meta.states(NS, ["a"]) == ["committed"]
    assert meta.commit(NS, reservation.epoch, [grant.id]) == [True]  # a repeated commit is fine


def test_first_writer_wins(meta: LocalMetadata) -> None:
    first = meta.reserve(NS, GEO, [("k", 10)])
    assert meta.reserve(NS, GEO, [("k", 10)]).grants[0].status == "busy"
    meta.commit(NS, first.epoch, [first.grants[0].id])
    assert meta.reserve(NS, GEO, [("k", 10)]).grants[0].status == "exists"


def test_abort_frees_slots_and_key(meta: LocalMetadata) -> None:
    reservation = meta.reserve(NS, GEO, [("k", 1000)])
    assert meta.stats(NS)["slots_free"] == 0
    meta.abort(NS, reservation.epoch, [reservation.grants[0].id])
    assert meta.stats(NS)["slots_free"] == 10 and meta.states(NS, ["k"]) == ["absent"]
    assert meta.reserve(NS, GEO, [("k", 1000)]).grants[0].status == "reserved"


def test_full_store_evicts_least_recently_used(meta: LocalMetadata) -> None:
    ids = {key: put(meta, key, 200) for key in "abcde"}  # 10 slots used
    found = meta.lookup(NS, ["a"])
    assert meta.confirm(NS, found.epoch, [("a", ids["a"])]) == [True]  # a read touches "a"
    put(meta, "f", 300)  # needs 2 more slots than free: evicts b and c, the oldest unread
    assert meta.states(NS, list("abcdef")) == [
        "committed",
        "absent",
        "absent",
        "committed",
        "committed",
        "committed",
    ]
    stats = meta.stats(NS)
    assert stats["evictions"] == 2 and stats["bytes"] == 4 * 200 - 200 + 300
    used = [s for key in "adef" for s in _slots(meta.lookup(NS, [key]).locations[0].extents)]
    assert len(used) == len(set(used)) == 9


def test_confirm_fails_once_the_entry_is_gone(meta: LocalMetadata) -> None:
    id = put(meta, "k", 100)
    epoch = meta.lookup(NS, ["k"]).epoch
    assert meta.delete(NS, ["k", "k"]) == [True, False]
    new_id = put(meta, "k", 100)  # same key, same slot, new entry
    assert new_id != id
    assert meta.confirm(NS, epoch, [("k", id)]) == [False]
    assert meta.confirm(NS, epoch, [("k", new_id)]) == [True]
    assert meta.confirm(NS, "other-epoch", [("k", new_id)]) == [False]
    assert meta.commit(NS, "other-epoch", [new_id]) == [False]


def test_expired_lease_reclaims_slots_and_refuses_commit(meta: LocalMetadata, clock: Clock) -> None:
    reservation = meta.reserve(NS, GEO, [("k", 1000)])
    assert meta.reserve(NS, GEO, [("x", 100)]).grants[0].status == "full"
    clock.now += 10.5
    assert meta.states(NS, ["k"]) == ["absent"]
    assert meta.commit(NS, reservation.epoch, [reservation.grants[0].id]) == [False]
    assert meta.stats(NS)["expired"] == 1
    assert meta.reserve(NS, GEO, [("x", 100)]).grants[0].status == "reserved"


def test_too_large_and_pending_are_never_evicted(meta: LocalMetadata) -> None:
    assert meta.reserve(NS, GEO, [("big", 1001)]).grants[0].status == "too_large"
    meta.reserve(NS, GEO, [("p", 600)])
    put(meta, "c", 400)
    assert meta.reserve(NS, GEO, [("x", 500)]).grants[0].status == "full"
    assert meta.states(NS, ["p", "c"]) == ["reserved", "committed"]


def test_grace_refuses_reservations_until_it_ends(clock: Clock) -> None:
    meta = LocalMetadata(lease_s=5.0, grace_s=5.0, clock=clock)
    assert meta.reserve(NS, GEO, [("k", 1)]).grants[0].status == "starting"
    assert meta.grace_left() == 5.0
    clock.now += 5.0
    assert meta.reserve(NS, GEO, [("k", 1)]).grants[0].status == "reserved"


def test_geometry_mismatch_refused(meta: LocalMetadata) -> None:
    other = Geometry(slot_bytes=200, slots_per_file=5, file_count=2)
    with pytest.raises(GeometryError, match="slots of 100 bytes"):
        meta.open(NS, other)
    with pytest.raises(GeometryError):
        meta.reserve(NS, other, [("k", 1)])
    assert meta.open("another", other) == meta.epoch


def test_values_take_consecutive_slots_starting_in_the_next_file(meta: LocalMetadata) -> None:
    grants = meta.reserve(NS, GEO, [("a", 300), ("b", 300), ("c", 300)]).grants
    # a: file 0; b: file 1 (slots 5-9); c: the rest of file 0, then file 1's last slot.
    assert [g.extents for g in grants] == [[(0, 3)], [(5, 3)], [(3, 2), (8, 1)]]


def test_a_batch_of_pages_is_spread_over_the_files(meta: LocalMetadata) -> None:
    """Buffered writes to one file are serialised by the kernel: a batch's pages go to
    different files, round the files in turn, and freed slots are reused in their own file."""
    geometry = Geometry(slot_bytes=100, slots_per_file=8, file_count=4)
    keys = [f"p{i}" for i in range(8)]
    grants = meta.reserve("spread", geometry, [(key, 100) for key in keys]).grants
    slots = [g.extents[0][0] for g in grants]
    assert [slot // 8 for slot in slots] == [0, 1, 2, 3, 0, 1, 2, 3]
    meta.abort("spread", meta.epoch, [g.id for g in grants[:4]])
    again = meta.reserve("spread", geometry, [(f"q{i}", 100) for i in range(4)]).grants
    assert sorted(g.extents[0][0] for g in again) == sorted(slots[:4])


def test_snapshot_and_journal_restore_the_same_state(clock: Clock) -> None:
    records: list[list[Any]] = []
    meta = LocalMetadata(lease_s=10.0, clock=clock, journal=records.append)
    meta.open(NS, GEO)
    base = meta.snapshot()
    for key in "abc":
        put(meta, key, 150)
    meta.delete(NS, ["b"])
    pending = meta.reserve(NS, GEO, [("p", 100)]).grants[0]

    restored = LocalMetadata(lease_s=10.0, clock=clock)
    restored.restore(base, records)
    assert restored.epoch == meta.epoch
    assert restored.lookup(NS, list("abcp")).locations == meta.lookup(NS, list("abcp")).locations
    assert restored.states(NS, ["p"]) == ["reserved"]
    fresh = restored.reserve(NS, GEO, [("n", 1000 - 2 * 200 - 100)]).grants[0]
    taken = set(_slots(fresh.extents))
    live = {s for key in "ac" for s in _slots(meta.lookup(NS, [key]).locations[0].extents)}
    assert not taken & (live | set(_slots(pending.extents)))
    assert restored.commit(NS, meta.epoch, [pending.id]) == [True]


def test_persistence_ignores_a_torn_journal_line(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "meta.snapshot"
    first = Persistence(str(path))
    meta = LocalMetadata(lease_s=10.0, clock=clock)
    first.load(meta)
    meta.open(NS, GEO)
    put(meta, "a", 100)
    put(meta, "b", 100)
    with open(first.journal_path, "ab") as journal:
        journal.write(b'["c","ns",')  # a record cut short by a kill
    again = LocalMetadata(lease_s=10.0, clock=clock)
    second = Persistence(str(path))
    assert second.found()
    second.load(again)
    assert again.exists(NS, ["a", "b"]) == 2 and again.epoch == meta.epoch
    put(again, "c", 100)
    second.close()
    third = LocalMetadata(lease_s=10.0, clock=clock)
    Persistence(str(path)).load(third)
    assert third.exists(NS, ["a", "b", "c"]) == 3


def _live_slots(meta: LocalMetadata, ns: str) -> list[int]:
    """Every slot a committed or pending entry of ``ns`` holds (with repeats, if any)."""
    space = meta.snapshot()["namespaces"][ns]
    held = [e[3] for e in space["entries"]] + [p[3] for p in space["pending"]]
    return [slot for extents in held for slot in _slots(tuple(x) for x in extents)]


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["reserve", "commit", "abort", "delete", "expire"]),
            st.integers(0, 11),
            st.integers(1, 700),
        ),
        max_size=60,
    )
)
def test_slots_are_never_handed_out_twice(ops: list[tuple[str, int, int]]) -> None:
    """Whatever the order of reservations, commits, aborts, deletes and expiries, no slot is held
    by two entries, the free count is the slots nobody holds, and a restored map agrees."""
    clock = Clock()
    geometry = Geometry(slot_bytes=100, slots_per_file=4, file_count=3)
    meta = LocalMetadata(lease_s=10.0, clock=clock)
    epoch = meta.open(NS, geometry)
    pending: dict[str, int] = {}
    for op, k, nbytes in ops:
        key = f"k{k}"
        if op == "reserve":
            grant = meta.reserve(NS, geometry, [(key, nbytes)]).grants[0]
            if grant.status == "reserved":
                assert sum(count for _, count in grant.extents) == geometry.slots_for(nbytes)
                pending[key] = grant.id
        elif op in ("commit", "abort") and key in pending:
            id = pending.pop(key)
            if op == "commit":
                meta.commit(NS, epoch, [id])
            else:
                meta.abort(NS, epoch, [id])
        elif op == "delete":
            meta.delete(NS, [key])
        elif op == "expire":
            clock.now += 11.0
        live = _live_slots(meta, NS)
        assert len(live) == len(set(live)), "a slot is held twice"
        assert meta.stats(NS)["slots_free"] == geometry.total_slots - len(live)
    restored = LocalMetadata(lease_s=10.0, clock=clock)
    restored.restore(meta.snapshot())
    assert restored.stats(NS)["slots_free"] == meta.stats(NS)["slots_free"]
    restored.reserve(NS, geometry, [("fill", restored.stats(NS)["slots_free"] * 100)])
    live = _live_slots(restored, NS)  # the fill among them, if it found room
    assert len(live) == len(set(live)), "a restored map handed out a held slot"
