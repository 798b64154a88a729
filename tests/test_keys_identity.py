"""A model's identity: its weights, sampled, and the settings that shape its KV, never its path."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.keys import validate_key
from hicache_storage.keys.identity import (
    SAMPLE_BLOCKS,
    SAMPLE_BYTES,
    kv_settings,
    model_identity,
    weights_fingerprint,
)

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "vocab_size": 256,
}
BIG = 4 * SAMPLE_BLOCKS * SAMPLE_BYTES  # larger than the sampled bytes: sampling applies


def checkpoint(root: Path, content: bytes, config: dict[str, Any] | None = None) -> Path:
    """A model directory: config.json, two weight shards and a tokenizer file."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or CONFIG))
    (root / "model-00001-of-00002.safetensors").write_bytes(content)
    (root / "model-00002-of-00002.safetensors").write_bytes(content[::-1])
    (root / "tokenizer.json").write_text("{}")
    return root


def identity(root: Path, config: dict[str, Any] | None = None) -> str:
    return model_identity(str(root), weights_fingerprint(root), kv_settings(config or CONFIG))


def content(seed: int, size: int = BIG) -> bytes:
    import random

    return random.Random(seed).randbytes(size)


def test_same_weights_same_identity_wherever_they_lie(tmp_path: Path) -> None:
    first = checkpoint(tmp_path / "a" / "llama", content(1))
    copy = tmp_path / "elsewhere" / "llama"
    shutil.copytree(first, copy)
    assert identity(first) == identity(first)
    assert weights_fingerprint(first) == weights_fingerprint(copy)
    assert identity(first) == identity(copy)
    assert identity(first).startswith("llama-")
    validate_key(identity(first))


def test_a_changed_byte_in_a_sampled_block_changes_the_identity(tmp_path: Path) -> None:
    data = bytearray(content(1))
    before = identity(checkpoint(tmp_path / "m", bytes(data)))
    data[len(data) - 1] ^= 1  # the last block is always sampled
    assert identity(checkpoint(tmp_path / "m", bytes(data))) != before


def test_a_new_checkpoint_of_the_same_size_over_the_old_changes_the_identity(
    tmp_path: Path,
) -> None:
    root = tmp_path / "m"
    before = identity(checkpoint(root, content(1)))
    after = identity(checkpoint(root, content(2)))  # same path, same file sizes
    assert after != before


def test_tokenizer_and_config_files_are_not_weights(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m", content(1))
    before = weights_fingerprint(root)
    (root / "tokenizer.json").write_text('{"changed": true}')
    assert weights_fingerprint(root) == before


@pytest.mark.parametrize(
    "change",
    [
        {"rope_theta": 500000.0},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {"sliding_window": 1024},
        {"quantization_config": {"quant_method": "fp8"}},
        {"max_position_embeddings": 8192},
    ],
)
def test_a_kv_setting_changes_the_identity(tmp_path: Path, change: dict[str, Any]) -> None:
    root = checkpoint(tmp_path / "m", content(1))
    assert identity(root, {**CONFIG, **change}) != identity(root)


def test_kv_settings_reads_config_objects_and_omits_what_is_unset() -> None:
    class Config:
        rope_theta = 1e6
        rope_scaling = None
        text_config = None

        def __init__(self) -> None:
            self.sliding_window = 512

    assert kv_settings(Config()) == {"rope_theta": 1e6, "sliding_window": 512}
    nested = kv_settings({"text_config": {"rope_theta": 5.0}})
    assert nested == {"text_config": {"rope_theta": 5.0}}
    assert "vocab_size" not in kv_settings(CONFIG)


def test_a_single_weight_file_is_fingerprinted(tmp_path: Path) -> None:
    one = tmp_path / "model.gguf"
    one.write_bytes(content(1))
    before = weights_fingerprint(one)
    one.write_bytes(content(2))
    assert weights_fingerprint(one) != before


def test_a_large_file_is_read_only_where_sampled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = tmp_path / "model.safetensors"
    size = 8 << 30  # sparse: takes no disk space
    with big.open("wb") as f:
        f.truncate(size)
    read: list[int] = []
    real_open = Path.open

    def counting_open(self: Path, *args: Any, **kwargs: Any) -> Any:
        handle = real_open(self, *args, **kwargs)
        if self == big:
            real_read = handle.read

            def read_counted(n: int = -1) -> bytes:
                data: bytes = real_read(n)
                read.append(len(data))
                return data

            handle.read = read_counted
        return handle

    monkeypatch.setattr(Path, "open", counting_open)
    before = weights_fingerprint(big)
    assert sum(read) == SAMPLE_BLOCKS * SAMPLE_BYTES  # 1 MiB of an 8 GiB file
    monkeypatch.undo()
    with big.open("r+b") as f:  # a byte between two sampled blocks is not read
        f.seek(size // (SAMPLE_BLOCKS - 1) // 2)
        f.write(b"\x01")
    assert weights_fingerprint(big) == before
    with big.open("r+b") as f:  # a byte of the eighth sampled block is
        f.seek((size - SAMPLE_BYTES) * 7 // (SAMPLE_BLOCKS - 1) + 100)
        f.write(b"\x01")
    assert weights_fingerprint(big) != before


def test_a_hub_id_without_local_weights_falls_back_to_name_and_revision(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level("WARNING"):
        main = weights_fingerprint("example-org/not-downloaded", "main")
    assert "no weight files found" in caplog.text
    assert weights_fingerprint("example-org/not-downloaded", "v2") != main
    assert weights_fingerprint("example-org/not-downloaded", "main") == main


def test_a_hub_id_in_the_local_cache_is_fingerprinted_by_its_weights(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    snapshot = checkpoint(tmp_path / "snap", content(1))
    import huggingface_hub

    def local(repo_id: str, revision: str | None = None, local_files_only: bool = False) -> str:
        assert local_files_only and repo_id == "org/model" and revision == "r1"
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", local)
    assert weights_fingerprint("org/model", "r1") == weights_fingerprint(snapshot)


def test_identity_names_are_key_safe() -> None:
    for name in ("/models/Qwen/Qwen3-8B/", "..", "", "weird name!..x", "a" * 300):
        ident = model_identity(name, "w", {})
        validate_key(ident)
        assert len(ident) <= 65
