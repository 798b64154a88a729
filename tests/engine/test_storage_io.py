"""The storage threads: prefetches read in batches, backups write, close flushes and joins."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from hicache_storage import FaultConfig, FaultRule, LayerConfig, StorageBackend, create_backend
from hicache_storage.engine.errors import StorageBugError
from hicache_storage.engine.storage_io import Backup, BackupDone, Prefetch, PrefetchState, StorageIO
from hicache_storage.errors import BackendIOError, ConfigError, HostPoolError
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.layers import ForwardingBackend

from ._child import PAGE, host_pool

WAIT_S = 5.0


class Spy(ForwardingBackend):
    """Record the page calls; hold them at a gate; make them raise or claim more than is stored."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gets: list[int] = []
        self.sets: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.raising: set[str] = set()
        self.error: type[Exception] = RuntimeError
        self.claim_all = False
        self.fail_second_set = False
        self.policies: list[tuple[str, int, int]] = []
        """(call, scheduling policy, niceness) of the thread of each call."""

    def _call(self, op: str) -> None:
        if sys.platform.startswith("linux"):
            nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            self.policies.append((op, os.sched_getscheduler(0), nice))
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        if op in self.raising:
            raise self.error(f"{op} broke")

    def batch_exists(self, keys: Sequence[str]) -> int:
        self._call("batch_exists")
        return len(keys) if self.claim_all else self.inner.batch_exists(keys)

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        self.gets.append(len(keys))
        self._call("batch_get_v1")
        return self.inner.batch_get_v1(keys, host_indices)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        self.sets.append(len(keys))
        self._call("batch_set_v1")
        done = self.inner.batch_set_v1(keys, host_indices)
        return [ok and not (self.fail_second_set and i == 1) for i, ok in enumerate(done)]


def slots(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def fill(pool: MHAHostPool, indices: torch.Tensor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for start in pool.page_starts(indices):
        pool.set_data_page(start, torch.randn(pool.page_shape, generator=generator))


def pages(pool: MHAHostPool, indices: torch.Tensor) -> list[bytes]:
    return [pool.get_data_page(s).numpy().tobytes() for s in pool.page_starts(indices)]


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def finished(fetch: Prefetch) -> None:
    wait_until(lambda: fetch.state is PrefetchState.FINISHED, "the fetch to finish")


def poll_all(io: StorageIO, count: int) -> list[BackupDone]:
    done: list[BackupDone] = []
    deadline = time.monotonic() + WAIT_S
    while len(done) < count:
        assert time.monotonic() < deadline, f"got {len(done)} of {count} backups"
        done += io.poll(timeout_s=0.05)
    return done


@pytest.fixture
def pool() -> MHAHostPool:
    return host_pool(32 * PAGE)


@pytest.fixture
def make_io(pool: MHAHostPool) -> Iterator[Callable[..., tuple[StorageIO, Spy]]]:
    """Build a StorageIO over a spied memory backend (layers as given); close both afterwards."""
    built: list[tuple[StorageIO, Spy]] = []

    def make(layers: LayerConfig | None = None, **io_options: Any) -> tuple[StorageIO, Spy]:
        spy = Spy(create_backend("memory", layers=layers))
        spy.register_host_pool(pool)
        io = StorageIO(spy, **io_options)
        built.append((io, spy))
        return io, spy

    yield make
    for io, spy in built:
        spy.gate.set()
        io.close()
        assert not any(t.is_alive() for t in io.threads)
        spy.close()


def store(io: StorageIO, pool: MHAHostPool, names: list[str], first_page: int) -> torch.Tensor:
    """Fill ``len(names)`` pages from ``first_page`` and store page i under ``names[i]``."""
    src = slots(first_page, len(names))
    fill(pool, src, seed=first_page)
    assert io.backend.batch_set_v1(names, src) == [True] * len(names)
    return src


def slowed(op: str, delay_s: float) -> LayerConfig:
    return LayerConfig(faults=FaultConfig(ops={op: FaultRule(delay_s=delay_s)}))


# ---- prefetch ------------------------------------------------------------------------------------


def test_prefetch_reads_the_stored_pages_into_its_host_slots(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, _ = make_io()
    src = store(io, pool, keys(5), first_page=0)
    dst = slots(10, 5)
    fetch = Prefetch(keys(5), 1, dst, PAGE, ticket="mine")
    assert fetch.state is PrefetchState.QUERYING and fetch.hit_pages is None
    assert fetch.target_pages == 5
    io.prefetch(fetch)
    finished(fetch)
    assert (fetch.hit_pages, fetch.read_pages, fetch.target_pages) == (5, 5, 5)
    assert pages(pool, dst) == pages(pool, src)
    assert fetch.ticket == "mine" and fetch.host_indices is dst


def test_slots_given_later_are_read_into_only_once_ready_returns(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    """Slots a GPU copy may still be landing in: ``assign`` returns at once, and the read
    threads call ``ready`` before every read into them, so no page read is overwritten."""
    io, spy = make_io(read_batch_pages=2)
    src = store(io, pool, keys(4), first_page=0)
    fetch = Prefetch(keys(4), 1, None, PAGE)
    io.prefetch(fetch)
    wait_until(lambda: fetch.state is PrefetchState.QUERIED, "the query")
    dst = slots(10, 4)
    fill(pool, dst, seed=99)  # what the late copy would leave behind
    landed = threading.Event()
    reads_when_ready: list[int] = []

    def ready() -> None:
        assert landed.wait(WAIT_S), "the test never landed the copy"
        reads_when_ready.append(len(spy.gets))

    assert fetch.assign(dst, ready=ready)
    io.read(fetch)
    time.sleep(0.05)
    assert spy.gets == [] and fetch.read_pages == 0, "no read before the slots are ready"
    landed.set()
    finished(fetch)
    assert fetch.read_pages == 4 and pages(pool, dst) == pages(pool, src)
    assert len(reads_when_ready) == 2 and reads_when_ready[0] == 0, "ready before each batch"


def test_a_pool_another_user_registered_fails_reads_and_writes_as_a_bug(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    """One backend object addresses one pool: a second registration must not route our pages."""
    io, spy = make_io(pool=pool)
    store(io, pool, keys(3), first_page=0)
    other = host_pool(32 * PAGE)
    spy.register_host_pool(other)
    dst = slots(10, 3)
    fetch = Prefetch(keys(3), 1, dst, PAGE)
    io.prefetch(fetch)
    finished(fetch)
    assert fetch.read_pages == 0, "nothing is read through another cache's pool"
    with pytest.raises(StorageBugError, match="registered host pool") as raised:
        io.check()
    assert isinstance(raised.value.__cause__, HostPoolError)
    assert io.backup(Backup(keys(2, "w"), slots(0, 2), ticket=1))
    (done,) = poll_all(io, 1)
    assert not done.stored and not spy.inner.exists("w0")
    spy.register_host_pool(pool)


def test_prefetch_of_missing_pages_reads_only_the_leading_present_ones(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io()
    src = store(io, pool, keys(5), first_page=0)
    io.backend.delete("k2")
    dst = slots(10, 5)
    fill(pool, dst, seed=99)
    untouched = pages(pool, dst)
    fetch = Prefetch(keys(5), 1, dst, PAGE)
    io.prefetch(fetch)
    finished(fetch)
    assert (fetch.hit_pages, fetch.read_pages, fetch.target_pages) == (2, 2, 2)
    assert pages(pool, dst)[:2] == pages(pool, src)[:2]
    assert pages(pool, dst)[2:] == untouched[2:], "pages after the first miss are not read"
    assert spy.gets == [2]


def test_prefetch_of_no_stored_page_finishes_without_reading(
    make_io: Callable[..., tuple[StorageIO, Spy]],
) -> None:
    io, spy = make_io()
    fetch = Prefetch(keys(3, "absent"), 1, slots(0, 3), PAGE)
    io.prefetch(fetch)
    finished(fetch)
    assert (fetch.hit_pages, fetch.read_pages, fetch.target_pages) == (0, 0, 0)
    assert spy.gets == []


def test_prefetch_reads_in_batches_and_shows_its_progress(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io(slowed("batch_get_v1", 0.1), read_batch_pages=2, read_threads=1)
    src = store(io, pool, keys(6), first_page=0)
    dst = slots(10, 6)
    fetch = Prefetch(keys(6), 1, dst, PAGE)
    io.prefetch(fetch)
    seen: list[tuple[PrefetchState, int]] = []
    while (state := fetch.state) is not PrefetchState.FINISHED:
        seen.append((state, fetch.read_pages))
        time.sleep(0.005)
    reading = [n for state, n in seen if state is PrefetchState.READING]
    assert reading == sorted(reading), "progress only grows"
    assert {0, 2, 4} <= set(reading), f"every batch's pages became visible: {sorted(set(reading))}"
    assert fetch.read_pages == 6 and spy.gets == [2, 2, 2]
    assert pages(pool, dst) == pages(pool, src)


@pytest.mark.parametrize("threads", [1, 3])
def test_cancel_mid_read_stops_further_batches_and_returns_the_prefix_read(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool, threads: int
) -> None:
    io, spy = make_io(slowed("batch_get_v1", 0.05), read_batch_pages=1, read_threads=threads)
    src = store(io, pool, keys(8), first_page=0)
    dst = slots(10, 8)
    fetch = Prefetch(keys(8), 1, dst, PAGE)
    io.prefetch(fetch)
    wait_until(lambda: fetch.read_pages >= 2, "two pages read")
    read = fetch.cancel()
    assert 2 <= read < 8
    finished(fetch)
    calls = len(spy.gets)
    assert calls <= read + threads, "at most the batches in flight at the cancel ran after it"
    time.sleep(0.15)
    assert len(spy.gets) == calls and fetch.read_pages == read, "the prefix is final"
    assert pages(pool, dst)[:read] == pages(pool, src)[:read]
    assert fetch.cancel() == read


class Staggered(ForwardingBackend):
    """Hold the read calls whose first key is in ``held`` until ``release`` is set."""

    def __init__(self, inner: StorageBackend, held: set[str]) -> None:
        super().__init__(inner)
        self.held = held
        self.release = threading.Event()
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        with self.lock:
            self.calls.append(keys[0])
        if keys[0] in self.held:
            assert self.release.wait(WAIT_S), "the test never released the held read"
        return self.inner.batch_get_v1(keys, host_indices)


@pytest.fixture
def staggered(
    pool: MHAHostPool,
) -> Iterator[Callable[..., tuple[StorageIO, Staggered, StorageBackend]]]:
    """Build a StorageIO over a memory store whose reads in ``held`` wait; close it afterwards."""
    built: list[tuple[StorageIO, Staggered]] = []

    def make(held: set[str], **options: Any) -> tuple[StorageIO, Staggered, StorageBackend]:
        memory = create_backend("memory")
        memory.register_host_pool(pool)
        backend = Staggered(memory, held)
        io = StorageIO(backend, **options)
        built.append((io, backend))
        return io, backend, memory

    yield make
    for io, backend in built:
        backend.release.set()
        io.close()


def test_batches_of_one_fetch_are_read_side_by_side_and_count_in_order(
    pool: MHAHostPool, staggered: Callable[..., tuple[StorageIO, Staggered, StorageBackend]]
) -> None:
    """A later batch that arrives first counts only once the pages before it have arrived."""
    io, backend, memory = staggered({"k0"}, read_batch_pages=2, read_threads=3)
    fill(pool, slots(0, 6), seed=4)
    assert memory.batch_set_v1(keys(6), slots(0, 6)) == [True] * 6
    fetch = Prefetch(keys(6), 1, slots(10, 6), PAGE)
    io.prefetch(fetch)
    wait_until(lambda: len(backend.calls) == 3, "all three batches in flight")
    time.sleep(0.05)  # the second and third batches return meanwhile
    assert fetch.read_pages == 0, "nothing counts before the first batch has arrived"
    assert fetch.state is PrefetchState.READING
    backend.release.set()
    finished(fetch)
    assert fetch.read_pages == 6 and sorted(backend.calls) == ["k0", "k2", "k4"]
    assert pages(pool, slots(10, 6)) == pages(pool, slots(0, 6))


def test_the_oldest_fetch_is_read_first(
    pool: MHAHostPool, staggered: Callable[..., tuple[StorageIO, Staggered, StorageBackend]]
) -> None:
    """Every read thread takes the oldest fetch's batches before a younger fetch's."""
    io, backend, memory = staggered({"a0"}, read_batch_pages=1, read_threads=2)
    fill(pool, slots(0, 6), seed=8)
    assert memory.batch_set_v1([*keys(4, "a"), *keys(2, "b")], slots(0, 6)) == [True] * 6
    old = Prefetch(keys(4, "a"), 1, slots(10, 4), PAGE)
    io.prefetch(old)
    wait_until(lambda: "a1" in backend.calls, "the old fetch's first two batches")
    young = Prefetch(keys(2, "b"), 1, slots(20, 2), PAGE)
    io.prefetch(young)
    wait_until(lambda: len(backend.calls) >= 4, "the old fetch's other batches")
    assert backend.calls[:4] == ["a0", "a1", "a2", "a3"], "the young fetch waited its turn"
    backend.release.set()
    for fetch in (old, young):
        finished(fetch)
    assert old.read_pages == 4 and young.read_pages == 2
    assert backend.calls[4:] == ["b0", "b1"]


def test_a_failed_batch_ends_the_run_even_when_later_batches_arrive(
    pool: MHAHostPool, staggered: Callable[..., tuple[StorageIO, Staggered, StorageBackend]]
) -> None:
    io, backend, memory = staggered({"k2"}, read_batch_pages=2, read_threads=3)
    src = slots(0, 6)
    fill(pool, src, seed=12)
    present = [0, 1, 2, 4, 5]  # page 3 is not stored
    stored = memory.batch_set_v1([f"k{i}" for i in present], src.view(6, PAGE)[present].ravel())
    assert stored == [True] * 5
    fetch = Prefetch(keys(6), 1, slots(10, 6), PAGE)
    fetch._queried(6, 0.0)  # as if the query had found all six (page 3 vanished since)
    io.read(fetch)
    wait_until(lambda: fetch.read_pages == 2 and "k4" in backend.calls, "batches 1 and 3")
    time.sleep(0.05)  # the third batch returns while the second is held
    assert fetch.read_pages == 2 and fetch.state is PrefetchState.READING
    backend.release.set()
    finished(fetch)
    assert fetch.read_pages == 3, "page 2 arrived; page 3 is missing, so 4-5 do not count"
    assert pages(pool, slots(10, 3)) == pages(pool, src)[:3]


def test_cancel_while_querying_finishes_at_once(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io()
    store(io, pool, keys(2), first_page=0)
    spy.gate.clear()
    spy.entered.clear()
    blocker = Prefetch(keys(2), 1, slots(10, 2), PAGE)
    io.prefetch(blocker)
    assert spy.entered.wait(WAIT_S)  # the query thread holds the first fetch's query
    queued = Prefetch(keys(2), 1, slots(20, 2), PAGE)
    io.prefetch(queued)
    assert queued.cancel() == 0
    assert queued.state is PrefetchState.FINISHED
    spy.gate.set()
    finished(blocker)
    time.sleep(0.05)
    assert blocker.read_pages == 2 and spy.gets == [2], "the cancelled fetch read nothing"
    assert queued.read_pages == 0 and queued.hit_pages is None


def test_a_page_gone_between_query_and_read_ends_the_fetch_at_the_last_read_page(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io(read_batch_pages=4)
    store(io, pool, keys(4), first_page=0)
    io.backend.delete("k2")
    spy.claim_all = True  # the query saw page 2, then it was evicted before the read
    fetch = Prefetch(keys(4), 1, slots(10, 4), PAGE)
    io.prefetch(fetch)
    finished(fetch)
    time.sleep(0.1)
    assert (fetch.hit_pages, fetch.read_pages) == (4, 2)
    assert spy.gets == [4], "one read, then no more once the fetch finished"


def test_a_failing_query_or_read_finishes_the_fetch_and_the_threads_carry_on(
    make_io: Callable[..., tuple[StorageIO, Spy]],
    pool: MHAHostPool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    io, spy = make_io()
    src = store(io, pool, keys(3), first_page=0)
    for op in ("batch_exists", "batch_get_v1"):
        spy.raising = {op}
        fetch = Prefetch(keys(3), 1, slots(10, 3), PAGE)
        io.prefetch(fetch)
        finished(fetch)
        assert fetch.read_pages == 0 and io.alive, op
    assert "existence query of 3 pages failed" in caplog.text
    assert "read of 3 pages failed" in caplog.text
    # Neither raised a BackendError: each is a bug, kept for the engine's poll to raise.
    with pytest.raises(StorageBugError, match="existence query of 3 pages raised RuntimeError"):
        io.check()
    with pytest.raises(StorageBugError, match="read of 3 pages raised RuntimeError") as bug:
        io.check()
    assert isinstance(bug.value.__cause__, RuntimeError)
    io.check()  # each bug is raised once
    spy.raising = set()
    fetch = Prefetch(keys(3), 1, slots(20, 3), PAGE)
    io.prefetch(fetch)
    finished(fetch)
    assert fetch.read_pages == 3 and pages(pool, slots(20, 3)) == pages(pool, src)


# ---- backup --------------------------------------------------------------------------------------


def test_backup_writes_the_pages_under_their_keys_after_ready(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io()
    src = slots(0, 3)
    fill(pool, src, seed=5)
    readied: list[int] = []
    job = Backup(keys(3), src, ticket=7, ready=lambda: readied.append(len(spy.sets)))
    assert io.backup(job)
    (done,) = poll_all(io, 1)
    assert done == BackupDone(job, stored=True) and done.backup.ticket == 7
    assert readied == [0], "ready ran once, before the write"
    dst = slots(10, 3)
    assert spy.inner.batch_get_v1(keys(3), dst) == [True] * 3
    assert pages(pool, dst) == pages(pool, src)
    assert io.refused_backups == 0


def test_a_backup_is_written_a_few_pages_at_a_time_in_order(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io(write_batch_pages=2)
    src = slots(0, 5)
    fill(pool, src, seed=6)
    job = Backup(keys(5), src, ticket=1)
    assert io.backup(job)
    (done,) = poll_all(io, 1)
    assert done.stored and spy.sets == [2, 2, 1]
    dst = slots(10, 5)
    assert spy.inner.batch_get_v1(keys(5), dst) == [True] * 5
    assert pages(pool, dst) == pages(pool, src), "each chunk went to its own keys"


def test_hurry_writes_the_queued_backups_wider_until_the_queue_drains(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io(write_batch_pages=2)
    spy.gate.clear()
    fill(pool, slots(0, 7), seed=9)
    first, second = Backup(keys(7, "a"), slots(0, 7), 1), Backup(keys(9, "b"), slots(7, 9), 2)
    assert io.backup(first) and io.backup(second)
    assert spy.entered.wait(WAIT_S)  # the writer holds the first two pages of the first backup
    io.hurry()
    spy.gate.set()
    assert all(done.stored for done in poll_all(io, 2))
    assert spy.sets == [2, 5, 8, 1], "after hurry, four times as many pages a call"
    third = Backup(keys(5, "c"), slots(16, 5), 3)
    assert io.backup(third) and poll_all(io, 1)[0].stored
    assert spy.sets[4:] == [2, 2, 1], "a drained queue writes a few pages a call again"
    dst = slots(24, 7)
    assert spy.inner.batch_get_v1(keys(7, "a"), dst) == [True] * 7
    assert pages(pool, dst) == pages(pool, slots(0, 7))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
def test_idle_writes_run_the_writer_alone_under_sched_idle(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    nice = max(os.getpriority(os.PRIO_PROCESS, 0), 7)
    io, spy = make_io(write_batch_pages=2, nice=nice, idle_writes=True)
    fill(pool, slots(0, 4), seed=4)
    spy.gate.clear()
    assert io.backup(Backup(keys(2, "a"), slots(0, 2), 1))
    assert spy.entered.wait(WAIT_S)
    assert io.backup(Backup(keys(2, "b"), slots(2, 2), 2))
    io.hurry()  # hurried writes go wider, not ahead of the forward
    spy.gate.set()
    poll_all(io, 2)
    fetch = Prefetch(keys(2, "a"), 1, slots(8, 2), PAGE)
    io.prefetch(fetch)
    wait_until(lambda: fetch.state is PrefetchState.FINISHED, "the fetch")
    assert fetch.read_pages == 2
    writes = [p[1] for p in spy.policies if p[0] == "batch_set_v1"]
    assert writes == [os.SCHED_IDLE] * 2
    others = [p[1:] for p in spy.policies if p[0] != "batch_set_v1"]
    assert others == [(os.SCHED_OTHER, nice)] * 2, "queries and reads keep the niceness"
    assert os.sched_getscheduler(0) == os.SCHED_OTHER, "the caller's thread is left alone"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
def test_without_idle_writes_the_writer_runs_at_the_storage_niceness(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    nice = max(os.getpriority(os.PRIO_PROCESS, 0), 5)
    io, spy = make_io(nice=nice)
    assert io.backup(Backup(keys(1, "d"), slots(0, 1), 1))
    poll_all(io, 1)
    assert [p[1:] for p in spy.policies] == [(os.SCHED_OTHER, nice)]


@pytest.mark.parametrize("value", [1, "yes", None])
def test_idle_writes_must_be_a_bool(
    make_io: Callable[..., tuple[StorageIO, Spy]], value: object
) -> None:
    with pytest.raises(ConfigError, match="idle_writes"):
        make_io(idle_writes=value)


def test_close_writes_every_queued_backup_before_stopping(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io(write_batch_pages=4)
    spy.gate.clear()
    jobs = [Backup(keys(n, f"c{n}"), slots(2 * n, n), n) for n in (3, 1, 2)]
    assert all(io.backup(job) for job in jobs)
    spy.gate.set()
    done = io.close()
    assert sorted(d.backup.ticket for d in done) == [1, 2, 3] and all(d.stored for d in done)
    assert not any(t.is_alive() for t in io.threads)


def test_a_failed_chunk_of_a_backup_stops_it_unstored(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io(write_batch_pages=2)
    spy.fail_second_set = True  # the second page of every call fails
    job = Backup(keys(6, "c"), slots(0, 6), ticket=2)
    assert io.backup(job)
    (done,) = poll_all(io, 1)
    assert not done.stored
    assert spy.sets == [2], "no chunk is written after one failed"


def test_small_backups_share_a_call_and_each_gets_its_own_outcome(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io(write_batch_pages=4)
    spy.fail_second_set = True  # the second page of every call fails
    fill(pool, slots(0, 7), seed=3)
    spy.gate.clear()
    held = Backup(keys(1, "h"), slots(6, 1), ticket=9)
    assert io.backup(held)
    assert spy.entered.wait(WAIT_S)  # the writer is inside the first call; the rest queue
    sizes = [(0, 1), (1, 2), (3, 1), (4, 2)]
    jobs = [Backup(keys(n, f"s{t}_"), slots(first, n), t) for t, (first, n) in enumerate(sizes)]
    assert all(io.backup(job) for job in jobs)
    spy.gate.set()
    done = {d.backup.ticket: d.stored for d in poll_all(io, 5)}
    assert spy.sets == [1, 4, 2], "1 + 2 + 1 pages in one call of at most four, then the last"
    assert done == {9: True, 0: True, 1: False, 2: True, 3: False}, "a failed page fails its job"
    for t, (first, n) in enumerate(sizes):
        if done[t]:
            dst = slots(16, n)
            assert spy.inner.batch_get_v1(keys(n, f"s{t}_"), dst) == [True] * n
            assert pages(pool, dst) == pages(pool, slots(first, n)), "each job's own pages"


def test_a_lingering_writer_writes_the_backups_of_a_step_in_one_call(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    """Woken for less than a call takes, the writer waits for the next backups, not a call each."""
    io, spy = make_io(write_batch_pages=8, write_linger_s=0.5)
    fill(pool, slots(0, 5), seed=4)
    sizes = [(0, 1), (1, 2), (3, 2)]
    jobs = [Backup(keys(n, f"l{t}_"), slots(first, n), t) for t, (first, n) in enumerate(sizes)]
    assert all(io.backup(job) for job in jobs)  # one request's release after another
    done = {d.backup.ticket: d.stored for d in poll_all(io, 3)}
    assert done == {0: True, 1: True, 2: True}
    assert spy.sets == [5], "the three backups in one call"


def test_without_linger_the_writer_starts_at_once(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io(write_batch_pages=8, write_linger_s=0.0)
    fill(pool, slots(0, 2), seed=5)
    spy.gate.clear()
    assert io.backup(Backup(keys(1, "a"), slots(0, 1), 0))
    assert spy.entered.wait(WAIT_S), "the first backup's call started alone"
    assert io.backup(Backup(keys(1, "b"), slots(1, 1), 1))
    spy.gate.set()
    poll_all(io, 2)
    assert spy.sets == [1, 1]


@pytest.mark.parametrize("end", ["hurry", "close"])
def test_hurry_or_close_ends_a_linger(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool, end: str
) -> None:
    """A writer lingering for more backups writes at once when hurried or closed: nothing waits
    out the linger, and nothing queued is lost."""
    io, spy = make_io(write_batch_pages=8, write_linger_s=0.99)
    fill(pool, slots(0, 1), seed=6)
    job = Backup(keys(1, "z"), slots(0, 1), 0)
    assert io.backup(job)
    wait_until(lambda: not io._writer.queued(), "the writer took the backup")
    began = time.monotonic()
    if end == "hurry":
        io.hurry()
        done = poll_all(io, 1)
    else:
        done = io.close()
    assert [d.stored for d in done] == [True]
    assert spy.inner.exists("z0")
    assert time.monotonic() - began < 0.9, "the writer waited out its linger"


def test_a_full_write_queue_refuses_a_backup_and_counts_it(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io(write_capacity=1)
    spy.gate.clear()
    jobs = [Backup([f"p{i}"], slots(i, 1), ticket=i) for i in range(3)]
    assert io.backup(jobs[0])
    assert spy.entered.wait(WAIT_S)  # the writer holds job 0; the queue has room for one
    assert io.backup(jobs[1])
    assert not io.backup(jobs[2])
    assert io.refused_backups == 1
    spy.gate.set()
    done = poll_all(io, 2)
    assert sorted(d.backup.ticket for d in done) == [0, 1]  # type: ignore[type-var]
    assert all(d.stored for d in done)
    assert not spy.inner.exists("p2")


def test_close_writes_every_queued_backup_and_joins_every_thread(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io(write_capacity=4, query_threads=2, read_threads=3)
    assert len(io.threads) == 2 + 3 + 1 and io.alive
    assert len({t.name for t in io.threads}) == 6, "each thread has its own name"
    spy.gate.clear()
    for i in range(4):
        assert io.backup(Backup([f"q{i}"], slots(i, 1), ticket=i))
        if i == 0:
            assert spy.entered.wait(WAIT_S)
    timer = threading.Timer(0.1, spy.gate.set)
    timer.start()
    done = io.close()
    timer.join()
    assert sorted(d.backup.ticket for d in done) == [0, 1, 2, 3]  # type: ignore[type-var]
    assert all(d.stored for d in done)
    assert all(spy.inner.exists(f"q{i}") for i in range(4))
    assert not any(t.is_alive() for t in io.threads) and not io.alive
    assert io.close() == [], "a second close does nothing"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_ends_unexpectedly_makes_the_io_not_alive(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    """The engine stops waiting on storage once any of its threads is gone."""
    io, _ = make_io(query_threads=1)
    assert io.alive

    def broken(item: Prefetch) -> None:
        raise RuntimeError("a bug outside the backend call ends the thread")

    io._query = broken  # type: ignore[method-assign]
    io.prefetch(Prefetch(keys(1), 1, None, PAGE))
    wait_until(lambda: not io.alive, "the io to notice the ended query thread")
    wait_until(lambda: not any(t.is_alive() for t in io._query_threads), "the thread to end")
    assert all(t.is_alive() for t in (*io._read_threads, *io._write_threads))
    assert not io.alive, "one thread gone is enough"
    io.close()


@pytest.mark.parametrize("failure", ["raises", "a page fails", "ready raises"])
def test_a_failed_backup_is_not_stored_and_the_writer_carries_on(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool, failure: str
) -> None:
    io, spy = make_io()
    ready = None
    if failure == "raises":
        spy.raising = {"batch_set_v1"}
    elif failure == "a page fails":
        spy.fail_second_set = True
    else:

        def ready() -> None:
            raise RuntimeError("the device copy failed")

    bad = Backup(keys(2, "bad"), slots(0, 2), ticket="bad", ready=ready)
    assert io.backup(bad)
    (done,) = poll_all(io, 1)
    assert done == BackupDone(bad, stored=False)
    assert io.alive
    spy.raising = set()
    spy.fail_second_set = False
    good = Backup(keys(1, "good"), slots(4, 1), ticket="good")
    assert io.backup(good)
    assert poll_all(io, 1) == [BackupDone(good, stored=True)]


# ---- after close and bad arguments ---------------------------------------------------------------


def test_after_close_a_prefetch_finishes_empty_and_a_backup_is_refused(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io()
    store(io, pool, keys(2), first_page=0)
    io.close()
    calls = (len(spy.gets), len(spy.sets))
    fetch = Prefetch(keys(2), 1, slots(10, 2), PAGE)
    io.prefetch(fetch)
    assert fetch.state is PrefetchState.FINISHED
    assert fetch.read_pages == 0 and fetch.cancel() == 0
    assert not io.backup(Backup(keys(1), slots(0, 1)))
    assert io.refused_backups == 1
    assert (len(spy.gets), len(spy.sets)) == calls, "no thread touched the backend"


def test_close_cancels_a_fetch_still_reading(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, _ = make_io(slowed("batch_get_v1", 0.05), read_batch_pages=1)
    store(io, pool, keys(8), first_page=0)
    fetch = Prefetch(keys(8), 1, slots(10, 8), PAGE)
    io.prefetch(fetch)
    wait_until(lambda: fetch.read_pages >= 1, "a first page read")
    io.close()
    assert fetch.state is PrefetchState.FINISHED and fetch.read_pages < 8
    assert not any(t.is_alive() for t in io.threads)


@pytest.mark.parametrize("value", [-0.1, 1.0, True, "0.02", None])
def test_storage_io_refuses_a_linger_outside_zero_to_one_second(value: object) -> None:
    backend = create_backend("memory")
    with pytest.raises(ConfigError, match="write_linger_s"):
        StorageIO(backend, write_linger_s=value)  # type: ignore[arg-type]
    backend.close()


@pytest.mark.parametrize("option", ["read_batch_pages", "write_capacity"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_storage_io_refuses_a_size_that_is_not_a_positive_int(option: str, value: object) -> None:
    backend = create_backend("memory")
    with pytest.raises(ConfigError, match=option):
        StorageIO(backend, **{option: value})  # type: ignore[arg-type]
    backend.close()


def test_prefetch_refuses_keys_that_do_not_match_its_slots() -> None:
    with pytest.raises(ConfigError, match="do not match"):
        Prefetch(keys(3), 1, slots(0, 2), PAGE)
    with pytest.raises(ConfigError, match="do not match"):
        Prefetch(keys(3), 2, slots(0, 2), PAGE)
    assert Prefetch(keys(4), 2, slots(0, 2), PAGE).pages == 2


def test_a_store_failure_is_a_miss_and_no_bug(
    make_io: Callable[..., tuple[StorageIO, Spy]], pool: MHAHostPool
) -> None:
    io, spy = make_io()
    store(io, pool, keys(2), first_page=0)
    spy.error = BackendIOError
    for op in ("batch_exists", "batch_get_v1", "batch_set_v1"):
        spy.raising = {op}
        fetch = Prefetch(keys(2), 1, slots(10, 2), PAGE)
        io.prefetch(fetch)
        finished(fetch)
        assert fetch.read_pages == (2 if op == "batch_set_v1" else 0), op
        bad = Backup(keys(1, op), slots(4, 1), ticket=op)
        assert io.backup(bad)
        (done,) = poll_all(io, 1)
        assert done.stored is (op != "batch_set_v1"), op
    io.check()  # the store failed; nothing is a bug
