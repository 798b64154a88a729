"""``close()`` from another thread while calls run: each call completes or is refused, cleanly.

Engines close a backend from a shutdown path while prefetch and backup threads are still inside
calls. Every call in flight must then either return a valid answer (right bytes on a hit) or
raise :class:`~hicache_storage.errors.BackendClosedError`, never a client library's raw error
from a released connection or descriptor, and a call started after ``close()`` returned must be
refused. ``hicache_storage.kit.closed_guard`` gives a backend this.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import traceback
from collections.abc import Callable

import msgspec

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import _bytes, _indices, _pool, fill_random
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.errors import BackendClosedError
from hicache_storage.layers import ForwardingBackend

__all__ = ["TestCloseRace"]

STACKS = ("bare", "layered")
"""Each round's instance alternates: without the layers, then through them (no degrade)."""
ROUNDS = (3, 8)
"""Fresh instances closed under load: at least the first, at most the second number ..."""
ROUNDS_BUDGET_S = 1.0
"""... more rounds only while the check has run less than this (slow stores get fewer)."""
WORKERS = 4
KEYS = 4
WARM_CALLS = WORKERS
"""Calls answered before ``close()`` is sent, so that every worker is running."""
MAX_PROBLEMS = 20
STUCK_S = 30.0
"""How long a worker may stay inside one call after ``close()`` before it counts as hung."""


class _Race:
    """One instance, ``WORKERS`` threads cycling through every call, one ``close()``."""

    def __init__(self, instance: StorageBackend, keys: list[str], seed: int) -> None:
        self.instance = instance
        self.keys = keys
        self.rng = random.Random(seed)
        self.pool = _pool("mha", "page_first", pages=(WORKERS + 1) * KEYS)
        fill_random(self.pool, seed)
        self.source = _indices(self.pool, range(KEYS))
        self.expected = [_bytes(page) for page in self._pages(range(KEYS))]
        self.problems: list[str] = []
        self.lock = threading.Lock()
        self.answered = 0
        self.inside = 0
        self.warm = threading.Event()
        self.closed = threading.Event()

    def _pages(self, pages: range) -> list[bytes]:
        views = self.pool.page_buffer_views(_indices(self.pool, pages))
        return [b"".join(bytes(view) for view in page) for page in views]

    def prepare(self) -> None:
        self.instance.register_host_pool(self.pool)
        stored = self.instance.batch_set_v1(self.keys, self.source)
        assert stored == [True] * KEYS, f"batch_set_v1 of {KEYS} pages answered {stored}"

    def _calls(self, worker: int) -> list[tuple[str, Callable[[], str | None]]]:
        """Each call and the check of its answer (a problem, or None)."""
        keys, expected, n = self.keys, self.expected, len(self.keys)
        pages = range((worker + 1) * KEYS, (worker + 2) * KEYS)
        target = _indices(self.pool, pages)

        def flags(op: str, got: object) -> str | None:
            if isinstance(got, list) and len(got) == n and all(type(f) is bool for f in got):
                return None
            return f"{op} answered {got!r}, not {n} bools"

        def batch_get() -> str | None:
            outs = [bytearray(len(value)) for value in expected]
            got = self.instance.batch_get(keys, outs)
            return flags("batch_get", got) or _wrong_hits("batch_get", got, outs, expected)

        def batch_get_v1() -> str | None:
            got = self.instance.batch_get_v1(keys, target)
            return flags("batch_get_v1", got) or _wrong_hits(
                "batch_get_v1", got, self._pages(pages), expected
            )

        def batch_exists() -> str | None:
            got = self.instance.batch_exists(keys)
            ok = type(got) is int and 0 <= got <= n
            return None if ok else f"batch_exists answered {got!r}"

        def get() -> str | None:
            got = self.instance.get(keys[0])
            ok = got is None or _bytes(got) == expected[0]
            return None if ok else "get answered bytes that were never written"

        def exists() -> str | None:
            got = self.instance.exists(keys[1])
            return None if type(got) is bool else f"exists answered {got!r}"

        return [
            ("batch_get", batch_get),
            ("batch_set", lambda: flags("batch_set", self.instance.batch_set(keys, expected))),
            ("batch_exists", batch_exists),
            ("batch_get_v1", batch_get_v1),
            (
                "batch_set_v1",
                lambda: flags("batch_set_v1", self.instance.batch_set_v1(keys, self.source)),
            ),
            ("get", get),
            ("exists", exists),
        ]

    def work(self, worker: int) -> None:
        calls = self._calls(worker)
        for turn in itertools.count():
            op, call = calls[(worker + turn) % len(calls)]
            after_close = self.closed.is_set()
            with self.lock:
                self.inside += 1
            try:
                problem = call()
            except BackendClosedError:
                return
            except BaseException as exc:  # noqa: BLE001 - every other failure is reported
                where = traceback.format_exception(exc)[-2].strip()
                problem = f"{op} raised {type(exc).__name__}: {exc} ({where})"
            finally:
                with self.lock:
                    self.inside -= 1
            if after_close:
                problem = problem or f"{op}, started after close() returned, answered instead"
            with self.lock:
                if problem is not None and len(self.problems) < MAX_PROBLEMS:
                    self.problems.append(problem)
                self.answered += 1
                if self.answered >= WARM_CALLS:
                    self.warm.set()
            if after_close:
                return

    def close(self, close: Callable[[], None]) -> None:
        """Close once every worker is running, at a moment when all are inside a call."""
        self.warm.wait(STUCK_S)
        time.sleep(self.rng.uniform(0.0, 0.002))
        for _ in range(10_000):
            if self.inside == WORKERS:
                break
            time.sleep(0)
        try:
            close()
        except BaseException as exc:  # noqa: BLE001 - reported
            with self.lock:
                self.problems.append(f"close() raised {type(exc).__name__}: {exc}")
        self.closed.set()

    def run(self, close: Callable[[], None]) -> list[str]:
        threads = [
            threading.Thread(target=self.work, args=(i,), name=f"hicache-race-{i}", daemon=True)
            for i in range(WORKERS)
        ]
        closer = threading.Thread(target=self.close, args=(close,), name="hicache-race-close")
        for thread in [*threads, closer]:
            thread.start()
        closer.join(STUCK_S)
        for thread in threads:
            thread.join(STUCK_S)
        stuck = [thread.name for thread in [*threads, closer] if thread.is_alive()]
        if stuck:
            self.problems.append(f"{stuck} still inside a call {STUCK_S:g} s after close()")
        if not self.instance.closed:
            self.problems.append("closed is False after close() returned")
        return self.problems


def _wrong_hits(
    op: str, hits: list[bool], got: list[bytearray] | list[bytes], expected: list[bytes]
) -> str | None:
    wrong = [i for i, hit in enumerate(hits) if hit and bytes(got[i]) != expected[i]]
    return f"{op} reported hits {wrong} with bytes that were never written" if wrong else None


def _instance(factory: BackendFactory, stack: str) -> tuple[StorageBackend, StorageBackend]:
    """Return (the instance to race, the one to close): bare, or layered without degrade."""
    layered = factory(msgspec.structs.replace(factory.layers, degrade=False, faults=None))
    if stack == "bare" and isinstance(layered, ForwardingBackend):
        return layered.unwrap(), layered
    return layered, layered


class TestCloseRace:
    """``close()`` while threads are inside every batch and v1 call, repeated on fresh instances."""

    def test_close_under_load_calls_complete_or_raise_closed(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """Each call answers validly or raises ``BackendClosedError``; nothing else.

        ``bare`` rounds race the backend without the layers (engines build it so); ``layered``
        ones the stack without the degrade layer, so an error is seen as itself, not hidden as
        a miss.
        """
        problems: list[str] = []
        started = time.monotonic()
        try:
            for round_ in range(ROUNDS[1]):
                if round_ >= ROUNDS[0] and time.monotonic() - started > ROUNDS_BUDGET_S:
                    break
                stack = STACKS[round_ % len(STACKS)]
                instance, outer = _instance(hicache_factory, stack)
                race = _Race(instance, k.many(f"race{round_}-", KEYS), seed=round_)
                try:
                    race.prepare()
                except BaseException:
                    outer.close()
                    raise
                problems += [f"round {round_} ({stack}): {p}" for p in race.run(outer.close)]
                outer.close()
        finally:
            cleanup(hicache_factory, None, k)
        assert not problems, f"{len(problems)} problems; first: {problems[:3]}"
