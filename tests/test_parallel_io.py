"""Many pages in flight: the kit's I/O workers and the file backend's parallel v1 batches."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from hicache_storage import create_backend
from hicache_storage.errors import BackendClosedError, ConfigError
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.kit import IOWorkers, pageio


def test_results_come_back_in_order_and_pages_run_at_once() -> None:
    workers = IOWorkers(4, "t-io")
    inside, most = 0, 0
    lock = threading.Lock()

    def work(i: int) -> int:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        time.sleep(0.02 if i % 2 else 0.005)
        with lock:
            inside -= 1
        return i * i

    assert workers.map(work, list(range(12))) == [i * i for i in range(12)]
    assert 1 < most <= 4, "pages must be in flight together, never more than the bound"
    workers.close()


def test_a_failure_is_raised_only_after_every_page_is_done() -> None:
    workers = IOWorkers(3, "t-io")
    finished: list[int] = []

    def work(i: int) -> int:
        if i in (1, 4):
            raise OSError(f"page {i}")
        time.sleep(0.01)
        finished.append(i)
        return i

    with pytest.raises(OSError, match="page 1"):
        workers.map(work, list(range(6)))
    assert sorted(finished) == [0, 2, 3, 5], "no page may still run once the call has raised"
    workers.close()


def test_one_thread_or_one_page_runs_inline_and_starts_no_pool() -> None:
    caller = threading.get_ident()
    single = IOWorkers(1, "t-io")
    assert single.map(lambda _: threading.get_ident(), [0, 1, 2]) == [caller] * 3
    wide = IOWorkers(8, "t-io")
    assert wide.map(lambda _: threading.get_ident(), [0]) == [caller]
    assert not single.started and not wide.started


def test_racing_first_calls_make_one_pool_and_close_stops_it() -> None:
    before = set(threading.enumerate())
    workers = IOWorkers(2, "t-race-io")
    barrier = threading.Barrier(8)

    def first_call() -> None:
        barrier.wait()
        workers.map(lambda i: i, [0, 1, 2])

    callers = [threading.Thread(target=first_call) for _ in range(8)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    ours = [t for t in threading.enumerate() if t not in before and t.name.startswith("t-race-io")]
    assert 1 <= len(ours) <= 2, f"one pool of at most 2 threads, got {[t.name for t in ours]}"
    workers.close()
    assert not any(t.is_alive() for t in ours)
    with pytest.raises(BackendClosedError):
        workers.map(lambda i: i, [0, 1])
    workers.close()


def test_batches_that_run_their_own_threads_share_one_budget() -> None:
    workers = IOWorkers(4, "t-io")
    with workers.share(3) as first:
        assert first == 3
        with workers.share(8) as second:
            assert second == 1, "a batch takes what is left of the budget, not its own"
        taken: list[int] = []
        waiter = threading.Thread(target=lambda: taken.append(workers.share(2).__enter__()))
        with workers.share(1):
            waiter.start()
            waiter.join(0.1)
            assert waiter.is_alive(), "with the budget taken a batch waits for one to end"
    waiter.join(5)
    assert taken == [2]
    workers.close()


def test_a_batch_waiting_for_the_budget_is_woken_by_close() -> None:
    workers = IOWorkers(1, "t-io")
    raised: list[BaseException] = []

    def wait_for_share() -> None:
        try:
            with workers.share(1):
                pass
        except BackendClosedError as exc:
            raised.append(exc)

    with workers.share(1):
        waiter = threading.Thread(target=wait_for_share)
        waiter.start()
        waiter.join(0.05)
        workers.close()
    waiter.join(5)
    assert not waiter.is_alive() and len(raised) == 1
    with pytest.raises(BackendClosedError):
        workers.share(1).__enter__()


def test_concurrent_native_batches_never_run_more_pages_than_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The file backend's batches run on threads the C helper starts: their sum is bounded."""
    lock = threading.Lock()
    running, most, asked = 0, 0, []

    class Helper:
        def read_files(self, paths: list[bytes], *args: object) -> list[tuple[int, ...]]:
            nonlocal running, most
            threads = args[-1]
            assert isinstance(threads, int)
            with lock:
                asked.append(threads)
                running += threads
                most = max(most, running)
            time.sleep(0.02)
            with lock:
                running -= threads
            return [(0, 0, 0, 0)] * len(paths)

    monkeypatch.setattr(pageio, "_CHECKED", Helper())
    workers = IOWorkers(6, "t-io")
    views = [[memoryview(bytearray(4))]] * 5
    callers = [
        threading.Thread(target=pageio.read_files, args=(["p"] * 5, views, [4] * 5, workers))
        for _ in range(4)
    ]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    assert len(asked) == 4 and all(1 <= n <= 5 for n in asked)
    assert most <= 6, f"{most} pages in flight at once against a budget of 6"
    workers.close()


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_thread_count_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="threads"):
        IOWorkers(bad, "t-io")  # type: ignore[arg-type]


def _pool() -> MHAHostPool:
    return MHAHostPool(64, 4, 2, 2, 8, dtype=torch.float16, layout="layer_first", pin_memory=False)


def _page(pool: MHAHostPool, page: int) -> bytes:
    return bytes(pool.get_data_page(page * pool.page_size).view(torch.uint8).reshape(-1).numpy())


@pytest.mark.parametrize("threads", [1, 4])
def test_file_v1_batches_keep_order_misses_and_integrity(tmp_path: Path, threads: int) -> None:
    options = {"root": str(tmp_path), "io_threads": threads}
    with create_backend("file", options) as backend:
        source = _pool()
        torch.manual_seed(threads)
        source.kv_buffer.copy_(torch.randn_like(source.kv_buffer, dtype=torch.float32).half())
        backend.register_host_pool(source)
        keys = [f"page-{i}" for i in range(12)]
        index = torch.arange(0, 12 * 4)
        assert backend.batch_set_v1(keys, index) == [True] * 12
        victim = next(tmp_path.rglob("page-5"))
        data = bytearray(victim.read_bytes())
        data[7] ^= 0xFF
        victim.write_bytes(bytes(data))

        target = _pool()
        backend.register_host_pool(target)
        asked = [*keys[:8], "absent", *keys[8:]]
        pages = list(range(3, 16))
        indices = torch.cat([torch.arange(p * 4, (p + 1) * 4) for p in pages])
        got = backend.batch_get_v1(asked, indices)
        assert got == [key != "page-5" and key != "absent" for key in asked]
        for key, page, hit in zip(asked, pages, got, strict=True):
            if hit:
                assert _page(target, page) == _page(source, keys.index(key)), key
        assert backend.stats()["integrity_failures"] == {"checksum": 1}
        assert not victim.exists(), "an object that failed its check is removed"


def test_file_io_threads_are_validated(tmp_path: Path) -> None:
    for bad in (0, -2, True, "4", 10**6):
        with pytest.raises(ConfigError, match="io_threads"):
            create_backend("file", {"root": str(tmp_path), "io_threads": bad})
