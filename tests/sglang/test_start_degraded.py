"""A store unreachable when SGLang starts: the adapter starts detached and attaches it later.

Through SGLang's own factory and host pools on CPU, against a real Redis stopped at start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache_storage.backends.redis import provision
from hicache_storage.errors import BackendUnavailableError
from hicache_storage.integrations.sglang import SGLangStorage
from hicache_storage.keys import page_hashes
from hicache_storage.kit.services import LocalService

from .helpers import ADAPTER, PAGE, fill_random, make_pools, read_pages, storage_config

ATTACH_BOUND_S = 30.0


@pytest.fixture
def stopped_redis(tmp_path: Path) -> Iterator[LocalService]:
    """A Redis service described but not started; stopped by PID afterwards."""
    service = provision.standalone(tmp_path / "redis", deadline_s=1.0, socket_timeout_s=0.5)
    try:
        yield service
    finally:
        service.stop()


def extra(service: LocalService, **more: Any) -> dict[str, Any]:
    return {
        **ADAPTER,
        "backend": "redis",
        "options": {**service.options, "prefix": "sgl-start"},
        "layers": {"health": {"probe_interval_s": 0.05, "max_probe_interval_s": 0.2}},
        **more,
    }


def test_sglang_starts_while_the_store_is_down_and_uses_it_once_it_answers(
    stopped_redis: LocalService,
) -> None:
    pools = make_pools("mha", "page_first")
    adapter = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra(stopped_redis)), pools.host
    )
    assert isinstance(adapter, SGLangStorage)
    adapter.register_mem_pool_host(pools.host)
    adapter.on_host_pools_registered()
    try:
        src = pools.host.alloc(2 * PAGE)
        pages = fill_random(pools.host, src, seed=3)
        hashes = page_hashes(range(2 * PAGE), PAGE)
        # The planner's probe at registration was a read, answered as a miss too.
        shed = adapter.backend.stats()["attach"]["shed_total"]
        assert adapter.batch_exists(hashes) == 0
        assert adapter.batch_set_v1(hashes, src) == [False, False]
        assert adapter.backend.stats()["attach"]["shed_total"] == shed + 2

        stopped_redis.start()
        until = time.monotonic() + ATTACH_BOUND_S
        while not adapter.backend.stats()["attach"]["attached"] and time.monotonic() < until:
            time.sleep(0.05)
        assert adapter.batch_set_v1(hashes, src) == [True, True]
        assert adapter.batch_exists(hashes) == 2
        dst = pools.host.alloc(2 * PAGE)
        assert adapter.batch_get_v1(hashes, dst) == [True, True]
        got = read_pages(pools.host, dst)
        assert all(torch.equal(a, b) for a, b in zip(got, pages, strict=True))
    finally:
        adapter.clear()
        adapter.close()


def test_strict_start_refuses_to_start_while_the_store_is_down(
    stopped_redis: LocalService,
) -> None:
    pools = make_pools("mha", "page_first")
    with pytest.raises(BackendUnavailableError, match="cannot reach"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra(stopped_redis, strict_start=True)), pools.host
        )
