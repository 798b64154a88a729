"""The Redis backend passes the conformance suite on a server and on a cluster, faults included."""

from __future__ import annotations

from pathlib import Path

from hicache_storage.kit.services import LocalService

from ...helpers import assert_conforms, passing_suite


def test_redis_passes_suite_with_server_faults(tmp_path: Path, redis_service: LocalService) -> None:
    mode = "cluster" if "cluster_nodes" in redis_service.options else "standalone"
    config = {**redis_service.options, "prefix": f"conformance-{mode}:"}
    report = passing_suite("redis", config, tmp_path)
    assert report.backend == "redis"
    assert {"persistent", "shared", "delete", "crash_safe_writes"} <= set(report.capabilities)
    assert_conforms(report, server_faults=True)
    multiprocess = [c for c in report.checks if c.id.startswith("TestMultiProcess::")]
    assert multiprocess and all(c.outcome == "passed" for c in multiprocess)
