"""Pages go into the first tier (written or promoted) only while that pays for the writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hicache_storage import create_backend
from hicache_storage.backends.chain.promotion import MEASURE_PLACEMENTS, SAMPLE_EVERY, FirstTierPays
from hicache_storage.hostpool import MHAHostPool

VALUE = 256 * 1024


def _rates(pays: FirstTierPays, *, first: float, later: float, write: float) -> None:
    pays.observe("first_read", 1, first)
    pays.observe("later_read", 1, later)
    pays.observe("first_write", 1, write)


def test_placements_never_read_near_stop_all_but_a_sample() -> None:
    pays = FirstTierPays()
    _rates(pays, first=0.001, later=0.010, write=0.002)
    keys = [f"k{i}" for i in range(8)]
    assert pays.choose(keys) == [True] * 8
    pays.served([], keys)  # each came back from the later tier: it left the first unread
    chosen = pays.choose([f"n{i}" for i in range(2 * SAMPLE_EVERY)])
    assert sum(chosen) == 2 and chosen[0] and chosen[SAMPLE_EVERY]
    stats = pays.stats()
    assert stats["left_unread"] == 8 and stats["pays"] is False


def test_placements_go_on_while_the_reads_saved_pay_for_the_writes() -> None:
    keys = [f"k{i}" for i in range(8)]
    pays = FirstTierPays()
    _rates(pays, first=0.001, later=0.010, write=0.002)
    pays.choose(keys)
    pays.served(keys[:2], [])  # 2 near reads x 9 ms saved >= 8 placements x 2 ms written
    assert pays.choose(["x", "y"]) == [True, True]
    slow_write = FirstTierPays()
    _rates(slow_write, first=0.001, later=0.010, write=0.003)  # 18 ms saved < 24 ms written
    slow_write.choose(keys)
    slow_write.served(keys[:2], [])
    assert slow_write.stats()["pays"] is False


def test_one_disk_twice_saves_nothing_and_stops() -> None:
    pays = FirstTierPays()
    _rates(pays, first=0.001, later=0.001, write=0.001)
    keys = [f"k{i}" for i in range(8)]
    pays.choose(keys)
    pays.served(keys * 4, [])  # read near again and again, but no faster than far
    assert pays.stats()["pays"] is False


def test_unmeasured_the_first_placements_are_made_then_a_sample() -> None:
    pays = FirstTierPays()
    chosen = pays.choose([f"n{i}" for i in range(MEASURE_PLACEMENTS + 2 * SAMPLE_EVERY)])
    assert chosen[:MEASURE_PLACEMENTS] == [True] * MEASURE_PLACEMENTS  # in one call, too
    rest = chosen[MEASURE_PLACEMENTS:]
    assert sum(rest) == 2 and rest[0] and rest[SAMPLE_EVERY] and not pays.measured


def test_a_first_tier_no_faster_than_the_later_gets_no_sample_until_it_reads_faster() -> None:
    """Two tiers on one disk: a placement there can save nothing, whatever the reuse."""
    pays = FirstTierPays()
    _rates(pays, first=0.004, later=0.003, write=0.010)
    assert pays.choose([f"k{i}" for i in range(MEASURE_PLACEMENTS)]) == [True] * MEASURE_PLACEMENTS
    assert pays.measured
    assert not any(pays.choose([f"n{i}" for i in range(4 * SAMPLE_EVERY)]))
    for _ in range(8):  # its reads of the pages it holds turn faster (the read order's samples)
        pays.observe("first_read", 1, 0.0005)
    chosen = pays.choose([f"m{i}" for i in range(2 * SAMPLE_EVERY)])
    assert sum(chosen) == 2, "sampling resumes once a placement could save a read"


def test_a_working_set_written_before_any_read_is_placed_only_as_a_sample(
    tmp_path: Path,
) -> None:
    """Documents loaded, then queried: before any read says the first tier pays, it takes the
    pages the rule needs and a sample though it has room for all, so a prefill is not written
    twice over; every page is served."""
    chain = _chain(tmp_path, near_values=64)
    for i in range(64):
        assert chain.set(f"k{i}", bytes([i]) * VALUE)
    first = chain.stats()["first_tier"]["objects"]
    assert first["placed"] <= MEASURE_PLACEMENTS + 64 // SAMPLE_EVERY
    assert first["withheld"] == 64 - first["placed"]
    assert chain.stats()["tiers"][0]["stats"]["capacity"]["evictions"] == 0
    for i in range(64):
        assert chain.get(f"k{i}") == bytes([i]) * VALUE
    chain.close()


def _chain(tmp_path: Path, near_values: int) -> Any:
    slow = {"faults": {"default": {"delay_s": 0.01}}}
    tiers = [
        {"backend": "file", "options": {"root": str(tmp_path / "near"),
                                        "max_bytes": near_values * VALUE + 1024}},
        {"backend": "file", "options": {"root": str(tmp_path / "far")}, "layers": slow},
    ]  # fmt: skip
    return create_backend("chain", {"tiers": tiers})


def test_a_cycle_larger_than_the_first_tier_stops_promoting(tmp_path: Path) -> None:
    chain = _chain(tmp_path, near_values=4)
    for i in range(16):
        assert chain.set(f"k{i}", bytes([i]) * VALUE)
    for _ in range(4):
        for i in range(16):
            assert chain.get(f"k{i}") == bytes([i]) * VALUE
    first = chain.stats()["first_tier"]["objects"]
    assert first["left_unread"] >= 8 and first["left_unread"] > 3 * first["near_reads"]
    assert first["withheld"] > 0  # it stopped, but for samples (which may turn it back on)
    chain.close()


def test_a_hot_set_the_first_tier_holds_is_promoted_and_read_there(tmp_path: Path) -> None:
    chain = _chain(tmp_path, near_values=8)
    for i in range(16):
        assert chain.set(f"k{i}", bytes([i]) * VALUE)
    for i in range(16):  # the first tier now holds the last few written; read the first four
        chain.get(f"k{i}")
    for _ in range(12):
        for i in range(4):
            assert chain.get(f"k{i}") == bytes([i]) * VALUE
    stats = chain.stats()
    assert stats["first_tier"]["objects"]["pays"] is True and stats["tiers"][0]["promoted"] >= 4
    assert stats["tiers"][0]["hits"] >= 40  # the hot set is read from the first tier
    chain.close()


def test_pages_and_the_objects_beside_them_are_measured_apart(tmp_path: Path) -> None:
    """A zero-copy page's rates are its own: the small objects written in copying calls beside
    it (an integrity record a page) cost far less a key and must not stand for it."""
    slow = {"faults": {"ops": {"batch_set_v1": {"delay_s": 0.05}}}}
    tiers = [
        {"backend": "file", "options": {"root": str(tmp_path / "near")}, "layers": slow},
        {"backend": "file", "options": {"root": str(tmp_path / "far")}},
    ]
    pool = MHAHostPool(4 * 16, 16, 2, 2, 8, torch.float16, "page_first", False)
    with create_backend("chain", {"tiers": tiers}) as chain:
        chain.register_host_pool(pool)
        for i in range(4):
            assert chain.batch_set_v1([f"page{i}"], torch.arange(16)) == [True]
            for j in range(4):
                assert chain.set(f"object{i}.{j}", b"x" * 64)
        first = chain.stats()["first_tier"]
    assert first["pages"]["placed"] == 4 and first["objects"]["placed"] >= MEASURE_PLACEMENTS
    assert first["pages"]["s_per_page"]["first_write"] >= 0.05
    assert first["objects"]["s_per_page"]["first_write"] < 0.05
