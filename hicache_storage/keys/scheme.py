"""What every key scheme answers: the keys of pages, which keys a rank owns, whether it writes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

__all__ = ["KeyScheme"]


class KeyScheme(Protocol):
    """One rank's mapping from page hashes to storage keys.

    :class:`~hicache_storage.keys.rank_suffix.RankSuffixScheme` gives one key per page;
    :class:`~hicache_storage.keys.unified.UnifiedPlan` one per object (layer chunk and head
    group) of the page.
    """

    @property
    def keys_per_page(self) -> int:
        """Keys (objects) this rank stores per page."""
        ...

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes; ranks holding replicated KV leave it to one of them."""
        ...

    def keys(self, page_hashes: Iterable[str]) -> list[str]:
        """Return the keys of ``page_hashes``: page-major, ``keys_per_page`` per page."""
        ...

    def owns(self, key: str) -> bool:
        """Whether ``key`` is one of this rank's keys (backends evict and clear only those)."""
        ...
