"""The unified key scheme end to end through Redis, standalone and Cluster."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from hicache_storage.kit.services import LocalService
from tests.test_unified_e2e import *  # noqa: F403
from tests.test_unified_e2e import StoreFactory, shared_store


@pytest.fixture
def store(redis_service: LocalService) -> Iterator[StoreFactory]:
    options = {**redis_service.options, "prefix": f"unified-{secrets.token_hex(4)}:"}
    yield from shared_store("redis", options)
