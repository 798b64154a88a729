"""The storage tier's writer: queued backups written a few pages a call, as the planner admits.

:class:`BackupWriter` is the write half of :class:`StorageIO
<hicache_storage.engine.storage_io.StorageIO>`, run on one thread of its own. The queue is
bounded, and a full queue refuses a backup rather than block the scheduler (the pages stay
unstored and are written again when next backed up or evicted). Before it writes the backups it
took off the queue, the writer offers their pages to its :class:`~hicache_storage.planner.Planner`,
if given one (back-pressure: what the store cannot absorb is shed, reported unwritten with the
rule, rather than held on the host behind the writes ahead of it). Outcomes wait in a deque the
scheduler polls every step.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Sequence

import torch

from hicache_storage.errors import ConfigError
from hicache_storage.kit.options import positive_int
from hicache_storage.planner import Planner
from hicache_storage.planner.rates import CostModel

from .storage_calls import StorageCalls
from .storage_jobs import Backup, BackupDone

__all__ = ["HURRY_FACTOR", "BackupWriter", "check_linger"]

STOP = object()
"""Put on a queue of the storage threads: the thread that takes it ends."""

HURRY_FACTOR = 4
"""How many times ``write_batch_pages`` a hurried backup writes per call: enough to clear a
queue several times faster, small enough that reads still get between the calls and keep part of
a backend's shared thread budget."""


class BackupWriter:
    """Queued backups, written on the thread that runs :meth:`run`.

    The parameters are :class:`StorageIO <hicache_storage.engine.storage_io.StorageIO>`'s of
    the same names; ``calls`` is the backend as the storage threads share it.
    """

    def __init__(
        self,
        calls: StorageCalls,
        *,
        capacity: int,
        batch_pages: int,
        linger_s: float,
        costs: CostModel | None,
        shed_failing: bool,
        planner: Planner | None,
        room_pages: int | None,
    ) -> None:
        positive_int("write_capacity", capacity, ConfigError)
        positive_int("write_batch_pages", batch_pages, ConfigError)
        check_linger(linger_s)
        if room_pages is not None:
            positive_int("write_room_pages", room_pages, ConfigError)
        self._calls = calls
        self.batch_pages = batch_pages
        self.linger_s = linger_s
        self.costs = costs
        self.shed_failing = shed_failing
        self.planner = planner
        self.room_pages = room_pages
        self.refused = 0
        """Backups refused: the queue was full or closed."""
        self._queue: queue.Queue[object] = queue.Queue(capacity)
        # The scheduler polls it every step: a deque, whose emptiness is read without a lock.
        self._done: collections.deque[BackupDone] = collections.deque()
        self._done_ready = threading.Condition()
        self._writing_now: list[Backup] = []
        """The backups taken off the queue and not yet reported."""
        self._closing = False
        self._hurry = threading.Event()
        self._wake = threading.Event()
        """Ends a lingering writer's wait: set by :meth:`hurry` and :meth:`stop`."""

    # -- the scheduler's side ---------------------------------------------------------------------

    def backup(self, job: Backup) -> bool:
        """Queue ``job``; return False (and count it) when the queue is full or closing."""
        if self._closing:
            self.refused += 1
            return False
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.refused += 1
            return False
        return True

    def refuse(self) -> None:
        """Count a backup refused by the caller (closed) without offering it."""
        self.refused += 1

    def hurry(self) -> None:
        """Write the queued backups :data:`HURRY_FACTOR` times wider until the queue drains."""
        self._hurry.set()
        self._wake.set()

    def poll(self, timeout_s: float = 0.0) -> list[BackupDone]:
        """Return the backups finished since the last poll, waiting up to ``timeout_s`` for one."""
        if timeout_s > 0 and not self._done:
            with self._done_ready:
                self._done_ready.wait_for(lambda: bool(self._done), timeout_s)
        out: list[BackupDone] = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def stop(self, threads: int, timeout_s: float | None) -> None:
        """Queue one stop per writer thread, after every queued backup; write lingering ones now.

        A writer stuck in a call may keep the queue full past ``timeout_s``: the stops not
        queued by then are queued by :meth:`abandon`.
        """
        self._closing = True
        self._wake.set()
        for _ in range(threads):
            try:
                self._queue.put(STOP, timeout=timeout_s)
            except queue.Full:
                return

    def abandon(self, threads: int) -> int:
        """Report every backup not written as not stored; return how many.

        Called under :meth:`StorageCalls.abandoning`, so a writer whose call returns later
        reports nothing more.
        """
        unwritten = list(self._writing_now)
        self._writing_now.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Backup):
                unwritten.append(item)
        for _ in range(threads):  # the queue was just emptied: room for each
            self._queue.put_nowait(STOP)
        self._done.extend(BackupDone(job, False) for job in unwritten)
        return len(unwritten)

    def queued(self) -> int:
        """Backups waiting in the queue."""
        return self._queue.qsize()

    # -- the writer's thread ----------------------------------------------------------------------

    def run(self) -> None:
        """Write queued backups until a stop is taken off the queue, or the writer is abandoned."""
        stop = False
        while not stop and (item := self._queue.get()) is not STOP:
            assert isinstance(item, Backup)
            if self.linger_s and item.pages < self._batch_pages():
                self._wake.wait(self.linger_s)  # more backups may share the call
            jobs = [item]
            pages = item.pages
            with self._calls.live() as live:  # taken while a close may still report them
                if not live:
                    return
                while pages < self._batch_pages():  # small backups share a call
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is STOP:
                        stop = True
                        break
                    assert isinstance(more, Backup)
                    jobs.append(more)
                    pages += more.pages
                self._writing_now[:] = jobs
            shed = self._shedding()
            shed_by: str | None = None
            try:
                if shed:
                    outcomes = [False] * len(jobs)
                else:
                    for job in jobs:
                        if job.ready is not None:
                            job.ready()
                    outcomes, shed_by = self._write(jobs)
            except BaseException as exc:  # noqa: BLE001 - not stored; the writer goes on (a bug)
                self._calls.failed(f"backup of {sum(len(job.keys) for job in jobs)} keys", exc)
                outcomes = [False] * len(jobs)
            if self._queue.empty():
                self._hurry.clear()
                if not self._closing:
                    self._wake.clear()
            with self._calls.live() as live, self._done_ready:
                if not live:  # the close reported these backups unwritten and gave up on us
                    return
                self._writing_now.clear()
                self._done.extend(
                    BackupDone(job, stored, shed=shed, shed_by=shed_by)
                    for job, stored in zip(jobs, outcomes, strict=True)
                )
                self._done_ready.notify_all()

    def _batch_pages(self) -> int:
        return self.batch_pages * (HURRY_FACTOR if self._hurry.is_set() else 1)

    def _write(self, jobs: Sequence[Backup]) -> tuple[list[bool], str | None]:
        """Write ``jobs`` if the planner admits them; return, per job, whether it was stored.

        The second value is the planner's rule when it shed them (every job then unwritten).
        The planner is offered every page of the jobs at once, on this thread, right before the
        calls: its gate times this thread's offers against the writes it admitted, and a writer
        with a queue behind it offers back to back. A plan that admits any page writes every
        job: the cache's planner admits all the pages it is offered or none (the write policy
        chose what is backed up).
        """
        self._calls.check_pool()
        planner = self.planner
        pages = [key for job in jobs for key in job.keys[:: max(job.keys_per_page, 1)]]
        if planner is None or not pages:
            return self._write_calls(jobs)[0], None
        queued = None if self.room_pages is None else self._queued_pages()
        room = self.room_pages or 0
        with self._calls.live() as live:  # nothing is asked or told once a close gave up on us
            plan = planner.offer(pages, queued=queued, room=room) if live else None
        if plan is None or not plan.pages:
            return [False] * len(jobs), None if plan is None else plan.rule
        stored = 0
        try:
            outcomes, stored = self._write_calls(jobs)
        finally:
            with self._calls.live() as live:
                if live:
                    planner.done(plan, stored)
        return outcomes, None

    def _write_calls(self, jobs: Sequence[Backup]) -> tuple[list[bool], int]:
        """Write ``jobs`` a few pages a call; return, per job, whether every page was stored.

        The second value is the pages stored in all. Backups are background work:
        ``batch_pages`` bounds how many pages a backend that parallelises a batch moves at once
        for them, so that they do not take the cores (and the GIL) that the model's forward and
        the prefetch reads need; once :meth:`hurry` was called, :data:`HURRY_FACTOR` times as
        many. Small backups share a call up to that bound (a call's fixed work, in the layers
        and the backend, is paid once for them); a job's pages after one that failed are not
        written, nor anything once a close abandoned the writer (the host slots are no longer
        the caller's to read) or while the store is failing (:meth:`_shedding`). Without a
        planner, a call that stored nothing is a failure the cost model counts
        (:meth:`CostModel.observe_failure
        <hicache_storage.planner.rates.CostModel.observe_failure>`); with one, the planner
        counts each offer that stored nothing (:meth:`Planner.done
        <hicache_storage.planner.Planner.done>`).
        """
        stored = [job.pages > 0 for job in jobs]
        cursor = [0] * len(jobs)  # pages of each job handed to a call so far
        pending = [i for i, ok in enumerate(stored) if ok]
        pages_stored = 0
        calls = self._calls
        while pending and not calls.abandoned and not self._shedding():
            room = self._batch_pages()
            parts: list[tuple[int, int, int]] = []  # (job, first page, end page)
            for i in pending:
                if room == 0:
                    break
                first = cursor[i]
                end = min(first + room, jobs[i].pages)
                parts.append((i, first, end))
                room -= end - first
            keys: list[str] = []
            slots: list[torch.Tensor] = []
            for i, first, end in parts:
                job = jobs[i]
                keys.extend(job.keys[first * job.keys_per_page : end * job.keys_per_page])
                slots.append(job.slots(first, end))
            try:
                with calls.calling():
                    done = calls.backend.batch_set_v1(keys, calls.indices(torch.cat(slots)))
            except BaseException as exc:  # noqa: BLE001 - not stored; the writer goes on (a bug)
                calls.failed(f"backup of {len(keys)} keys", exc)
                done = []
            if self.costs is not None and self.planner is None and not any(done):
                self.costs.observe_failure(write=True)
            at = 0
            for i, first, end in parts:
                count = (end - first) * jobs[i].keys_per_page
                ok = len(done) == len(keys) and all(done[at : at + count])
                at += count
                cursor[i] = end
                stored[i] = stored[i] and ok
                pages_stored += (end - first) if ok else 0
            pending = [i for i in pending if stored[i] and cursor[i] < jobs[i].pages]
        return [ok and cursor[i] == jobs[i].pages for i, ok in enumerate(stored)], pages_stored

    def _queued_pages(self) -> int:
        """Pages of the backups still queued."""
        with self._queue.mutex:
            return sum(job.pages for job in self._queue.queue if isinstance(job, Backup))

    def _shedding(self) -> bool:
        """Whether queued backups are dropped unwritten: ``shed_failing`` and a failing store."""
        return self.shed_failing and self.costs is not None and self.costs.failing


def check_linger(linger: object, name: str = "write_linger_s") -> None:
    """Raise :class:`ConfigError` unless ``linger`` is a number of seconds in ``[0, 1)``."""
    if (
        isinstance(linger, bool)
        or not isinstance(linger, int | float)
        or not 0 <= linger < 1  # also refuses NaN
    ):
        raise ConfigError(f"{name} must be a number in [0, 1), got {linger!r}")
