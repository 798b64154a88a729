"""Promotion into the first tier goes on only while it is measured to pay for its writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hicache_storage import create_backend
from hicache_storage.backends.chain.promotion import SAMPLE_EVERY, PromotionPays

VALUE = 256 * 1024


def _rates(pays: PromotionPays, *, first: float, later: float, write: float) -> None:
    pays.observe("first_read", 1, first)
    pays.observe("later_read", 1, later)
    pays.observe("first_write", 1, write)


def test_promotions_that_leave_unread_stop_all_but_a_sample() -> None:
    pays = PromotionPays()
    _rates(pays, first=0.001, later=0.010, write=0.002)
    keys = [f"k{i}" for i in range(8)]
    assert pays.choose(keys) == [True] * 8
    pays.served([], keys)  # each came back from the later tier: gone from the first unread
    chosen = pays.choose([f"n{i}" for i in range(2 * SAMPLE_EVERY)])
    assert sum(chosen) == 2 and chosen[0] and chosen[SAMPLE_EVERY]
    assert pays.stats()["unpaid"] == 8 and pays.stats()["pays"] is False


def test_promotions_read_again_near_go_on_while_the_saving_beats_the_write() -> None:
    pays = PromotionPays()
    _rates(pays, first=0.001, later=0.010, write=0.002)
    keys = [f"k{i}" for i in range(8)]
    pays.choose(keys)
    pays.served(keys[:4], keys[4:])  # half paid: 0.5 x 9 ms saved >= 2 ms written
    assert pays.choose(["x", "y"]) == [True, True]
    slow_write = PromotionPays()
    _rates(slow_write, first=0.001, later=0.010, write=0.006)  # 0.5 x 9 ms < 6 ms
    slow_write.choose(keys)
    slow_write.served(keys[:4], keys[4:])
    assert slow_write.stats()["pays"] is False


def test_unmeasured_promotions_are_made() -> None:
    pays = PromotionPays()
    assert pays.choose(["a", "b"]) == [True, True]


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
    promotion = chain.stats()["promotion"]
    assert promotion["unpaid"] >= 8 and promotion["unpaid"] > 4 * promotion["paid"]
    assert promotion["withheld"] > 0  # it stopped, but for samples (which may flip it back)
    chain.close()


def test_a_hot_set_the_first_tier_holds_keeps_promoting(tmp_path: Path) -> None:
    chain = _chain(tmp_path, near_values=8)
    for i in range(16):
        assert chain.set(f"k{i}", bytes([i]) * VALUE)
    for i in range(16):  # the first tier now holds the last few written; read the first four
        chain.get(f"k{i}")
    for _ in range(12):
        for i in range(4):
            assert chain.get(f"k{i}") == bytes([i]) * VALUE
    stats = chain.stats()
    assert stats["promotion"]["withheld"] == 0
    assert stats["tiers"][0]["hits"] >= 40
    chain.close()
