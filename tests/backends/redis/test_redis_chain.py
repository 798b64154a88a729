"""A local file tier before a real Redis: the suite, and the remote stopped and paused."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import create_backend
from hicache_storage.backend import StorageBackend
from hicache_storage.kit.services import LocalService

from ...helpers import assert_conforms, passing_suite


def _tiers(root: Path, redis: LocalService, prefix: str, **redis_options: Any) -> list[Any]:
    remote = {**redis.options, "prefix": prefix, **redis_options}
    return [
        {"backend": "file", "options": {"root": str(root)}},
        {"backend": "redis", "options": remote},
    ]


@pytest.mark.timeout(900)
def test_file_before_redis_passes_the_suite(tmp_path: Path, redis_standalone: LocalService) -> None:
    config = {"tiers": _tiers(tmp_path / "near", redis_standalone, "chain-conformance:")}
    report = passing_suite("chain", config, tmp_path / "report")
    assert {"persistent", "shared", "delete", "crash_safe_writes"} <= set(report.capabilities)
    assert_conforms(report)


def _remote_failures(chain: StorageBackend) -> int:
    stats = chain.stats()["tiers"][1]["stats"]
    return int(stats["degraded"]["total"]) + int(stats["health"]["shed_total"])


@pytest.mark.parametrize("outage", ["stop", "pause"])
def test_a_remote_outage_costs_no_local_hit_and_writes_resume_after_it(
    tmp_path: Path, redis_standalone: LocalService, outage: str
) -> None:
    tiers = _tiers(
        tmp_path / "near",
        redis_standalone,
        f"chain-{outage}:",
        deadline_s=1.0,
        socket_timeout_s=0.5,
    )
    value = bytes(range(256)) * 64
    with create_backend("chain", {"tiers": tiers}) as chain:
        assert chain.batch_set(["held0", "held1"], [value, value]) == [True, True]
        getattr(redis_standalone, outage)()
        try:
            started = time.monotonic()
            for _ in range(20):
                assert chain.batch_exists(["held0", "held1"]) == 2
                assert chain.batch_get(["held0"], [bytearray(len(value))]) == [True]
            local_s = time.monotonic() - started
            assert chain.set("during", value)  # the local tier holds it
            assert chain.get("nowhere") is None  # the remote's miss, within its deadline
            assert _remote_failures(chain) >= 1
        finally:
            {"stop": redis_standalone.start, "pause": redis_standalone.resume}[outage]()
        print(f"{outage}: 40 local lookups and reads in {local_s * 1000:.1f} ms")
        deadline = time.monotonic() + 30
        while not chain.set("after", value) or not _remote_has(redis_standalone, tiers, "after"):
            assert time.monotonic() < deadline, "writes never reached the remote again"
            time.sleep(0.2)
        chain.clear()


def _remote_has(redis: LocalService, tiers: list[Any], key: str) -> bool:
    with create_backend("redis", tiers[1]["options"]) as remote:
        return remote.exists(key)
