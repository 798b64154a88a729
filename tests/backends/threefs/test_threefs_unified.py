"""The unified key scheme end to end through the 3FS backend with a shared metadata service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_storage.conformance.provision import LocalService
from tests.test_unified_e2e import (
    StoreFactory,
    model,
    shared_store,
    test_fp8_e4m3_and_e5m2_never_exchange_bytes,
    test_mla_ranks_share_one_copy_written_by_rank_zero,
    test_readers_of_another_namespace_miss,
    test_tp2_tp1_and_pp2_readers_load_bit_identical_kv,
)

from .conftest import service_options

__all__ = [
    "model",
    "test_fp8_e4m3_and_e5m2_never_exchange_bytes",
    "test_mla_ranks_share_one_copy_written_by_rank_zero",
    "test_readers_of_another_namespace_miss",
    "test_tp2_tp1_and_pp2_readers_load_bit_identical_kv",
]


@pytest.fixture
def store(private_service: LocalService, tmp_path: Path) -> Iterator[StoreFactory]:
    yield from shared_store("3fs", service_options(private_service, tmp_path / "data"))
