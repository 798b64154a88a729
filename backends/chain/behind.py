"""Write-behind: pages the first tier stored reach the later tiers from a thread of its own.

The queue holds keys and sizes only. The bytes are read back from the first tier when their
turn comes, so a write returns as soon as the first tier holds its pages and never lends the
caller's buffers (a host pool's pages are reused once the call returns) to a later copy. A page
the first tier evicted before its turn is counted ``missing``: the later tiers never see it, as
they would not have under write-through had the page never been written.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

from hicache_storage.backend import StorageBackend

__all__ = ["COPY_BATCH_BYTES", "WriteBehind"]

COPY_BATCH_BYTES: Final = 64 << 20
"""Bytes copied to the later tiers per round: the memory write-behind holds beyond its queue of
keys (eight 8 MiB pages), enough for a batch call to amortise a remote store's round trip."""


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
        self._queue: collections.deque[tuple[str, int]] = collections.deque()
        self._busy = 0
        self._copying = threading.Lock()
        self._stopping = False
        self._counts = {"queued": 0, "written": 0, "shed": 0, "missing": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name="hicache-chain-behind", daemon=True)
        self._thread.start()

    def offer(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """Queue ``keys`` (each ``sizes[i]`` bytes) for the later tiers; beyond the bound, shed."""
        with self._changed:
            room = 0 if self._stopping else max(0, self._max_pending - len(self._queue))
            taken = list(zip(keys, sizes, strict=True))[:room]
            self._queue.extend(taken)
            self._counts["queued"] += len(taken)
            self._counts["shed"] += len(keys) - len(taken)
            if taken:
                self._changed.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued page was copied (or ``timeout_s`` passed); return whether."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._queue or self._busy:
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
            self._counts["shed"] += len(self._queue)
            self._queue.clear()
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
                if keys is None:
                    dropped = len(self._queue)
                    self._queue.clear()
                else:
                    gone = set(keys)
                    kept = [entry for entry in self._queue if entry[0] not in gone]
                    dropped = len(self._queue) - len(kept)
                    self._queue = collections.deque(kept)
                self._counts["queued"] -= dropped
                self._changed.notify_all()
            yield

    def stats(self) -> dict[str, Any]:
        """Pages queued, written to every later tier, shed, missing from the first, failed."""
        with self._lock:
            return {**self._counts, "pending": len(self._queue) + self._busy}

    def _take(self) -> list[tuple[str, int]] | None:
        """Wait for queued pages; return up to one round's worth, or None once stopping."""
        with self._changed:
            while not self._queue and not self._stopping:
                self._changed.wait()
            if self._stopping:
                return None
            batch: list[tuple[str, int]] = []
            total = 0
            while self._queue and (not batch or total + self._queue[0][1] <= COPY_BATCH_BYTES):
                key, size = self._queue.popleft()
                batch.append((key, size))
                total += size
            self._busy = len(batch)
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            try:
                with self._copying:
                    self._copy(batch)
            finally:
                with self._changed:
                    self._busy = 0
                    self._changed.notify_all()

    def _copy(self, batch: list[tuple[str, int]]) -> None:
        keys = [key for key, _ in batch]
        buffers = [bytearray(size) for _, size in batch]
        try:
            found = self._source.batch_get(keys, buffers)
        except Exception:  # noqa: BLE001 - the tiers' layers answer misses; anything else is a miss
            found = [False] * len(keys)
        held = [i for i, hit in enumerate(found) if hit]
        written = [True] * len(held)
        for target in self._targets if held else []:
            try:
                stored = target.batch_set([keys[i] for i in held], [buffers[i] for i in held])
            except Exception:  # noqa: BLE001 - a later tier's failure is counted, never raised
                stored = [False] * len(held)
            written = [a and b for a, b in zip(written, stored, strict=True)]
        with self._lock:
            self._counts["missing"] += len(keys) - len(held)
            self._counts["written"] += sum(written)
            self._counts["failed"] += len(written) - sum(written)
