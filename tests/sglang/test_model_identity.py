"""Through SGLang's factory: stored KV belongs to the weights and KV settings, not a path."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.errors import ConfigError
from hicache_storage.keys import page_hashes

from .helpers import PAGE, fill_random, make_pools, set_rank, storage_config
from .test_adapter import build

HASHES = page_hashes(range(2 * PAGE), PAGE)


def checkpoint(root: Path, seed: int, **config: Any) -> Path:
    """A model directory: its config and one weight file of seeded bytes (same size every seed)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"rope_theta": 10000.0, **config}))
    (root / "model.safetensors").write_bytes(random.Random(seed).randbytes(3 << 20))
    return root


def hits(extra: dict[str, Any], store: Path, *, write: bool = False, **fields: Any) -> list[bool]:
    """Open an adapter over the file store at ``store``; write the pages first if asked."""
    pools = make_pools("mha", "page_first")
    backend = build(
        {**extra, "backend": "file", "options": {"root": str(store)}}, pools.host, **fields
    )
    try:
        if write:
            src = pools.host.alloc(len(HASHES) * PAGE)
            fill_random(pools.host, src, seed=5)
            assert backend.batch_set_v1(HASHES, src) == [True] * len(HASHES)
        dst = pools.host.alloc(len(HASHES) * PAGE)
        result: list[bool] = backend.batch_get_v1(HASHES, dst)
        return result
    finally:
        backend.close()


UNIFIED = {
    "key_scheme": "unified",
    "unified": {"dtype": "float16", "num_layers": 3, "local_kv_heads": 2, "head_group": 1},
}


@pytest.mark.parametrize("deployment", [{}, UNIFIED], ids=["rank-suffix", "unified"])
def test_new_weights_at_the_model_path_miss_the_old_kv(
    tmp_path: Path, deployment: dict[str, Any]
) -> None:
    set_rank()
    model = checkpoint(tmp_path / "model", seed=1)
    extra = {"model_path": str(model), "deployment": deployment}
    store = tmp_path / "store"
    assert hits(extra, store, write=True) == [True, True]
    assert hits(extra, store) == [True, True]  # the same weights: the identity is stable
    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(model, copy)
    moved = {**extra, "model_path": str(copy)}
    assert hits(moved, store) == [True, True]  # a copy is the same model
    checkpoint(model, seed=2)  # a new checkpoint copied over the old one
    assert hits(extra, store) == [False, False]


def test_a_model_name_that_is_a_local_path_is_identified_by_its_weights(tmp_path: Path) -> None:
    set_rank()
    model = checkpoint(tmp_path / "model", seed=1)
    store = tmp_path / "store"
    assert hits({}, store, write=True, model_name=str(model)) == [True, True]
    checkpoint(model, seed=2)
    assert hits({}, store, model_name=str(model)) == [False, False]


@pytest.mark.parametrize(
    "overrides",
    [{"rope_theta": 500000.0}, {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}],
)
def test_a_changed_kv_setting_misses_the_old_kv(tmp_path: Path, overrides: dict[str, Any]) -> None:
    set_rank()
    model = checkpoint(tmp_path / "model", seed=1)
    store = tmp_path / "store"
    assert hits({"model_path": str(model)}, store, write=True) == [True, True]
    changed = {"model_path": str(model), "model_overrides": overrides}
    assert hits(changed, store) == [False, False]
    checkpoint(model, seed=1, **overrides)  # the same change made in config.json
    assert hits({"model_path": str(model)}, store) == [False, False]


def test_sglang_file_compat_names_are_sglangs_whatever_the_weights(tmp_path: Path) -> None:
    set_rank()
    model = checkpoint(tmp_path / "model", seed=1)
    options = {"root": str(tmp_path / "store"), "naming": "sglang_file_compat"}
    pools = make_pools("mha", "page_first")
    extra = {"backend": "file", "options": options, "model_path": str(model)}
    backend = build(extra, pools.host)
    src = pools.host.alloc(len(HASHES) * PAGE)
    fill_random(pools.host, src, seed=5)
    assert backend.batch_set_v1(HASHES, src) == [True, True]
    backend.close()
    names = sorted(p.name for p in (tmp_path / "store").iterdir() if p.suffix == ".bin")
    assert names == sorted(f"{h}_org-model_0_1.bin" for h in HASHES)


def test_bad_adapter_keys_are_refused() -> None:
    from hicache_storage.integrations.sglang import served_model_identity

    with pytest.raises(ConfigError, match="model_path"):
        served_model_identity(storage_config({"backend": "memory", "model_path": 3}))
    with pytest.raises(ConfigError, match="model_overrides"):
        served_model_identity(storage_config({"backend": "memory", "model_overrides": [1]}))
    assert served_model_identity(storage_config({"backend": "memory"})) == "org/model"
