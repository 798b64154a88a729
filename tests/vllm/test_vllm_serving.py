"""A fresh vLLM engine served from storage: hits reported by vLLM, tokens unchanged."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hicache_storage.integrations.vllm import harness

from .conftest import ENV, Generations, served, tokens

PROMPTS = harness.prompts(4, 200, 40, seed=1)
"""Four 240-token prompts sharing a 200-token prefix: 7 full 32-token blocks each."""


def test_fresh_engine_is_served_from_storage(
    model: Path, baseline: Callable[[Sequence[Sequence[int]]], Generations], tmp_path: Path
) -> None:
    tier = {"backend": "file", "options": {"root": str(tmp_path / "store")}}
    cold, warm, stats = served(model, tier, PROMPTS)
    assert cold[0].cached_tokens == 0  # nothing stored before the first request
    assert tokens(cold) == tokens(baseline(PROMPTS))
    # Every full block but the one holding the last prompt token comes from storage.
    assert [g.cached_tokens for g in warm] == [224] * 4
    assert tokens(warm) == tokens(baseline(PROMPTS))
    assert stats["loaded"] > 0 and stats["load_failed"] == 0
    assert stats["backend"]["degraded"]["total"] == 0


def test_prompt_extending_a_stored_prefix(
    model: Path, baseline: Callable[[Sequence[Sequence[int]]], Generations], tmp_path: Path
) -> None:
    tier = {"backend": "file", "options": {"root": str(tmp_path / "store")}}
    config = harness.kv_transfer_config(tier)
    with harness.engine(model, config) as llm:
        harness.generate(llm, PROMPTS)
    longer = [p + harness.prompts(1, 60, 0, seed=10 + i)[0] for i, p in enumerate(PROMPTS)]
    with harness.engine(model, config) as llm:
        extended = harness.generate(llm, longer)
    assert [g.cached_tokens for g in extended] == [224] * 4  # the stored prefix, no more
    assert tokens(extended) == tokens(baseline(longer))
    with harness.engine(model, config) as llm:  # the extension was stored in turn
        again = harness.generate(llm, longer)
    assert [g.cached_tokens for g in again] == [288] * 4
    assert tokens(again) == tokens(baseline(longer))


def test_two_engines_share_one_store_at_once(
    model: Path, baseline: Callable[[Sequence[Sequence[int]]], Generations], tmp_path: Path
) -> None:
    tier = {"backend": "file", "options": {"root": str(tmp_path / "store")}}
    config = harness.kv_transfer_config(tier)
    first, second = harness.prompts(2, 160, 40, seed=2), harness.prompts(2, 160, 40, seed=3)
    engines = [harness.run_detached(model, [config], batch, env=ENV) for batch in (first, second)]
    results = [harness.detached_result(process)[0] for process in engines]
    assert tokens(results[0]) == tokens(baseline(first))
    assert tokens(results[1]) == tokens(baseline(second))
    # A third engine finds what both wrote while they ran side by side.
    with harness.engine(model, config) as llm:
        both = harness.generate(llm, first + second)
    assert [g.cached_tokens for g in both] == [192] * 4
    assert tokens(both) == tokens(baseline(first)) + tokens(baseline(second))


def test_altered_bytes_change_the_output(
    model: Path, baseline: Callable[[Sequence[Sequence[int]]], Generations], tmp_path: Path
) -> None:
    """Negative control: the loaded KV is what the model attends to.

    Bare values (no integrity record) with the verify layer off let altered bytes through as
    hits; the tokens then differ from the baseline, which an engine ignoring loaded KV would not
    show. (With either check on, they are misses: test_vllm_faults.py.)
    """
    store = tmp_path / "store"
    tier: dict[str, Any] = {
        "backend": "file",
        "options": {"root": str(store), "integrity": False},
        "layers": {"verify": False},
    }
    config = harness.kv_transfer_config(tier)
    with harness.engine(model, config) as llm:
        harness.generate(llm, PROMPTS)
    objects = [path for path in store.rglob("vllm-*") if path.is_file()]
    assert objects
    for path in objects:
        data = bytearray(path.read_bytes())
        data[: len(data) // 2] = bytes(len(data) // 2)  # zero the first half of each chunk
        path.write_bytes(bytes(data))
    with harness.engine(model, config) as llm:
        altered = harness.generate(llm, PROMPTS)
    assert [g.cached_tokens for g in altered] == [224] * 4
    assert tokens(altered) != tokens(baseline(PROMPTS))


def test_engine_core_in_a_process_of_its_own(
    model: Path, baseline: Callable[[Sequence[Sequence[int]]], Generations], tmp_path: Path
) -> None:
    """vLLM's default (what ``vllm serve`` runs): the scheduler, and so the tier, in a separate
    engine-core process."""
    tier = {"backend": "file", "options": {"root": str(tmp_path / "store")}}
    config = harness.kv_transfer_config(tier)
    env = {**ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cold, warm = harness.detached_result(
        harness.run_detached(model, [config, config], PROMPTS[:2], env=env)
    )
    assert [g.cached_tokens for g in warm] == [224, 224]
    assert tokens(cold) == tokens(warm) == tokens(baseline(PROMPTS[:2]))
