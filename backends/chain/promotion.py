"""Which pages the first tier gets: two policies of their own.

:class:`HitCountPromotion` admits a page a later tier served by how often it was read;
:class:`FirstTierPays` places pages in the first tier (written or promoted) only while that is
measured to pay (below).

A page read once from a remote tier may never be read again (a one-off document); copying it
into the local tier would evict a page that is. Counting reads before promoting (LMCache's and
CacheLib's admission by frequency) keeps one-off pages out; ``after_hits=1`` promotes every page
read, the right choice when the local tier is larger than the pages read again. The counts live
in a bounded table (oldest key forgotten first), so a scan of new keys cannot grow it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

__all__ = ["COUNTED_KEYS", "FirstTierPays", "HitCountPromotion"]

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


PLACEMENTS_REMEMBERED: Final = 64
"""Placements into the first tier the measure remembers (older ones weigh less, by
``1 - 1/64`` a placement): enough to mean something, few enough to follow a workload that
changes."""

SAMPLE_EVERY: Final = 16
"""While the first tier does not pay, one page in this many is still placed there, so the
measure stays current (a workload whose reuse returns is seen again) at a sixteenth of the
cost."""

MEASURE_PLACEMENTS: Final = 8
"""Placements made before the rule weighs them, so its counts mean something."""

_WEIGHT: Final = 0.25
"""Weight of a new call in a tier's seconds a page (the planner's rates use the same)."""


class FirstTierPays:
    """Whether placing pages in the first tier pays for the writes it costs, measured.

    A page is placed in the first tier by a write (``through``: beside the later tiers;
    ``behind``: before them) or by a promotion, after a read a later tier served; each placement
    costs one write into the first tier. A read of a placed page from the first tier saves
    ``later read - first read`` seconds; a read of it from a later tier means it left the first
    tier first (the first tier holds less than the pages cycling through it, a scan, documents
    read in turn) or saves nothing. Pages go on being placed while the reads saved pay for the
    writes: ``first-tier reads x (later read - first read) >= placements x first write``, over
    decayed counts of the last :data:`PLACEMENTS_REMEMBERED` placements (a first tier never read
    yet reads for free); otherwise one page in :data:`SAMPLE_EVERY` is placed, so reuse that
    returns is seen. A first tier measured no faster to read than the later ones (``later read
    <= first read``) saves nothing whatever the reuse, so it gets no sample: each would be a
    write of pure cost, on a disk the later tier may share; the read order's samples
    (:mod:`.read_order`) go on timing its reads of the pages it holds, and once those say it is
    the faster one, sampling resumes. Until the rule is measured (:data:`MEASURE_PLACEMENTS`
    placements, a later read and a first write), the first placements are made and then only the
    sample: a placement is a bet until reads say the first tier is the faster one, and a prefill
    that writes a working set larger than the first tier before any of it is read back would
    otherwise write the first tier full of pages read from the later tiers anyway (two tiers on
    one disk: every page written twice). Two tiers on one disk save nothing and stop; a hot set
    the first tier holds pays many times over.
    """

    def __init__(self, *, counted_keys: int = COUNTED_KEYS) -> None:
        self._counted_keys = counted_keys
        self._lock = threading.Lock()
        self._placed: OrderedDict[str, None] = OrderedDict()
        self._placements = 0.0
        self._near_reads = 0.0
        self._rates: dict[str, float] = {}
        self._skipped = 0
        self.placed = 0
        self.near_reads = 0
        self.left_unread = 0
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
        """Record the pages the first tier and the later tiers served: what placements saved."""
        with self._lock:
            for key in first:
                if key in self._placed:
                    self._near_reads += 1
                    self.near_reads += 1
            for key in later:
                if key in self._placed:
                    del self._placed[key]
                    self.left_unread += 1

    @property
    def measured(self) -> bool:
        """Whether the rates and placements the rule weighs are measured yet."""
        rates = self._rates
        placed = self.placed >= MEASURE_PLACEMENTS
        return placed and "later_read" in rates and "first_write" in rates

    def choose(self, keys: Sequence[str]) -> list[bool]:
        """Return which of ``keys`` to place in the first tier now; remember those placed."""
        with self._lock:
            chosen = []
            keep = 1.0 - 1.0 / PLACEMENTS_REMEMBERED
            for key in keys:
                pays = self._pays()  # per key: unmeasured, the count placed decides
                take = pays or (self._may_save() and self._skipped % SAMPLE_EVERY == 0)
                if not pays:
                    self._skipped += 1
                if take:
                    self._placed[key] = None
                    self._placed.move_to_end(key)
                    while len(self._placed) > self._counted_keys:
                        self._placed.popitem(last=False)
                    self._placements = self._placements * keep + 1
                    self._near_reads *= keep
                    self.placed += 1
                else:
                    self.withheld += 1
                chosen.append(take)
            return chosen

    def _may_save(self) -> bool:
        """Whether a page in the first tier can save anything: unmeasured, or it reads faster."""
        rates = self._rates
        if not self.measured:
            return True
        return rates["later_read"] > rates.get("first_read", 0.0)

    def _pays(self) -> bool:
        rates = self._rates
        if not self.measured:
            return self.placed < MEASURE_PLACEMENTS
        saved = rates["later_read"] - rates.get("first_read", 0.0)
        return self._near_reads * saved >= self._placements * rates["first_write"]

    def stats(self) -> dict[str, object]:
        """Return the placements so far, what they saved, and the rates weighed."""
        with self._lock:
            return {
                "placed": self.placed,
                "near_reads": self.near_reads,
                "left_unread": self.left_unread,
                "withheld": self.withheld,
                "pays": self._pays(),
                "s_per_page": dict(self._rates),
            }
