"""Storage failures under real vLLM: counted misses, identical tokens, no hang."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from hicache_storage.backends.redis import provision as redis_provision
from hicache_storage.conformance.provision import LocalService
from hicache_storage.integrations.vllm import harness

from .conftest import Generations, served, tokens

PROMPTS = harness.prompts(2, 200, 40, seed=5)


@pytest.fixture
def redis_own(tmp_path: Path) -> Iterator[LocalService]:
    """A Redis server of this test's own, which it stops."""
    with redis_provision.standalone(tmp_path / "redis") as service:
        yield service


def test_server_stopped_mid_run(
    model: Path,
    baseline: Callable[[Sequence[Sequence[int]]], Generations],
    redis_own: LocalService,
) -> None:
    config = harness.kv_transfer_config({"backend": "redis", "options": redis_own.options})
    with harness.engine(model, config) as llm:
        harness.generate(llm, PROMPTS)
    with harness.engine(model, config) as llm:  # starts while the server is up
        redis_own.stop()
        start = time.monotonic()
        lost = harness.generate(llm, PROMPTS)
        elapsed = time.monotonic() - start
        (tier,) = harness.tiers(llm)
        stats = tier.stats()
    assert tokens(lost) == tokens(baseline(PROMPTS))
    assert [g.cached_tokens for g in lost] == [0, 0]
    assert stats["backend"]["degraded"]["total"] > 0  # counted, not mistaken for misses
    # Bounded by the backend's deadline per call, not a hang (a generous bound for 2 cores).
    assert elapsed < 60, elapsed


def test_corrupted_objects_are_misses(
    model: Path, baseline: Callable[[Sequence[Sequence[int]]], Generations], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    config = harness.kv_transfer_config({"backend": "file", "options": {"root": str(store)}})
    with harness.engine(model, config) as llm:
        harness.generate(llm, PROMPTS)
    objects = [p for p in store.rglob("vllm-*") if p.is_file()]
    assert len(objects) >= 8
    for path in objects:
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(bytes(data))
    with harness.engine(model, config) as llm:
        corrupted = harness.generate(llm, PROMPTS)
        (tier,) = harness.tiers(llm)
        stats = tier.stats()
    assert tokens(corrupted) == tokens(baseline(PROMPTS))
    assert corrupted[0].cached_tokens == 0
    assert stats["load_failed"] > 0 and stats["loaded"] == 0
    assert sum(stats["backend"]["integrity_failures"].values()) > 0


def test_store_that_fills_up(
    model: Path, baseline: Callable[[Sequence[Sequence[int]]], Generations], tmp_path: Path
) -> None:
    """A store bounded to 4 chunks keeps the newest; nothing fails, tokens stay right."""
    batch = [harness.prompts(1, 200, 40, seed=30 + i)[0] for i in range(3)]
    options = {"root": str(tmp_path / "store"), "max_bytes": 4 * 65_600, "low_watermark": 0.5}
    cold, warm, stats = served(model, {"backend": "file", "options": options}, batch)
    assert tokens(cold) == tokens(warm) == tokens(baseline(batch))
    assert stats["backend"]["bytes"] <= 4 * 65_600
    assert stats["backend"]["evictions"] > 0 or stats["stored"] > 0
    assert stats["backend"]["degraded"]["total"] == 0
