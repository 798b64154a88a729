"""The unified key scheme end to end through a real Mooncake store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.test_unified_e2e import *  # noqa: F403
from tests.test_unified_e2e import StoreFactory, shared_store


@pytest.fixture
def store(options: dict[str, object]) -> Iterator[StoreFactory]:
    yield from shared_store("mooncake", options)
