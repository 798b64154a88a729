"""Fixtures of the SGLang integration tests: real servers for the backends, stopped by PID."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.backends.mooncake.provision import local_store
from hicache_storage.backends.redis import provision as redis_provision
from hicache_storage.backends.s3 import provision as s3_provision
from hicache_storage.kit.services import LocalService

# Imported first: it imports SGLang with the torchvision stand-in, before any test module does.
from .helpers import SGLANG_VERSION


def pytest_report_header() -> str:
    return f"sglang {version('sglang')} (pinned {SGLANG_VERSION}; CPU, torchvision stand-in)"


# -- real servers, started for this package and stopped by PID ---------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    with redis_provision.standalone(tmp_path_factory.mktemp("sgl-redis")) as service:
        yield service


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    service = s3_provision.seaweedfs(tmp_path_factory.mktemp("sgl-s3"))
    env = s3_provision.credentials_env(service)
    with service, pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        yield service


@pytest.fixture(scope="session")
def mooncake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    with local_store(tmp_path_factory.mktemp("sgl-mooncake")) as service:
        yield service


@pytest.fixture
def backend_config(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[str], dict[str, Any]]:
    """Our part of the extra config for each backend, on the servers above."""

    def build(name: str) -> dict[str, Any]:
        tag = f"sgl{secrets.token_hex(4)}"
        if name == "memory":
            return {"backend": "memory"}
        if name == "file":
            return {"backend": "file", "options": {"root": str(tmp_path / "file")}}
        if name == "3fs":
            return {
                "backend": "3fs",
                "options": {"path": str(tmp_path / "3fs"), "file_size": 64 << 20, "file_count": 1},
            }
        if name == "redis":
            service = request.getfixturevalue("redis_server")
            return {"backend": "redis", "options": {**service.options, "prefix": tag}}
        if name == "s3":
            service = request.getfixturevalue("s3_server")
            return {"backend": "s3", "options": {**service.options, "prefix": f"{tag}/"}}
        if name == "mooncake":
            service = request.getfixturevalue("mooncake_server")
            return {
                "backend": "mooncake",
                "options": {
                    "master": service.options["master"],
                    "global_segment_size": 0,
                    "local_hostname": "127.0.0.1",
                    "prefix": f"{tag}/",
                },
            }
        raise ValueError(name)

    return build
