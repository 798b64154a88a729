"""The storage tier's background threads: existence queries, reads (prefetch) and writes (backup).

The scheduler thread owns the radix tree and the allocators; these threads only move bytes
between the host pool and the backend and report what they did. A :class:`Prefetch` runs in two
stages: a query thread asks ``batch_exists`` how many of its pages storage holds, then the read
threads read those pages in batches into host slots the scheduler allocated, the oldest fetch's
batches first and several at once. Several queries run at once (``query_threads``), up to
``read_threads`` read calls, and every call's duration goes to a
:class:`~hicache_storage.planner.rates.CostModel`. The slots may
be given up front, or once the query has answered (:meth:`StorageIO.read`), so that host room is
taken only for pages storage holds. A :class:`Backup` names host slots to write under their
keys; one writer thread writes them (:class:`~hicache_storage.engine.storage_writer.BackupWriter`:
a bounded queue, and the planner's back-pressure).

The jobs (:class:`Prefetch`, :class:`Backup`, :class:`BackupDone`) are defined in
:mod:`hicache_storage.engine.storage_jobs` and importable from here. Completions come back
through :meth:`StorageIO.poll`, for the scheduler to apply to the tree.
Nothing here raises into the scheduler: a backend error is a failed page, logged once per job.

:meth:`StorageIO.close` is bounded: a thread still in a backend call when its time is up is
abandoned. Every result a thread applies (to a fetch, the cost model or the completions) is
applied under one lock with the abandoned flag checked first
(:class:`~hicache_storage.engine.storage_calls.StorageCalls`), so such a thread, once its call
returns, acts on nothing and exits.
"""

from __future__ import annotations

import logging
import operator
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

import torch

from hicache_storage.backend import HostPool, StorageBackend
from hicache_storage.errors import ConfigError
from hicache_storage.kit.options import positive_int
from hicache_storage.planner import Planner
from hicache_storage.planner.rates import CostModel

from .storage_calls import StorageCalls
from .storage_jobs import Backup, BackupDone, Prefetch, PrefetchState
from .storage_writer import HURRY_FACTOR, STOP, BackupWriter, check_linger

__all__ = [
    "HURRY_FACTOR",
    "Backup",
    "BackupDone",
    "Prefetch",
    "PrefetchState",
    "StorageIO",
    "check_linger",
    "leading_count",
]

logger = logging.getLogger(__name__)


def leading_count(answer: object, asked: int) -> int:
    """Return a ``batch_exists`` answer as an ``int`` in ``[0, asked]``.

    Any integer is taken (numpy's too, as ``np.count_nonzero`` gives); a bool, a float, None or
    a count outside the keys asked is a bug of the backend, raised here so that the query
    counts it as one and finds nothing, instead of the number reaching the host allocator.

    Raises
    ------
    TypeError
        If ``answer`` is not an integer.
    ValueError
        If it is negative or more than ``asked``.
    """
    try:
        if isinstance(answer, bool):
            raise TypeError
        count = operator.index(answer)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"batch_exists answered {answer!r}, not a count of keys") from None
    if not 0 <= count <= asked:
        raise ValueError(f"batch_exists answered {count} for {asked} keys")
    return count


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
        :meth:`hurry`, :data:`~hicache_storage.engine.storage_writer.HURRY_FACTOR` times as
        many until the queue has drained.
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
            ("query_threads", query_threads),
            ("read_threads", read_threads),
        ):
            positive_int(name, value, ConfigError)
        self.backend = backend
        self.read_batch_pages = read_batch_pages
        self.costs = costs
        self._calls = StorageCalls(backend, pool=pool, object_indices=object_indices)
        self._writer = BackupWriter(
            self._calls,
            capacity=write_capacity,
            batch_pages=write_batch_pages,
            linger_s=write_linger_s,
            costs=costs,
            shed_failing=shed_failing,
            planner=planner,
            room_pages=write_room_pages,
        )
        self._queries: queue.Queue[object] = queue.Queue()
        self._read_order: list[Prefetch] = []
        """Fetches being read, oldest first: every read thread takes the oldest one's batches."""
        self._read_ready = threading.Condition()
        self._reads = 0
        self._closed = False
        self.abandoned_calls = 0
        """Backend calls still running when :meth:`close` stopped waiting for them."""
        self._nice = nice
        self._exited = False
        """Whether a thread has ended (its loop returned or raised)."""
        self._query_threads = self._start("query", self._query_loop, query_threads)
        self._read_threads = self._start("read", self._read_loop, read_threads)
        self._write_threads = self._start("write", self._writer.run, 1, idle=idle_writes)

    @property
    def planner(self) -> Planner | None:
        """Decides which backups the writer makes (``planner`` above); None writes every one."""
        return self._writer.planner

    @planner.setter
    def planner(self, planner: Planner | None) -> None:
        self._writer.planner = planner

    @property
    def shed_failing(self) -> bool:
        """Whether queued backups are dropped unwritten while the store is failing."""
        return self._writer.shed_failing

    @property
    def refused_backups(self) -> int:
        """Backups :meth:`backup` refused: the queue was full or closed."""
        return self._writer.refused

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
            return self._reads

    def backup(self, job: Backup) -> bool:
        """Queue ``job``; return False (and count it) when the queue is full or closed."""
        if self._closed:
            self._writer.refuse()
            return False
        return self._writer.backup(job)

    def hurry(self) -> None:
        """Write the queued backups several times wider until the queue drains.

        :data:`~hicache_storage.engine.storage_writer.HURRY_FACTOR` times as many pages a call.
        For a caller that waits for them (room on the host is made by evicting pages that are
        stored): background writes are then no longer background, and a few pages a call would
        make the wait as long as the queue. Reads still get between the calls.
        """
        self._writer.hurry()

    def check(self) -> None:
        """Raise the first bug a storage thread met since the last check, if any.

        See :meth:`StorageCalls.check
        <hicache_storage.engine.storage_calls.StorageCalls.check>`.
        """
        self._calls.check()

    def poll(self, timeout_s: float = 0.0) -> list[BackupDone]:
        """Return the backups finished since the last poll, waiting up to ``timeout_s`` for one."""
        return self._writer.poll(timeout_s)

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
            self._queries.put(STOP)
        for thread in self._query_threads:
            thread.join(left())
        with self._read_ready:
            self._read_ready.notify_all()
        for thread in self._read_threads:
            thread.join(left())
        self._writer.stop(len(self._write_threads), left())  # after every queued backup
        for thread in self._write_threads:
            thread.join(left())
        if any(thread.is_alive() for thread in self.threads):
            self._abandon()
        return self.poll()

    def _abandon(self) -> None:
        """Stop acting on any result from now on; report unwritten backups as not stored."""
        with self._calls.abandoning() as running:
            self.abandoned_calls = running
            unwritten = self._writer.abandon(len(self._write_threads))
        logger.warning(
            "storage close gave up on %d backend call(s) still running: their threads exit "
            "when the calls return, acting on nothing; %d backup(s) not written",
            self.abandoned_calls,
            unwritten,
        )

    # -- the threads ------------------------------------------------------------------------------

    def _query_loop(self) -> None:
        while (item := self._queries.get()) is not STOP:
            assert isinstance(item, Prefetch)
            self._query(item)

    def _query(self, item: Prefetch) -> None:
        if self._closed or item.state is PrefetchState.FINISHED:
            item.cancel()
            return
        began = time.monotonic()
        error: BaseException | None = None
        try:
            with self._calls.calling():
                found = self.backend.batch_exists(item.keys)
            hits = leading_count(found, len(item.keys)) // item.keys_per_page
        except BaseException as exc:  # noqa: BLE001 - a failed query finds nothing (a bug: check())
            error, hits = exc, 0
        seconds = time.monotonic() - began
        with self._calls.live() as live:
            if not live:
                return
            if error is not None:
                self._calls.failed(f"existence query of {item.pages} pages", error)
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
                        self._reads += 1
                        return fetch, *batch, self._reads
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
            error: BaseException | None = None
            got: list[bool] = []
            try:
                if fetch.ready is not None:  # before the clock: a copy's wait is not the store's
                    fetch.ready()
                began = time.monotonic()
                self._calls.check_pool()
                with self._calls.calling():
                    got = self.backend.batch_get_v1(
                        fetch.keys[first * kpp : end * kpp],
                        self._calls.indices(host[first * page : end * page]),
                    )
            except BaseException as exc:  # noqa: BLE001 - a miss of the rest (a bug: check())
                error = exc
            with self._calls.live() as live:
                if not live:  # close gave up on this call: its fetch is no longer the caller's
                    return
                ok_keys = next((i for i, ok in enumerate(got) if not ok), len(got))
                if self.costs is not None and (error is not None or ok_keys < kpp):
                    self.costs.observe_failure()  # no page in the call's time
                elif self.costs is not None:
                    with self._read_ready:
                        beside = (calls + self._reads) / 2
                    self.costs.observe_read(ok_keys // kpp, (time.monotonic() - began) / beside)
                if error is not None:
                    self._calls.failed(f"read of {end - first} pages", error)
                    fetch._fail(first)
                    return
                fetch._read(first, ok_keys // kpp, ok_keys == len(got) == (end - first) * kpp)
        finally:
            with self._read_ready:
                self._reads -= 1
                self._read_ready.notify_all()


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
