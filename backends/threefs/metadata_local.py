"""The slot allocator and key → slot map, in process: what the metadata service serves too.

One :class:`LocalMetadata` holds any number of namespaces behind one lock. Per namespace:

* free slots are kept per data file: a min-heap of released slots plus a high-water mark below
  which every slot of the file has been handed out once, so a fresh namespace of millions of
  slots costs nothing and a value's slots come out as runs of consecutive slots of one file;
* consecutive values start in consecutive files, so the pages of a batch are spread over the
  files: a kernel filesystem serialises buffered writes to one file (ext4 and XFS hold the
  file's lock for each ``pwrite``), and a batch whose slots all sat in one file was written one
  page at a time however many I/O threads moved it;
* committed entries sit in an ordered dict in LRU order (a confirmed read moves an entry to the
  end), and a reservation that needs room evicts from the front;
* pending reservations carry a wall-clock expiry (their lease); an expired one is dropped and its
  slots freed the next time the namespace is changed.

Every change is offered to an optional ``journal`` callback as a small record before the call
returns, and :meth:`LocalMetadata.snapshot` / :meth:`LocalMetadata.restore` turn the whole state
into plain data and back: that is how the metadata service persists (see :mod:`.metadata_server`).
"""

from __future__ import annotations

import heapq
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .metadata import (
    Extent,
    Geometry,
    GeometryError,
    Grant,
    Location,
    Lookup,
    Metadata,
    Reservation,
    SlotState,
)

__all__ = ["Journal", "LocalMetadata"]

Journal = Callable[[list[Any]], None]
"""Receives each change as a list: ``["g", ns, geometry]``, ``["r", ns, id, key, length,
extents, expires]``, ``["c", ns, id]``, ``["d", ns, ids]``."""


def _runs(slots: Iterable[int]) -> list[Extent]:
    """Coalesce slot numbers into ``(first, count)`` runs, in ascending order."""
    extents: list[Extent] = []
    for slot in sorted(slots):
        if extents and extents[-1][0] + extents[-1][1] == slot:
            first, count = extents[-1]
            extents[-1] = (first, count + 1)
        else:
            extents.append((slot, 1))
    return extents


def _slots(extents: Iterable[Extent]) -> Iterator[int]:
    for first, count in extents:
        yield from range(first, first + count)


class _Entry:
    """A committed value or a pending reservation."""

    __slots__ = ("expires", "extents", "id", "key", "length", "nslots")

    def __init__(
        self, id: int, key: str, length: int, extents: list[Extent], expires: float = 0.0
    ) -> None:
        self.id = id
        self.key = key
        self.length = length
        self.extents = extents
        self.nslots = sum(count for _, count in extents)
        self.expires = expires


class _Namespace:
    """The slots, entries and reservations of one namespace (the caller holds the lock)."""

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry
        self.entries: OrderedDict[str, _Entry] = OrderedDict()
        self.pending: dict[str, _Entry] = {}
        self.by_id: dict[int, _Entry] = {}
        self.expiries: list[tuple[float, int]] = []
        files = geometry.file_count
        self.free: list[list[int]] = [[] for _ in range(files)]
        """Per file: released slots (global slot numbers), a min-heap."""
        self.high = [0] * files
        """Per file: slots (within the file) below which every one was handed out once."""
        self.next_file = 0
        """The file the next value's slots are taken from first."""
        self.free_slots = geometry.total_slots
        """Slots free over all files (kept, not summed: the eviction loop asks per victim)."""
        self.committed_slots = 0
        self.committed_bytes = 0
        self.reserved_slots = 0
        self.counters = {"evictions": 0, "expired": 0, "commits": 0, "aborts": 0, "deletes": 0}

    def free_count(self) -> int:
        return self.free_slots

    def take(self, n: int) -> list[Extent]:
        """Take ``n`` free slots (there are that many), from the next file first."""
        files, per_file = self.geometry.file_count, self.geometry.slots_per_file
        start = self.next_file
        self.next_file = (start + 1) % files
        taken: list[int] = []
        for file in [(start + i) % files for i in range(files)]:
            free = self.free[file]
            while free and len(taken) < n:
                taken.append(heapq.heappop(free))
            rest = min(n - len(taken), per_file - self.high[file])
            first = file * per_file + self.high[file]
            taken.extend(range(first, first + rest))
            self.high[file] += rest
            if len(taken) == n:
                break
        self.free_slots -= len(taken)
        return _runs(sorted(taken))

    def release(self, entry: _Entry) -> None:
        per_file = self.geometry.slots_per_file
        for slot in _slots(entry.extents):
            heapq.heappush(self.free[slot // per_file], slot)
            self.free_slots += 1

    def add_pending(self, entry: _Entry) -> None:
        self.pending[entry.key] = entry
        self.by_id[entry.id] = entry
        self.reserved_slots += entry.nslots
        heapq.heappush(self.expiries, (entry.expires, entry.id))

    def add_committed(self, entry: _Entry) -> None:
        self.entries[entry.key] = entry
        self.by_id[entry.id] = entry
        self.committed_slots += entry.nslots
        self.committed_bytes += entry.length

    def drop(self, entry: _Entry) -> None:
        """Forget ``entry`` (committed or pending) and free its slots."""
        del self.by_id[entry.id]
        if self.pending.get(entry.key) is entry:
            del self.pending[entry.key]
            self.reserved_slots -= entry.nslots
        else:
            del self.entries[entry.key]
            self.committed_slots -= entry.nslots
            self.committed_bytes -= entry.length
        self.release(entry)

    def rebuild_free(self) -> None:
        """Recompute the free slots from the entries (after a restore)."""
        per_file = self.geometry.slots_per_file
        used: list[set[int]] = [set() for _ in self.free]
        for entry in self.by_id.values():
            for slot in _slots(entry.extents):
                used[slot // per_file].add(slot)
        for file, held in enumerate(used):
            base = file * per_file
            self.high[file] = max(held) - base + 1 if held else 0
            self.free[file] = [
                slot for slot in range(base, base + self.high[file]) if slot not in held
            ]
        self.free_slots = self.geometry.total_slots - sum(len(held) for held in used)


class LocalMetadata(Metadata):
    """The in-process metadata: one lock, any number of namespaces.

    Parameters
    ----------
    lease_s
        How long a reservation stays valid without a commit.
    grace_s
        After construction, ``reserve`` answers ``starting`` for this long: the metadata service
        sets it to the lease when it starts without its state, so that writers of its previous
        run, which may still be writing into slots it no longer knows are taken, finish or give
        up before any slot is handed out again.
    journal
        Called with every change before the method returns (see :data:`Journal`).
    epoch
        The epoch to answer with; a fresh random one by default.
    clock
        Wall-clock time source (seconds); leases are wall-clock so that they survive a restart.
    """

    def __init__(
        self,
        *,
        lease_s: float = 60.0,
        grace_s: float = 0.0,
        journal: Journal | None = None,
        epoch: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.lease_s = lease_s
        self.epoch = epoch or secrets.token_hex(8)
        self.journal = journal
        self._clock = clock
        self._lock = threading.Lock()
        self._spaces: dict[str, _Namespace] = {}
        self._next_id = 1
        self._starting_until = clock() + grace_s if grace_s > 0 else 0.0

    def grace_left(self) -> float:
        """Seconds until ``reserve`` stops answering ``starting`` (0 once it grants slots)."""
        return max(0.0, self._starting_until - self._clock())

    # -- the interface --------------------------------------------------------------------------

    def open(self, ns: str, geometry: Geometry) -> str:
        """Create ``ns`` with ``geometry`` or check that it matches; return the epoch."""
        with self._lock:
            self._space(ns, geometry)
            return self.epoch

    def lookup(self, ns: str, keys: Sequence[str]) -> Lookup:
        """Return the location of each committed key."""
        with self._lock:
            space = self._spaces.get(ns)
            if space is None:
                return Lookup(self.epoch, [None] * len(keys))
            locations: list[Location | None] = []
            for key in keys:
                entry = space.entries.get(key)
                locations.append(
                    None if entry is None else Location(entry.id, entry.length, entry.extents)
                )
            return Lookup(self.epoch, locations)

    def confirm(self, ns: str, epoch: str, pairs: Sequence[tuple[str, int]]) -> list[bool]:
        """Return per ``(key, id)`` whether that entry still holds the key; touch it."""
        with self._lock:
            space = self._spaces.get(ns)
            if space is None or epoch != self.epoch:
                return [False] * len(pairs)
            result = []
            for key, id in pairs:
                entry = space.entries.get(key)
                alive = entry is not None and entry.id == id
                if alive:
                    space.entries.move_to_end(key)
                result.append(alive)
            return result

    def exists(self, ns: str, keys: Sequence[str]) -> int:
        """Return the length of the leading run of committed keys."""
        with self._lock:
            space = self._spaces.get(ns)
            if space is None:
                return 0
            count = 0
            for key in keys:
                if key not in space.entries:
                    break
                count += 1
            return count

    def reserve(self, ns: str, geometry: Geometry, items: Sequence[tuple[str, int]]) -> Reservation:
        """Reserve slots for each ``(key, nbytes)`` (first writer wins; LRU eviction when full)."""
        with self._lock:
            space = self._space(ns, geometry)
            now = self._clock()
            self._expire(ns, space, now)
            starting = now < self._starting_until
            grants = [self._grant(ns, space, key, nbytes, now, starting) for key, nbytes in items]
            return Reservation(self.epoch, self.lease_s, grants)

    def commit(self, ns: str, epoch: str, ids: Sequence[int]) -> list[bool]:
        """Make reservations visible; an id that is already committed answers ``True``."""
        with self._lock:
            space = self._spaces.get(ns)
            if space is None or epoch != self.epoch:
                return [False] * len(ids)
            self._expire(ns, space, self._clock())
            result = []
            for id in ids:
                entry = space.by_id.get(id)
                if entry is None:
                    result.append(False)
                    continue
                if space.pending.get(entry.key) is entry:
                    self._log(["c", ns, id])
                    del space.pending[entry.key]
                    space.reserved_slots -= entry.nslots
                    entry.expires = 0.0
                    space.add_committed(entry)
                    space.counters["commits"] += 1
                result.append(True)
            return result

    def abort(self, ns: str, epoch: str, ids: Sequence[int]) -> None:
        """Free the slots of reservations whose write failed."""
        with self._lock:
            space = self._spaces.get(ns)
            if space is None or epoch != self.epoch:
                return
            dropped = []
            for id in ids:
                entry = space.by_id.get(id)
                if entry is not None and space.pending.get(entry.key) is entry:
                    space.drop(entry)
                    dropped.append(id)
            if dropped:
                space.counters["aborts"] += len(dropped)
                self._log(["d", ns, dropped])

    def delete(self, ns: str, keys: Sequence[str]) -> list[bool]:
        """Remove committed keys; return per key whether it existed."""
        with self._lock:
            space = self._spaces.get(ns)
            if space is None:
                return [False] * len(keys)
            result = []
            dropped = []
            for key in keys:
                entry = space.entries.get(key)
                result.append(entry is not None)
                if entry is not None:
                    space.drop(entry)
                    dropped.append(entry.id)
            if dropped:
                space.counters["deletes"] += len(dropped)
                self._log(["d", ns, dropped])
            return result

    def clear(self, ns: str) -> int:
        """Remove every committed key of ``ns`` (reservations in flight stay)."""
        with self._lock:
            space = self._spaces.get(ns)
            if space is None:
                return 0
            entries = list(space.entries.values())
            for entry in entries:
                space.drop(entry)
            if entries:
                space.counters["deletes"] += len(entries)
                self._log(["d", ns, [entry.id for entry in entries]])
            return len(entries)

    def states(self, ns: str, keys: Sequence[str]) -> list[SlotState]:
        """Return whether each key is absent, reserved or committed."""
        with self._lock:
            space = self._spaces.get(ns)
            if space is None:
                return ["absent"] * len(keys)
            self._expire(ns, space, self._clock())
            result: list[SlotState] = []
            for key in keys:
                if key in space.entries:
                    result.append("committed")
                elif key in space.pending:
                    result.append("reserved")
                else:
                    result.append("absent")
            return result

    def stats(self, ns: str) -> dict[str, Any]:
        """Return the namespace's counters (zeros for a namespace not created yet)."""
        with self._lock:
            space = self._spaces.get(ns)
            if space is None:
                return {"epoch": self.epoch, "objects": 0, "bytes": 0}
            geometry = space.geometry
            return {
                "epoch": self.epoch,
                "objects": len(space.entries),
                "bytes": space.committed_bytes,
                "max_bytes": geometry.capacity,
                "slots": geometry.total_slots,
                "slots_used": space.committed_slots,
                "slots_reserved": space.reserved_slots,
                "slots_free": space.free_count(),
                "reservations": len(space.pending),
                **space.counters,
            }

    # -- persistence ----------------------------------------------------------------------------

    @property
    def lock(self) -> threading.Lock:
        """The lock every call holds; a persistence layer takes it to checkpoint consistently."""
        return self._lock

    def snapshot(self) -> dict[str, Any]:
        """Return the whole state as plain data."""
        with self._lock:
            return self.snapshot_locked()

    def snapshot_locked(self) -> dict[str, Any]:
        """Return the whole state as plain data; the caller holds the lock (a journal callback)."""
        return {
            "version": 1,
            "epoch": self.epoch,
            "next_id": self._next_id,
            "namespaces": {
                ns: {
                    "geometry": [
                        space.geometry.slot_bytes,
                        space.geometry.slots_per_file,
                        space.geometry.file_count,
                    ],
                    "entries": [[e.id, e.key, e.length, e.extents] for e in space.entries.values()],
                    "pending": [
                        [e.id, e.key, e.length, e.extents, e.expires]
                        for e in space.pending.values()
                    ],
                }
                for ns, space in self._spaces.items()
            },
        }

    def restore(self, state: dict[str, Any], records: Iterable[list[Any]] = ()) -> None:
        """Load a :meth:`snapshot`, then replay journal ``records`` written after it."""
        with self._lock:
            self.epoch = str(state.get("epoch") or self.epoch)
            self._next_id = int(state.get("next_id", 1))
            self._spaces = {}
            for ns, data in state.get("namespaces", {}).items():
                space = _Namespace(Geometry(*data["geometry"]))
                for id, key, length, extents in data["entries"]:
                    space.add_committed(_Entry(id, key, length, [tuple(x) for x in extents]))
                for id, key, length, extents, expires in data["pending"]:
                    space.add_pending(_Entry(id, key, length, [tuple(x) for x in extents], expires))
                self._spaces[ns] = space
            for record in records:
                self._replay(record)
            for space in self._spaces.values():
                space.rebuild_free()

    def _replay(self, record: list[Any]) -> None:
        kind, ns = record[0], record[1]
        if kind == "g":
            self._spaces.setdefault(ns, _Namespace(Geometry(*record[2])))
            return
        space = self._spaces.get(ns)
        if space is None:
            return
        if kind == "r":
            _, _, id, key, length, extents, expires = record
            stale = space.pending.get(key)
            if stale is not None:
                del space.by_id[stale.id]
                space.reserved_slots -= stale.nslots
            space.add_pending(_Entry(id, key, length, [tuple(x) for x in extents], expires))
            self._next_id = max(self._next_id, id + 1)
        elif kind == "c":
            entry = space.by_id.get(record[2])
            if entry is not None and space.pending.get(entry.key) is entry:
                del space.pending[entry.key]
                space.reserved_slots -= entry.nslots
                space.add_committed(entry)
        elif kind == "d":
            for id in record[2]:
                entry = space.by_id.pop(id, None)
                if entry is None:
                    continue
                if space.pending.get(entry.key) is entry:
                    del space.pending[entry.key]
                    space.reserved_slots -= entry.nslots
                elif space.entries.get(entry.key) is entry:
                    del space.entries[entry.key]
                    space.committed_slots -= entry.nslots
                    space.committed_bytes -= entry.length

    # -- internals (lock held) ------------------------------------------------------------------

    def _log(self, record: list[Any]) -> None:
        if self.journal is not None:
            self.journal(record)

    def _space(self, ns: str, geometry: Geometry) -> _Namespace:
        space = self._spaces.get(ns)
        if space is None:
            shape = [geometry.slot_bytes, geometry.slots_per_file, geometry.file_count]
            self._log(["g", ns, shape])
            space = self._spaces[ns] = _Namespace(geometry)
        elif space.geometry != geometry:
            raise GeometryError(
                f"namespace {ns!r} has {space.geometry.file_count} files of "
                f"{space.geometry.slots_per_file} slots of {space.geometry.slot_bytes} bytes; "
                f"this client uses {geometry.file_count} files of {geometry.slots_per_file} "
                f"slots of {geometry.slot_bytes} bytes"
            )
        return space

    def _expire(self, ns: str, space: _Namespace, now: float) -> None:
        dropped = []
        while space.expiries and space.expiries[0][0] <= now:
            _, id = heapq.heappop(space.expiries)
            entry = space.by_id.get(id)
            if entry is not None and space.pending.get(entry.key) is entry:
                space.drop(entry)
                dropped.append(id)
        if dropped:
            space.counters["expired"] += len(dropped)
            self._log(["d", ns, dropped])

    def _grant(
        self, ns: str, space: _Namespace, key: str, nbytes: int, now: float, starting: bool
    ) -> Grant:
        if key in space.entries:
            return Grant("exists")
        if key in space.pending:
            return Grant("busy")
        if starting:
            return Grant("starting")
        geometry = space.geometry
        need = geometry.slots_for(nbytes)
        if need > geometry.total_slots:
            return Grant("too_large")
        if need > space.free_count() + space.committed_slots:
            return Grant("full")
        evicted = []
        while space.free_count() < need:
            victim = next(iter(space.entries.values()))
            space.drop(victim)
            evicted.append(victim.id)
        if evicted:
            space.counters["evictions"] += len(evicted)
            self._log(["d", ns, evicted])
        id = self._next_id
        self._next_id += 1
        entry = _Entry(id, key, nbytes, space.take(need), now + self.lease_s)
        self._log(["r", ns, id, key, nbytes, entry.extents, entry.expires])
        space.add_pending(entry)
        return Grant("reserved", id, entry.extents)
