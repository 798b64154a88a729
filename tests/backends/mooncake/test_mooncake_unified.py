"""The unified key scheme end to end through a real Mooncake store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.test_unified_e2e import (
    StoreFactory,
    model,
    shared_store,
    test_fp8_e4m3_and_e5m2_never_exchange_bytes,
    test_mla_ranks_share_one_copy_written_by_rank_zero,
    test_readers_of_another_namespace_miss,
    test_tp2_tp1_and_pp2_readers_load_bit_identical_kv,
)

__all__ = [
    "model",
    "test_fp8_e4m3_and_e5m2_never_exchange_bytes",
    "test_mla_ranks_share_one_copy_written_by_rank_zero",
    "test_readers_of_another_namespace_miss",
    "test_tp2_tp1_and_pp2_readers_load_bit_identical_kv",
]


@pytest.fixture
def store(options: dict[str, object]) -> Iterator[StoreFactory]:
    yield from shared_store("mooncake", options)
