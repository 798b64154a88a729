"""A real Mooncake store for the session: a master and a segment holder on 127.0.0.1."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from hicache_storage.backends.mooncake import provision
from hicache_storage.backends.mooncake.provision import local_store
from hicache_storage.kit.services import LocalService


@pytest.fixture(scope="session")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    """Start ``mooncake_master`` and a 512 MB segment holder; stop both by PID afterwards."""
    with local_store(tmp_path_factory.mktemp("mooncake")) as master:
        yield master


@pytest.fixture
def options(mooncake_store: LocalService) -> dict[str, object]:
    """Options of a pure client (no segment of its own) under a fresh prefix."""
    return {
        "master": mooncake_store.options["master"],
        "master_metrics": provision.metrics_address(mooncake_store),
        "global_segment_size": 0,
        "local_hostname": "127.0.0.1",
        "prefix": f"t-{secrets.token_hex(4)}/",
    }
