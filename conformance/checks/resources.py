"""Resources: error paths and racing first calls leak no file descriptors and no threads.

A leak on a path the round trips never take (a descriptor left open when ``get(out)`` refuses a
wrong-sized buffer, a second worker pool built by two first calls that raced past an unlocked
check) grows with every such call. The checks repeat a round of those calls until the counts
stop growing: a backend's own connections and pools reach their steady size in the warm-up
round (or soon after), a leak grows in every round.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable

import pytest

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import _indices, _pool
from hicache_storage.conformance.checks.concurrency import _run_threads
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.workers import make_value
from hicache_storage.errors import (
    BufferSizeError,
    HiCacheError,
    IndexAlignmentError,
    PoolNotRegisteredError,
)
from hicache_storage.layers import ForwardingBackend

__all__ = ["TestResources"]

ROUNDS = 4
"""Measured rounds after the warm-up: a count must stop growing within them."""

SETTLE_S = 0.5
"""How long a round waits for closed connections and finished threads to go before counting."""

FIRST_CALLERS = 16
"""Threads making the first calls on each new instance, released together at a barrier."""


def _counts() -> dict[str, int]:
    """Count the open file descriptors and threads (OS threads, where /proc lists them)."""
    counts = {"threads": threading.active_count()}
    if os.path.isdir("/proc/self/task"):
        counts["threads"] = len(os.listdir("/proc/self/task"))
    if os.path.isdir("/proc/self/fd"):
        counts["file descriptors"] = len(os.listdir("/proc/self/fd"))
    return counts


def _settled(previous: dict[str, int]) -> dict[str, int]:
    """Count, waiting up to :data:`SETTLE_S` for every count to come down to ``previous``."""
    deadline = time.monotonic() + SETTLE_S
    now = _counts()
    collected = False
    while any(now[name] > previous[name] for name in now) and time.monotonic() < deadline:
        if not collected:  # free what only reference cycles hold (once: a full gc is slow)
            gc.collect()
            collected = True
        else:
            time.sleep(0.02)
        now = _counts()
    return now


def _assert_no_growth(what: str, round_: Callable[[int], None]) -> None:
    """Run ``round_`` to warm up, then until each count has stayed put once; fail if one never did.

    A count that grows in every one of :data:`ROUNDS` rounds is a leak: say by how much.
    """
    round_(0)
    gc.collect()
    previous = _counts()
    history = {name: [count] for name, count in previous.items()}
    growing = set(previous)
    for number in range(1, ROUNDS + 1):
        round_(number)
        now = _settled(previous)
        for name, count in now.items():
            history[name].append(count)
            if count <= previous[name]:
                growing.discard(name)
        if not growing:
            return
        previous = now
    leaks = "; ".join(f"{name}: {' -> '.join(map(str, history[name]))}" for name in growing)
    pytest.fail(
        f"{what} leak: the count grew in each of {ROUNDS} rounds after a warm-up ({leaks}); "
        f"release what the call opened (close the descriptor in a finally, build lazy state "
        f"once under a lock, shut pools down in close())"
    )


def _bare(instance: StorageBackend) -> StorageBackend:
    return instance.unwrap() if isinstance(instance, ForwardingBackend) else instance


def _attempt(call: Callable[[], object]) -> None:
    """Make a call the bare backend may refuse: only what it leaks matters here."""
    with contextlib.suppress(HiCacheError):
        call()


class TestResources:
    """Error paths and concurrent first calls release every descriptor and thread they take."""

    def test_error_paths_leak_no_fds_or_threads(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """Refused buffers, unregistered pools, misaligned indices and misses leak nothing.

        First, rounds of v1 calls before ``register_host_pool`` (through the layers and on the
        bare backend, whose own checks the layers would otherwise pre-empt). Then rounds of
        ``get(out)`` with buffers one byte short, one byte long and empty (``BufferSizeError``),
        a ``batch_get`` of wrong sizes (misses), v1 calls with misaligned indices, a v1 read of
        an object of another size, and every read path on a missing key.
        """
        size = 4096 + 3
        held, odd, absent, never = k("held"), k("odd-size"), k("absent"), k("never")
        pool = _pool("mla", "layer_first", pages=2)
        page = _indices(pool, [0])
        wrong_sizes = [bytearray(size - 1), bytearray(size + 1)]
        with hicache_factory() as instance:
            bare = _bare(instance)

            def unregistered_calls(_: int) -> None:
                for target in (instance, bare):
                    with pytest.raises(PoolNotRegisteredError):
                        target.batch_get_v1([held], page)
                    with pytest.raises(PoolNotRegisteredError):
                        target.batch_set_v1([never], page)

            def error_calls(_: int) -> None:
                for out in (bytearray(size - 1), bytearray(size + 1), bytearray(0)):
                    with pytest.raises(BufferSizeError):
                        instance.get(held, out)
                assert instance.batch_get([held, held], wrong_sizes) == [False, False]
                with pytest.raises(IndexAlignmentError):
                    instance.batch_get_v1([held, odd], page)
                with pytest.raises(IndexAlignmentError):
                    instance.batch_set_v1([never], _indices(pool, [0, 1]))
                _attempt(lambda: bare.batch_get_v1([held, odd], page))
                _attempt(lambda: bare.batch_set_v1([never], page[1:]))
                assert instance.batch_get_v1([odd], page) == [False]
                assert instance.get(absent) is None
                assert instance.get(absent, bytearray(size)) is None
                assert instance.exists(absent) is False
                assert instance.batch_exists([absent, held]) == 0
                assert instance.batch_get([absent], [bytearray(size)]) == [False]
                assert instance.batch_get_v1([absent], page) == [False]
                if instance.capabilities.delete:
                    assert instance.delete(absent) is False

            try:
                _assert_no_growth("unregistered-pool", unregistered_calls)
                instance.register_host_pool(pool)
                assert instance.set(held, make_value(held, size)), f"set({held!r}) failed"
                assert instance.set(odd, make_value(odd, pool.page_nbytes + 1))
                _assert_no_growth("error-path", error_calls)
            finally:
                cleanup(hicache_factory, instance, k)

    def test_concurrent_first_calls_leak_no_fds_or_threads(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """Per round, a new instance takes 16 barrier-started first calls, then closes.

        Lazily built state (a connection pool, a worker pool, a client) that two first calls both
        build, because the check and the assignment are not under one lock, leaves the loser's
        threads or sockets behind when the instance closes.
        """
        ops = ("get", "get_into", "exists", "set", "batch_get", "batch_set", "batch_exists", "v1")

        def first_calls(round_: int) -> None:
            with hicache_factory() as instance:
                pool = _pool("mla", "layer_first", pages=FIRST_CALLERS)
                instance.register_host_pool(pool)
                barrier = threading.Barrier(FIRST_CALLERS)

                def first_call(i: int) -> None:
                    key = k(f"first{round_}-{i}")
                    op = ops[i % len(ops)]
                    barrier.wait()
                    if op == "get":
                        assert instance.get(key) is None
                    elif op == "get_into":
                        assert instance.get(key, bytearray(3)) is None
                    elif op == "exists":
                        assert instance.exists(key) is False
                    elif op == "set":
                        assert instance.set(key, b"v%d" % i)
                    elif op == "batch_get":
                        assert instance.batch_get([key], [bytearray(3)]) == [False]
                    elif op == "batch_set":
                        assert instance.batch_set([key], [b"v%d" % i]) == [True]
                    elif op == "batch_exists":
                        assert instance.batch_exists([key]) == 0
                    elif i // len(ops) % 2:  # one v1 read, one v1 write
                        assert instance.batch_get_v1([key], _indices(pool, [i])) == [False]
                    else:
                        assert instance.batch_set_v1([key], _indices(pool, [i])) == [True]

                errors = _run_threads(FIRST_CALLERS, first_call)
                cleanup(hicache_factory, instance, k)
            assert not errors, f"{len(errors)} first calls failed; the first:\n{errors[0]}"

        _assert_no_growth("concurrent-first-call", first_calls)
