"""The jobs the storage threads run: a :class:`Prefetch` (query, then reads) and a :class:`Backup`.

The scheduler's thread builds a job and hands it to :class:`StorageIO
<hicache_storage.engine.storage_io.StorageIO>`; the threads advance it and report back. A
prefetch is shared with them while it runs: its state (:class:`PrefetchState`) only moves
forward, under its own lock, and what the scheduler may read of it (pages found, pages read,
the call in flight) is read under that lock too. A backup is a frozen value, and its outcome a
:class:`BackupDone` the scheduler collects with :meth:`StorageIO.poll
<hicache_storage.engine.storage_io.StorageIO.poll>`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hicache_storage.errors import ConfigError

__all__ = ["Backup", "BackupDone", "Prefetch", "PrefetchState"]


class PrefetchState(enum.Enum):
    """Where a :class:`Prefetch` is; only ever moves forward."""

    QUERYING = "querying"
    """Waiting for, or in, the existence query."""
    QUERIED = "queried"
    """Storage holds ``hit_pages`` leading pages; waiting for host slots to read them into."""
    READING = "reading"
    """Reading the pages storage holds, batch by batch."""
    FINISHED = "finished"
    """No more reads: every hit page read, a read failed, or the fetch was cancelled."""


class Prefetch:
    """One L3→L2 fetch of a run of consecutive pages into host slots.

    Parameters
    ----------
    keys
        Storage keys of the pages, ``keys_per_page`` per page, in page order.
    keys_per_page
        Keys each page is stored under (several for a multi-object key scheme).
    host_indices
        Host slots of the pages' tokens, ``page_size`` per page; allocated by the scheduler and
        not touched by it until the fetch is finished. None to give them after the query
        (:meth:`assign`): the fetch then waits in ``QUERIED``.
    page_size
        Tokens per page.
    ticket
        The scheduler's handle, returned untouched.

    Notes
    -----
    Pages arrive in order, so the usable result is always a prefix: :meth:`cancel` returns how
    many leading pages were read, and those slots are the caller's at once; the rest of the slots
    are the caller's once the state is ``FINISHED`` (a batch may still be writing into them).
    """

    def __init__(
        self,
        keys: Sequence[str],
        keys_per_page: int,
        host_indices: torch.Tensor | None,
        page_size: int,
        ticket: object = None,
    ) -> None:
        if len(keys) % keys_per_page or (
            host_indices is not None
            and host_indices.numel() != len(keys) // keys_per_page * page_size
        ):
            raise ConfigError(
                f"{len(keys)} keys at {keys_per_page} per page do not match "
                f"{0 if host_indices is None else host_indices.numel()} host slots at "
                f"{page_size} per page"
            )
        self.keys = list(keys)
        self.keys_per_page = keys_per_page
        self.host_indices = host_indices
        self.page_size = page_size
        self.ticket = ticket
        self.pages = len(keys) // keys_per_page
        self.started = time.monotonic()
        self.query_s: float | None = None
        """Seconds the existence query took, once it answered."""
        self.finished_at: float | None = None
        """When (``time.monotonic``) the fetch finished, once it has."""
        self.ready: Callable[[], None] | None = None
        """Returns once the host slots may be written; called before every read (see assign)."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._state = PrefetchState.QUERYING
        self._calls: dict[int, tuple[int, float]] = {}
        """Batches being read: first page -> (end page, when the call started)."""
        self._arrived: dict[int, tuple[int, int]] = {}
        """Batches read past the leading run: first page -> (end of what arrived, batch end)."""
        self._next_page = 0
        self._hit_pages: int | None = None
        self._read_pages = 0
        self._cancelled = False
        self._stopped = False

    @property
    def state(self) -> PrefetchState:
        """Where the fetch is."""
        with self._lock:
            return self._state

    @property
    def stopped(self) -> bool:
        """Whether a read came back short or raised: the store failed to deliver the rest."""
        with self._lock:
            return self._stopped

    @property
    def hit_pages(self) -> int | None:
        """Leading pages storage holds, once the existence query answered."""
        with self._lock:
            return self._hit_pages

    @property
    def read_pages(self) -> int:
        """Leading pages read into their host slots so far."""
        with self._lock:
            return self._read_pages

    @property
    def target_pages(self) -> int:
        """Pages the fetch is after: the hits once known, else every page asked for."""
        with self._lock:
            return self.pages if self._hit_pages is None else self._hit_pages

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called (the fetch did not end on its own)."""
        with self._lock:
            return self._cancelled

    @property
    def call(self) -> tuple[float, int]:
        """Seconds the oldest read call in flight has run and its pages; ``(0.0, 0)`` if none."""
        with self._lock:
            if not self._calls:
                return 0.0, 0
            first, (end, started) = min(self._calls.items(), key=lambda item: item[1][1])
            return time.monotonic() - started, end - first

    def wait_change(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` until the fetch's state or progress changes."""
        with self._changed:
            if self._state is not PrefetchState.FINISHED:
                self._changed.wait(max(timeout_s, 0.0))

    def cancel(self) -> int:
        """Stop reading further batches; return the leading pages read (final from now on)."""
        with self._lock:
            self._cancelled = True
            if self._state is not PrefetchState.READING or not self._calls:
                self._finish()
            self._changed.notify_all()
            return self._read_pages

    def assign(
        self, host_indices: torch.Tensor, *, ready: Callable[[], None] | None = None
    ) -> bool:
        """Give a ``QUERIED`` fetch the host slots of its first ``numel / page_size`` pages.

        Fewer slots than hit pages shorten the fetch. ``ready`` returns once the slots may be
        written (GPU copies still landing in them); the read threads call it before reading,
        so the caller does not wait. Return False (the slots stay the caller's) when the fetch
        is no longer waiting for slots.
        """
        pages = host_indices.numel() // self.page_size
        with self._lock:
            if self._state is not PrefetchState.QUERIED or self._hit_pages is None or pages < 1:
                return False
            self.ready = ready
            self.host_indices = host_indices[: min(pages, self._hit_pages) * self.page_size]
            self._hit_pages = min(pages, self._hit_pages)
            self._state = PrefetchState.READING
            self._changed.notify_all()
            return True

    # -- the threads' side ------------------------------------------------------------------------

    def _queried(self, hit_pages: int, seconds: float) -> bool:
        """Record the query's answer; return whether to read at once (slots given up front)."""
        with self._lock:
            self._changed.notify_all()
            self.query_s = seconds
            self._hit_pages = hit_pages
            if self._cancelled or hit_pages == 0:
                self._finish()
                return False
            if self.host_indices is None:
                self._state = PrefetchState.QUERIED
                return False
            self._state = PrefetchState.READING
            return True

    def _next_batch(self, batch_pages: int) -> tuple[int, int] | None:
        """Hand out the next ``[first, end)`` pages to read, or None when none is left to read.

        Several read threads may read batches of one fetch at once; the fetch finishes once
        nothing is left to hand out and no batch is being read.
        """
        with self._lock:
            assert self._hit_pages is not None
            if self._state is PrefetchState.FINISHED:
                return None
            if self._cancelled or self._stopped or self._next_page >= self._hit_pages:
                self._finish_if_idle()
                return None
            first = self._next_page
            end = self._next_page = min(first + batch_pages, self._hit_pages)
            self._calls[first] = (end, time.monotonic())
            return first, end

    def _read(self, first: int, pages: int, complete: bool) -> None:
        """Record the batch at ``first``: its ``pages`` leading pages read, ``complete`` or not.

        Pages count once every page before them has arrived; an incomplete batch ends the
        fetch's usable run where it failed (batches after it are not used).
        """
        with self._lock:
            end, _ = self._calls.pop(first)
            if not self._cancelled:
                self._arrived[first] = (first + pages, end)
                while self._read_pages in self._arrived:
                    got, stop = self._arrived.pop(self._read_pages)
                    self._read_pages = got
                    if got < stop:
                        break
            if not complete:
                self._stopped = True
            self._finish_if_idle()
            self._changed.notify_all()

    def _fail(self, first: int) -> None:
        with self._lock:
            self._calls.pop(first, None)
            self._stopped = True
            self._finish_if_idle()
            self._changed.notify_all()

    def _finish_if_idle(self) -> None:
        """Finish (caller holds the lock) once no batch is read and none will be."""
        assert self._hit_pages is not None
        done = self._cancelled or self._stopped or self._next_page >= self._hit_pages
        if done and not self._calls:
            self._finish()
            self._changed.notify_all()

    def _finish(self) -> None:
        """Mark the fetch finished now (caller holds the lock); the first time counts."""
        if self._state is not PrefetchState.FINISHED:
            self._state = PrefetchState.FINISHED
            self.finished_at = time.monotonic()


@dataclass(frozen=True)
class Backup:
    """Host pages to write under their keys.

    Attributes
    ----------
    keys
        Storage keys, ``keys_per_page`` per page.
    host_indices
        Host slots of the pages' tokens.
    ticket
        The scheduler's handle, returned in the :class:`BackupDone`.
    ready
        Waited on before reading the host slots (the device→host copy that fills them).
    keys_per_page
        Keys each page is stored under (several for a multi-object key scheme).
    """

    keys: Sequence[str]
    host_indices: torch.Tensor
    ticket: object = None
    ready: Callable[[], None] | None = None
    keys_per_page: int = 1

    @property
    def pages(self) -> int:
        """Whole pages the keys name (0 for a backup without a page)."""
        return len(self.keys) // self.keys_per_page if self.keys_per_page > 0 else 0

    def slots(self, first: int, end: int) -> torch.Tensor:
        """Host slots of pages ``[first, end)``."""
        tokens = self.host_indices.numel() // self.pages
        return self.host_indices[first * tokens : end * tokens]


@dataclass(frozen=True)
class BackupDone:
    """The outcome of a :class:`Backup`: whether every page was written, or it was shed."""

    backup: Backup
    stored: bool
    shed: bool = False
    """Not written, nor tried: the store was failing when the writer came to it."""
    shed_by: str | None = None
    """Not written: the planner's rule that shed it (:meth:`Planner.offer
    <hicache_storage.planner.Planner.offer>`), or None."""
