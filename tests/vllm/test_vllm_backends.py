"""Every built-in backend, on its real server, as vLLM's storage tier."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.integrations.vllm import harness

from .conftest import Generations, served, tokens

PROMPTS = harness.prompts(2, 200, 40, seed=4)


@pytest.mark.parametrize("name", ["redis", "redis-cluster", "s3", "mooncake", "3fs", "fsspec"])
def test_fresh_engine_served_by(
    name: str,
    model: Path,
    baseline: Callable[[Sequence[Sequence[int]]], Generations],
    tier_for: Callable[[str], dict[str, Any]],
) -> None:
    cold, warm, stats = served(model, tier_for(name), PROMPTS)
    assert tokens(cold) == tokens(baseline(PROMPTS))
    assert [g.cached_tokens for g in warm] == [224, 224]
    assert tokens(warm) == tokens(baseline(PROMPTS))
    assert stats["loaded"] >= 7 and stats["load_failed"] == 0
    assert stats["backend"]["degraded"]["total"] == 0


def test_memory_backend_serves_what_the_primary_tier_evicted(
    model: Path, baseline: Callable[[Sequence[Sequence[int]]], Generations]
) -> None:
    """The memory backend lives in the engine's process: one engine whose primary tier is too
    small for its working set gets back, from the memory tier, chunks the primary evicted."""
    batch = [harness.prompts(1, 200, 40, seed=20 + i)[0] for i in range(4)]  # no shared prefix
    config = harness.kv_transfer_config({"backend": "memory"}, cpu_bytes=12 * 64 * 1024)
    with harness.engine(model, config) as llm:
        first = [harness.generate(llm, [p])[0] for p in batch]
        again = [harness.generate(llm, [p])[0] for p in batch]
        (tier,) = harness.tiers(llm)
        stats = tier.stats()
    assert [g.cached_tokens for g in first] == [0] * 4
    assert again[0].cached_tokens == 224  # evicted from the 12-chunk primary tier long ago
    assert stats["loaded"] >= 7
    assert tokens(first) == tokens(again) == [g.tokens for p in batch for g in baseline([p])]
