"""The storage tier's background threads: existence queries, reads (prefetch) and writes (backup).

The scheduler thread owns the radix tree and the allocators; these threads only move bytes
between the host pool and the backend and report what they did. A :class:`Prefetch` runs in two
stages: a query thread asks ``batch_exists`` how many of its pages storage holds, then the read
threads read those pages in batches into host slots the scheduler allocated, the oldest fetch's
batches first and several at once. Several queries run at once (``query_threads``), up to
``read_threads`` read calls, and every call's duration goes to a
:class:`~hicache_storage.planner.rates.CostModel`. The slots may
be given up front, or once the query has answered (:meth:`StorageIO.read`), so that host room is
taken only for pages storage holds. A
:class:`Backup` names host slots to write under their keys; the write queue is bounded, and a
full queue refuses a backup rather than block the scheduler (the pages stay unstored and are
written again when next backed up or evicted). Before it writes the backups it took off the
queue, the writer offers their pages to its :class:`~hicache_storage.planner.Planner`, if given
one (back-pressure: what the store cannot absorb is shed, reported unwritten with the rule, rather
than held on the host behind the writes ahead of it).

The jobs (:class:`Prefetch`, :class:`Backup`, :class:`BackupDone`) are defined in
:mod:`hicache_storage.engine.storage_jobs` and importable from here. Completions come back
through :meth:`StorageIO.poll`, for the scheduler to apply to the tree.
Nothing here raises into the scheduler: a backend error is a failed page, logged once per job.

:meth:`StorageIO.close` is bounded: a thread still in a backend call when its time is up is
abandoned. Every result a thread applies (to a fetch, the cost model or the completions) is
applied under one lock with the abandoned flag checked first, so such a thread, once its call
returns, acts on nothing and exits.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from hicache_storage.backend import HostPool, StorageBackend
from hicache_storage.engine.errors import StorageBugError
from hicache_storage.errors import BackendError, ConfigError, HostPoolError
from hicache_storage.kit.options import positive_int
from hicache_storage.planner import Planner
from hicache_storage.planner.rates import CostModel

from .storage_jobs import Backup, BackupDone, Prefetch, PrefetchState

__all__ = ["HURRY_FACTOR", "Backup", "BackupDone", "Prefetch", "PrefetchState", "StorageIO"]

logger = logging.getLogger(__name__)
_STOP = object()

HURRY_FACTOR = 4
"""How many times ``write_batch_pages`` a hurried backup writes per call: enough to clear a
queue several times faster, small enough that reads still get between the calls and keep part of
a backend's shared thread budget."""


class StorageIO:
    """Daemon threads over one backend: existence queries, reads and writes.

    Parameters
    ----------
    backend
        The storage backend, with the default layers (a failure is a miss, within the deadline).
    read_batch_pages
        Pages per ``batch_get_v1`` call of a fetch; smaller batches let a cancelled or timed-out
        fetch stop sooner and let early pages be used sooner.
    write_capacity
        Most backups waiting at once; beyond it :meth:`backup` refuses.
    object_indices
        Maps host slots of pages to the registered pool's indices of their objects, for a key
        scheme of several objects per page (:meth:`UnifiedObjectPool.object_indices
        <hicache_storage.hostpool.UnifiedObjectPool.object_indices>`); None when the host pool
        itself is registered.
    query_threads, read_threads
        Existence queries and read calls in flight at once. The read threads take the oldest
        fetch's batches first, several of one fetch at once: its request can go while younger
        fetches read, and a backend that serves calls concurrently is kept busy.
    write_batch_pages
        Pages per ``batch_set_v1`` call of a backup: background writes move a few pages at a
        time, so they leave the cores and the GIL to the forward and the reads; after
        :meth:`hurry`, :data:`HURRY_FACTOR` times as many until the queue has drained.
    write_linger_s
        How long the writer, woken for fewer pages than a call takes, waits for more before it
        writes (not when hurried or closing): one call instead of one per backup, and no
        wake-up that takes the GIL while the scheduler's thread works. 0 writes at once.
    costs
        Where every query's and read call's duration is recorded (for the ``adaptive`` policy).
    nice
        Niceness the storage threads take (Linux; threads they start inherit it): when the
        cores are all busy the kernel runs the forward's threads first, so background storage
        work cannot stall a CPU forward's parallel regions. None leaves the threads as started.
    idle_writes
        Run the writer, and the threads it starts for a call, under Linux's ``SCHED_IDLE``:
        background writes then take only cores that no other thread wants, where a niced
        writer still takes a share of a core from a forward that fills them all. When host
        room waits on the writes, the scheduler's thread blocks, which frees its core for
        them. Queries and reads, which requests wait on, keep ``nice``.
    shed_failing
        Drop, unwritten, the queued backups the writer comes to while ``costs`` says the store
        is failing (:attr:`CostModel.failing <hicache_storage.planner.rates.CostModel.failing>`):
        each would only wait out a deadline, pinning its host pages meanwhile. Reported with
        ``shed`` set.
    planner
        Decides, on the writer's thread right before its calls, which backups are written
        (:meth:`Planner.offer <hicache_storage.planner.Planner.offer>`, told how each ended with
        :meth:`Planner.done <hicache_storage.planner.Planner.done>`); a backup it sheds is
        reported unwritten with ``shed_by`` set. None writes every backup.
    write_room_pages
        How many pages queued backups may hold on the host: the planner is told the pages
        waiting behind each offer and this room (its ``backlog`` rule), and sheds the oldest
        backups while the queue is longer, so the writer is never idle while pages wait. None
        leaves the planner to price the writer's offers by rate alone (its ``absorb`` rule).
    pool
        The host pool the caller registered with ``backend``. A backend addresses one
        registered pool; if another user of the same backend object registers its own, every
        page would move through that pool instead. Each read and write checks first and fails
        as a bug (:meth:`check`) rather than serve another pool's bytes. None skips the check.
    """

    def __init__(
        self,
        backend: StorageBackend,
        *,
        read_batch_pages: int = 32,
        write_capacity: int = 64,
        object_indices: Callable[[torch.Tensor], torch.Tensor] | None = None,
        query_threads: int = 2,
        read_threads: int = 4,
        write_batch_pages: int = 2,
        write_linger_s: float = 0.0,
        costs: CostModel | None = None,
        nice: int | None = None,
        idle_writes: bool = False,
        shed_failing: bool = False,
        planner: Planner | None = None,
        write_room_pages: int | None = None,
        pool: HostPool | None = None,
    ) -> None:
        check_nice(nice)
        if not isinstance(idle_writes, bool):
            raise ConfigError(f"idle_writes must be a bool, got {idle_writes!r}")
        for name, value in (
            ("read_batch_pages", read_batch_pages),
            ("write_capacity", write_capacity),
            ("query_threads", query_threads),
            ("read_threads", read_threads),
            ("write_batch_pages", write_batch_pages),
        ):
            positive_int(name, value, ConfigError)
        self.backend = backend
        self.read_batch_pages = read_batch_pages
        check_linger(write_linger_s)
        self.write_batch_pages = write_batch_pages
        self.write_linger_s = write_linger_s
        self.costs = costs
        self.shed_failing = shed_failing
        if write_room_pages is not None:
            positive_int("write_room_pages", write_room_pages, ConfigError)
        self.planner = planner
        """Decides which backups the writer makes (``planner`` above); None writes every one."""
        self.write_room_pages = write_room_pages
        self._objects = object_indices
        self.refused_backups = 0
        self._queries: queue.Queue[object] = queue.Queue()
        self._read_order: list[Prefetch] = []
        """Fetches being read, oldest first: every read thread takes the oldest one's batches."""
        self._read_ready = threading.Condition()
        self._calls = 0
        self._writes: queue.Queue[object] = queue.Queue(write_capacity)
        # The scheduler polls both every step: deques, whose emptiness is read without a lock.
        self._done: collections.deque[BackupDone] = collections.deque()
        self._done_ready = threading.Condition()
        self._bugs: collections.deque[tuple[str, Exception]] = collections.deque()
        self._closed = False
        self._acting = threading.Lock()
        """Held while a thread applies a call's result; :meth:`close` takes it to abandon."""
        self._abandoned = False
        """Set once :meth:`close` gave up waiting: no thread acts on a result from then on."""
        self._writing_now: list[Backup] = []
        """The backups the writer has taken off the queue and not yet reported."""
        self.abandoned_calls = 0
        """Backend calls still running when :meth:`close` stopped waiting for them."""
        self._in_calls = 0
        self._in_calls_lock = threading.Lock()
        self._hurry = threading.Event()
        self._wake = threading.Event()
        """Ends a lingering writer's wait: set by :meth:`hurry` and :meth:`close`."""
        self._nice = nice
        self._pool = pool
        self._exited = False
        """Whether a thread has ended (its loop returned or raised)."""
        self._query_threads = self._start("query", self._query_loop, query_threads)
        self._read_threads = self._start("read", self._read_loop, read_threads)
        self._write_threads = self._start("write", self._write_loop, 1, idle=idle_writes)

    def _start(
        self, name: str, loop: Callable[[], None], count: int, *, idle: bool = False
    ) -> list[threading.Thread]:
        threads = [
            threading.Thread(
                target=self._run,
                args=(loop, idle),
                name=f"hicache-l3-{name}" + (f"-{i}" if count > 1 else ""),
                daemon=True,
            )
            for i in range(count)
        ]
        for thread in threads:
            thread.start()
        return threads

    def _run(self, loop: Callable[[], None], idle: bool) -> None:
        try:
            if self._nice is not None:
                lower_priority(self._nice)
            if idle:
                schedule_idle()
            loop()
        finally:
            self._exited = True

    @property
    def read_threads(self) -> int:
        """Most read calls at once."""
        return len(self._read_threads)

    # -- the scheduler's side ---------------------------------------------------------------------

    def prefetch(self, fetch: Prefetch, *, inline: bool = False) -> None:
        """Start ``fetch``: query, then read what storage holds (a closed I/O finishes it empty).

        ``inline`` asks the existence query in the calling thread, for a store whose queries
        are known to be quick: the answer is there on return, with no hand-over to a query
        thread. A fetch made without host slots stops in ``QUERIED``; :meth:`read` continues it.
        """
        if self._closed:
            fetch.cancel()
            return
        if inline:
            self._query(fetch)
        else:
            self._queries.put(fetch)

    def read(self, fetch: Prefetch) -> None:
        """Read a fetch that got its slots with :meth:`Prefetch.assign`."""
        if self._closed:
            fetch.cancel()
            return
        self._queue_read(fetch)

    @property
    def reads_in_flight(self) -> int:
        """Read calls running now."""
        with self._read_ready:
            return self._calls

    def backup(self, job: Backup) -> bool:
        """Queue ``job``; return False (and count it) when the queue is full or closed."""
        if self._closed:
            self.refused_backups += 1
            return False
        try:
            self._writes.put_nowait(job)
        except queue.Full:
            self.refused_backups += 1
            return False
        return True

    def hurry(self) -> None:
        """Write the queued backups :data:`HURRY_FACTOR` times wider until the queue drains.

        For a caller that waits for them (room on the host is made by evicting pages that are
        stored): background writes are then no longer background, and a few pages a call would
        make the wait as long as the queue. Reads still get between the calls.
        """
        self._hurry.set()
        self._wake.set()

    def check(self) -> None:
        """Raise the first bug a storage thread met since the last check, if any.

        A storage call that raises a :class:`~hicache_storage.errors.BackendError` is the
        store's failure: a miss (or a backup not stored), logged, and nothing more. Anything
        else is a bug (in the backend, a layer or the engine's own copy) and is kept for this
        call, which the engine's poll makes, so it is seen instead of served around.

        Raises
        ------
        StorageBugError
            With the bug as its ``__cause__``.
        """
        if not self._bugs:
            return
        what, bug = self._bugs.popleft()
        raise StorageBugError(
            f"{what} raised {type(bug).__name__}: {bug} (not a BackendError: a bug in the "
            "backend, a layer or the engine, not a failure of the store)"
        ) from bug

    def _failed(self, what: str, exc: Exception) -> None:
        """Log a storage call that failed; keep it for :meth:`check` unless the store failed."""
        if isinstance(exc, BackendError):
            logger.warning("%s failed: %s", what, exc)
            return
        logger.error("%s failed", what, exc_info=exc)
        self._bugs.append((what, exc))

    def poll(self, timeout_s: float = 0.0) -> list[BackupDone]:
        """Return the backups finished since the last poll, waiting up to ``timeout_s`` for one."""
        if timeout_s > 0 and not self._done:
            with self._done_ready:
                self._done_ready.wait_for(lambda: bool(self._done), timeout_s)
        out: list[BackupDone] = []
        while self._done:
            out.append(self._done.popleft())
        return out

    @property
    def alive(self) -> bool:
        """Whether every thread is running."""
        return not self._exited  # set as any thread ends: asked before every admission

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """Every thread (for a caller checking that none outlives :meth:`close`)."""
        return (*self._query_threads, *self._read_threads, *self._write_threads)

    def close(self, timeout_s: float | None = None) -> list[BackupDone]:
        """Stop the threads, writing every queued backup first; return the unpolled outcomes.

        Queued fetches are cancelled. ``timeout_s`` bounds the whole close (None waits for the
        queued writes and every call in flight, however long). When it runs out, the threads
        still in a backend call are abandoned (counted in :attr:`abandoned_calls`): once their
        call returns they apply nothing (no fetch, cost or outcome is recorded, no further call
        is made) and exit. Backups not written by then are returned as not stored, and a fetch
        whose read was abandoned never finishes, so its host slots, which the backend may still
        write, are never handed back.
        """
        if self._closed:
            return self.poll()
        self._closed = True
        deadline = None if timeout_s is None else time.monotonic() + max(timeout_s, 0.0)

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        # Queries first: a query answering now may still hand its fetch to the readers.
        for _ in self._query_threads:
            self._queries.put(_STOP)
        for thread in self._query_threads:
            thread.join(left())
        with self._read_ready:
            self._read_ready.notify_all()
        for thread in self._read_threads:
            thread.join(left())
        self._wake.set()  # a lingering writer writes now
        for _ in self._write_threads:  # after every queued backup
            with contextlib.suppress(queue.Full):  # a writer stuck in a call: abandoned below
                self._writes.put(_STOP, timeout=left())
        for thread in self._write_threads:
            thread.join(left())
        if any(thread.is_alive() for thread in self.threads):
            self._abandon()
        return self.poll()

    def _abandon(self) -> None:
        """Stop acting on any result from now on; report unwritten backups as not stored."""
        with self._acting:
            self._abandoned = True
            with self._in_calls_lock:
                self.abandoned_calls = self._in_calls
            unwritten = list(self._writing_now)
            self._writing_now.clear()
            while True:
                try:
                    item = self._writes.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Backup):
                    unwritten.append(item)
            for _ in self._write_threads:  # the queue was just emptied: room for each
                self._writes.put_nowait(_STOP)
            self._done.extend(BackupDone(job, False) for job in unwritten)
        logger.warning(
            "storage close gave up on %d backend call(s) still running: their threads exit "
            "when the calls return, acting on nothing; %d backup(s) not written",
            self.abandoned_calls,
            len(unwritten),
        )

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """Count a backend call as running while the block runs."""
        with self._in_calls_lock:
            self._in_calls += 1
        try:
            yield
        finally:
            with self._in_calls_lock:
                self._in_calls -= 1

    @contextlib.contextmanager
    def _live(self) -> Iterator[bool]:
        """Hold the result lock; yield whether results may still be applied (not abandoned)."""
        with self._acting:
            yield not self._abandoned

    # -- the threads ------------------------------------------------------------------------------

    def _query_loop(self) -> None:
        while (item := self._queries.get()) is not _STOP:
            assert isinstance(item, Prefetch)
            self._query(item)

    def _query(self, item: Prefetch) -> None:
        if self._closed or item.state is PrefetchState.FINISHED:
            item.cancel()
            return
        began = time.monotonic()
        error: Exception | None = None
        try:
            with self._calling():
                hits = self.backend.batch_exists(item.keys) // item.keys_per_page
        except Exception as exc:  # noqa: BLE001 - a failed query finds nothing (a bug: check())
            error, hits = exc, 0
        seconds = time.monotonic() - began
        with self._live() as live:
            if not live:
                return
            if error is not None:
                self._failed(f"existence query of {item.pages} pages", error)
            if self.costs is not None:
                self.costs.observe_query(seconds, asked=item.pages, found=min(hits, item.pages))
            if item._queried(min(hits, item.pages), seconds):
                self._queue_read(item)

    def _queue_read(self, fetch: Prefetch) -> None:
        with self._read_ready:
            if self._closed:
                fetch.cancel()
                return
            self._read_order.append(fetch)
            self._read_ready.notify_all()

    def _read_loop(self) -> None:
        while (work := self._next_read()) is not None:
            self._read(*work)

    def _next_read(self) -> tuple[Prefetch, int, int, int] | None:
        """Wait for the next batch to read, of the oldest fetch that has one; None once closed.

        Fetches are read in the order their reads began, every thread on the oldest one's
        batches first: where the store's bandwidth is the limit, the first fetch gets all of it
        and its request can go while the others read, rather than every fetch ending late
        together; where a call's latency is the limit, one fetch's batches run side by side.
        """
        with self._read_ready:
            while True:
                if self._closed:
                    for fetch in self._read_order:
                        fetch.cancel()
                    self._read_order.clear()
                    return None
                for fetch in list(self._read_order):
                    batch = fetch._next_batch(self.read_batch_pages)
                    if batch is not None:
                        self._calls += 1
                        return fetch, *batch, self._calls
                    if fetch.state is PrefetchState.FINISHED:
                        self._read_order.remove(fetch)
                self._read_ready.wait()

    def _read(self, fetch: Prefetch, first: int, end: int, calls: int) -> None:
        """Read pages ``[first, end)`` of ``fetch``; ``calls`` were in flight as it started.

        The cost model gets the call's seconds per page over the calls that ran beside it:
        the store's whole rate, which is what a fetch queued behind others is read at.
        """
        kpp, page = fetch.keys_per_page, fetch.page_size
        host = fetch.host_indices
        assert host is not None
        try:
            error: Exception | None = None
            got: list[bool] = []
            try:
                if fetch.ready is not None:  # before the clock: a copy's wait is not the store's
                    fetch.ready()
                began = time.monotonic()
                self._check_pool()
                with self._calling():
                    got = self.backend.batch_get_v1(
                        fetch.keys[first * kpp : end * kpp],
                        self._indices(host[first * page : end * page]),
                    )
            except Exception as exc:  # noqa: BLE001 - a miss of the rest (a bug: check())
                error = exc
            with self._live() as live:
                if not live:  # close gave up on this call: its fetch is no longer the caller's
                    return
                ok_keys = next((i for i, ok in enumerate(got) if not ok), len(got))
                if self.costs is not None and (error is not None or ok_keys < kpp):
                    self.costs.observe_failure()  # no page in the call's time
                elif self.costs is not None:
                    with self._read_ready:
                        beside = (calls + self._calls) / 2
                    self.costs.observe_read(ok_keys // kpp, (time.monotonic() - began) / beside)
                if error is not None:
                    self._failed(f"read of {end - first} pages", error)
                    fetch._fail(first)
                    return
                fetch._read(first, ok_keys // kpp, ok_keys == len(got) == (end - first) * kpp)
        finally:
            with self._read_ready:
                self._calls -= 1
                self._read_ready.notify_all()

    def _check_pool(self) -> None:
        """Raise :class:`HostPoolError` if the backend's registered pool is not the caller's."""
        if self._pool is not None and self.backend.host_pool is not self._pool:
            raise HostPoolError(
                "the backend's registered host pool is no longer this cache's: another user of "
                "the same backend object registered its own (give each cache a backend of its own)"
            )

    def _indices(self, host: torch.Tensor) -> torch.Tensor:
        return host if self._objects is None else self._objects(host)

    def _batch_pages(self) -> int:
        return self.write_batch_pages * (HURRY_FACTOR if self._hurry.is_set() else 1)

    def _write(self, jobs: Sequence[Backup]) -> tuple[list[bool], str | None]:
        """Write ``jobs`` if the planner admits them; return, per job, whether it was stored.

        The second value is the planner's rule when it shed them (every job then unwritten).
        The planner is offered every page of the jobs at once, on this thread, right before the
        calls: its gate times this thread's offers against the writes it admitted, and a writer
        with a queue behind it offers back to back. A plan that admits any page writes every
        job: the cache's planner admits all the pages it is offered or none (the write policy
        chose what is backed up).
        """
        self._check_pool()
        planner = self.planner
        pages = [key for job in jobs for key in job.keys[:: max(job.keys_per_page, 1)]]
        if planner is None or not pages:
            return self._write_calls(jobs)[0], None
        queued = None if self.write_room_pages is None else self._queued_pages()
        room = self.write_room_pages or 0
        with self._live() as live:  # nothing is asked or told once close gave up on the writer
            plan = planner.offer(pages, queued=queued, room=room) if live else None
        if plan is None or not plan.pages:
            return [False] * len(jobs), None if plan is None else plan.rule
        stored = 0
        try:
            outcomes, stored = self._write_calls(jobs)
        finally:
            with self._live() as live:
                if live:
                    planner.done(plan, stored)
        return outcomes, None

    def _write_calls(self, jobs: Sequence[Backup]) -> tuple[list[bool], int]:
        """Write ``jobs`` a few pages a call; return, per job, whether every page was stored.

        The second value is the pages stored in all. Backups are background work:
        ``write_batch_pages`` bounds how many pages a backend that
        parallelises a batch moves at once for them, so that they do not take the cores (and
        the GIL) that the model's forward and the prefetch reads need; once :meth:`hurry` was
        called, :data:`HURRY_FACTOR` times as many. Small backups share a call up to that bound
        (a call's fixed work, in the layers and the backend, is paid once for them); a job's
        pages after one that failed are not written, nor anything once :meth:`close` abandoned
        the writer (the host slots are no longer the caller's to read) or while the store is
        failing (:meth:`_shedding`). Without a planner, a call that stored nothing is a failure
        the cost model counts (:meth:`CostModel.observe_failure
        <hicache_storage.planner.rates.CostModel.observe_failure>`); with one, the planner
        counts each offer that stored nothing (:meth:`Planner.done
        <hicache_storage.planner.Planner.done>`).
        """
        stored = [job.pages > 0 for job in jobs]
        cursor = [0] * len(jobs)  # pages of each job handed to a call so far
        pending = [i for i, ok in enumerate(stored) if ok]
        pages_stored = 0
        while pending and not self._abandoned and not self._shedding():
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
                with self._calling():
                    done = self.backend.batch_set_v1(keys, self._indices(torch.cat(slots)))
            except Exception as exc:  # noqa: BLE001 - not stored; the writer goes on (a bug: check())
                self._failed(f"backup of {len(keys)} keys", exc)
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
        """Pages of the backups still queued for the writer."""
        with self._writes.mutex:
            return sum(job.pages for job in self._writes.queue if isinstance(job, Backup))

    def _shedding(self) -> bool:
        """Whether queued backups are dropped unwritten: ``shed_failing`` and a failing store."""
        return self.shed_failing and self.costs is not None and self.costs.failing

    def _write_loop(self) -> None:
        stop = False
        while not stop and (item := self._writes.get()) is not _STOP:
            assert isinstance(item, Backup)
            if self.write_linger_s and item.pages < self._batch_pages():
                self._wake.wait(self.write_linger_s)  # more backups may share the call
            jobs = [item]
            pages = item.pages
            with self._live() as live:  # taken while close may still report them unwritten
                if not live:
                    return
                while pages < self._batch_pages():  # small backups share a call
                    try:
                        more = self._writes.get_nowait()
                    except queue.Empty:
                        break
                    if more is _STOP:
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
            except Exception as exc:  # noqa: BLE001 - not stored; the writer goes on (a bug: check())
                self._failed(f"backup of {sum(len(job.keys) for job in jobs)} keys", exc)
                outcomes = [False] * len(jobs)
            if self._writes.empty():
                self._hurry.clear()
                if not self._closed:
                    self._wake.clear()
            with self._live() as live, self._done_ready:
                if not live:  # close reported these backups unwritten and gave up on the writer
                    return
                self._writing_now.clear()
                self._done.extend(
                    BackupDone(job, stored, shed=shed, shed_by=shed_by)
                    for job, stored in zip(jobs, outcomes, strict=True)
                )
                self._done_ready.notify_all()


def check_linger(linger: object, name: str = "write_linger_s") -> None:
    """Raise :class:`ConfigError` unless ``linger`` is a number of seconds in ``[0, 1)``."""
    if (
        isinstance(linger, bool)
        or not isinstance(linger, int | float)
        or not 0 <= linger < 1  # also refuses NaN
    ):
        raise ConfigError(f"{name} must be a number in [0, 1), got {linger!r}")


def check_nice(nice: object, name: str = "nice") -> None:
    """Raise :class:`ConfigError` unless ``nice`` is None or a niceness in 0..19."""
    if nice is not None and (
        isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19
    ):
        raise ConfigError(f"{name} must be None or an int in 0..19, got {nice!r}")


def schedule_idle() -> None:
    """Put the calling thread under ``SCHED_IDLE`` (Linux only: elsewhere a no-op).

    The kernel runs such a thread only on a core no other thread wants; threads it starts
    inherit the policy.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        logger.warning("could not put the storage writer under SCHED_IDLE: %s", exc)


def lower_priority(nice: int) -> None:
    """Give the calling thread niceness ``nice`` (Linux only: elsewhere a no-op).

    On Linux a thread is a task of its own, so ``setpriority`` with its thread id changes that
    thread alone; other systems would take the id for a process's, so they are left alone.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:  # lowering back below a niceness set from outside needs privileges
        logger.warning("could not set the storage thread's niceness to %d: %s", nice, exc)
