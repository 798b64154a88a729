"""A model is known by its weights and KV settings, not its path: no hits across either change."""

from __future__ import annotations

from pathlib import Path

from hicache_storage.integrations.vllm import harness

from .conftest import tokens

PROMPTS = harness.prompts(2, 200, 40, seed=3)
"""Two 240-token prompts sharing a 200-token prefix: 7 full 32-token blocks each."""


def _stored_files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file())


def test_new_weights_at_the_same_path_never_read_the_old_kv(tmp_path: Path) -> None:
    model = harness.write_tiny_model(tmp_path / "model", seed=0)
    store = tmp_path / "store"
    config = harness.kv_transfer_config({"backend": "file", "options": {"root": str(store)}})
    with harness.engine(model, config) as llm:
        old = harness.generate(llm, PROMPTS)
    assert _stored_files(store) > 0
    harness.write_tiny_model(model, seed=1)  # a new checkpoint copied over the old one
    with harness.engine(model) as llm:
        fresh = harness.generate(llm, PROMPTS)
    assert tokens(fresh) != tokens(old)  # the new weights compute other tokens
    with harness.engine(model, config) as llm:
        served = harness.generate(llm, PROMPTS)
        (tier,) = harness.tiers(llm)
        stats = tier.stats()
    assert [g.cached_tokens for g in served] == [0, 0]
    assert stats["loaded"] == 0
    assert tokens(served) == tokens(fresh)


def test_a_changed_rope_setting_never_reads_the_kv_of_the_old_one(tmp_path: Path) -> None:
    model = harness.write_tiny_model(tmp_path / "model", seed=0)
    config = harness.kv_transfer_config(
        {"backend": "file", "options": {"root": str(tmp_path / "store")}}
    )
    with harness.engine(model, config) as llm:
        harness.generate(llm, PROMPTS)
    overrides = {"rope_theta": 500000.0}
    with harness.engine(model, config, hf_overrides=overrides) as llm:
        served = harness.generate(llm, PROMPTS)
        (tier,) = harness.tiers(llm)
        stats = tier.stats()
    assert [g.cached_tokens for g in served] == [0, 0]
    assert stats["loaded"] == 0
