"""Promotion off the read path: pages a later tier served reach the earlier tiers from a thread.

A read that promoted inside the call waited for a write into the first tier, and a write to a
disk takes several times a read of it: the promoting reads were the chain's slowest, and a
request waiting on its fetch waited for a copy it does not need. A read now copies the admitted
pages' bytes (its caller's buffers, or for ``batch_get_v1`` its host-pool pages, are the
caller's again once it returns: a memory copy, far cheaper than a write into a busy disk) and
queues them; a thread of the chain stores them into the earlier tiers. The queue holds at most
``max_bytes`` of copies: a
promotion beyond it is shed (counted), so a first tier slower to write than the reads promoting
into it is never offered more than it absorbs, and the copies' memory stays bounded.

A delete or a clear unqueues its keys and waits out the round being stored (:meth:`Promoter.
paused`), so a removed page is never put back once the removal returned; ``close`` drops what is
queued (a promotion is an optimisation, never owed) and waits out the round being stored.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from .behind import COPY_BATCH_BYTES

__all__ = ["MAX_PENDING_BYTES", "Origin", "Promoter"]

MAX_PENDING_BYTES: Final = 4 * COPY_BATCH_BYTES
"""Bytes of copies waiting to be promoted: four rounds of the thread's batches (256 MiB), enough
that a burst of reads never waits for the first tier, bounded so a first tier that cannot keep
up costs promotions, not memory."""

Origin = tuple[int, str]
"""Where queued pages came from: the index of the tier that served them, and their family (what
the chain measures apart)."""

Store = Callable[[Origin, list[str], list[bytes]], None]
"""Store pages of one origin (the first argument) into the earlier tiers."""

_Entry = tuple[Origin, str, bytes]
"""A queued promotion: its origin, the page's key and its bytes."""


class Promoter:
    """Promote queued pages with ``store`` on a daemon thread, ``max_bytes`` of copies at most."""

    def __init__(self, store: Store, max_bytes: int = MAX_PENDING_BYTES) -> None:
        self._store = store
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: collections.deque[_Entry] = collections.deque()
        self._bytes = 0
        self._taken: list[_Entry] = []
        """The round the thread took, until it begins to store it (a removal filters it)."""
        self._busy = False
        self._storing = threading.Lock()
        self._stopping = False
        self._counts = dict.fromkeys(("queued", "shed", "dropped"), 0)
        self._thread = threading.Thread(target=self._run, name="hicache-chain-promote", daemon=True)
        self._thread.start()

    def offer(self, origin: Origin, keys: Sequence[str], values: Sequence[bytes]) -> int:
        """Queue copies of pages from ``origin``; return how many were shed (no room)."""
        with self._changed:
            taken = 0
            for key, value in zip(keys, values, strict=True):
                if self._stopping or self._bytes + len(value) > self._max_bytes:
                    break
                self._queue.append((origin, key, value))
                self._bytes += len(value)
                taken += 1
            self._counts["queued"] += taken
            self._counts["shed"] += len(keys) - taken
            if taken:
                self._changed.notify_all()
        return len(keys) - taken

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued page was stored (or ``timeout_s`` passed); return whether."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    @contextlib.contextmanager
    def paused(self, keys: Sequence[str] | None) -> Iterator[None]:
        """Hold promotion still and unqueue ``keys`` (every key if None) inside the block.

        The round the thread has taken but not begun to store is filtered too, so no page of
        ``keys`` is stored from the moment the block is entered until it is left.
        """
        with self._storing:
            with self._changed:
                self._queue = self._without(self._queue, keys)
                self._taken = list(self._without(self._taken, keys))
                self._bytes = sum(len(e[2]) for e in self._queue)
                self._changed.notify_all()
            yield

    def _without(
        self, entries: Sequence[_Entry], keys: Sequence[str] | None
    ) -> collections.deque[_Entry]:
        """Return ``entries`` but those of ``keys`` (all of them if None), counting the dropped."""
        gone = None if keys is None else set(keys)
        kept = collections.deque(e for e in entries if gone is not None and e[1] not in gone)
        self._counts["dropped"] += len(entries) - len(kept)
        return kept

    def close(self) -> None:
        """Drop what is queued and stop, once the round being stored (if any) is done."""
        with self.paused(None), self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join()

    def stats(self) -> dict[str, Any]:
        """Pages ``queued``, ``shed`` (no room), ``dropped`` (removed) and still ``pending``."""
        with self._lock:
            return {**self._counts, "pending": len(self._queue) + int(self._busy)}

    def _take(self) -> bool:
        """Wait for queued pages and take up to one round's worth; False once stopping."""
        with self._changed:
            while not self._queue and not self._stopping:
                self._changed.wait()
            if self._stopping:
                return False
            total = 0
            while self._queue and (
                not self._taken or total + len(self._queue[0][2]) <= COPY_BATCH_BYTES
            ):
                entry = self._queue.popleft()
                self._taken.append(entry)
                total += len(entry[2])
            self._bytes -= total
            self._busy = True
            return True

    def _run(self) -> None:
        while self._take():
            try:
                with self._storing:  # a removal between the take and here filtered the round
                    with self._lock:
                        batch, self._taken = self._taken, []
                    for origin in sorted({e[0] for e in batch}):
                        picked = [e for e in batch if e[0] == origin]
                        self._store(origin, [e[1] for e in picked], [e[2] for e in picked])
            except Exception:  # noqa: BLE001 - the chain counts a tier's failures; never raise
                pass
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()
