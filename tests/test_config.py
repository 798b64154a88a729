"""Config sources, environment overrides and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_storage import (
    ConfigError,
    Deployment,
    HiCacheConfig,
    create_backend,
    load_config,
    open_backend,
)


def test_sources_agree(tmp_path: Path) -> None:
    data = {"backend": "memory", "deployment": {"tp_rank": 1, "tp_size": 2, "model_name": "m"}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    expected = load_config(data, env={})
    assert load_config(json.dumps(data), env={}) == expected
    assert load_config(f"@{path}", env={}) == expected
    assert load_config(path, env={}) == expected
    assert expected.deployment.tp_rank == 1
    assert isinstance(expected, HiCacheConfig)


def test_environment_overrides(tmp_path: Path) -> None:
    env = {
        "HICACHE_BACKEND": "file",
        "HICACHE_OPTIONS__ROOT": str(tmp_path),
        "HICACHE_OPTIONS__MAX_BYTES": "1048576",
        "HICACHE_DEPLOYMENT__TP_SIZE": "4",
        "HICACHE_DEPLOYMENT__TP_RANK": "3",
        "HICACHE_DEPLOYMENT__IS_MLA": "true",
        "HICACHE_LAYERS__FAULTS__DEFAULT__FAILURE_RATE": "0.25",
        "UNRELATED": "x",
    }
    config = load_config({"backend": "memory"}, env=env)
    assert config.backend == "file"
    assert config.options == {"root": str(tmp_path), "max_bytes": 1048576}
    assert config.deployment.tp_rank == 3 and config.deployment.is_mla
    assert config.layers.faults is not None
    assert config.layers.faults.default.failure_rate == 0.25


def test_config_from_env_variable(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"backend": "memory"}')
    assert load_config(env={"HICACHE_CONFIG": f"@{path}"}).backend == "memory"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ('{"backend": "file",', "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({"backnd": "file"}, "backnd"),
        ({"deployment": {"tp_rank": "zero"}}, "tp_rank"),
        ({"deployment": {"tp_rank": 2, "tp_size": 2}}, "tp_rank"),
        ({"deployment": {"page_size": 0}}, "page_size"),
        ({"layers": {"faults": {"default": {"failure_rate": 1.5}}}}, "failure_rate"),
        ({"layers": {"faults": {"ops": {"gett": {"failure_rate": 0.5}}}}}, "gett"),
        ("@/nonexistent/hicache.json", "cannot read config file"),
        (42, "mapping"),
    ],
)
def test_config_errors_are_clear(source: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(source, env={})


def test_backend_options_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rooot"):
        create_backend("file", {"rooot": str(tmp_path)})
    with pytest.raises(ConfigError, match="max_bytes"):
        create_backend("file", {"root": str(tmp_path), "max_bytes": "lots"})
    with pytest.raises(ConfigError, match="root"):
        create_backend("file", {})
    with pytest.raises(ConfigError, match="unknown_option"):
        create_backend("memory", '{"unknown_option": 1}')


def test_open_backend_from_whole_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_OPTIONS__ROOT", str(tmp_path))
    with open_backend({"backend": "file", "deployment": {"model_name": "m"}}) as backend:
        assert backend.set("k", b"v")
    assert any(p.is_file() for p in tmp_path.rglob("k"))


def test_deployment_key_scheme() -> None:
    scheme = Deployment(model_name="org/model", tp_rank=1, tp_size=2).rank_suffix()
    assert scheme.key("a" * 64).endswith("_1_2")
    assert "/" not in scheme.key("a" * 64)


def test_reserved_environment_names_are_not_fields() -> None:
    config = load_config(
        {"backend": "memory"},
        env={"HICACHE_SERVICES": "/tmp/a.json:/tmp/b.json", "HICACHE_LAYERS__METRICS": "false"},
    )
    assert config.backend == "memory" and config.layers.metrics is False


BAD_NUMBERS = [float("inf"), float("-inf"), float("nan"), 1e300, -1.0, True]


@pytest.mark.parametrize(
    ("name", "options", "field"),
    [
        ("file", {"metadata_ttl_s": None}, "metadata_ttl_s"),
        ("file", {"stale_temp_s": None}, "stale_temp_s"),
        ("file", {"max_bytes": None}, "max_bytes"),
        ("3fs", {"timeout_s": None}, "timeout_s"),
        ("3fs", {"file_size": None}, "file_size"),
        ("3fs", {"io_threads": None}, "io_threads"),
    ],
)
@pytest.mark.parametrize("bad", BAD_NUMBERS, ids=str)
def test_numeric_options_refuse_inf_nan_and_huge(
    tmp_path: Path, name: str, options: dict[str, object], field: str, bad: float
) -> None:
    """Issue 14 item 7: every numeric option is validated when the config is read."""
    root = {"root": str(tmp_path)} if name == "file" else {"path": str(tmp_path)}
    with pytest.raises(ConfigError, match=field):
        create_backend(name, {**root, field: bad})


@pytest.mark.parametrize("bad", BAD_NUMBERS, ids=str)
def test_fault_delay_refuses_inf_nan_and_huge(bad: float) -> None:
    with pytest.raises(ConfigError, match="delay_s"):
        load_config({"layers": {"faults": {"default": {"delay_s": bad}}}}, env={})


@pytest.mark.parametrize("url", ["http://h:99999", "http://h:0", "http://:80", "ftp://h:1"])
def test_metadata_url_is_checked_at_config_time(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError, match="metadata_url"):
        create_backend("3fs", {"path": str(tmp_path), "metadata_url": url})


def test_config_errors_mask_secrets(tmp_path: Path) -> None:
    """Issue 14 item 14: a password or token in a bad config is never echoed."""
    source = {
        "path": str(tmp_path),
        "metadata_url": "http://user:pa55word-secret@h:99999",
        "metadata_token": "tok-secret-1234",
    }
    with pytest.raises(ConfigError) as caught:
        create_backend("3fs", source)
    text = str(caught.value) + repr(caught.value.__cause__) + repr(caught.value.__context__)
    assert "pa55word-secret" not in text and "metadata_url" in text
