"""LRUCapacity: reservations, LRU order, pinning and the bound under concurrency."""

from __future__ import annotations

import threading

import pytest

from hicache_storage.backends.file.evictor import LRUCapacity


def capacity(max_bytes: int | None, low: float = 0.5) -> tuple[LRUCapacity, list[str]]:
    removed: list[str] = []
    return LRUCapacity(max_bytes, low, removed.append), removed


def store(cap: LRUCapacity, key: str, size: int) -> bool:
    if not cap.reserve(size, key):
        return False
    cap.commit(key, size)
    return True


def test_unbounded_counts_and_never_evicts() -> None:
    cap, removed = capacity(None)
    for i in range(100):
        assert store(cap, f"k{i}", 1000)
    assert (len(cap), cap.used, removed) == (100, 100_000, [])


def test_evicts_oldest_down_to_low_watermark() -> None:
    cap, removed = capacity(100, low=0.5)
    for i in range(10):
        assert store(cap, f"k{i}", 10)
    assert removed == []
    cap.touch("k0")
    assert store(cap, "new", 10)
    # 110 > 100: evict until 100 - evicted + 10 <= 50, i.e. 60 bytes, oldest first, k0 spared.
    assert removed == ["k1", "k2", "k3", "k4", "k5", "k6"]
    assert cap.keys() == ["k7", "k8", "k9", "k0", "new"]
    assert cap.used == 50
    assert cap.stats()["evictions"] == 6
    assert cap.stats()["evicted_bytes"] == 60


def test_too_large_value_is_refused_without_evicting() -> None:
    cap, removed = capacity(100)
    store(cap, "a", 60)
    assert not cap.reserve(101)
    assert removed == []
    assert cap.reserved == 0


def test_refuses_when_pinned_and_reserved_bytes_leave_no_room() -> None:
    cap, removed = capacity(100)
    assert store(cap, "a", 40)
    assert cap.reserve(50, "a")  # a rewrite of "a" in flight pins it
    assert not cap.reserve(20)  # only "a" could go, and it is pinned
    assert removed == []
    cap.abort(50, "a")
    assert cap.reserve(70)  # "a" is evictable again
    assert removed == ["a"]


def test_pinned_keys_are_skipped() -> None:
    cap, removed = capacity(100, low=0.5)
    for key in "abcde":
        store(cap, key, 20)
    assert cap.reserve(0, "a")  # pin the oldest
    assert store(cap, "f", 20)
    assert "a" not in removed
    assert removed == ["b", "c", "d", "e"]  # 120 bytes down to 50: 70 to free, "a" spared


def test_forget_and_add() -> None:
    cap, _ = capacity(1000)
    cap.add("x", 10)
    cap.add("y", 20)
    assert cap.forget("x") == 10
    assert cap.forget("x") is None
    cap.forget_many(["y", "z"])
    assert (len(cap), cap.used) == (0, 0)


def test_commit_of_known_key_replaces_its_size() -> None:
    cap, _ = capacity(1000)
    store(cap, "k", 10)
    store(cap, "k", 30)
    assert (len(cap), cap.used) == (1, 30)


def test_enforce_after_scan() -> None:
    cap, removed = capacity(100, low=0.5)
    for i in range(15):
        cap.add(f"k{i}", 10)
    assert cap.enforce() == 10
    assert removed == [f"k{i}" for i in range(10)]
    assert cap.enforce() == 0


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        LRUCapacity(0)
    with pytest.raises(ValueError):
        LRUCapacity(10, 1.0)
    with pytest.raises(ValueError):
        LRUCapacity(10, 0.9, high_watermark=0.8)
    with pytest.raises(ValueError):
        LRUCapacity(10, 0.9, high_watermark=1.0)
    with pytest.raises(ValueError):
        LRUCapacity(10).reserve(-1)


def test_eviction_runs_outside_the_lock() -> None:
    started, release = threading.Event(), threading.Event()

    def slow_remove(key: str) -> None:
        started.set()
        release.wait(5)

    cap = LRUCapacity(100, 0.5, slow_remove)
    for i in range(10):
        assert cap.reserve(10, f"k{i}")
        cap.commit(f"k{i}", 10)
    writer = threading.Thread(target=lambda: cap.reserve(10, "new"))
    writer.start()
    assert started.wait(5)
    cap.touch("k9")  # a read is not blocked by the eviction in flight
    assert cap.evicting > 0
    release.set()
    writer.join(5)
    assert not writer.is_alive()
    assert cap.evicting == 0
    assert cap.reserved == 10


@pytest.mark.parametrize("high", [None, 0.9])
def test_bound_holds_under_concurrency(high: float | None) -> None:
    """Simulate the disk: bytes land when a reservation is granted, leave when removed."""
    limit = 10_000
    disk_lock = threading.Lock()
    sizes: dict[str, int] = {}
    disk = [0, 0]  # current, peak

    def remove(key: str) -> None:
        with disk_lock:
            disk[0] -= sizes.pop(key)

    cap = LRUCapacity(limit, 0.8, remove, high_watermark=high)

    def work(t: int) -> None:
        for i in range(2000):
            key, size = f"{t}-{i}", 1 + (i * 37 + t) % 500
            if cap.reserve(size, key):
                with disk_lock:  # the writer's temporary file appears
                    sizes[key] = size
                    disk[0] += size
                    disk[1] = max(disk[1], disk[0])
                if i % 7:
                    cap.commit(key, size)
                else:
                    with disk_lock:  # a failed write removes its temporary file
                        disk[0] -= sizes.pop(key)
                    cap.abort(size, key)
            if i % 5 == 0:
                cap.touch(f"{t}-{i - 3}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cap.close()
    assert disk[1] <= limit
    assert cap.used == disk[0] == sum(sizes.values())
    assert cap.reserved == cap.evicting == 0
    assert cap.stats()["evictions"] > 0


def test_a_free_space_floor_evicts_old_objects_whatever_max_bytes_says() -> None:
    disk = {"free": 10_000}
    removed: list[str] = []

    def remove(key: str) -> None:
        removed.append(key)
        disk["free"] += 1000

    cap = LRUCapacity(None, 0.5, remove, free_bytes=lambda: disk["free"], min_free_bytes=4000)
    for i in range(6):  # 6,000 bytes fit above the floor
        assert cap.reserve(1000, f"k{i}")
        disk["free"] -= 1000
        cap.commit(f"k{i}", 1000)
    assert removed == [] and disk["free"] == 4000
    assert cap.reserve(1000, "k6")  # past the floor: the oldest go first, in a batch
    assert removed[0] == "k0" and disk["free"] - 1000 >= 4000
    assert cap.stats()["min_free_bytes"] == 4000


def test_a_floor_that_nothing_evictable_can_meet_refuses_the_write() -> None:
    cap = LRUCapacity(None, 0.5, None, free_bytes=lambda: 4500, min_free_bytes=4000)
    assert cap.reserve(400, "a")
    assert not cap.reserve(400, "b")  # 500 free above the floor, 400 already promised
    cap.abort(400, "a")
    assert cap.reserve(400, "b")


def test_an_object_and_its_companion_are_used_and_evicted_together() -> None:
    """A page and its record (the companion) never part: one use marks both, one eviction takes
    both, though the 20 bytes it needs are the page's alone."""
    removed: list[str] = []
    cap = LRUCapacity(100, 0.9, removed.append, companion=lambda k: None if "~" in k else k + "~")
    for key in ("a", "a~", "b", "b~"):
        assert store(cap, key, 20)
    cap.touch("a")
    assert cap.keys() == ["b", "b~", "a", "a~"]
    cap.touch("b~")
    assert cap.keys() == ["a", "a~", "b~", "b"]
    assert store(cap, "c", 30)  # 110 > 100: down to 90, 20 bytes: a, and a's record with it
    assert removed == ["a", "a~"]
    assert cap.keys() == ["b~", "b", "c"]


def _record(key: str) -> str | None:
    """The companion of page ``pN`` is its record ``pN.r``; a record has none."""
    return None if key.endswith(".r") else f"{key}.r"


def _ahead(release: threading.Event) -> tuple[LRUCapacity, list[str]]:
    """A bound of 100 bytes, watermarks 0.5 and 0.75, whose removals wait for ``release``."""
    removed: list[str] = []

    def remove(key: str) -> None:
        release.wait(5)
        removed.append(key)

    return LRUCapacity(100, 0.5, remove, high_watermark=0.75), removed


def test_removals_start_at_the_midpoint_and_writers_do_not_wait_for_them() -> None:
    release = threading.Event()
    cap, removed = _ahead(release)
    for i in range(7):
        assert store(cap, f"k{i}", 10)
    assert cap.evicting == 0, "70 bytes: below the high watermark"
    assert store(cap, "k7", 10)  # 80 > 75: the oldest down to 50 go, behind this write
    assert cap.evicting == 30 and removed == []
    assert cap.keys() == ["k3", "k4", "k5", "k6", "k7"]
    release.set()
    cap.close()
    assert removed == ["k0", "k1", "k2"] and cap.evicting == 0
    assert cap.stats()["evictions"] == 3


def test_a_writer_at_the_bound_waits_for_the_removals_in_flight() -> None:
    release = threading.Event()
    cap, _ = _ahead(release)
    for i in range(8):
        assert store(cap, f"k{i}", 10)  # k0..k2 detached at 80 bytes
    assert store(cap, "k8", 10) and store(cap, "k9", 10)  # 70 + 30 evicting = 100
    writer = threading.Thread(target=lambda: store(cap, "k10", 10))
    writer.start()
    writer.join(0.2)
    assert writer.is_alive(), "100 bytes taken with the files not yet removed"
    release.set()
    writer.join(5)
    assert not writer.is_alive() and "k10" in cap
    cap.close()
    assert cap.used + cap.evicting <= 100


def test_an_object_written_again_before_its_removal_keeps_its_file() -> None:
    release = threading.Event()
    cap, removed = _ahead(release)
    for i in range(8):
        assert store(cap, f"k{i}", 10)  # k0..k2 detached for removal
    assert cap.reserve(10, "k1")  # a write of k1 finds its old file and keeps it
    cap.abort(10, "k1")
    assert cap.reserve(10, "k2")  # a write of k2 replaces it
    cap.commit("k2", 10)
    release.set()
    cap.close()
    assert removed == ["k0"]
    assert "k1" in cap and "k2" in cap and cap.evicting == 0
    assert cap.stats()["evictions"] == 1


def test_an_object_kept_from_removal_keeps_its_companion() -> None:
    """A page written again before its removal keeps its file, and its record keeps its own: a
    page without the record every read of it needs would be held but never served."""
    release = threading.Event()
    removed: list[str] = []

    def remove(key: str) -> None:
        release.wait(5)
        removed.append(key)

    cap = LRUCapacity(100, 0.5, remove, companion=_record, high_watermark=0.75)
    for i in range(4):
        assert store(cap, f"p{i}", 15) and store(cap, f"p{i}.r", 5)
    # 80 > 75: p0 and its record, p1 and its record are detached (down to 40 bytes).
    assert cap.reserve(15, "p1")  # p1 is written again and finds its old file
    cap.abort(15, "p1")
    release.set()
    cap.close()
    assert sorted(removed) == ["p0", "p0.r"]
    assert "p1" in cap and "p1.r" in cap and cap.evicting == 0
