"""Resources: error paths and racing first calls leak no file descriptors and no threads.

A leak on a path the round trips never take (a descriptor left open when ``get(out)`` refuses a
wrong-sized buffer, a second worker pool built by two first calls that raced past an unlocked
check) grows with every such call. The checks repeat a round of those calls and count after
each: a backend's own connections and pools reach their steady size in the warm-up round (or
soon after) and then stay at or under it, a leak raises it again and again. Racing first calls
are made to race in nearly every round (``concurrency.run_together``), so a leak that needs
a lost race grows in most rounds too, and the counts must stay put for :data:`STEADY_ROUNDS`
rounds in a row.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import os
import threading
import time
from collections.abc import Callable

import pytest

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import _indices, _pool
from hicache_storage.conformance.checks.concurrency import first_call, run_together
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

STEADY_ROUNDS = 3
"""Rounds in a row in which no count may rise above its highest earlier value."""

MAX_ROUNDS = 10
"""Measured rounds after the warm-up within which the counts must have been steady.

A leak lost in nearly every round raises a count in nearly every round and never gets
:data:`STEADY_ROUNDS` in a row. A pool that widens as concurrency first reaches a new level
(Mooncake's client under a loaded machine: a socket more in 3 of 4 rounds, then none) rises in
a few rounds and then stays; six rounds were too few for it to settle."""

SETTLE_S = 2.0
"""How long a round waits for closed connections and finished threads to go before counting.

Only a count above its highest waits, so a backend that leaks nothing never does. A client that
closes its connections from threads of its own (Mooncake's transfer engine) can take longer than
half a second to do so on a loaded two-core machine."""

FIRST_CALLERS = 32
"""Threads making the first calls on each new instance, released together at a barrier."""

INSTANCES_PER_ROUND = 2
"""Fresh instances a round of racing first calls opens and closes, one after another: a lazy
pool whose loser got no work before it was replaced leaves no thread, so one race in five
leaks nothing, and two instances make a round that leaks nothing rare."""


def _counts() -> dict[str, int]:
    """Count the open file descriptors and threads (OS threads, where /proc lists them)."""
    counts = {"threads": threading.active_count()}
    if os.path.isdir("/proc/self/task"):
        counts["threads"] = len(os.listdir("/proc/self/task"))
    if os.path.isdir("/proc/self/fd"):
        counts["file descriptors"] = len(os.listdir("/proc/self/fd"))
    return counts


def _fd_kinds() -> collections.Counter[str]:
    """Count the open file descriptors by kind (``socket``, ``pipe``, ``anon_inode``, ``file``)."""
    kinds: collections.Counter[str] = collections.Counter()
    if not os.path.isdir("/proc/self/fd"):
        return kinds
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since it was listed
            continue
        kinds["file" if target.startswith("/") else target.split(":")[0]] += 1
    return kinds


def _settled(limit: dict[str, int]) -> dict[str, int]:
    """Count, waiting up to :data:`SETTLE_S` for every count to come down to ``limit``."""
    deadline = time.monotonic() + SETTLE_S
    now = _counts()
    collected = False
    while any(now[name] > limit[name] for name in now) and time.monotonic() < deadline:
        if not collected:  # free what only reference cycles hold (once: a full gc is slow)
            gc.collect()
            collected = True
        else:
            time.sleep(0.02)
        now = _counts()
    return now


def _assert_no_growth(what: str, round_: Callable[[int], None]) -> None:
    """Run ``round_`` to warm up, then until no count has risen for :data:`STEADY_ROUNDS` rounds.

    After each round the counts are compared with the highest seen since the warm-up: a
    backend's pools and connections come and go under that mark, a leak raises it. The check
    fails when the counts cannot be steady for that many rounds within :data:`MAX_ROUNDS`.
    """
    round_(0)
    gc.collect()
    kinds = _fd_kinds()
    highest = _counts()
    history = {name: [count] for name, count in highest.items()}
    risen = {name: 0 for name in highest}
    steady = 0
    for number in range(1, MAX_ROUNDS + 1):
        round_(number)
        now = _settled(highest)
        steady += 1
        for name, count in now.items():
            history[name].append(count)
            if count > highest[name]:
                highest[name] = count
                risen[name] += 1
                steady = 0
        if steady >= STEADY_ROUNDS:
            return
        if steady + MAX_ROUNDS - number < STEADY_ROUNDS:
            break
    grown = _fd_kinds()
    grown.subtract(kinds)
    leaks = "; ".join(
        f"{name}: {' -> '.join(map(str, history[name]))} (a new high in {risen[name]} rounds)"
        for name in history
        if risen[name]
    )
    leaks += "".join(f", {kind} {n:+d}" for kind, n in sorted(grown.items()) if n)
    pytest.fail(
        f"{what} leak: after a warm-up, the counts rose to new highs too often to stay put for "
        f"{STEADY_ROUNDS} rounds in a row within {MAX_ROUNDS} ({leaks}); release what the call "
        f"opened (close the descriptor in a finally, build lazy state once under a lock, shut "
        f"pools down in close())"
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
        """Per round, 2 new instances each take 32 racing first calls, then close.

        Lazily built state (a connection pool, a worker pool, a client) that two first calls both
        build, because the check and the assignment are not under one lock, leaves the loser's
        threads or sockets behind when the instance closes. The calls are released together at a
        barrier and interleave at every call they make (``concurrency.run_together``): the
        race is lost in nearly every round, not now and then.
        """

        def first_calls(round_: int) -> None:
            for number in range(INSTANCES_PER_ROUND):
                with hicache_factory() as instance:
                    pool = _pool("mla", "layer_first", pages=FIRST_CALLERS)
                    instance.register_host_pool(pool)
                    stem = f"f{round_}-{number}-"
                    errors = run_together(
                        FIRST_CALLERS, functools.partial(first_call, instance, pool, k, stem)
                    )
                    cleanup(hicache_factory, instance, k)
                assert not errors, f"{len(errors)} first calls failed; the first:\n{errors[0]}"

        _assert_no_growth("concurrent-first-call", first_calls)
