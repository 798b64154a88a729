"""When a page a later tier served is copied into the earlier tiers: a policy of its own.

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

__all__ = ["COUNTED_KEYS", "HitCountPromotion"]

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
