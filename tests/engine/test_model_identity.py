"""The tier engine's model is known by its weights, not only by the seed they were drawn from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache_storage.engine.engine import Engine
from hicache_storage.engine.model import LlamaModel, spaced_indices

from ._child import CONFIG, conversations
from .test_object_format import cache, file_store, serve


class _OtherDraws(torch.Generator):
    """A generator that draws other numbers from a seed, as another torch release may."""

    def manual_seed(self, seed: int) -> torch.Generator:
        return super().manual_seed(seed + 1)


def test_other_weights_from_the_same_config_have_another_identity(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = LlamaModel(CONFIG)
    assert LlamaModel(CONFIG).identity == model.identity  # the same weights: one identity
    with monkeypatch.context() as patch:
        patch.setattr(torch, "Generator", _OtherDraws)
        other = LlamaModel(CONFIG)
    assert other.config == model.config
    assert not torch.equal(other.embedding, model.embedding)
    assert other.identity != model.identity
    prompts = conversations(rounds=2, clients=2, seed=23)
    first = cache(file_store(tmp_path))
    serve(Engine(model, first), prompts)
    assert first.stats.pages_stored > 0
    second = cache(file_store(tmp_path))
    assert serve(Engine(other, second), prompts) == serve(Engine(other, None), prompts)
    assert second.stats.storage_hit_tokens == 0 and second.stats.pages_fetched == 0


def test_sampled_indices_stay_inside_a_matrix_too_large_for_float32_steps() -> None:
    numel = 128256 * 4096  # the 8B shape's embedding
    at = spaced_indices(numel, 64, torch.device("cpu"))
    assert at[0] == 0 and at[-1] == numel - 1 and bool((at[1:] > at[:-1]).all())
    assert int(torch.linspace(0, numel - 1, 64).long().max()) == numel  # what it replaced
