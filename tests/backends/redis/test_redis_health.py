"""A paused Redis (SIGSTOP: sockets open, no answer) costs one deadline, not one per lookup.

Issue 48 item 15: through vLLM, eight requests waited out the deadline one after another. With
the default layers, the first call that times out marks the store down; every lookup after it,
sequential or from several threads at once, is a miss at once; once Redis is resumed the probe
finds it and the same instance serves the stored pages again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from hicache_storage import create_backend
from hicache_storage.backends.redis import provision
from hicache_storage.config import HealthConfig, LayerConfig
from hicache_storage.kit.services import LocalService

from ...helpers import timed

DEADLINE_S = 1.0
SLACK_S = 1.0
"""Scheduling on a loaded machine for the one call that meets the paused server."""
AT_ONCE_S = DEADLINE_S / 2
"""Well within the deadline: a lookup that reached the paused server would take all of it."""
REQUESTS = 8


@pytest.fixture(scope="module")
def paused_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    with provision.standalone(tmp_path_factory.mktemp("redis-health")) as service:
        yield service


def test_paused_redis_costs_one_deadline_then_lookups_miss_at_once(
    paused_standalone: LocalService,
) -> None:
    options = {
        **paused_standalone.options,
        "prefix": "health",
        "deadline_s": DEADLINE_S,
        "socket_timeout_s": DEADLINE_S,
        "connect_timeout_s": DEADLINE_S,
    }
    health = HealthConfig(probe_interval_s=0.05, max_probe_interval_s=0.5)
    backend = create_backend("redis", options, layers=LayerConfig(health=health))
    keys = [f"page{i}" for i in range(8)]
    values = [b"v%d" % i for i in range(8)]
    try:
        assert backend.batch_set(keys, values) == [True] * 8
        paused_standalone.pause()
        try:
            elapsed, found = timed(lambda: backend.batch_exists(keys))
            assert found == 0 and elapsed <= DEADLINE_S + SLACK_S
            for _ in range(REQUESTS):  # one request after another, as vLLM's lookups come
                elapsed, found = timed(lambda: backend.batch_exists(keys))
                assert found == 0 and elapsed < AT_ONCE_S, f"a lookup waited {elapsed:.2f}s"
                elapsed, got = timed(lambda: backend.get(keys[0]))
                assert got is None and elapsed < AT_ONCE_S, f"a read waited {elapsed:.2f}s"
            slow: list[float] = []

            def lookup() -> None:
                elapsed, found = timed(lambda: backend.batch_exists(keys))
                if found != 0 or elapsed >= AT_ONCE_S:
                    slow.append(elapsed)

            threads = [threading.Thread(target=lookup) for _ in range(REQUESTS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not slow, f"lookups from threads waited {slow}"
            stats = backend.stats()
            assert stats["health"]["state"] == "down" and stats["health"]["trips"] == 1
            assert stats["health"]["shed_total"] == 3 * REQUESTS
            assert stats["degraded"]["total"] == 1  # the one call that met the paused server
        finally:
            paused_standalone.resume()
        until = time.monotonic() + 30
        while backend.batch_exists(keys) != 8 and time.monotonic() < until:
            time.sleep(0.05)
        outs = [bytearray(2) for _ in keys]
        assert backend.batch_get(keys, outs) == [True] * 8
        assert [bytes(out) for out in outs] == values
        health_stats = backend.stats()["health"]
        assert health_stats["state"] == "up" and health_stats["trips"] == 1
    finally:
        backend.clear()
        backend.close()
