"""Lifecycle: context managers close, and open/use/close cycles leak no fds or threads."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import gc
import os
import threading
import time

import pytest

from hicache_storage.conformance.checks.common import _indices, _pool
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup

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
