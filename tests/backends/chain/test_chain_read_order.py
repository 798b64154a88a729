"""A read asks the first tier first unless asking the later tiers first is measured cheaper."""

from __future__ import annotations

from pathlib import Path

from hicache_storage import create_backend
from hicache_storage.backends.chain.promotion import SAMPLE_EVERY
from hicache_storage.backends.chain.read_order import MEASURED_CALLS, ReadOrder

VALUE = 64 * 1024


def _measure(order: ReadOrder, *, near_s: float, near_held: float, far_s: float) -> None:
    """Reads of 10 keys asked near first: the first tier holds ``near_held`` of them, the later
    tiers every key it missed; each call takes its seconds a key times the keys asked."""
    for _ in range(MEASURED_CALLS):
        found = round(10 * near_held)
        order.observe(near=True, asked=10, found=found, seconds=10 * near_s, first=True)
        order.observe(near=False, asked=10 - found, found=10 - found, seconds=(10 - found) * far_s,
                      first=False)  # fmt: skip


def test_unmeasured_reads_ask_the_first_tier_first() -> None:
    order = ReadOrder()
    order.observe(near=True, asked=10, found=0, seconds=1.0, first=True)
    order.observe(near=False, asked=10, found=10, seconds=0.001, first=False)
    assert order.near_first(), "one call each measures nothing yet"
    assert order.stats() == {"far_first": 0, "s_per_key": None}


def test_a_first_tier_that_holds_most_and_answers_fast_is_asked_first() -> None:
    order = ReadOrder()
    _measure(order, near_s=0.001, near_held=0.8, far_s=0.005)  # 2.0 ms a key against 5.2
    assert all(order.near_first() for _ in range(3 * SAMPLE_EVERY))


def test_a_first_tier_that_holds_little_is_asked_after_the_later_ones() -> None:
    """The first tier answers as fast as the later tiers but holds a third of what is read (a
    quarter of the working set): asking it first costs a call for two keys in three."""
    order = ReadOrder()
    _measure(order, near_s=0.001, near_held=0.3, far_s=0.001)  # 1.7 ms a key against 1.0
    asked = [order.near_first() for _ in range(2 * SAMPLE_EVERY)]
    assert sum(asked) == 2, "one read in SAMPLE_EVERY still asks it first, to keep measuring"
    stats = order.stats()
    assert stats["far_first"] == 2 * SAMPLE_EVERY - 2
    costs = stats["s_per_key"]
    assert isinstance(costs, dict) and costs["far_first"] < costs["near_first"]


def test_the_first_tiers_share_is_taken_only_from_reads_that_asked_it_first() -> None:
    order = ReadOrder()
    _measure(order, near_s=0.001, near_held=0.9, far_s=0.002)
    for _ in range(4 * MEASURED_CALLS):  # asked after the later tiers, it sees only their misses
        order.observe(near=True, asked=1, found=0, seconds=0.001, first=False)
    assert order.near_first()


def test_a_chain_whose_first_tier_is_slow_reads_the_later_tier_first(tmp_path: Path) -> None:
    """A first tier behind a slow medium: once measured, reads are served by the later tier, and
    a page only the first tier holds is still found there."""
    slow = {"faults": {"default": {"delay_s": 0.005}}}
    tiers = [
        {"backend": "file", "options": {"root": str(tmp_path / "near")}, "layers": slow},
        {"backend": "file", "options": {"root": str(tmp_path / "far")}},
    ]
    with create_backend("chain", {"tiers": tiers, "promote_after_hits": 0}) as chain:
        keys = [f"k{i}" for i in range(8)]
        values = [bytes([i]) * VALUE for i in range(8)]
        assert chain.batch_set(keys, values) == [True] * 8
        for _ in range(2 * MEASURED_CALLS * SAMPLE_EVERY):  # the later tier asked in samples
            outs = [bytearray(VALUE) for _ in keys]
            assert chain.batch_get(keys, outs) == [True] * 8 and outs == values
        before = chain.stats()["tiers"]
        for _ in range(SAMPLE_EVERY):
            outs = [bytearray(VALUE) for _ in keys]
            assert chain.batch_get(keys, outs) == [True] * 8 and outs == values
        after = chain.stats()
        assert after["read_order"]["objects"]["far_first"] > 0
        far_hits = after["tiers"][1]["hits"] - before[1]["hits"]
        near_hits = after["tiers"][0]["hits"] - before[0]["hits"]
        assert far_hits > near_hits, "the later tier served most reads"
        with create_backend("file", {"root": str(tmp_path / "far")}) as far:
            assert far.delete("k0")
        assert chain.get("k0") == values[0], "a page only the first tier holds is still served"
