"""The planner under real vLLM: a slow store costs no first-token time, a fast one still serves."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hicache_storage.integrations.vllm import harness
from hicache_storage.integrations.vllm.pressure import PlannerPressure

from .conftest import Generations, tokens

SLOW_READS = {"faults": {"ops": {"batch_get_v1": {"delay_s": 1.0}, "get": {"delay_s": 1.0}}}}
"""Every read of the store takes a second: the chunk reads of a load and the probe's read."""

LONG = [harness.prompts(1, 3800, 40, seed=60 + i)[0] for i in range(4)]
"""Four 3,840-token prompts with nothing in common: long to compute, so that what the tier adds
to their first token (a lookup's round trip) weighs little."""

STORED = 8
"""Leading 32-token chunks of each ``LONG`` prompt in the store (and nowhere else): a slow store's
round trip spread over them is far slower than computing them on any machine."""

ENGINE = {"max_model_len": 4096}
"""Room for a ``LONG`` prompt (the tiny model's positions go to 4,096)."""

ROUNDS = 1
"""Rounds of an engine without a storage tier and one with the slow store, one after the other;
the ratio of their first-token times is printed, not asserted (timings on a shared CI machine
are not a test's): what is asserted is that nothing is read from the slow store."""

SHORT = harness.prompts(4, 200, 40, seed=7)
"""Four 240-token prompts sharing a 200-token prefix: 7 full 32-token blocks each."""


def fresh(seed: int, prefix_tokens: int = 300) -> list[list[int]]:
    """A prompt no engine has seen: computing it prices a prefill for the planner."""
    return harness.prompts(1, prefix_tokens, 40, seed=1000 + seed)


def first_token_s(llm: Any, prompt: Sequence[int]) -> tuple[float, int]:
    """vLLM's own time to first token of one request alone, and its cached prompt tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)
    assert out.metrics is not None  # the engine runs with its stats on
    return float(out.metrics.first_token_latency), int(out.num_cached_tokens or 0)


def timed(
    model: Path, tier: dict[str, Any] | None, seed: int
) -> tuple[list[float], list[int], dict[str, Any]]:
    """An engine's first-token times over ``LONG``, one request at a time, after a warm-up.

    The warm-up computes a prompt as long as those timed, so the planner prices their
    recompute; a tier's engine then waits for its probe of the store (a round trip of each
    slow read) to have measured it.
    """
    config = harness.kv_transfer_config(tier)
    with harness.engine(model, config, disable_log_stats=False, **ENGINE) as llm:
        harness.generate(llm, fresh(seed, 3800))
        tiers = harness.tiers(llm)
        deadline = time.monotonic() + 60
        while tiers and tiers[0].stats()["planner"]["probe_s"] is None:
            assert time.monotonic() < deadline, "the probe of the store never finished"
            time.sleep(0.1)
        runs = [first_token_s(llm, prompt) for prompt in LONG]
        stats = tiers[0].stats() if tiers else {}
        if tiers:
            assert isinstance(tiers[0].bp_detector, PlannerPressure)
    return [s for s, _ in runs], [cached for _, cached in runs], stats


def test_a_slow_store_costs_no_first_token_time(model: Path, tmp_path: Path) -> None:
    """Reads of a second a chunk never pay against computing: the tier answers misses, and
    requests take as long to their first token as without a storage tier."""
    store = {"backend": "file", "options": {"root": str(tmp_path / "store")}}
    cold = harness.kv_transfer_config({**store, "planner": False})
    with harness.engine(model, cold, **ENGINE) as llm:
        harness.generate(llm, [p[: 32 * STORED + 8] for p in LONG])  # none shed
    slow = {**store, "layers": SLOW_READS}
    ratios = []
    for round_ in range(ROUNDS):
        without, _, _ = timed(model, None, seed=2 * round_)
        with_slow, cached, stats = timed(model, slow, seed=2 * round_ + 1)
        assert cached == [0] * len(LONG)  # found in the store, and recomputed
        assert stats["loaded"] == 0 and stats["load_failed"] == 0
        planner = stats["planner"]
        assert planner["fetch_pages"].get("recompute", 0) >= STORED * len(LONG)
        assert "pays" not in planner["fetch_pages"]
        assert planner["probe_s"] >= 1.0
        # What it recomputed is offered again, and shed: reads from this store do not pay.
        assert stats["store_shed"] > 0 and planner["write_pages"]["shed:unread"] > 0
        ratios.append(statistics.median(with_slow) / statistics.median(without))
        print(
            f"round {round_}: time to first token, median of {len(LONG)}: "
            f"{statistics.median(without):.4f} s without a storage tier, "
            f"{statistics.median(with_slow):.4f} s with a store whose every read takes a second: "
            f"ratio {ratios[-1]:.3f}"
        )


def test_without_the_planner_the_slow_store_is_waited_on(model: Path, tmp_path: Path) -> None:
    """The control: the same store, the planner off, a request waits out a one-second read."""
    store = {"backend": "file", "options": {"root": str(tmp_path / "store")}}
    cold = harness.kv_transfer_config({**store, "planner": False})
    with harness.engine(model, cold, **ENGINE) as llm:
        harness.generate(llm, [LONG[0][: 32 * STORED + 8]])
    config = harness.kv_transfer_config({**store, "layers": SLOW_READS, "planner": False})
    with harness.engine(model, config, disable_log_stats=False, **ENGINE) as llm:
        seconds, cached = first_token_s(llm, LONG[0])
        (tier,) = harness.tiers(llm)
        stats = tier.stats()
    assert cached == 32 * STORED and stats["loaded"] == STORED
    assert seconds >= 1.0  # the injected read, not a measurement
    assert "planner" not in stats


def test_a_fast_store_still_serves_once_computing_is_priced(
    model: Path, baseline: Callable[[Sequence[Sequence[int]]], Generations], tmp_path: Path
) -> None:
    """A prompt computed first prices a prefill; the stored prompts still come from storage."""
    store = {"backend": "file", "options": {"root": str(tmp_path / "store")}}
    config = harness.kv_transfer_config(store)
    with harness.engine(model, config) as llm:
        harness.generate(llm, SHORT)
    with harness.engine(model, config) as llm:
        harness.generate(llm, fresh(99))
        (tier,) = harness.tiers(llm)
        priced = tier.stats()["planner"]["rates"]["compute_s_per_token"]
        warm = harness.generate(llm, SHORT)
        stats = tier.stats()
    assert priced is not None  # measured before the stored prompts' lookups
    assert [g.cached_tokens for g in warm] == [224] * 4
    assert tokens(warm) == tokens(baseline(SHORT))
    assert stats["planner"]["fetch_pages"]["pays"] > 0
    assert "recompute" not in stats["planner"]["fetch_pages"]
    assert stats["loaded"] >= 7 and stats["load_failed"] == 0
