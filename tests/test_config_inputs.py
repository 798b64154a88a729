"""URL passwords masked as the clients parse them; config input that is not plain JSON."""

from __future__ import annotations

import json
import socket
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hicache_storage import ConfigError, create_backend, load_config
from hicache_storage.backends.redis.config import RedisConfig, parse_url
from hicache_storage.cli import main
from hicache_storage.config import MAX_DEPTH, env_overrides, read_source
from hicache_storage.conformance.report import CheckResult, Report, redacted
from hicache_storage.redact import redact_options, redact_text, redact_url, secrets_in

# -- URL passwords: exactly what urllib.parse.urlsplit (redis-py, fsspec, yarl) reads ------------

PASSWORDS = ["s3@cr3t", "s3@cr@3t", "s3:cr@3t", "s3 cr3t", "s3\tcr3t", "@s3cr3t@"]


@pytest.mark.parametrize("password", PASSWORDS)
def test_redact_url_masks_the_password_the_client_reads(password: str) -> None:
    url = f"redis://user:{password}@127.0.0.1:6379/0"
    assert redact_url(url) == "redis://user:***@127.0.0.1:6379/0"
    client = urllib.parse.urlsplit(url).password
    assert client is not None and client in secrets_in({"url": url})


def test_redact_url_keeps_what_no_client_reads_as_a_password() -> None:
    for url in ("s3://bucket/path@2024/x", "redis://host:6379/0", "http://h/x?a=b:c@d"):
        assert redact_url(url) == url


def test_a_url_inside_a_message_is_masked_up_to_its_last_at() -> None:
    text = "cannot reach redis://u:s3@cr3t@h:1: refused; mail ops@example.com"
    assert redact_text(text) == "cannot reach redis://u:***@h:1: refused; mail ops@example.com"


def test_redis_password_with_at_is_masked_in_config_repr_and_endpoint() -> None:
    url = "redis://user:s3@cr@3t@127.0.0.1:6379/0"
    config = RedisConfig(url=url)
    assert parse_url(url).password == "s3@cr@3t"  # redis-py reads the same
    shown = f"{config!r} {config.endpoints()!r} {redact_options({'url': url})!r}"
    assert "redis://user:***@127.0.0.1:6379/0" in shown
    assert "s3" not in shown and "cr" not in shown and "3t" not in shown
    assert "s3@cr@3t" in config.secrets()


def test_redis_password_with_at_is_masked_in_a_report() -> None:
    url = "redis://user:s3@cr@3t@127.0.0.1:6379/0"
    report = Report(
        backend="redis",
        version="0",
        options={"url": url},
        capabilities_error=f"cannot reach {url}: refused",
        checks=[CheckResult(id="C::t", outcome="failed", message=f"url={url!r} password=s3@cr@3t")],
    )
    shown = json.dumps(
        {
            "options": redacted(report).options,
            "error": redacted(report).capabilities_error,
            "message": redacted(report).checks[0].message,
        }
    )
    assert "s3" not in shown and "cr@" not in shown and "3t" not in shown


def test_check_of_an_unreachable_redis_masks_a_password_with_at() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = json.dumps({"url": f"redis://u:s3@cr@3t@127.0.0.1:{port}/0", "deadline_s": 1})
    result = CliRunner().invoke(main, ["check", "redis", "--config", config])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: cannot open the redis backend")
    assert "s3" not in line and "cr@" not in line and "3t" not in line


# -- config input: other encodings, deep nesting, huge integers ----------------------------------

OPTIONS = {"root": "/tmp/hicache-issue22", "max_bytes": 1024}


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_a_config_file_in_utf16_or_utf32_reads(tmp_path: Path, encoding: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(json.dumps({"backend": "file", "options": OPTIONS}).encode(encoding))
    assert read_source(f"@{path}")["options"] == OPTIONS
    assert load_config(f"@{path}", env={}).options == OPTIONS
    assert load_config(env={"HICACHE_CONFIG": f"@{path}"}).options == OPTIONS


def test_a_config_file_in_another_encoding_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes('{"root": "/tmp/caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not utf-8 text .* save it as UTF-8"):
        read_source(f"@{path}")
    with pytest.raises(ConfigError, match="save it as UTF-8"):
        create_backend("file", f"@{path}")


def _nested(depth: int) -> dict[str, Any]:
    data: dict[str, Any] = {}
    node = data
    for _ in range(depth):
        node["x"] = {}
        node = node["x"]
    return data


DEEP_JSON = '{"options": ' + "[" * 100_000 + "]" * 100_000 + "}"
MIDDLING_JSON = '{"options": {"x": ' + "[" * 500 + "]" * 500 + "}}"
HUGE_INT_JSON = '{"options": {"x": ' + "9" * 5000 + "}}"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (DEEP_JSON, "nested deeper"),
        (MIDDLING_JSON, "nested deeper"),
        (HUGE_INT_JSON, "integer of more than"),
        ({"options": _nested(100_000)}, "nested deeper"),
        ({"options": {"x": 10**5000}}, "integer of"),
        ({"options": {"x": 2**64}}, "integer of 65 bits"),
    ],
    ids=["deep-json", "middling-json", "huge-int-json", "deep-mapping", "huge-int", "wide-int"],
)
def test_deep_nesting_and_huge_integers_are_config_errors(source: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        read_source(source)
    with pytest.raises(ConfigError, match=message):
        load_config(source, env={})
    options = source["options"] if isinstance(source, dict) else source.split(": ", 1)[1][:-1]
    with pytest.raises(ConfigError, match=message):
        create_backend("memory", options)


def test_nesting_up_to_the_bound_is_accepted() -> None:
    data = {"options": _nested(MAX_DEPTH - 2)}
    assert read_source(data) == data


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("9" * 5000, "holds an integer of more than"),
        ("[" * 100_000 + "]" * 100_000, "is nested deeper"),
    ],
)
def test_an_environment_variable_out_of_bounds_is_a_config_error(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"HICACHE_OPTIONS__X {message}"):
        env_overrides({"HICACHE_OPTIONS__X": value})
    with pytest.raises(ConfigError, match=message):
        load_config(env={"HICACHE_BACKEND": "memory", "HICACHE_OPTIONS__X": value})


def test_a_config_path_with_a_nul_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_source("@/tmp/a\x00b")


def test_the_cli_reads_a_utf16_config_file(tmp_path: Path) -> None:
    path = tmp_path / "options.json"
    path.write_bytes(json.dumps({"root": str(tmp_path / "kv")}).encode("utf-16"))
    small = ["--page-size", "64KiB", "--batch-size", "4", "--batches", "2", "--repeat", "1"]
    result = CliRunner().invoke(main, ["bench", "file", "--config", f"@{path}", *small])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"root": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper"),
        ('{"root": ' + "9" * 5000 + "}", "integer of more than"),
    ],
    ids=["deep", "huge-int"],
)
def test_the_cli_refuses_bad_config_input_in_one_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "options.json"
    path.write_text(text)
    for source in (f"@{path}", text):
        result = CliRunner().invoke(main, ["check", "file", "--config", source])
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.splitlines()
        assert line.startswith("error: ") and message in line
