"""The Mooncake backend reads how full the store is from the master's metrics."""

from __future__ import annotations

import time

from hicache_storage import create_backend
from hicache_storage.kit.services import free_port

PAGE = 1024 * 1024


def test_the_master_says_how_full_the_store_is(options: dict[str, object]) -> None:
    assert options.get("master_metrics"), "the local store publishes its metrics address"
    with create_backend("mooncake", options) as backend:
        before = backend.stats()["capacity"]
        assert before["scope"] == "server" and before["bound_bytes"] == 512 * 2**20
        assert backend.batch_set(
            [f"cap{i}" for i in range(8)], [bytes([i]) * PAGE for i in range(8)]
        )
        after = backend.stats()["capacity"]
        assert after["used_bytes"] >= before["used_bytes"] + 8 * PAGE
        assert after["evictions"] >= 0 and after["bound_bytes"] == before["bound_bytes"]


def test_a_master_metrics_address_that_does_not_answer_is_named_in_stats(
    options: dict[str, object],
) -> None:
    silent = f"127.0.0.1:{free_port()}"
    with create_backend("mooncake", {**options, "master_metrics": silent}) as backend:
        start = time.monotonic()
        stats = backend.stats()
        assert time.monotonic() - start < float(stats["deadline_s"]) + 1
        assert "capacity" not in stats and silent in stats["capacity_error"]
