"""When a page a later tier served is copied into the earlier tiers: two policies of their own.

:class:`HitCountPromotion` admits a page by how often it was read; :class:`PromotionPays` then
promotes only while promotions are measured to pay (below).

A page read once from a remote tier may never be read again (a one-off document); copying it
into the local tier would evict a page that is. Counting reads before promoting (LMCache's and
CacheLib's admission by frequency) keeps one-off pages out; ``after_hits=1`` promotes every page
read, the right choice when the local tier is larger than the pages read again. The counts live
in a bounded table (oldest key forgotten first), so a scan of new keys cannot grow it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Final

__all__ = ["COUNTED_KEYS", "HitCountPromotion", "PromotionPays"]

COUNTED_KEYS: Final = 65536
"""Keys whose later-tier reads are remembered: a few MB of memory, well above the pages an
engine's host pool holds, so a key read again while it is still in the host pool's working
set is still counted."""


class HitCountPromotion:
    """Promote a page once later tiers have served it ``after_hits`` times (0: never)."""

    def __init__(self, after_hits: int, *, counted_keys: int = COUNTED_KEYS) -> None:
        self.after_hits = after_hits
        self._counted_keys = counted_keys
        self._lock = threading.Lock()
        self._hits: OrderedDict[str, int] = OrderedDict()

    def admit(self, keys: Sequence[str]) -> list[bool]:
        """Count one later-tier read of each key; return per key whether to promote it now."""
        if self.after_hits == 0:
            return [False] * len(keys)
        admitted = []
        with self._lock:
            for key in keys:
                count = self._hits.pop(key, 0) + 1
                if count >= self.after_hits:
                    admitted.append(True)
                    continue
                self._hits[key] = count
                admitted.append(False)
                while len(self._hits) > self._counted_keys:
                    self._hits.popitem(last=False)
        return admitted


PROMOTION_OUTCOMES: Final = 64
"""Promotions whose fate (read again from the tier they were copied into, or gone from it
before that read) decides whether the next page is promoted: enough for a share to mean
something, few enough to follow a workload that changes."""

SAMPLE_EVERY: Final = 16
"""While promotions do not pay, one admitted page in this many is still promoted, so the
measure stays current (a workload whose reuse returns is seen again) at a sixteenth of the
promotions' cost."""

_WEIGHT: Final = 0.25
"""Weight of a new call in a tier's seconds a page (the planner's rates use the same)."""


class PromotionPays:
    """Whether promotions into the first tier pay for the writes they cost, measured.

    A promotion writes the page into the first tier inside the read that served it from a later
    tier. It pays when the page is read from the first tier afterwards: each such read saves
    ``later read - first read`` seconds, and the promotion cost one write into the first tier.
    A promoted page read again from a later tier left the first tier unread (the first tier
    holds less than the pages cycling through it), and its promotion was wasted. Promotion goes
    on while ``share paid * (later read - first read) >= first write`` over the last
    :data:`PROMOTION_OUTCOMES` outcomes (a first tier never read yet reads for free), and always
    until 8 outcomes and the later read and first write are measured; otherwise one admitted
    page in :data:`SAMPLE_EVERY`.
    """

    def __init__(self, *, counted_keys: int = COUNTED_KEYS) -> None:
        self._counted_keys = counted_keys
        self._lock = threading.Lock()
        self._promoted: OrderedDict[str, None] = OrderedDict()
        self._outcomes: deque[bool] = deque(maxlen=PROMOTION_OUTCOMES)
        self._rates: dict[str, float] = {}
        self._skipped = 0
        self.paid = 0
        self.unpaid = 0
        self.withheld = 0

    def observe(self, kind: str, pages: int, seconds: float) -> None:
        """Fold a call of ``pages`` pages in ``seconds`` into ``kind``'s seconds a page.

        ``kind`` is ``first_read``, ``later_read`` or ``first_write``.
        """
        if pages <= 0:
            return
        per_page = seconds / pages
        with self._lock:
            old = self._rates.get(kind)
            self._rates[kind] = per_page if old is None else old + _WEIGHT * (per_page - old)

    def served(self, first: Sequence[str], later: Sequence[str]) -> None:
        """Record the pages the first tier and the later tiers served: the promotions' fates."""
        with self._lock:
            for key, paid in [(k, True) for k in first] + [(k, False) for k in later]:
                if key in self._promoted:
                    del self._promoted[key]
                    self._outcomes.append(paid)
                    if paid:
                        self.paid += 1
                    else:
                        self.unpaid += 1

    def choose(self, keys: Sequence[str]) -> list[bool]:
        """Return which of the admitted ``keys`` to promote now; remember those promoted."""
        with self._lock:
            pays = self._pays()
            chosen = []
            for key in keys:
                take = pays or self._skipped % SAMPLE_EVERY == 0
                if not pays:
                    self._skipped += 1
                if take:
                    self._promoted[key] = None
                    while len(self._promoted) > self._counted_keys:
                        self._promoted.popitem(last=False)
                else:
                    self.withheld += 1
                chosen.append(take)
            return chosen

    def _pays(self) -> bool:
        outcomes = self._outcomes
        rates = self._rates
        if len(outcomes) < 8 or "later_read" not in rates or "first_write" not in rates:
            return True
        saved = rates["later_read"] - rates.get("first_read", 0.0)  # unread: free at best
        return sum(outcomes) / len(outcomes) * saved >= rates["first_write"]

    def stats(self) -> dict[str, object]:
        """Return the promotions' fates so far and the rates weighed (seconds a page)."""
        with self._lock:
            return {
                "paid": self.paid,
                "unpaid": self.unpaid,
                "withheld": self.withheld,
                "pays": self._pays(),
                "s_per_page": dict(self._rates),
            }
