"""Backend URLs (``redis://``, ``s3://``, ``file://``) as BACKEND of ``hicache check`` and bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hicache_storage.cli.main import main as cli
from hicache_storage.cli.options import resolve_backend
from hicache_storage.errors import ConfigError
from hicache_storage.registry import hookimpl, register_plugin, unregister_plugin
from hicache_storage.urls import UrlScheme, is_url, parse_backend_url, url_schemes


@pytest.mark.parametrize(
    ("url", "backend", "options"),
    [
        ("redis://cache:6379/0", "redis", {"url": "redis://cache:6379/0"}),
        ("redis://localhost", "redis", {"url": "redis://localhost"}),
        ("rediss://user:pw@cache:6380/2", "redis", {"url": "rediss://user:pw@cache:6380/2"}),
        ("s3://kv-bucket", "s3", {"bucket": "kv-bucket"}),
        ("s3://kv-bucket/", "s3", {"bucket": "kv-bucket"}),
        ("s3://kv-bucket/llama", "s3", {"bucket": "kv-bucket", "prefix": "llama"}),
        ("s3://kv-bucket/a/b/", "s3", {"bucket": "kv-bucket", "prefix": "a/b/"}),
        ("s3://kv-bucket/a%20b", "s3", {"bucket": "kv-bucket", "prefix": "a b"}),
        ("file:///data/kv", "file", {"root": "/data/kv"}),
        ("file://localhost/data/kv", "file", {"root": "/data/kv"}),
        ("file:///data/my%20kv", "file", {"root": "/data/my kv"}),
        ("FILE:///data/kv", "file", {"root": "/data/kv"}),
    ],
)
def test_url_names_backend_and_options(url: str, backend: str, options: dict[str, Any]) -> None:
    assert is_url(url)
    assert parse_backend_url(url) == (backend, options)


@pytest.mark.parametrize("name", ["file", "memory", "3fs", "example-sqlite", "my_kv.v2"])
def test_backend_names_are_not_urls(name: str) -> None:
    assert not is_url(name)
    assert resolve_backend(name, None) == (name, None)
    assert resolve_backend(name, "@x.json") == (name, "@x.json")


def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_backend_url("gs://user:hunter22@bucket/kv")
    message = str(caught.value)
    assert "no backend claims URL scheme 'gs'" in message
    for scheme in ("file://", "redis://", "rediss://", "s3://"):
        assert scheme in message
    assert "hunter22" not in message


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("s3://", "needs a bucket"),
        ("s3:///prefix", "needs a bucket"),
        ("s3://key:hunter22@bucket/p", "no user, password or port"),
        ("s3://bucket:9000/p", "no user, password or port"),
        ("s3://bucket/p?region=x", "no ?query"),
        ("file://", "needs a path"),
        ("file://data/kv", "file:///data/kv for /data/kv"),
        ("file:///data/kv#frag", "no ?query"),
    ],
)
def test_malformed_url_is_a_config_error(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match="backend URL") as caught:
        parse_backend_url(url)
    assert says in str(caught.value)
    assert "hunter22" not in str(caught.value)


def test_config_keys_win_over_the_url() -> None:
    name, source = resolve_backend("s3://bucket/from-url", '{"prefix": "from-config", "x": 1}')
    assert name == "s3"
    assert source is not None
    assert json.loads(source) == {"bucket": "bucket", "prefix": "from-config", "x": 1}
    name, source = resolve_backend("file:///from/url", None)
    assert (name, json.loads(source or "")) == ("file", {"root": "/from/url"})


def test_config_file_merges_with_the_url(tmp_path: Path) -> None:
    (tmp_path / "redis.yaml").write_text("prefix: ci\nurl: redis://other:6379/1\n")
    name, source = resolve_backend("redis://cache:6379/0", f"@{tmp_path / 'redis.yaml'}")
    assert name == "redis"
    assert json.loads(source or "") == {"url": "redis://other:6379/1", "prefix": "ci"}


def _dirkv_options(url: str) -> dict[str, Any]:
    if url.endswith("/bad"):
        raise ValueError("dirkv://PATH does not take /bad")
    return {"root": url.removeprefix("dirkv://")}


class _DirKvSchemes:
    @hookimpl
    def hicache_url_schemes(self) -> list[UrlScheme]:
        return [
            UrlScheme(scheme="dirkv", backend="dirkv", options=_dirkv_options),
            # Taken by a built-in backend: not replaced.
            UrlScheme(scheme="s3", backend="dirkv", options=_dirkv_options),
        ]


@pytest.fixture
def dirkv_plugin() -> Iterator[None]:
    plugin = _DirKvSchemes()
    register_plugin(plugin, name="test-dirkv-schemes")
    try:
        yield
    finally:
        unregister_plugin(plugin)


@pytest.mark.usefixtures("dirkv_plugin")
def test_plugin_claims_a_scheme_through_the_hook() -> None:
    assert parse_backend_url("dirkv:///srv/kv") == ("dirkv", {"root": "/srv/kv"})
    assert url_schemes()["s3"].backend == "s3"
    assert parse_backend_url("s3://bucket")[0] == "s3"
    with pytest.raises(ConfigError, match="does not take /bad"):
        parse_backend_url("dirkv:///bad")


def test_plugin_schemes_go_with_the_plugin() -> None:
    plugin = _DirKvSchemes()
    register_plugin(plugin, name="test-dirkv-schemes")
    try:
        assert "dirkv" in url_schemes()
    finally:
        unregister_plugin(plugin)
    assert "dirkv" not in url_schemes()
    with pytest.raises(ConfigError, match="no backend claims URL scheme 'dirkv'"):
        parse_backend_url("dirkv:///srv/kv")


def test_cli_unknown_scheme_exits_2() -> None:
    result = CliRunner().invoke(cli, ["check", "gopher://host/kv"])
    assert result.exit_code == 2, result.output
    assert "no backend claims URL scheme 'gopher'" in result.output
    assert "s3://" in result.output


def test_cli_bench_resolves_a_url_too() -> None:
    result = CliRunner().invoke(cli, ["bench", "file://somehost/kv"])
    assert result.exit_code == 2, result.output
    assert "file:///somehost/kv" in result.output


def test_check_runs_the_backend_a_url_names(tmp_path: Path) -> None:
    """One cheap check of ``file:///...`` merged with a YAML --config, read back from the report."""
    root = tmp_path / "kv root"
    report = tmp_path / "report"
    config = tmp_path / "extra.yaml"
    config.write_text("fsync: true\nmetadata_cache: false\n")
    env = {
        **os.environ,
        "COLUMNS": "250",
        "PYTEST_ADDOPTS": "-k 'roundtrip_get_matches_sha256 and 1B'",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from hicache_storage.cli import main; main()",
            "check",
            f"file://{str(root).replace(' ', '%20')}",
            "--config",
            f"@{config}",
            "--report",
            str(report),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "PASS file" in result.stdout
    data = json.loads((report / "report.json").read_text())
    assert data["backend"] == "file"
    assert data["options"]["root"] == str(root)
    assert data["options"]["fsync"] is True
    assert data["options"]["metadata_cache"] is False
    assert data["totals"].get("passed", 0) >= 1


def test_create_backend_builds_the_backend_a_url_names(tmp_path: Path) -> None:
    from hicache_storage import create_backend

    root = tmp_path / "kv"
    with create_backend(f"file://{root}", {"fsync": True}) as backend:
        assert backend.set("k", b"value") is True
        got = backend.get("k")
        assert got is not None and bytes(got) == b"value"
    assert any(root.rglob("*")), "the URL's path is the backend's root"
    with pytest.raises(ConfigError, match="no backend claims URL scheme 'gopher'"):
        create_backend("gopher://host/kv")


@pytest.mark.parametrize("command", ["sglang-args", "vllm-args"])
def test_launch_args_take_a_url(command: str) -> None:
    result = CliRunner().invoke(
        cli, [command, "redis://127.0.0.1:6379/0", "--config", '{"prefix": "qwen"}', "--json"]
    )
    assert result.exit_code == 0, result.output
    text = json.loads(result.stdout)
    tier = text if command == "sglang-args" else text["kv_connector_extra_config"]
    assert '"backend": "redis"' in json.dumps(tier)
    assert '"url": "redis://127.0.0.1:6379/0"' in json.dumps(tier)
    assert '"prefix": "qwen"' in json.dumps(tier)
