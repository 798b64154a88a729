"""What the 3FS backend asks of its metadata: the slot protocol, its records and its interface.

Values live in fixed-size slots of large files; the metadata maps each key to the slots that hold
its bytes. A write follows one protocol, whichever implementation answers it:

1. ``reserve`` the key: the metadata hands out free slots (evicting the least recently used
   committed keys when full) under a *lease*, or answers that the key exists already (first
   writer wins) or that another writer holds it (``busy``);
2. write the bytes into those slots;
3. ``commit``: only now does the key become visible to readers. A failed write is ``abort``-ed;
   a writer killed mid-write leaves a reservation that expires with its lease, so no reader ever
   sees its slots and their space comes back.

A read is optimistic: ``lookup`` gives the slots, the reader reads them, then ``confirm`` checks
that the same entry (by id) still holds the key. An entry's slots are only handed out again after
the entry is gone, so a confirmed read saw exactly the committed bytes; a read that raced an
eviction is a miss.

Every answer carries the metadata's *epoch*. Ids are only meaningful within one epoch: a
metadata service restarted without its snapshot starts a new epoch, and a ``confirm`` or
``commit`` carrying the old one is refused.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

__all__ = [
    "Extent",
    "Geometry",
    "GeometryError",
    "Grant",
    "Location",
    "Lookup",
    "Metadata",
    "Reservation",
    "SlotState",
]

Extent = tuple[int, int]
"""A run of consecutive slots: ``(first slot, count)``."""

SlotState = Literal["absent", "reserved", "committed"]
GrantStatus = Literal["reserved", "exists", "busy", "starting", "full", "too_large"]


class GeometryError(ValueError):
    """A namespace is used with a slot geometry other than the one it was created with."""


class Geometry(msgspec.Struct, frozen=True, array_like=True):
    """How a namespace's files are cut into slots.

    Attributes
    ----------
    slot_bytes
        Bytes per slot.
    slots_per_file
        Slots in each data file (``file_size // slot_bytes``).
    file_count
        Data files; slot ``s`` lives in file ``s // slots_per_file``.
    """

    slot_bytes: int
    slots_per_file: int
    file_count: int

    @property
    def total_slots(self) -> int:
        """Slots over all files."""
        return self.slots_per_file * self.file_count

    @property
    def capacity(self) -> int:
        """Bytes over all slots."""
        return self.total_slots * self.slot_bytes

    def slots_for(self, nbytes: int) -> int:
        """Return how many slots a value of ``nbytes`` occupies."""
        return -(-nbytes // self.slot_bytes)


class Location(msgspec.Struct, frozen=True, array_like=True):
    """Where a committed value lives: its entry id, byte length and slot runs."""

    id: int
    length: int
    extents: list[Extent]


class Lookup(msgspec.Struct, frozen=True):
    """The answer to ``lookup``: one location (or ``None`` for a miss) per key."""

    epoch: str
    locations: list[Location | None]


class Grant(msgspec.Struct, frozen=True, array_like=True):
    """The answer for one key of ``reserve``.

    ``status`` is ``reserved`` (write ``extents``, then commit ``id``), ``exists`` (the key is
    committed: nothing to write), ``busy`` (another writer holds it), ``starting`` (a restarted
    service waits for the leases of its previous run to run out), ``full`` (not enough slots
    even after evicting every committed key) or ``too_large`` (more than the whole capacity).
    """

    status: GrantStatus
    id: int = 0
    extents: list[Extent] = []


class Reservation(msgspec.Struct, frozen=True):
    """The answer to ``reserve``: the epoch, the lease in seconds and one grant per key."""

    epoch: str
    lease_s: float
    grants: list[Grant]


class Metadata(abc.ABC):
    """The key → slot map of the 3FS backend; in-process or behind an HTTP service.

    Every method takes the namespace ``ns`` it acts on; namespaces are independent (their own
    files, slots, keys and LRU order). Implementations are safe to call from several threads.
    Errors of a remote implementation are the typed backend errors
    (:class:`~hicache_storage.errors.BackendUnavailableError`,
    :class:`~hicache_storage.errors.BackendTimeoutError`).
    """

    @abc.abstractmethod
    def open(self, ns: str, geometry: Geometry) -> str:
        """Create namespace ``ns`` with ``geometry`` (or check it matches); return the epoch.

        Raises
        ------
        GeometryError
            If ``ns`` exists with another geometry.
        """

    @abc.abstractmethod
    def lookup(self, ns: str, keys: Sequence[str]) -> Lookup:
        """Return where each committed key lives (``None`` for absent or uncommitted keys)."""

    @abc.abstractmethod
    def confirm(self, ns: str, epoch: str, pairs: Sequence[tuple[str, int]]) -> list[bool]:
        """Return per ``(key, id)`` whether entry ``id`` still holds ``key``; touch the LRU."""

    @abc.abstractmethod
    def exists(self, ns: str, keys: Sequence[str]) -> int:
        """Return the length of the leading run of committed keys."""

    @abc.abstractmethod
    def reserve(self, ns: str, geometry: Geometry, items: Sequence[tuple[str, int]]) -> Reservation:
        """Reserve slots for each ``(key, nbytes)``; see :class:`Grant` for the answers.

        Raises
        ------
        GeometryError
            If ``ns`` exists with another geometry.
        """

    @abc.abstractmethod
    def commit(self, ns: str, epoch: str, ids: Sequence[int]) -> list[bool]:
        """Make reserved entries visible; ``False`` for a reservation that expired or is gone."""

    @abc.abstractmethod
    def abort(self, ns: str, epoch: str, ids: Sequence[int]) -> None:
        """Give back reservations whose write failed."""

    @abc.abstractmethod
    def delete(self, ns: str, keys: Sequence[str]) -> list[bool]:
        """Remove committed keys; return per key whether it existed."""

    @abc.abstractmethod
    def clear(self, ns: str) -> int:
        """Remove every committed key of ``ns``; return how many there were."""

    @abc.abstractmethod
    def states(self, ns: str, keys: Sequence[str]) -> list[SlotState]:
        """Return whether each key is absent, reserved by a writer or committed."""

    @abc.abstractmethod
    def stats(self, ns: str) -> dict[str, Any]:
        """Return the counters of namespace ``ns`` (objects, bytes, max_bytes, ...)."""

    def close(self) -> None:  # noqa: B027 - the in-process implementation holds nothing
        """Release connections; calling it again does nothing."""
