"""Start a local server for every networked backend and run ``hicache bench`` against each.

Usage: ``.venv/bin/python scripts/bench_all.py [LABEL ...]`` (all labels by default:
redis-standalone redis-cluster s3 mooncake mooncake-v1 3fs 3fs-service file). The servers are
the ones the tests use (each backend's ``provision`` module), on free 127.0.0.1 ports, stopped by
PID afterwards. The figures in docs/performance.md's summary come from this script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hicache_storage.backends.mooncake.provision import local_store
from hicache_storage.backends.redis import provision as redis
from hicache_storage.backends.s3 import provision as s3
from hicache_storage.backends.threefs.provision import metadata_service

LABELS = [
    "redis-standalone",
    "redis-cluster",
    "s3",
    "mooncake",
    "mooncake-v1",
    "3fs",
    "3fs-service",
    "file",
]
SLOTS = {"file_size": 1 << 30, "file_count": 2, "slot_bytes": 1 << 20}
MOONCAKE = [
    "--page-size",
    "64KiB,1MiB,4MiB",
    "--batch-size",
    "8",
    "--batches",
    "6",
    "--repeat",
    "4",
]


def main(labels: list[str]) -> None:
    """Run the benchmarks named by ``labels`` (all when empty), each beside its raw baseline."""
    unknown = set(labels) - set(LABELS)
    if unknown:
        raise SystemExit(f"unknown labels {sorted(unknown)}; choose from {LABELS}")
    wanted = set(labels or LABELS)
    work = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    hicache = str(Path(sys.executable).parent / "hicache")

    def bench(label: str, name: str, options: dict[str, Any], *flags: str) -> None:
        print(f"\n### {label}: hicache bench {name} {' '.join(flags)}", flush=True)
        command = [hicache, "bench", name, "--config", json.dumps(options), *flags]
        subprocess.run(command, check=True)

    redis_flags = ["--page-size", "64KiB,1MiB", "--batches", "32", "--repeat", "5"]
    if "redis-standalone" in wanted:
        with redis.standalone(work / "redis") as server:
            bench("redis-standalone", "redis", {**server.options, "prefix": "bench:"}, *redis_flags)
    if "redis-cluster" in wanted:
        with redis.cluster(work / "redis-cluster") as cluster:
            bench("redis-cluster", "redis", {**cluster.options, "prefix": "bench:"}, *redis_flags)
    if "s3" in wanted:
        os.environ.update(
            AWS_ACCESS_KEY_ID=s3.TEST_ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=s3.TEST_SECRET_KEY,
            AWS_EC2_METADATA_DISABLED="true",
        )
        with s3.seaweedfs(work / "s3") as gateway:
            bench("s3", "s3", {**gateway.options, "prefix": "bench/"})
    if wanted & {"mooncake", "mooncake-v1"}:
        with local_store(work / "mooncake", segment="3GB") as master:
            options = {
                "master": master.options["master"],
                "global_segment_size": 0,
                "local_hostname": "127.0.0.1",
                "local_buffer_size": "64MiB",
            }
            if "mooncake" in wanted:
                bench("mooncake", "mooncake", options, *MOONCAKE)
            if "mooncake-v1" in wanted:
                bench(
                    "mooncake-v1", "mooncake", options, "--v1", "--layout", "page_first", *MOONCAKE
                )
    if "3fs" in wanted:
        bench(
            "3fs", "3fs", {"path": str(work / "3fs"), **SLOTS}, "--batches", "32", "--repeat", "5"
        )
    if "3fs-service" in wanted:
        with metadata_service(work / "metadata") as service:
            options = {"path": str(work / "3fs-shared"), **SLOTS, **service.options}
            bench(
                "3fs-service",
                "3fs",
                options,
                "--batch-size",
                "64",
                "--batches",
                "4",
                "--repeat",
                "5",
            )
    if "file" in wanted:
        flags = ["--page-size", "1MiB,4MiB", "--batches", "32", "--repeat", "5"]
        bench("file", "file", {"root": str(work / "file")}, *flags)


if __name__ == "__main__":
    main(sys.argv[1:])
