"""Many pages in flight: a bounded pool of I/O threads shared by the calls of one backend.

A batch of page reads done one after another runs at the speed of one request to the medium;
file systems, page caches and NVMe drives serve many at once (on the GPU host, ``preadv`` of
8 MiB pages from the page cache reaches 4 GiB/s on one thread and 38 GiB/s on sixteen).
``os.preadv``/``os.pwritev`` and the CRC32C of large buffers release the GIL, so threads are
enough. :class:`IOWorkers` runs one callable per page on up to ``threads`` threads and hands the
results back in order, only after every page is done: no worker touches a caller's buffer once
the call has returned, whether it succeeded or raised.

``threads`` bounds the pages in flight across every call at once, not per call: a native batch
that starts threads of its own takes them from the same budget (:meth:`IOWorkers.share`). Four
concurrent batches of sixteen threads each on a sixteen-core GPU host ran 64 copies at once and
made the forward beside them 5.5x slower, for no more bandwidth than sixteen reach.

The threads start on first use, under a lock (two racing first calls make one pool), and stop in
:meth:`IOWorkers.close`, which the backend calls from its own ``close()`` after its calls have
drained.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from hicache_storage.errors import BackendClosedError
from hicache_storage.kit.options import positive_int

__all__ = ["Beside", "IOWorkers"]

T = TypeVar("T")
R = TypeVar("R")


class IOWorkers:
    """Run per-page I/O on a bounded, lazily started thread pool.

    Parameters
    ----------
    threads
        Pages in flight at once; 1 runs every page in the calling thread.
    name
        Prefix of the threads' names (what a profiler or ``threading.enumerate`` shows).
    """

    def __init__(self, threads: int, name: str) -> None:
        self.threads = positive_int("threads", threads)
        self.name = name
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._free = self.threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @contextlib.contextmanager
    def share(self, wanted: int) -> Iterator[int]:
        """Hold up to ``wanted`` of the budget's threads for a batch that runs its own.

        Waits until at least one is free, takes as many as are free (at most ``wanted``) and
        yields their count; they go back on exit. A batch that finds the budget taken waits for
        the batches ahead of it rather than crowd the cores they already fill.

        Raises
        ------
        BackendClosedError
            After :meth:`close`.
        """
        with self._freed:
            self.check_open()
            while self._free == 0:
                self._freed.wait()
                self.check_open()
            taken = min(max(wanted, 1), self._free)
            self._free -= taken
        try:
            yield taken
        finally:
            with self._freed:
                self._free += taken
                self._freed.notify_all()

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """Return ``[fn(item) for item in items]``, computed up to ``threads`` at a time.

        Every item is finished before this returns or raises; if any raised, the exception of
        the first such item (in order) is raised.

        Raises
        ------
        BackendClosedError
            After :meth:`close`.
        """
        if len(items) <= 1 or self.threads == 1:
            self.check_open()
            return [fn(item) for item in items]
        futures = [self._executor().submit(fn, item) for item in items]
        concurrent.futures.wait(futures)
        return [future.result() for future in futures]

    def close(self) -> None:
        """Stop the threads (waiting for work already submitted); idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            self._freed.notify_all()
        if pool is not None:
            pool.shutdown(wait=True)

    @property
    def started(self) -> bool:
        """Whether the thread pool exists (it starts on the first batch of two or more pages)."""
        return self._pool is not None

    def check_open(self) -> None:
        """Raise :class:`BackendClosedError` after :meth:`close`."""
        if self._closed:
            raise BackendClosedError(f"the I/O threads of {self.name} are stopped")

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            self.check_open()
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads, thread_name_prefix=self.name
                )
            return self._pool


class Beside(Generic[T]):
    """``fn(*args)`` run on a thread of its own while the caller goes on.

    A thread per call, not a pool: the work waits on a store, so a pool sized by cores would
    queue the calls of many engine threads behind each other, each waiting out a slow store in
    turn. :meth:`result` joins the thread, so none outlives the call that started it.
    """

    def __init__(self, fn: Callable[..., T], *args: Any, name: str = "hicache-beside") -> None:
        self._outcome: tuple[bool, Any] = (False, None)
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        try:
            self._outcome = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - raised again by result()
            self._outcome = (False, exc)

    def result(self) -> T:
        """Wait for the thread; return what ``fn`` returned or raise what it raised."""
        self._thread.join()
        done, value = self._outcome
        if not done:
            raise value
        result: T = value
        return result
