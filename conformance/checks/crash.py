"""Crash safety: a writer killed mid-``set`` leaves every key absent or complete."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import multiprocessing
import os
import signal
import time

from hicache_storage.conformance.checks.common import MiB, requires
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.workers import digest, make_value, write_forever

__all__ = ["TestCrashSafety"]


class TestCrashSafety:
    """A writer killed mid-``set`` leaves every key absent or complete."""

    @requires("crash_safe_writes", "shared")
    def test_killed_writer_leaves_absent_or_complete(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        size = 2 * MiB
        ctx = multiprocessing.get_context("spawn")
        for attempt, delay in enumerate((0.05, 0.15)):
            prefix = k(f"crash{attempt}-")
            started = ctx.Event()
            child = ctx.Process(
                target=write_forever, args=(hicache_factory, prefix, size, started), daemon=True
            )
            child.start()
            try:
                assert started.wait(60), "the writer process did not start"
                time.sleep(delay)
            finally:
                if child.pid is not None:
                    os.kill(child.pid, signal.SIGKILL)
                child.join(30)
            keys = [k(f"crash{attempt}-{i}") for i in range(400)]
            with hicache_factory() as reader:
                for key in keys:
                    got = reader.get(key)
                    if got is not None:
                        assert digest(got) == digest(make_value(key, size)), f"{key} is partial"
                cleanup(hicache_factory, reader, k)
