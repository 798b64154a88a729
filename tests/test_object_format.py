"""Object formats: tags that keys carry, and the manifest of the file backend's SGLang names."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from hicache_storage import create_backend
from hicache_storage.config import Deployment
from hicache_storage.errors import ConfigError
from hicache_storage.hostpool import MHAHostPool, MLAHostPool
from hicache_storage.keys import ObjectFormat, RankSuffixScheme
from hicache_storage.kit import MANIFEST_PREFIX, FormatManifest

BASE: dict[str, Any] = {
    "model": "org/model",
    "dtype": "bfloat16",
    "attention": "mha",
    "layers": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "page_size": 64,
    "layout": "layer_first",
}
HASH = hashlib.sha256(b"page").hexdigest()


def fmt(**changes: Any) -> ObjectFormat:
    return ObjectFormat(**{**BASE, **changes})


@pytest.mark.parametrize(
    "changes",
    [
        {"model": "org/other"},
        {"dtype": "float16"},
        {"layers": 16},
        {"kv_heads": 4, "head_dim": 256},
        {"page_size": 32},
        {"layout": "page_first"},
        {"attention": "mla", "kv_heads": 0, "head_dim": 576},
    ],
)
def test_every_fact_changes_the_tag(changes: dict[str, Any]) -> None:
    assert fmt(**changes).tag != fmt().tag
    assert len(fmt().tag) == 16 and int(fmt().tag, 16) >= 0


def test_the_tag_is_stable() -> None:
    assert fmt().tag == fmt().tag
    decoded = msgspec.json.decode(msgspec.json.encode(fmt()), type=ObjectFormat)
    assert decoded.tag == fmt().tag


@pytest.mark.parametrize(
    "changes",
    [
        {"layers": 0},
        {"head_dim": True},
        {"page_size": -1},
        {"attention": "mla"},
        {"attention": "mha", "kv_heads": 0},
        {"kv_heads": 1.5},
    ],
)
def test_impossible_formats_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        fmt(**changes)


def test_of_pool_reads_mha_and_mla_pools() -> None:
    mha = MHAHostPool(16, 4, 3, 2, 8, dtype=torch.float16, layout="page_first", pin_memory=False)
    got = ObjectFormat.of_pool(mha, model="m")
    assert (got.attention, got.layers, got.kv_heads, got.head_dim) == ("mha", 3, 2, 8)
    assert (got.dtype, got.page_size, got.layout) == ("float16", 4, "page_first")
    mla = MLAHostPool(16, 4, 3, 24, dtype=torch.uint8, pin_memory=False)
    latent = ObjectFormat.of_pool(mla, model="m", dtype="float8_e4m3fn")
    assert (latent.attention, latent.kv_heads, latent.head_dim) == ("mla", 0, 24)
    assert latent.dtype == "float8_e4m3fn"


def test_tagged_rank_suffix_keys_and_ownership() -> None:
    tag = fmt().tag
    tagged = RankSuffixScheme(model_name="org/model", tp_rank=1, tp_size=2, object_format=tag)
    plain = RankSuffixScheme(model_name="org/model", tp_rank=1, tp_size=2)
    assert tagged.key(HASH) == f"{HASH}_org-model_1_2_f{tag}"
    assert plain.key(HASH) == f"{HASH}_org-model_1_2"
    other_tag = fmt(layout="page_first").tag
    for scheme in (tagged, plain):
        assert scheme.owns(f"{HASH}_org-model_1_2")
        assert scheme.owns(f"{HASH}_org-model_1_2_f{other_tag}"), "a rank owns every format"
        assert not scheme.owns(f"{HASH}_org-model_0_2_f{tag}")
        assert not scheme.owns(f"{HASH}_org-model_1_2_fxyz")
        assert not scheme.owns(f"{HASH}_org-model_1_2_f{tag}0")


@pytest.mark.parametrize("bad", ["xyz", "F" * 16, "0" * 15, 3])
def test_a_malformed_format_tag_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match="object_format"):
        RankSuffixScheme(object_format=bad)


def test_manifest_first_format_wins_until_its_objects_are_gone(tmp_path: Path) -> None:
    manifest = FormatManifest(str(tmp_path))
    manifest.claim("_m_0_1", fmt(), lambda: True)
    manifest.claim("_m_0_1", fmt(), lambda: True)
    with pytest.raises(ConfigError, match="page_first layout"):
        manifest.claim("_m_0_1", fmt(layout="page_first"), lambda: True)
    manifest.claim("_other_0_1", fmt(layout="page_first"), lambda: True)
    manifest.claim("_m_0_1", fmt(layout="page_first"), lambda: False)
    with pytest.raises(ConfigError, match="layer_first layout"):
        manifest.claim("_m_0_1", fmt(), lambda: True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{MANIFEST_PREFIX}_m_0_1.json", f"{MANIFEST_PREFIX}_other_0_1.json"]


def test_an_unreadable_manifest_is_refused(tmp_path: Path) -> None:
    (tmp_path / f"{MANIFEST_PREFIX}_m_0_1.json").write_text('{"model": 3}')
    with pytest.raises(ConfigError, match="not an object format manifest"):
        FormatManifest(str(tmp_path)).claim("_m_0_1", fmt(), lambda: True)


def _compat(root: Path, model: str = "org/model") -> Any:
    options = {"root": str(root), "naming": "sglang_file_compat"}
    return create_backend("file", options, deployment=Deployment(model_name=model))


def _pool(layout: str, dtype: torch.dtype = torch.float16) -> MHAHostPool:
    return MHAHostPool(16, 4, 2, 2, 8, dtype=dtype, layout=layout, pin_memory=False)


def test_sglang_names_refuse_another_format_over_stored_objects(tmp_path: Path) -> None:
    writer = _compat(tmp_path)
    assert writer.capabilities.foreign_names
    pool = _pool("layer_first")
    writer.register_host_pool(pool)
    key = f"{HASH}_org-model_0_1"
    assert writer.batch_set_v1([key], list(range(4))) == [True]
    writer.close()
    for other in (_pool("page_first"), _pool("layer_first", torch.bfloat16)):
        with _compat(tmp_path) as reader, pytest.raises(ConfigError, match="holds objects"):
            reader.register_host_pool(other)
    with _compat(tmp_path, model="org/another") as another:
        another.register_host_pool(_pool("page_first"))  # another model: its own suffix
    with _compat(tmp_path) as same:
        same.register_host_pool(_pool("layer_first"))
        assert same.batch_get_v1([key], list(range(4, 8))) == [True]
        assert same.delete(key)
        same.register_host_pool(_pool("page_first"))  # no object left: the format moves on


def test_hicache_naming_needs_no_manifest(tmp_path: Path) -> None:
    with create_backend("file", {"root": str(tmp_path)}) as backend:
        assert not backend.capabilities.foreign_names
        backend.register_host_pool(_pool("layer_first"))
        backend.register_host_pool(_pool("page_first"))
    assert not any(p.name.startswith(MANIFEST_PREFIX) for p in tmp_path.rglob("*"))
