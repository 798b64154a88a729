"""Storage failures under real vLLM: counted misses, identical tokens, no hang."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from hicache_storage.backends.redis import provision as redis_provision
from hicache_storage.integrations.vllm import harness
from hicache_storage.kit.services import LocalService

from .conftest import Generations, tokens

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
    """A store bounded to 8 chunks keeps the newest; nothing fails, tokens stay right.

    The cold engine stores 3 prompts of 7 chunks; the bound keeps the last prompt's. The fresh
    engine is served that prompt and recomputes (and stores, evicting again) the others.
    """
    batch = [harness.prompts(1, 200, 40, seed=30 + i)[0] for i in range(3)]
    # 8 chunks with their integrity records, and the verify layer's 32-byte record of each
    # (an object of its own, with its integrity record).
    bound = 8 * (64 * 1024 + 32 + 2 * 32)
    options = {"root": str(tmp_path / "store"), "max_bytes": bound}
    config = harness.kv_transfer_config({"backend": "file", "options": options})
    with harness.engine(model, config) as llm:
        cold = [harness.generate(llm, [p])[0] for p in batch]
    with harness.engine(model, config) as llm:
        warm = [harness.generate(llm, [p])[0] for p in reversed(batch)]
        (tier,) = harness.tiers(llm)
        stats = tier.stats()
    assert tokens(cold) == tokens(warm[::-1]) == [g.tokens for p in batch for g in baseline([p])]
    assert [g.cached_tokens for g in warm] == [224, 0, 0]
    assert stats["backend"]["bytes"] <= bound
    assert stats["backend"]["evictions"] >= 13  # 7 + 14 chunks into room for 8
    assert stats["store_failed"] == 0 and stats["backend"]["degraded"]["total"] == 0


def test_pages_replaced_behind_the_writer_are_misses_not_tokens(
    model: Path,
    baseline: Callable[[Sequence[Sequence[int]]], Generations],
    redis_own: LocalService,
) -> None:
    """Redis keeps no integrity record: only the end-to-end check tells other bytes apart."""
    import redis

    config = harness.kv_transfer_config({"backend": "redis", "options": redis_own.options})
    with harness.engine(model, config) as llm:
        harness.generate(llm, PROMPTS)
    client = redis.Redis.from_url(
        redis_own.options["url"], password=redis_own.options.get("password")
    )
    pages = [key for key in client.scan_iter() if b"hcv-" not in key]
    assert len(pages) >= 8
    for key in pages:  # same length, other bytes: another engine's KV, a bad restore
        value = client.get(key)
        assert value is not None
        client.set(key, bytes(255 - b for b in value))
    with harness.engine(model, config) as llm:
        replaced = harness.generate(llm, PROMPTS)
        (tier,) = harness.tiers(llm)
        stats = tier.stats()
    assert tokens(replaced) == tokens(baseline(PROMPTS))
    assert stats["backend"]["verify"]["mismatched"] > 0
    assert stats["loaded"] == 0


def test_an_unreachable_store_at_start_up_starts_degraded_then_attaches(
    model: Path,
    baseline: Callable[[Sequence[Sequence[int]]], Generations],
    redis_own: LocalService,
) -> None:
    """vLLM serves while the store is down at start-up, and stores once it answers."""
    config = harness.kv_transfer_config({"backend": "redis", "options": redis_own.options})
    redis_own.stop()
    with harness.engine(model, config) as llm:  # starts although nothing answers
        down = harness.generate(llm, PROMPTS)
        (tier,) = harness.tiers(llm)
        assert tier.stats()["backend"]["attach"]["attached"] is False
        redis_own.start()
        deadline = time.monotonic() + 60
        while not tier.stats()["backend"]["attach"]["attached"]:
            assert time.monotonic() < deadline, "the tier never attached the store"
            time.sleep(0.2)
        later = harness.prompts(2, 200, 40, seed=6)
        harness.generate(llm, later)
        stats = tier.stats()
    assert tokens(down) == tokens(baseline(PROMPTS))
    assert stats["stored"] > 0, stats
