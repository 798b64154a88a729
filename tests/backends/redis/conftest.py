"""Real Redis servers for the Redis backend's tests, started once per session, stopped by PID.

The services are published in ``$HICACHE_SERVICES`` so the conformance suite, run in a
subprocess, can stop and restart them for its server-fault checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hicache_storage import create_backend
from hicache_storage.backend import StorageBackend
from hicache_storage.backends.redis import provision
from hicache_storage.kit.services import LocalService, publish


@pytest.fixture(scope="session")
def redis_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    service = provision.standalone(tmp_path_factory.mktemp("redis-standalone"))
    with service, publish(service):
        yield service


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    # The suite's paused-server check wants a miss from every call, which only holds when every
    # node hangs: with one primary paused, keys on the others rightly hit. That case (the one
    # that overran by tens of seconds) is test_redis_deadline.py's, on a cluster of its own.
    service = provision.cluster(tmp_path_factory.mktemp("redis-cluster"))
    with service, publish(service):
        yield service


@pytest.fixture(params=["standalone", "cluster"])
def redis_service(request: pytest.FixtureRequest) -> LocalService:
    service: LocalService = request.getfixturevalue(f"redis_{request.param}")
    return service


@pytest.fixture
def make(redis_service: LocalService) -> Iterator[Callable[..., StorageBackend]]:
    """Build backends on the service with extra options; clear and close them afterwards."""
    built: list[StorageBackend] = []

    def build(**options: Any) -> StorageBackend:
        backend = create_backend("redis", {**redis_service.options, **options})
        built.append(backend)
        return backend

    yield build
    for backend in built:
        backend.clear()
        backend.close()
