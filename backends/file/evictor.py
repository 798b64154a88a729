"""Capacity accounting of the file backend: a byte budget with least-recently-used eviction.

A writer reserves the bytes of its value before writing it, then commits them under the key once
the object is published, or aborts the reservation when it is not. Reserved bytes count against
the budget exactly like stored ones, so concurrent writers can never overshoot it together.

When a reservation does not fit, the least recently used objects are evicted until usage (stored
plus reserved plus the new value) falls to ``low_watermark * max_bytes``, which batches evictions
instead of evicting on every write. Eviction never touches a key that a writer has pinned by
reserving for it.

The files are removed outside the lock, so reads that only mark a key as used never wait for
disk work. Bytes being evicted keep counting against the budget until their files are gone, the
reservation that caused the eviction is granted only after that, and any other writer that
needs room meanwhile waits for the eviction in flight instead of evicting more: the objects on
disk plus the writes in flight never exceed ``max_bytes``.

With ``high_watermark``, removal starts before the bound is reached: once a reservation takes
usage past ``high_watermark * max_bytes``, the oldest objects down to the low watermark are
detached at once and their files removed on a thread of the index's own, one by one, so a writer
waits for removals only when it reaches the bound before they are done. Without it, the writer
that reaches the bound removes the batch inside its call, and a batch takes as long as unlinking
every file in it (seconds, on a disk busy with writes), stalling that write and every writer
behind it. A detached object written again before its file is removed keeps the file.

With ``companion``, each object may have one companion object (a page and the integrity record
the verify layer stores beside it): a use of either marks both as used, and an eviction takes
both or neither, so a page is never kept without the record every read of it needs.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

__all__ = ["LRUCapacity"]


class LRUCapacity:
    """Thread-safe byte budget and LRU index of the objects one backend instance owns.

    Parameters
    ----------
    max_bytes
        The budget, or ``None`` for an index that counts but never evicts.
    low_watermark
        Fraction of ``max_bytes`` that an eviction frees down to, in (0, 1).
    remove
        Called with each evicted key, without the lock held; it deletes the object and should
        not raise.
    free_bytes
        Returns the bytes free on the medium now; with ``min_free_bytes``, a write must leave
        at least that many free (counting the writes in flight as written), and old objects
        are evicted to make room, whatever ``max_bytes`` says (with no ``max_bytes`` too).
    min_free_bytes
        The free-space floor ``free_bytes`` is held above; 0 turns it off.
    companion
        Returns the key of an object's companion (its integrity record), or None for an object
        that has none (a record itself); see the module docstring.
    high_watermark
        Fraction of ``max_bytes`` past which removals start on a thread of the index's own,
        in (``low_watermark``, 1); None removes at the bound, inside the writer's call (see the
        module docstring). :meth:`close` stops the thread.
    """

    def __init__(
        self,
        max_bytes: int | None,
        low_watermark: float = 0.9,
        remove: Callable[[str], None] | None = None,
        *,
        free_bytes: Callable[[], int] | None = None,
        min_free_bytes: int = 0,
        companion: Callable[[str], str | None] | None = None,
        high_watermark: float | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        if not 0.0 < low_watermark < 1.0:
            raise ValueError(f"low_watermark must be within (0, 1), got {low_watermark}")
        if high_watermark is not None and not low_watermark < high_watermark < 1.0:
            raise ValueError(
                f"high_watermark must be within (low_watermark, 1), got {high_watermark}"
            )
        self.max_bytes = max_bytes
        self.low_watermark = low_watermark
        self.min_free_bytes = min_free_bytes if free_bytes is not None else 0
        self._free_bytes = free_bytes
        self._remove = remove
        self._companion = companion
        self._owner: dict[str, str] = {}
        """Companion key -> the indexed object it belongs to (the reverse of ``companion``)."""
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._pinned: Counter[str] = Counter()
        self._used = 0
        self._reserved = 0
        self._evicting = 0
        self._evictions = 0
        self._evicted_bytes = 0
        self.high_watermark = high_watermark
        self._pending: dict[str, int] = {}
        """Detached objects whose files the removal thread has yet to remove, oldest first, and
        their sizes; an object written again leaves it (:meth:`_revive`)."""
        self._remover: threading.Thread | None = None
        self._closed = False

    # -- the write protocol ---------------------------------------------------------------------

    def reserve(self, nbytes: int, key: str | None = None) -> bool:
        """Claim ``nbytes`` of budget for a write, evicting old objects if needed.

        With ``key``, the key is pinned (never evicted) until :meth:`commit` or :meth:`abort`.
        Returns once any eviction it started has removed its files.

        Returns
        -------
        bool
            False when the value alone exceeds ``max_bytes`` or not enough unpinned objects
            can be evicted; nothing is evicted or reserved then.
        """
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative size ({nbytes})")
        with self._lock:
            victims = self._claim(nbytes)
            if victims is None:
                return False
            self._reserved += nbytes
            if key is not None:
                self._pinned[key] += 1
            if not victims:
                self._evict_ahead()
        if victims:
            try:
                self._remove_all(victims)
            except BaseException:
                self.abort(nbytes, key)
                raise
        return True

    def commit(self, key: str, nbytes: int, *, pinned: bool = True) -> None:
        """Turn a reservation of ``nbytes`` into the stored object ``key`` (most recently used).

        ``pinned`` says whether the reservation was made with ``key`` (the default).
        """
        with self._lock:
            self._reserved -= nbytes
            self._unpin(key, pinned)
            self._keep(key)
            self._index(key, nbytes)

    def abort(self, nbytes: int, key: str | None = None) -> None:
        """Give back a reservation whose write failed or found the key already stored."""
        with self._lock:
            self._reserved -= nbytes
            if key is not None:
                self._unpin(key, True)
                self._keep(key)  # a write that found it still on disk: it stays stored

    # -- the index ------------------------------------------------------------------------------

    def add(self, key: str, nbytes: int) -> None:
        """Index an object found on disk as the most recently used, without a reservation."""
        with self._lock:
            self._index(key, nbytes)

    def touch(self, key: str) -> None:
        """Mark ``key`` and its companion as just used (a read hit); unknown keys are ignored."""
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                mate = self._mate(key)
                if mate is not None and mate in self._lru:
                    self._lru.move_to_end(mate)

    def forget(self, key: str) -> int | None:
        """Drop ``key`` from the index (it was deleted); return its size, or None if unknown."""
        with self._lock:
            return self._unindex(key)

    def forget_many(self, keys: Iterable[str]) -> None:
        """Drop every key of ``keys`` from the index."""
        with self._lock:
            for key in keys:
                self._unindex(key)

    def enforce(self) -> int:
        """Evict down to the low watermark if usage exceeds the limit; return evictions."""
        with self._lock:
            total = self._used + self._reserved + self._evicting
            limit = self._limit()
            if limit is None or total <= limit:
                return 0
            excess = total - int(limit * self.low_watermark)
            victims = self._detach(self._pick(excess)[0])
        self._remove_all(victims)
        return len(victims)

    def close(self, timeout_s: float = 30.0) -> None:
        """Remove the files of objects already detached (for at most ``timeout_s``), then stop."""
        with self._lock:
            self._closed = True
            self._freed.notify_all()
            remover = self._remover
        if remover is not None:
            remover.join(timeout_s)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._lru

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def keys(self) -> list[str]:
        """Return the indexed keys, least recently used first."""
        with self._lock:
            return list(self._lru)

    @property
    def used(self) -> int:
        """Bytes of the indexed objects."""
        with self._lock:
            return self._used

    @property
    def reserved(self) -> int:
        """Bytes reserved by writes in flight."""
        with self._lock:
            return self._reserved

    @property
    def evicting(self) -> int:
        """Bytes of evicted objects whose files are being removed."""
        with self._lock:
            return self._evicting

    def stats(self) -> dict[str, int | None]:
        """Return a consistent snapshot of the counters."""
        with self._lock:
            return {
                "objects": len(self._lru),
                "bytes": self._used,
                "reserved_bytes": self._reserved,
                "evicting_bytes": self._evicting,
                "max_bytes": self.max_bytes,
                "min_free_bytes": self.min_free_bytes,
                "evictions": self._evictions,
                "evicted_bytes": self._evicted_bytes,
            }

    # -- internals (lock held) ------------------------------------------------------------------

    def _index(self, key: str, nbytes: int) -> None:
        """Index ``key`` as the most recently used object; its companion's recency follows."""
        self._unindex(key)
        self._lru[key] = nbytes
        self._used += nbytes
        mate = self._companion(key) if self._companion is not None else None
        if mate is not None:
            self._owner[mate] = key
            if mate in self._lru:
                self._lru.move_to_end(mate)

    def _unindex(self, key: str) -> int | None:
        """Drop ``key`` from the index (and its companion's tie to it); return its size."""
        size = self._lru.pop(key, None)
        if size is None:
            return None
        self._used -= size
        mate = self._companion(key) if self._companion is not None else None
        if mate is not None:
            self._owner.pop(mate, None)
        return size

    def _mate(self, key: str) -> str | None:
        """Return the companion of indexed ``key``, or the object it is the companion of."""
        owner = self._owner.get(key)
        if owner is not None or self._companion is None:
            return owner
        return self._companion(key)

    def _unpin(self, key: str, pinned: bool) -> None:
        if pinned and self._pinned[key] > 0:
            self._pinned[key] -= 1
            if not self._pinned[key]:
                del self._pinned[key]

    def _claim(self, nbytes: int) -> list[tuple[str, int]] | None:
        """Make ``nbytes`` fit: return the objects to remove first, or None if it cannot fit."""
        while True:
            limit = self._limit()
            if limit is None:
                return []
            if nbytes > limit:
                return None
            if self._used + self._reserved + self._evicting + nbytes <= limit:
                return []
            if self._evicting:  # another writer is freeing room: wait for it, then look again
                self._freed.wait()
                continue
            target = int(limit * self.low_watermark)
            victims, freed = self._pick(self._used + self._reserved + nbytes - target)
            if self._used + self._reserved + nbytes - freed > limit:
                return None  # evicting every unpinned object would not be enough
            return self._detach(victims)

    def _evict_ahead(self) -> None:
        """Past the high watermark, detach down to the low one for the removal thread."""
        limit = self._limit()
        high = self.high_watermark
        if high is None or self._closed or limit is None or self._evicting:
            return
        total = self._used + self._reserved
        if total <= limit * high:
            return
        victims = self._detach(self._pick(total - int(limit * self.low_watermark))[0])
        if not victims:
            return
        self._pending.update(victims)
        if self._remover is None:
            self._remover = threading.Thread(
                target=self._remove_ahead, name="hicache-file-evict", daemon=True
            )
            self._remover.start()
        self._freed.notify_all()

    def _keep(self, key: str) -> None:
        """Index ``key`` and its companion again if their removals are pending."""
        mate = self._companion(key) if self._companion is not None else None
        for name in (key, mate):
            if name is not None and (size := self._revive(name)) is not None:
                self._index(name, size)

    def _revive(self, key: str) -> int | None:
        """Take ``key`` back from the removals pending (written again); return its old size."""
        size = self._pending.pop(key, None)
        if size is not None:
            self._evicting -= size
            self._evictions -= 1
            self._evicted_bytes -= size
            self._freed.notify_all()
        return size

    def _remove_ahead(self) -> None:
        """Remove detached objects' files one by one (the removal thread), until closed.

        An object written again since it was detached is no longer pending (:meth:`_revive`);
        one being written again (pinned) keeps its file and is indexed again: the write either
        replaces it or finds it and keeps it.
        """
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._freed.wait()
                if not self._pending:
                    return
                key = next(iter(self._pending))
                if key in self._pinned:
                    self._keep(key)
                    continue
                size = self._pending.pop(key)
            self._remove_all([(key, size)])

    def _limit(self) -> int | None:
        """Return the bytes the owned objects may take now: ``max_bytes``, lowered by the floor.

        With a floor, the objects may grow by what is free beyond it: ``used + free - floor``.
        Bytes reserved or being evicted count as taken, so writes in flight are never promised
        the same free space twice.
        """
        if self._free_bytes is None or self.min_free_bytes == 0:
            return self.max_bytes
        room = self._used + self._evicting + self._free_bytes() - self.min_free_bytes
        return max(0, room) if self.max_bytes is None else max(0, min(self.max_bytes, room))

    def _pick(self, excess: int) -> tuple[list[str], int]:
        """Choose unpinned objects, oldest first, until ``excess`` bytes are covered.

        An object goes with its companion; one whose companion is being written stays.
        """
        victims: dict[str, None] = {}
        freed = 0
        for key, size in self._lru.items():
            if freed >= excess:
                break
            if key in self._pinned or key in victims:
                continue
            mate = self._mate(key)
            if mate in self._pinned:
                continue
            victims[key] = None
            freed += size
            if mate is not None and mate in self._lru:
                victims[mate] = None
                freed += self._lru[mate]
        return list(victims), freed

    def _detach(self, victims: list[str]) -> list[tuple[str, int]]:
        """Drop ``victims`` from the index; their bytes count as evicting until removed."""
        detached = []
        for key in victims:
            size = self._lru[key]
            self._unindex(key)
            self._evicting += size
            self._evictions += 1
            self._evicted_bytes += size
            detached.append((key, size))
        return detached

    def _remove_all(self, victims: list[tuple[str, int]]) -> None:
        """Remove the files of detached objects (lock not held), then release their bytes."""
        try:
            if self._remove is not None:
                for key, _ in victims:
                    self._remove(key)
        finally:
            with self._lock:
                self._evicting -= sum(size for _, size in victims)
                self._freed.notify_all()
