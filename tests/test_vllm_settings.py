"""The vLLM tier's settings and chunk keys, checked without vLLM (its own tests need it)."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.vllm.config import TIER_KEYS, tier_settings
from hicache_storage.integrations.vllm.namespace import ChunkFormat, chunk_key, hash_setting
from hicache_storage.registry import registered_backends

FORMAT = ChunkFormat(
    model="m",
    model_identity="m-0123456789abcdef",
    dtype="bfloat16",
    kv_cache_dtype="auto",
    tokens_per_hash=32,
    blocks_per_chunk=1,
    groups=((32, ("layers.0", "layers.1")),),
    worker_kv_bytes_per_block=65536,
    row_bytes=65536,
    world_size=1,
    tp_size=1,
    pp_size=1,
    pcp_size=1,
    dcp_size=1,
    replicated_layout=False,
    canonical_layout=False,
    kv_cache_layout="None",
    device="cpu",
    attention_layout="amx",
    hash_algo="sha256",
    hash_seed="default",
)


def test_settings_read_inline_keys_over_a_config() -> None:
    source = json.dumps(
        {"backend": "file", "options": {"root": "/a"}, "layers": {"metrics": False}}
    )
    settings = tier_settings(
        {"config": source, "options": {"root": "/b"}, "read_threads": 8, "locality": "REMOTE"}
    )
    assert settings.hicache.backend == "file"
    assert settings.hicache.options == {"root": "/b"}
    assert settings.hicache.layers.metrics is False
    assert (settings.read_threads, settings.write_threads, settings.locality) == (8, 2, "REMOTE")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"backend": "memory", "colour": 1}, "unknown key(s) ['colour']"),
        ({"backend": "memory", "deployment": {}}, "takes no 'deployment'"),
        ({"config": {"backend": "memory", "deployment": {"tp_size": 2}}}, "holds a 'deployment'"),
        ({"backend": "memory", "read_threads": 0}, "read_threads"),
        ({"backend": "memory", "write_threads": True}, "write_threads"),
        ({"backend": "memory", "locality": "MARS"}, "locality"),
        ({"backend": 3}, "backend"),
    ],
)
def test_bad_entries_are_refused(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        tier_settings(entry)


def test_environment_deployment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_DEPLOYMENT__TP_RANK", "1")
    monkeypatch.setenv("HICACHE_DEPLOYMENT__TP_SIZE", "2")
    with pytest.raises(ConfigError, match="HICACHE_DEPLOYMENT"):
        tier_settings({"backend": "memory"})


@pytest.mark.parametrize(
    "entry",
    [
        {"options": {"url": "redis://127.0.0.1:6379/0"}},
        {"config": {"options": {"root": "/tmp/kv"}}},
        {},
    ],
    ids=["inline-options", "config-without-backend", "empty"],
)
def test_an_entry_without_backend_names_the_missing_key(
    entry: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the file backend's complaint about ``url``: the key that is missing, and the choices."""
    monkeypatch.delenv("HICACHE_BACKEND", raising=False)
    with pytest.raises(ConfigError) as caught:
        tier_settings(entry)
    message = str(caught.value)
    assert "names no 'backend'; it is required" in message
    assert all(name in message for name in registered_backends())
    assert "url" not in message


def test_the_backend_may_come_from_the_config_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HICACHE_BACKEND", raising=False)
    assert tier_settings({"config": {"backend": "memory"}}).hicache.backend == "memory"
    monkeypatch.setenv("HICACHE_BACKEND", "memory")
    assert tier_settings({}).hicache.backend == "memory"


def test_keys_cover_every_documented_setting() -> None:
    assert {"backend", "options", "layers", "config"} <= TIER_KEYS


def test_every_fact_changes_the_digest() -> None:
    digests = {FORMAT.digest}
    for field in FORMAT.__struct_fields__:
        value = getattr(FORMAT, field)
        if isinstance(value, bool):
            changed = not value
        elif isinstance(value, int):
            changed = value + 1
        elif isinstance(value, str):
            changed = value + "x"
        else:
            changed = ((64, ("layers.0",)),)
        digests.add(msgspec.structs.replace(FORMAT, **{field: changed}).digest)
    assert len(digests) == len(FORMAT.__struct_fields__) + 1
    assert (
        FORMAT.digest
        == ChunkFormat(**{f: getattr(FORMAT, f) for f in FORMAT.__struct_fields__}).digest
    )


def test_chunk_key_is_a_valid_store_key() -> None:
    from hicache_storage.keys import validate_key

    key = chunk_key(FORMAT.digest, bytes(range(32)) + (0).to_bytes(4, "big"))
    validate_key(key)
    assert key.startswith(f"vllm-{FORMAT.digest}-") and key.endswith("00000000")


def test_hash_settings() -> None:
    assert hash_setting("sha256", {}) == "default"
    assert hash_setting("xxhash", {"PYTHONHASHSEED": "7"}) == hash_setting(
        "sha256", {"PYTHONHASHSEED": "7"}
    )
    assert hash_setting("sha256", {"PYTHONHASHSEED": "7"}) != hash_setting(
        "sha256", {"PYTHONHASHSEED": "8"}
    )
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
            hash_setting(algo, {})
