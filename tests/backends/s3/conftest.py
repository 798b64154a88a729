"""A real SeaweedFS S3 server for the S3 backend's tests, started once per session, stopped by PID.

The service is published in ``$HICACHE_SERVICES`` so the conformance suite, run in a subprocess,
can stop and restart it for its server-fault checks. Its test credentials reach every client
(this process and its children) through the standard AWS environment variables.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hicache_storage import StorageBackend, create_backend
from hicache_storage.backends.s3 import provision
from hicache_storage.kit.services import LocalService, publish


@pytest.fixture(scope="session")
def s3_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    service = provision.seaweedfs(tmp_path_factory.mktemp("s3"))
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


@pytest.fixture
def test_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's throwaway credentials in the environment, for tests that run without it."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", provision.TEST_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", provision.TEST_SECRET_KEY)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3_options(s3_service: LocalService, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The service's options under a prefix private to this test."""
    service = s3_service
    if not service.running():  # a fault check may have left it stopped
        service.start()
    prefix = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[:60] + "/"
    return {**service.options, "prefix": prefix}


@pytest.fixture
def make_s3(s3_options: dict[str, Any]) -> Iterator[Callable[..., StorageBackend]]:
    """Build layered S3 backends over the test's prefix (overrides as keyword arguments)."""
    built: list[StorageBackend] = []

    def make(**overrides: Any) -> StorageBackend:
        backend = create_backend("s3", {**s3_options, **overrides})
        built.append(backend)
        return backend

    yield make
    for backend in built:
        backend.close()
