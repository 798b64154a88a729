"""The shared ledger of one namespace's bytes: what a quota is enforced against.

Every process writing into a namespace (on any machine) asks the same ledger for room before it
writes and tells it what it stored after. The ledger lives where all of them can reach it (a
file on the shared mount, the Redis the pages live in), and each call is one atomic step there,
so writers that never talk to each other never overshoot the quota together:

* :meth:`QuotaLedger.reserve` claims the bytes of a write as a *hold*. When the namespace is
  full it also takes the least recently used pages out of the ledger (the *victims*, which the
  caller deletes) and keeps their bytes as a second hold until they are gone; it frees down to a
  low watermark so evictions come in batches. While another writer's victims are being
  deleted, a write that does not fit gets no grant (it waits for that room rather than evicting
  more), nor does one that would not fit even with every page evicted (the rest is held by
  writes in flight).
* :meth:`QuotaLedger.settle` turns a hold into the pages the write stored (or drops it when
  nothing was stored); :meth:`QuotaLedger.release` drops a hold whose victims are deleted.
* Holds expire: a process killed between reserve and settle leaves bytes counted that nobody
  will settle; once its hold is older than ``hold_s`` the next reservation forgets it. The
  bound holds as long as no write outlives its hold (every backend bounds a call by its
  deadline, a few seconds, far below the default hold).

Only pages of this namespace are ever victims: one tenant filling its quota evicts its own
least recently used pages, never another tenant's (whose pages are in another ledger).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Grant", "LedgerUsage", "QuotaLedger"]


@dataclass(frozen=True)
class Grant:
    """Room granted to one write: its hold, and the pages to delete first (with their hold)."""

    hold: str
    """The id of the write's own hold, settled or released when the write is done."""
    victims: list[tuple[str, int]] = field(default_factory=list)
    """``(key, nbytes)`` of the pages taken out of the ledger, to delete before writing."""
    evicting: str | None = None
    """The hold covering the victims' bytes until they are deleted (None without victims)."""


@dataclass(frozen=True)
class LedgerUsage:
    """A namespace's bytes as its ledger counts them, across every process."""

    used_bytes: int
    """Bytes of the pages the ledger holds."""
    held_bytes: int
    """Bytes of writes in flight and of victims being deleted (unexpired holds)."""
    pages: int
    """Pages the ledger holds."""


class QuotaLedger(Protocol):
    """The accounting a quota is enforced against; one atomic step per call (see the module)."""

    def reserve(
        self,
        nbytes: int,
        *,
        quota: int,
        target: int,
        now: float,
        hold_s: float,
        touched: Sequence[tuple[str, float]] = (),
    ) -> Grant | None:
        """Hold ``nbytes`` within ``quota``, evicting down to ``target`` bytes when full.

        ``touched`` (key, time of its last read) is applied first, so the choice of victims
        sees the reads this process made since its last call. Returns None when the write
        does not fit now (see the module); nothing changes then (but expired holds and
        touches).
        """
        ...

    def settle(self, hold: str, stored: Sequence[tuple[str, int]], *, now: float) -> None:
        """Drop ``hold`` and record the pages of ``stored`` (``(key, nbytes)``) as just used."""
        ...

    def release(self, hold: str) -> None:
        """Drop ``hold`` (its victims are deleted, or its write stored nothing)."""
        ...

    def touch(self, touched: Sequence[tuple[str, float]]) -> None:
        """Record the reads of ``touched`` (key, time) for the least-recently-used order."""
        ...

    def forget(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        """Take ``keys`` out of the ledger (they are about to be deleted).

        Returns the ``(key, nbytes)`` it held, for :meth:`settle` to put back should the delete
        fail.
        """
        ...

    def clear(self) -> None:
        """Take every page out of the ledger (the namespace was cleared); holds stay."""
        ...

    def usage(self, *, now: float) -> LedgerUsage:
        """Return the namespace's bytes as the ledger counts them now."""
        ...

    def close(self) -> None:
        """Release the ledger's connection; the shared state stays."""
        ...
