"""Which tiers a read asks first: the first tier, unless the later ones first is measured cheaper.

A read asks its tiers one after another, each for the pages the tiers before it missed. Asking
the first tier first pays when it holds much of what is read and answers fast; it costs a whole
call when it holds little of it (a first tier smaller than the pages cycling through it) or is
slow (a disk busy writing and evicting), since the later tiers, written through, hold the pages
anyway. :class:`ReadOrder` weighs the two orders from what the tiers' calls measure:

- each side's seconds per key asked (``near``: the first tier; ``far``: the later tiers), hits
  and misses as they come, exponentially weighted;
- the share of the keys asked that each side held: the first tier's from reads that asked it
  first (asked after the later tiers, it only sees their misses), the later tiers' from every
  read.

With ``a`` the seconds a key and ``h`` the share held, a key costs ``a_near + (1 - h_near) *
a_far`` asked near first and ``a_far + (1 - h_far) * a_near`` far first; a read asks far first
while that is cheaper. Until each side has :data:`MEASURED_CALLS` calls it asks near first, but
for one read in :data:`~.promotion.SAMPLE_EVERY` far first while the later tiers lack calls (a
first tier holding every page asked never sends a read on to them); once measured, one read in
:data:`~.promotion.SAMPLE_EVERY` asked far first asks near first instead, so the first tier's
share stays measured and a first tier that becomes worth asking first again is seen.
"""

from __future__ import annotations

import threading
from typing import Final

from hicache_storage.planner.rates import WeightedMean

from .promotion import SAMPLE_EVERY

__all__ = ["MEASURED_CALLS", "ReadOrder"]

MEASURED_CALLS: Final = 8
"""Calls each side is measured over before the order may change: with a new call weighing a
quarter, eight calls carry 90 % of the weight, so one odd call cannot turn the order."""

_WEIGHT: Final = 0.25
"""Weight of a new call in each mean (the chain's other rates use the same)."""


class ReadOrder:
    """Measure the tiers' reads; say whether the next read asks the first tier first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ask = {side: WeightedMean(_WEIGHT) for side in ("near", "far")}
        self._held = {side: WeightedMean(_WEIGHT) for side in ("near", "far")}
        self._reads = 0
        self.far_first = 0

    def observe(self, *, near: bool, asked: int, found: int, seconds: float, first: bool) -> None:
        """Fold a tier's read call of ``asked`` keys, ``found`` held, in ``seconds``.

        ``near`` says the first tier answered it, ``first`` that it was the first call of its
        read.
        """
        if asked <= 0 or seconds < 0:
            return
        side = "near" if near else "far"
        with self._lock:
            self._ask[side].add(seconds / asked)
            if first or not near:
                self._held[side].add(min(found, asked) / asked)

    def near_first(self) -> bool:
        """Whether the next read asks the first tier first (see the module docstring)."""
        with self._lock:
            self._reads += 1
            sample = self._reads % SAMPLE_EVERY == 0
            costs = self._costs()
            if costs is None:  # near first, but for a sample while the later tiers lack calls
                near = not (sample and self._ask["far"].samples < MEASURED_CALLS)
            else:
                near = costs[0] <= costs[1] or sample
            self.far_first += not near
            return near

    def _costs(self) -> tuple[float, float] | None:
        """Seconds a key costs asked near first and far first, once both sides are measured."""
        a_near, a_far = self._ask["near"].value, self._ask["far"].value
        h_near, h_far = self._held["near"].value, self._held["far"].value
        if a_near is None or a_far is None or h_near is None or h_far is None:
            return None
        sides = (*self._ask.values(), *self._held.values())
        if any(m.samples < MEASURED_CALLS for m in sides):
            return None
        return a_near + (1 - h_near) * a_far, a_far + (1 - h_far) * a_near

    def stats(self) -> dict[str, object]:
        """Return the reads asked far first and what a key costs each order (None: unmeasured)."""
        with self._lock:
            costs = self._costs()
        return {
            "far_first": self.far_first,
            "s_per_key": None if costs is None else {"near_first": costs[0], "far_first": costs[1]},
        }
