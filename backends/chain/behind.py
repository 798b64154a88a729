"""Write-behind: pages the first tier stored reach the later tiers from a thread of its own.

The queue holds keys and sizes only. The bytes are read back from the first tier when their
turn comes, so a write returns as soon as the first tier holds its pages and never lends the
caller's buffers (a host pool's pages are reused once the call returns) to a later copy. A page
the first tier evicted before its turn is counted ``missing``: the later tiers never see it, as
they would not have under write-through had the page never been written.

A read-back that misses is told apart by asking the first tier whether it still holds the page
(its layers answer a failed read as a miss): a page it no longer holds is ``missing``; a page it
holds but could not read is tried again after a back-off, up to :data:`READ_ATTEMPTS` reads in
all (``retried``), then counted ``failed``, so an acknowledged write reaches the later tiers
while the first tier holds it and its reads fail only now and then.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

from hicache_storage.backend import StorageBackend

__all__ = ["COPY_BATCH_BYTES", "READ_ATTEMPTS", "RETRY_BACKOFF_S", "WriteBehind"]

COPY_BATCH_BYTES: Final = 64 << 20
"""Bytes copied to the later tiers per round: the memory write-behind holds beyond its queue of
keys (eight 8 MiB pages), enough for a batch call to amortise a remote store's round trip."""

READ_ATTEMPTS: Final = 5
"""Reads of a page the first tier holds before write-behind gives it up (counted ``failed``)."""

RETRY_BACKOFF_S: Final = (0.05, 1.0)
"""The wait before a failed read-back is tried again: the first value, doubling on each further
failure of the page up to the second (1.55 s in all over :data:`READ_ATTEMPTS` reads)."""

_Entry = tuple[str, int, int]
"""A queued page: its key, its size and how many of its read-backs failed."""


class WriteBehind:
    """Copy queued pages from ``source`` to each of ``targets`` on a daemon thread."""

    def __init__(
        self, source: StorageBackend, targets: Sequence[StorageBackend], max_pending: int
    ) -> None:
        self._source = source
        self._targets = list(targets)
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: collections.deque[_Entry] = collections.deque()
        self._retries: list[tuple[float, _Entry]] = []
        """Pages whose read-back failed, with the time each is due again."""
        self._taken: list[_Entry] = []
        """The round the thread took, until it begins to copy it (a removal filters it)."""
        self._busy = 0
        self._copying = threading.Lock()
        self._stopping = False
        self._counts = dict.fromkeys(
            ("queued", "written", "shed", "missing", "retried", "failed"), 0
        )
        self._thread = threading.Thread(target=self._run, name="hicache-chain-behind", daemon=True)
        self._thread.start()

    def offer(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """Queue ``keys`` (each ``sizes[i]`` bytes) for the later tiers; beyond the bound, shed."""
        with self._changed:
            pending = len(self._queue) + len(self._retries)
            room = 0 if self._stopping else max(0, self._max_pending - pending)
            taken = [(key, size, 0) for key, size in zip(keys, sizes, strict=True)][:room]
            self._queue.extend(taken)
            self._counts["queued"] += len(taken)
            self._counts["shed"] += len(keys) - len(taken)
            if taken:
                self._changed.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued page was copied (or ``timeout_s`` passed); return whether."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._queue or self._retries or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def close(self, timeout_s: float) -> None:
        """Copy what is queued (for at most ``timeout_s``), then stop; the rest is shed."""
        self.flush(timeout_s)
        with self._changed:
            self._stopping = True
            self._counts["shed"] += len(self._queue) + len(self._retries)
            self._queue.clear()
            self._retries.clear()
            self._changed.notify_all()
        self._thread.join(timeout_s)

    @contextlib.contextmanager
    def paused(self, keys: Sequence[str] | None) -> Iterator[None]:
        """Hold the copying still and unqueue ``keys`` (every key if None) inside the block.

        A page deleted (or cleared) while queued, or while its round was being copied, must not
        reach a later tier after the deletion returned.
        """
        with self._copying:
            with self._changed:
                before = len(self._queue) + len(self._retries) + len(self._taken)
                if keys is None:
                    self._queue.clear()
                    self._retries.clear()
                    self._taken = []
                else:
                    gone = set(keys)
                    self._queue = collections.deque(e for e in self._queue if e[0] not in gone)
                    self._retries = [r for r in self._retries if r[1][0] not in gone]
                    self._taken = [e for e in self._taken if e[0] not in gone]
                after = len(self._queue) + len(self._retries) + len(self._taken)
                self._counts["queued"] -= before - after
                self._changed.notify_all()
            yield

    def stats(self) -> dict[str, Any]:
        """Pages queued, written to every later tier, shed, missing from the first, retried, failed.

        ``retried`` counts read-backs tried again after a failure (see the module docstring).
        """
        with self._lock:
            pending = len(self._queue) + len(self._retries) + self._busy
            return {**self._counts, "pending": pending}

    def _take(self) -> list[_Entry] | None:
        """Wait for queued pages; return up to one round's worth, or None once stopping."""
        with self._changed:
            while True:
                if self._stopping:
                    return None
                wait = self._ripen()
                if self._queue:
                    break
                self._changed.wait(wait)
            batch = self._taken = []
            total = 0
            while self._queue and (not batch or total + self._queue[0][1] <= COPY_BATCH_BYTES):
                entry = self._queue.popleft()
                batch.append(entry)
                total += entry[1]
            self._busy = len(batch)
            return batch

    def _ripen(self) -> float | None:
        """Queue the retries that are due, first; return the seconds to the next (lock held)."""
        now = time.monotonic()
        due = [entry for when, entry in self._retries if when <= now]
        if due:
            self._retries = [r for r in self._retries if r[0] > now]
            self._queue.extendleft(reversed(due))
        if not self._retries:
            return None
        return min(when for when, _ in self._retries) - now

    def _run(self) -> None:
        while self._take() is not None:
            try:
                with self._copying:  # a removal between the take and here filtered the round
                    with self._lock:
                        batch, self._taken = self._taken, []
                    if batch:
                        self._copy(batch)
            finally:
                with self._changed:
                    self._busy = 0
                    self._changed.notify_all()

    def _copy(self, batch: list[_Entry]) -> None:
        keys = [key for key, _, _ in batch]
        buffers = [bytearray(size) for _, size, _ in batch]
        try:
            found = self._source.batch_get(keys, buffers)
        except Exception:  # noqa: BLE001 - the tiers' layers answer misses; anything else is a miss
            found = [False] * len(keys)
        held = [i for i, hit in enumerate(found) if hit]
        unread = [batch[i] for i, hit in enumerate(found) if not hit and self._holds(keys[i])]
        written = [True] * len(held)
        for target in self._targets if held else []:
            try:
                stored = target.batch_set([keys[i] for i in held], [buffers[i] for i in held])
            except Exception:  # noqa: BLE001 - a later tier's failure is counted, never raised
                stored = [False] * len(held)
            written = [a and b for a, b in zip(written, stored, strict=True)]
        now = time.monotonic()
        low, high = RETRY_BACKOFF_S
        again = [
            (now + min(high, low * 2**failures), (key, size, failures + 1))
            for key, size, failures in unread
            if failures + 1 < READ_ATTEMPTS
        ]
        with self._lock:
            self._counts["missing"] += len(keys) - len(held) - len(unread)
            self._counts["written"] += sum(written)
            self._counts["failed"] += len(written) - sum(written) + len(unread) - len(again)
            self._counts["retried"] += len(again)
            self._retries.extend(again)

    def _holds(self, key: str) -> bool:
        """Whether the first tier still holds ``key`` (a tier that cannot say: it does not)."""
        try:
            return self._source.exists(key)
        except Exception:  # noqa: BLE001 - as for reads: the tier's failure is a miss
            return False
