"""The unified key scheme end to end through the 3FS backend with a shared metadata service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_storage.kit.services import LocalService
from tests.test_unified_e2e import *  # noqa: F403
from tests.test_unified_e2e import StoreFactory, shared_store

from .conftest import service_options


@pytest.fixture
def store(private_service: LocalService, tmp_path: Path) -> Iterator[StoreFactory]:
    yield from shared_store("3fs", service_options(private_service, tmp_path / "data"))
