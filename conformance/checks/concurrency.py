"""Concurrency: threads sharing one instance see only complete, correct values.

The racing checks are built to fail a buggy backend on every run, not now and then: the threads
start together at a :class:`threading.Barrier`, every race is repeated over several rounds, the
readers poll for the whole time a write (or a delete) is in flight, and racing first calls step
through the backend side by side, each thread giving up the GIL at every call it makes
(``run_together``). They run without the degrade layer, so an error a reader gets is
reported as the error it is, not hidden as a miss.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import msgspec

from hicache_storage.backend import StorageBackend
from hicache_storage.capabilities import Capabilities
from hicache_storage.conformance.checks.common import KiB, MiB, _bytes, _indices, _pool, requires
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.workers import digest, make_value
from hicache_storage.hostpool import HostKVPool

__all__ = ["TestConcurrency", "TestFirstWins", "first_call", "racing", "run_together"]

RACE_SWITCH_INTERVAL_S = 1e-6
"""The interpreter's thread switch interval while first calls race (its default is 5 ms)."""

FIRST_CALL_ROUNDS = 4
"""Fresh instances whose first calls race, one after another, in the first-calls check."""

_Profiler = Callable[[FrameType, Any, Any], object]


@contextlib.contextmanager
def racing() -> Iterator[None]:
    """Make the interpreter hand the GIL to a waiting thread after 1 us instead of 5 ms."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(RACE_SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _yielding(previous: _Profiler | None) -> _Profiler:
    """Return a profile function that gives up the GIL at every call (after ``previous``)."""

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if previous is not None:
            previous(frame, event, arg)
        if event in ("call", "c_call"):
            time.sleep(0)  # releases the GIL: a waiting thread takes its turn

    return hook


def run_together(n: int, body: Callable[[int], None]) -> list[str]:
    """Run ``body(i)`` in ``n`` threads released together, interleaving at every call.

    Released from a barrier, threads leave it one at a time, and with the default 5 ms switch
    interval each runs the few microseconds of an unlocked ``if self._pool is None:
    self._pool = ThreadPoolExecutor(...)`` to its end before the next one gets there: such a
    race almost never happens. Here every thread gives up the GIL at each function call it
    makes (a profile function, for the call only) and the interpreter switches every
    microsecond between (:func:`racing`), so the threads step through the backend's code side
    by side and one that checks state another is still building sees it unbuilt: a
    check-then-act races in nearly every run, whatever the machine's load. Return the
    traceback of each call that raised.
    """
    barrier = threading.Barrier(n)

    def released(i: int) -> None:
        barrier.wait()
        previous = sys.getprofile()
        sys.setprofile(_yielding(previous))
        try:
            body(i)
        finally:
            sys.setprofile(previous)

    with racing():
        return _run_threads(n, released)


FIRST_CALL_OPS = (
    "get",
    "get_into",
    "exists",
    "set",
    "batch_get",
    "batch_set",
    "batch_exists",
    "v1_get",
    "v1_set",
)
"""The operations a fresh instance's racing first calls make, thread ``i`` the ``i``-th (cyclic)."""


def first_call(instance: StorageBackend, pool: HostKVPool, k: Keyspace, stem: str, i: int) -> None:
    """Make thread ``i``'s first call on ``instance``: a miss or a write of its own key.

    A v1 call moves page ``i`` of ``pool``, which ``instance`` has registered.
    """
    key = k(f"{stem}{i}")
    op = FIRST_CALL_OPS[i % len(FIRST_CALL_OPS)]
    if op == "get":
        assert instance.get(key) is None, f"get({key!r}) of a key never written hit"
    elif op == "get_into":
        assert instance.get(key, bytearray(3)) is None, f"get({key!r}, out) hit"
    elif op == "exists":
        assert instance.exists(key) is False, f"exists({key!r}) of a key never written"
    elif op == "set":
        assert instance.set(key, b"v%d" % i), f"set({key!r}) failed"
    elif op == "batch_get":
        assert instance.batch_get([key], [bytearray(3)]) == [False], f"batch_get([{key!r}])"
    elif op == "batch_set":
        assert instance.batch_set([key], [b"v%d" % i]) == [True], f"batch_set([{key!r}])"
    elif op == "batch_exists":
        assert instance.batch_exists([key]) == 0, f"batch_exists([{key!r}])"
    elif op == "v1_get":
        assert instance.batch_get_v1([key], _indices(pool, [i])) == [False], f"v1 get {key!r}"
    else:
        assert instance.batch_set_v1([key], _indices(pool, [i])) == [True], f"v1 set {key!r}"


def _run_threads(n: int, body: Callable[[int], None]) -> list[str]:
    errors: list[str] = []
    lock = threading.Lock()

    def wrapped(i: int) -> None:
        try:
            body(i)
        except BaseException:  # noqa: BLE001 - every failure in a thread is reported
            with lock:
                errors.append(traceback.format_exc())

    threads = [threading.Thread(target=wrapped, args=(i,), name=f"hicache-{i}") for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return errors


def _undegraded(factory: BackendFactory) -> StorageBackend:
    """Open an instance without the degrade layer: a backend error reaches the check as itself."""
    return factory(msgspec.structs.replace(factory.layers, degrade=False, faults=None))


def _describe(got: object, candidates: dict[str, str]) -> str:
    """Name the value ``got`` among ``candidates`` (digest -> name), or say what it is instead."""
    if got is None:
        return "None (a miss)"
    name = candidates.get(digest(got))
    return name if name is not None else f"{len(_bytes(got))} bytes matching no value written"


class _Problems:
    """What racing threads saw that they must not; the first few are reported."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[str] = []

    def add(self, text: str) -> None:
        with self.lock:
            self.items.append(text)

    def guard(self, what: str, body: Callable[[], None]) -> None:
        """Run ``body``; record any exception it raises as a problem of ``what``."""
        try:
            body()
        except AssertionError as exc:
            self.add(f"{what}: {exc}")
        except BaseException as exc:  # noqa: BLE001 - every failure in a thread is reported
            self.add(f"{what} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}")

    def check(self, summary: str) -> None:
        assert not self.items, f"{summary}: {len(self.items)} problems; first: {self.items[0]}"


def _rounds(
    min_rounds: int, budget_s: float, max_rounds: int, problems: _Problems
) -> Iterator[int]:
    """Yield round numbers for at least ``min_rounds`` rounds and ``budget_s`` seconds.

    It stops early at the first problem, so a loaded machine makes a race run longer, not pass.
    """
    start = time.monotonic()
    for round_ in range(max_rounds):
        if problems.items:
            return
        if round_ >= min_rounds and time.monotonic() - start >= budget_s:
            return
        yield round_


def _race(
    readers: list[Callable[[int, threading.Event], None]],
    writer: Callable[[int], None],
    problems: _Problems,
    *,
    min_rounds: int = 6,
    budget_s: float = 0.8,
    max_rounds: int = 60,
) -> None:
    """Per round, start the readers, release them with the writer, stop them when it is done.

    Each reader is called as ``reader(round, done)`` and polls until ``done`` is set (then
    makes one last read); the writer runs in this thread.
    """
    for round_ in _rounds(min_rounds, budget_s, max_rounds, problems):
        _race_round(round_, readers, writer, problems)


def _race_round(
    round_: int,
    readers: list[Callable[[int, threading.Event], None]],
    writer: Callable[[int], None],
    problems: _Problems,
) -> None:
    done = threading.Event()
    barrier = threading.Barrier(len(readers) + 1)

    def run(reader: Callable[[int, threading.Event], None]) -> None:
        barrier.wait()
        problems.guard(f"reader {reader.__name__} (round {round_})", lambda: reader(round_, done))

    threads = [threading.Thread(target=run, args=(reader,)) for reader in readers]
    for thread in threads:
        thread.start()
    barrier.wait()
    try:
        problems.guard(f"writer (round {round_})", lambda: writer(round_))
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=30)


class _LazyValues:
    """Round ``r``'s key and value, made when first asked (the races run a varying number)."""

    def __init__(self, k: Keyspace, stem: str, size: int) -> None:
        self.k, self.stem, self.size = k, stem, size
        self._made: dict[int, tuple[str, bytes]] = {}
        self._lock = threading.Lock()

    def _get(self, r: int) -> tuple[str, bytes]:
        with self._lock:
            if r not in self._made:
                key = self.k(f"{self.stem}{r}")
                self._made[r] = (key, make_value(key, self.size))
            return self._made[r]

    def key(self, r: int) -> str:
        return self._get(r)[0]

    def value(self, r: int) -> bytes:
        return self._get(r)[1]

    def drop(self, instance: StorageBackend, r: int) -> None:
        """Forget round ``r``'s value, and delete its key where the backend can."""
        with self._lock:
            made = self._made.pop(r, None)
        if made is not None and instance.capabilities.delete:
            instance.delete(made[0])


class TestFirstWins:
    """``set`` is first-wins: a key keeps the first complete value written to it."""

    def test_second_set_keeps_first_value(self, backend: StorageBackend, k: Keyspace) -> None:
        """A second ``set`` with another value returns True and every read still gives the first.

        Second values of the same size and of another size, through ``set`` and ``batch_set``.
        """
        cases = {
            "same size": 3000,
            "other size": 1234,
        }
        for label, size in cases.items():
            for via in ("set", "batch_set"):
                key = k(f"fw-{via}-{size}")
                first, second = make_value(f"{key}:first", 3000), make_value(f"{key}:second", size)
                names = {digest(first): "the first value", digest(second): "the second value"}
                assert backend.set(key, first) is True, f"set({key!r}, first value) failed"
                if via == "set":
                    again = backend.set(key, second)
                    assert again is True, (
                        f"a second set({key!r}) ({label}) returned {again!r}; a key that holds a "
                        f"value keeps it and set still returns True"
                    )
                else:
                    again_many = backend.batch_set([key], [second])
                    assert again_many == [True], (
                        f"batch_set([{key!r}]) of a second value ({label}) returned "
                        f"{again_many!r}; expected [True]"
                    )
                got = backend.get(key)
                assert got is not None and digest(got) == digest(first), (
                    f"after {via}({key!r}) of a second value ({label}), get returned "
                    f"{_describe(got, names)}; set is first-wins: keep the first complete value"
                )
                out = bytearray(3000)
                assert backend.get(key, out) is out and bytes(out) == first, (
                    f"after {via}({key!r}) of a second value ({label}), get into a 3000-byte "
                    f"buffer did not give the first value"
                )
                outs = [bytearray(3000)]
                assert backend.batch_get([key], outs) == [True] and bytes(outs[0]) == first, (
                    f"after {via}({key!r}) of a second value ({label}), batch_get did not give "
                    f"the first value"
                )

    def test_concurrent_writers_agree_on_one_value(
        self, hicache_factory: BackendFactory, capabilities: Capabilities, k: Keyspace
    ) -> None:
        """8 threads set 8 different values of one key at once; then all readers agree.

        After every writer returned, every read (``get``, ``get`` into, ``batch_get``, and a
        second instance when the store is shared or persistent) gives the same single complete
        value, one of those written. With ``atomic_first_wins`` a value once read never changes:
        each writer reads the key right after its ``set`` and until every writer is done.
        """
        writers, size = 8, 512 * KiB
        problems = _Problems()
        with _undegraded(hicache_factory) as instance:
            for round_ in _rounds(4, 0.8, 30, problems):
                key = k(f"cw{round_}")
                values = [make_value(f"{key}:{i}", size) for i in range(writers)]
                problems.guard(
                    f"round {round_}",
                    lambda key=key, values=values: _writers_agree(  # type: ignore[misc]
                        hicache_factory, capabilities, instance, key, values
                    ),
                )
                if capabilities.delete:
                    instance.delete(key)
            cleanup(hicache_factory, instance, k)
        problems.check("concurrent writers of one key")


def _writers_agree(
    factory: BackendFactory,
    capabilities: Capabilities,
    instance: StorageBackend,
    key: str,
    values: list[bytes],
) -> None:
    """One round of :meth:`TestFirstWins.test_concurrent_writers_agree_on_one_value`."""
    writers, size = len(values), len(values[0])
    names = {digest(v): f"the value of writer {i}" for i, v in enumerate(values)}
    barrier = threading.Barrier(writers)
    lock = threading.Lock()
    remaining = [writers]
    seen: dict[int, list[str]] = {i: [] for i in range(writers)}

    def write_then_read(i: int) -> None:
        barrier.wait()
        assert instance.set(key, values[i]) is True, f"set({key!r}) by writer {i} failed"
        with lock:
            remaining[0] -= 1
        while True:
            with lock:
                last = remaining[0] == 0
            seen[i].append(_describe(instance.get(key), names))
            if last:
                return

    errors = _run_threads(writers, write_then_read)
    assert not errors, f"a writer of {key!r} failed: {errors[0]}"
    final = _describe(instance.get(key), names)
    assert final in names.values(), (
        f"after {writers} concurrent set({key!r}) of different values, get returned {final}; "
        f"expected one complete value of those written"
    )
    out = bytearray(size)
    views = {"get into": _describe(out if instance.get(key, out) is not None else None, names)}
    outs = [bytearray(size)]
    hits = instance.batch_get([key], outs)
    views["batch_get"] = _describe(outs[0] if hits == [True] else None, names)
    if capabilities.shared or capabilities.persistent:
        with factory() as other:
            views["get on another instance"] = _describe(other.get(key), names)
    for i, reads in seen.items():
        views[f"writer {i}'s last read"] = reads[-1]
    differing = {view: got for view, got in views.items() if got != final}
    assert not differing, (
        f"after concurrent writers of {key!r} finished, get returned {final} but {differing}: "
        f"every reader must see the same single complete value"
    )
    if capabilities.atomic_first_wins:
        changed = {i: sorted(set(reads)) for i, reads in seen.items() if set(reads) != {final}}
        assert not changed, (
            f"{key!r} changed value while concurrent writers ran (atomic_first_wins is claimed): "
            f"writers read {changed} after their set returned, and the key finally holds {final}; "
            f"publish exclusively (link, SET NX, If-None-Match) so the first value is kept"
        )


class TestConcurrency:
    """Threads sharing one instance see only complete, correct values and no errors."""

    def test_first_calls_from_many_threads_on_a_fresh_instance(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """Per round a new instance takes 32 first calls at once, of every operation.

        Lazily built state (connections, label caches, pools) must be built under a lock: a
        race there raises only on a fresh instance, after the backend call itself succeeded.
        The calls are released together and interleave at every call they make
        (``run_together``), on ``FIRST_CALL_ROUNDS`` fresh instances.
        """
        for round_ in range(FIRST_CALL_ROUNDS):
            with hicache_factory() as instance:
                pool = _pool("mha", "layer_first", pages=32)
                instance.register_host_pool(pool)
                errors = run_together(
                    32, functools.partial(first_call, instance, pool, k, f"first{round_}-")
                )
                cleanup(hicache_factory, instance, k)
            assert not errors, (
                f"{len(errors)} first calls on fresh instance {round_} failed; the first:\n"
                f"{errors[0]}"
            )

    def test_threads_mixed_ops_correct_bytes(self, backend: StorageBackend, k: Keyspace) -> None:
        shared = k.many("shared", 8)
        own = {i: k.many(f"own{i}-", 6) for i in range(8)}

        def size_of(key: str) -> int:
            return 512 + (sum(key.encode()) * 131) % (16 * KiB)

        def check(key: str, got: object) -> None:
            assert got is not None, f"get({key!r}) missed a value this thread stored"
            assert _bytes(got) == make_value(key, size_of(key)), f"wrong bytes for {key}"

        def body(i: int) -> None:
            for step in range(24):
                key = shared[(i + step) % len(shared)]
                mine = own[i][step % len(own[i])]
                op = step % 6
                if op == 0:
                    assert backend.set(mine, make_value(mine, size_of(mine)))
                    check(mine, backend.get(mine))
                elif op == 1:
                    assert backend.set(key, make_value(key, size_of(key)))
                elif op == 2:
                    got = backend.get(key)
                    if got is not None:
                        check(key, got)
                elif op == 3:
                    out = bytearray(size_of(key))
                    if backend.get(key, out) is not None:
                        check(key, out)
                elif op == 4:
                    outs = [bytearray(size_of(s)) for s in shared]
                    hits = backend.batch_get(shared, outs)
                    for s, out, hit in zip(shared, outs, hits, strict=True):
                        if hit:
                            check(s, out)
                else:
                    n = backend.batch_exists(shared)
                    assert 0 <= n <= len(shared)
                    assert backend.exists(own[i][0]) in (True, False)

        errors = _run_threads(8, body)
        assert not errors, errors[0]
        for key in shared + [key for keys in own.values() for key in keys]:
            got = backend.get(key)
            if got is not None:
                check(key, got)

    def test_reader_racing_writer_sees_none_or_whole(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """Readers poll ``get``, ``get`` into and ``batch_get`` while a 4 MiB value is written.

        Each read is a miss or the whole value; at least 6 rounds and 0.8 s, each releasing the
        readers with the writer.
        """
        size = 4 * MiB
        problems = _Problems()
        keys = _LazyValues(k, "race", size)

        with _undegraded(hicache_factory) as instance:

            def check(how: str, r: int, got: object) -> bool:
                if got is None:
                    return False
                if _bytes(got) != keys.value(r):
                    problems.add(
                        f"{how}({keys.key(r)!r}) returned {len(_bytes(got))} bytes that are not "
                        f"the {size}-byte value being written: a reader saw a partial value"
                    )
                return True

            def poll_get(r: int, done: threading.Event) -> None:
                while not (check("get", r, instance.get(keys.key(r))) or done.is_set()):
                    pass
                check("get", r, instance.get(keys.key(r)))

            def poll_get_into(r: int, done: threading.Event) -> None:
                out = bytearray(size)
                while not done.is_set():
                    if instance.get(keys.key(r), out) is not None:
                        check("get into", r, out)
                        return

            def poll_batch_get(r: int, done: threading.Event) -> None:
                outs = [bytearray(size)]
                while not done.is_set():
                    if instance.batch_get([keys.key(r)], outs) == [True]:
                        check("batch_get", r, outs[0])
                        return

            def write(r: int) -> None:
                assert instance.set(keys.key(r), keys.value(r)), f"set({keys.key(r)!r}) failed"
                keys.drop(instance, r - 1)

            _race([poll_get, poll_get_into, poll_batch_get], write, problems)
            cleanup(hicache_factory, instance, k)
        problems.check("readers racing a writer")

    def test_exists_true_means_get_returns_whole_value(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """While a 4 MiB value is written, ``exists`` is never True before ``get`` gives it whole.

        Readers poll ``exists`` (and ``batch_exists``); the moment it says yes they read the key,
        which must return the complete value: a backend that publishes its index (or metadata)
        before the data fails every round.
        """
        size = 4 * MiB
        problems = _Problems()
        keys = _LazyValues(k, "pub", size)

        with _undegraded(hicache_factory) as instance:

            def read_after(how: str, r: int) -> None:
                got = instance.get(keys.key(r))
                if got is None or _bytes(got) != keys.value(r):
                    what = "None (a miss)" if got is None else f"{len(_bytes(got))} other bytes"
                    problems.add(
                        f"{how}({keys.key(r)!r}) was True while set was writing it, but get then "
                        f"returned {what}: exists must not be True before the whole value can be "
                        f"read"
                    )

            def poll_exists(r: int, done: threading.Event) -> None:
                while not done.is_set():
                    if instance.exists(keys.key(r)):
                        read_after("exists", r)
                        return

            def poll_batch_exists(r: int, done: threading.Event) -> None:
                while not done.is_set():
                    if instance.batch_exists([keys.key(r)]) == 1:
                        read_after("batch_exists", r)
                        return

            def write(r: int) -> None:
                assert instance.set(keys.key(r), keys.value(r)), f"set({keys.key(r)!r}) failed"
                assert instance.exists(keys.key(r)), f"exists({keys.key(r)!r}) is False after set"
                read_after("exists", r)
                keys.drop(instance, r - 1)

            _race([poll_exists, poll_exists, poll_batch_exists], write, problems)
            cleanup(hicache_factory, instance, k)
        problems.check("exists racing a writer")

    @requires("delete")
    def test_readers_racing_deleters_none_or_whole(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """Writers, deleters and readers hammer the same 4 keys; every read is None or whole.

        No read raises (a raw ``FileNotFoundError`` from a file deleted between two steps of a
        read, or a ``BackendError`` for what is a miss), and none returns part of a value.
        """
        keys = k.many("rd", 4)
        size = 96 * KiB
        values = {key: make_value(key, size) for key in keys}
        problems = _Problems()
        stop = threading.Event()
        budget_s, reads_needed = 0.8, 2000
        reads = [0]

        with _undegraded(hicache_factory) as instance:

            def check(how: str, key: str, got: object) -> None:
                if got is not None and _bytes(got) != values[key]:
                    problems.add(
                        f"{how}({key!r}) racing delete returned {len(_bytes(got))} bytes that "
                        f"are not the value: expected None or the whole value"
                    )

            def writer(i: int) -> None:
                while not stop.is_set():
                    for key in keys:
                        instance.set(key, values[key])

            def deleter(i: int) -> None:
                while not stop.is_set():
                    for key in keys[i % 2 :: 2]:
                        instance.delete(key)

            def reader(i: int) -> None:
                out = bytearray(size)
                while not stop.is_set():
                    for key in keys:
                        if i == 0:
                            check("get", key, instance.get(key))
                        elif i == 1:
                            check("get into", key, instance.get(key, out) and out)
                        else:
                            outs = [bytearray(size)]
                            check(
                                "batch_get",
                                key,
                                outs[0] if instance.batch_get([key], outs)[0] else None,
                            )
                            instance.exists(key)
                            instance.batch_exists([key])
                    with problems.lock:
                        reads[0] += len(keys)

            roles: list[tuple[str, Callable[[int], None], int]] = [
                ("writer", writer, 0),
                ("writer", writer, 1),
                ("deleter", deleter, 0),
                ("deleter", deleter, 1),
                ("reader", reader, 0),
                ("reader", reader, 1),
                ("reader", reader, 2),
            ]
            barrier = threading.Barrier(len(roles))

            def run(role: int) -> None:
                name, fn, i = roles[role]
                barrier.wait()
                try:
                    problems.guard(f"{name} {i}", lambda: fn(i))
                finally:
                    stop.set()

            threads = [threading.Thread(target=run, args=(r,)) for r in range(len(roles))]
            for thread in threads:
                thread.start()
            start = time.monotonic()
            while not stop.is_set() and not problems.items:
                elapsed = time.monotonic() - start
                if elapsed >= 3 * budget_s or (elapsed >= budget_s and reads[0] >= reads_needed):
                    break
                time.sleep(0.01)
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
            cleanup(hicache_factory, instance, k)
        problems.check("reads racing writes and deletes")
