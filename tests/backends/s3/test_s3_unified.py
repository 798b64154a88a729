"""The unified key scheme end to end through S3 (SeaweedFS)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from hicache_storage.kit.services import LocalService
from tests.test_unified_e2e import *  # noqa: F403
from tests.test_unified_e2e import StoreFactory, shared_store


@pytest.fixture
def store(s3_service: LocalService) -> Iterator[StoreFactory]:
    if not s3_service.running():
        s3_service.start()
    options = {**s3_service.options, "prefix": f"unified-{secrets.token_hex(4)}/"}
    yield from shared_store("s3", options)
