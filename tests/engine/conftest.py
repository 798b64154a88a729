"""The tiny model each test module shares, and the real servers the engine tests run against.

Each server is provisioned as the backend's own tests do (``tests/backends/*/conftest.py``) and
published to the conformance server-control hook; a server that cannot be started fails the tests
that use it. The 3FS metadata service's lease and timeout are those of the 3FS tests.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hicache_storage.engine.model import LlamaModel
from hicache_storage.kit.services import LocalService, publish

from ._child import CONFIG

MiB = 1 << 20
THREEFS_GEOMETRY: dict[str, Any] = {"file_size": 32 * MiB, "file_count": 2, "slot_bytes": 64 << 10}
THREEFS_LEASE_S = 2.0
THREEFS_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def model() -> Iterator[LlamaModel]:
    """The tiny model, on one thread: the tests' engines run storage threads beside it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LlamaModel(CONFIG)
    torch.set_num_threads(threads)


@pytest.fixture(scope="package")
def redis_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    from hicache_storage.backends.redis import provision

    service = provision.standalone(tmp_path_factory.mktemp("engine-redis"))
    with service, publish(service):
        yield service


@pytest.fixture(scope="package")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    from hicache_storage.backends.redis import provision

    service = provision.cluster(tmp_path_factory.mktemp("engine-redis-cluster"))
    with service, publish(service):
        yield service


@pytest.fixture(scope="package")
def s3_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    """SeaweedFS's S3 gateway, its throwaway credentials in the environment while it runs."""
    from hicache_storage.backends.s3 import provision

    service = provision.seaweedfs(tmp_path_factory.mktemp("engine-s3"))
    env = provision.credentials_env(service)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        with service, publish(service):
            yield service
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="package")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    from hicache_storage.backends.mooncake.provision import local_store

    with local_store(tmp_path_factory.mktemp("engine-mooncake")) as master:
        yield master


@pytest.fixture(scope="package")
def metadata_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    """The 3FS metadata service (``hicache metadata-server``)."""
    from hicache_storage.backends.threefs.provision import metadata_service as start

    service = start(
        tmp_path_factory.mktemp("engine-3fs-metadata"),
        token="t0ken",
        lease_s=THREEFS_LEASE_S,
        timeout_s=THREEFS_TIMEOUT_S,
    )
    with service, publish(service):
        yield service


@pytest.fixture(autouse=True)
def switch_interval() -> Iterator[None]:
    """Give back the thread switch interval that a cache a test never closed left lowered."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)
