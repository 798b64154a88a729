"""Lifecycle: what outlives a call or the instance.

Context managers close, open/use/close cycles leak no fds or threads, a buffer returned by
``get`` belongs to the caller for good, and the bare backend refuses calls after ``close()``.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import contextlib
import gc
import os
import threading
import time

import pytest

from hicache_storage.conformance.checks.common import _bytes, _indices, _pool
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.workers import make_value
from hicache_storage.errors import BackendClosedError, UnsupportedOperationError
from hicache_storage.layers import ForwardingBackend

__all__ = ["TestLifecycle"]


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _exercise(factory: BackendFactory, k: Keyspace) -> None:
    with factory() as instance:
        pool = _pool("mla", "layer_first", pages=2)
        instance.register_host_pool(pool)
        assert instance.set(k("life"), b"lifecycle")
        assert instance.get(k("life")) is not None
        assert instance.get(k("life"), bytearray(9)) is not None
        instance.exists(k("life"))
        instance.batch_exists([k("life"), k("none")])
        instance.batch_get([k("life")], [bytearray(9)])
        instance.batch_set_v1([k("life-page")], _indices(pool, [0]))
        instance.batch_get_v1([k("life-page")], _indices(pool, [1]))
        cleanup(factory, instance, k)


class TestLifecycle:
    """Instances release what they hold: context managers close, no fds or threads leak."""

    def test_context_manager_closes(self, hicache_factory: BackendFactory) -> None:
        with hicache_factory() as instance:
            assert instance.closed is False
        assert instance.closed is True

    @pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc/self/fd here")
    def test_no_fd_leak_after_open_use_close(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        _exercise(hicache_factory, k)  # warm-up: lazy imports, caches, loggers
        gc.collect()
        before = _fd_count()
        for _ in range(3):
            _exercise(hicache_factory, k)
        gc.collect()
        assert _fd_count() == before, "open file descriptors grew across open/use/close cycles"

    def test_no_thread_leak_after_open_use_close(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        _exercise(hicache_factory, k)
        baseline = threading.active_count()
        for _ in range(3):
            _exercise(hicache_factory, k)
        deadline = time.monotonic() + 2.0
        while threading.active_count() > baseline and time.monotonic() < deadline:
            time.sleep(0.02)
        assert threading.active_count() <= baseline, [t.name for t in threading.enumerate()]

    def test_get_buffer_unchanged_by_later_calls(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """A buffer ``get(key)`` returned is the caller's: later calls never change it.

        Later gets of other keys (same size, other size), sets, deletes, ``clear()`` and
        ``close()`` leave its bytes as they were; a backend returning a view into a staging
        buffer it reuses fails.
        """
        size = 48 * 1024
        keys = k.many("held", 4)
        values = {key: make_value(key, size) for key in keys}
        instance = hicache_factory()
        held: dict[str, tuple[object, bytes]] = {}
        problems: list[str] = []

        def check(after: str) -> None:
            for key, (buffer, expected) in held.items():
                if _bytes(buffer) != expected:
                    problems.append(
                        f"the buffer get({key!r}) returned changed after {after}: return a "
                        f"buffer the caller owns (bytes, or a fresh bytearray), never a view "
                        f"into memory the backend reuses"
                    )

        try:
            for key in keys:
                assert instance.set(key, values[key]), f"set({key!r}) failed"
            for key in keys[:2]:
                got = instance.get(key)
                assert got is not None and _bytes(got) == values[key], f"get({key!r}) is wrong"
                held[key] = (got, values[key])
            instance.get(keys[2])
            check("a get of another key of the same size")
            instance.get(keys[3], bytearray(size))
            instance.batch_get(keys[2:], [bytearray(size), bytearray(size)])
            check("a get into / batch_get of other keys")
            small, other = k("held-small"), k("held-other")
            instance.set(small, b"x" * 100)
            instance.get(small)
            instance.set(other, make_value(other, 2 * size))
            instance.get(other)
            check("sets and gets of other sizes")
            if instance.capabilities.delete:
                for key in keys[:2]:
                    instance.delete(key)
                check("a delete of its key")
            with contextlib.suppress(UnsupportedOperationError):
                instance.clear()
            check("clear()")
        finally:
            cleanup(hicache_factory, instance, k)
            instance.close()
        check("close()")
        assert not problems, f"{len(problems)} changed buffers; first: {problems[0]}"

    def test_bare_backend_refuses_calls_after_close(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """Without the layers, every data call after ``close()`` raises ``BackendClosedError``.

        Engines build backends bare too; a call after ``close()`` must not reach a released
        client or a recycled file descriptor (``hicache_storage.kit.closed_guard`` does this).
        """
        layered = hicache_factory()
        bare = layered.unwrap() if isinstance(layered, ForwardingBackend) else layered
        pool = _pool("mla", "page_first", pages=2)
        key = k("closed")
        try:
            bare.register_host_pool(pool)
            assert bare.set(key, b"before close")
            assert bare.batch_set_v1([k("closed-page")], _indices(pool, [0])) == [True]
        finally:
            cleanup(hicache_factory, layered, k)
            layered.close()
        calls: dict[str, object] = {
            "get": lambda: bare.get(key),
            "get into": lambda: bare.get(key, bytearray(12)),
            "exists": lambda: bare.exists(key),
            "set": lambda: bare.set(k("closed-new"), b"x"),
            "batch_get": lambda: bare.batch_get([key], [bytearray(12)]),
            "batch_set": lambda: bare.batch_set([k("closed-new")], [b"x"]),
            "batch_exists": lambda: bare.batch_exists([key]),
            "batch_get_v1": lambda: bare.batch_get_v1([k("closed-page")], _indices(pool, [1])),
            "batch_set_v1": lambda: bare.batch_set_v1([k("closed-new")], _indices(pool, [1])),
            "delete": lambda: bare.delete(key),
            "clear": bare.clear,
        }
        wrong = {}
        for op, call in calls.items():
            try:
                answer = call()  # type: ignore[operator]
            except BackendClosedError:
                continue
            except UnsupportedOperationError:
                if op in ("delete", "clear"):
                    continue
                answer = "UnsupportedOperationError"
            except Exception as exc:  # noqa: BLE001 - reported
                answer = f"{type(exc).__name__}: {exc}"
            wrong[op] = answer
        assert not wrong, (
            f"after close(), the bare backend answered {wrong} instead of raising "
            f"BackendClosedError"
        )
