"""S3 options are checked when the config is made: numbers, the endpoint URL, the prefix.

Every numeric option refuses bool, NaN, infinity and values past its bound, and the endpoint
must be ``http(s)://host[:port]`` with a port in 1..65535, so nothing reaches botocore or a
socket to fail later with a raw ``OverflowError``/``ValueError``. Runs without a server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest

from hicache_storage import create_backend
from hicache_storage.backends.s3 import S3Config, provision
from hicache_storage.errors import ConfigError

BASE = {"bucket": "ok-bucket", "verify_bucket": False}


@pytest.fixture(autouse=True)
def _credentials(test_credentials: None) -> None:
    """Throwaway credentials; no instance metadata probe."""


NUMERIC_BAD: list[tuple[str, Any]] = [
    (name, value)
    for name in ("deadline_s", "connect_timeout_s", "read_timeout_s")
    for value in (float("inf"), float("-inf"), float("nan"), 0, -1, 1e300, True, "5", None)
] + [
    (name, value)
    for name in ("max_concurrency", "max_attempts")
    for value in (0, -1, 2**70, 1.5, float("inf"), float("nan"), True, "4", None)
]


@pytest.mark.parametrize(("field", "value"), NUMERIC_BAD)
def test_numeric_option_refused_at_config_time(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        create_backend("s3", {**BASE, field: value})


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:99999",
        "http://127.0.0.1:65536",
        "http://127.0.0.1:0",
        "http://127.0.0.1:-1",
        "http://127.0.0.1:port",
        "http://127.0.0.1:",
        "http://:9000",
        "http://",
        "ftp://127.0.0.1:9000",
        "127.0.0.1:9000",
        "http://127.0.0.1:9000 ",
        "http://a b:9000",
        "http://user@127.0.0.1:9000",
    ],
)
def test_bad_endpoint_url_refused_at_config_time(url: str) -> None:
    with pytest.raises(ConfigError, match="endpoint_url"):
        create_backend("s3", {**BASE, "endpoint_url": url})


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9000",
        "http://127.0.0.1:65535",
        "http://127.0.0.1:1",
        "https://s3.us-west-2.amazonaws.com",
        "http://[::1]:8333",
        "http://seaweed.local:8333/",
    ],
)
def test_good_endpoint_url_accepted(url: str) -> None:
    assert S3Config(bucket="ok-bucket", endpoint_url=url).endpoint_url == url


def test_deadline_defaults_and_bounds_each_attempt() -> None:
    config = S3Config(bucket="ok-bucket")
    assert config.deadline_s == 10.0
    assert config.worst_call_s() <= config.deadline_s
    short = S3Config(bucket="ok-bucket", deadline_s=0.5, connect_timeout_s=2, read_timeout_s=5)
    assert (short.attempt_connect_timeout_s, short.attempt_read_timeout_s) == (0.5, 0.5)
    assert short.worst_call_s() == 0.5


@pytest.mark.parametrize(
    ("given", "stored"),
    [("tok", "tok/"), ("tok/", "tok/"), ("a/b", "a/b/"), ("a/b/", "a/b/"), ("", "")],
)
def test_prefix_without_trailing_slash_is_completed(given: str, stored: str) -> None:
    assert S3Config(bucket="ok-bucket", prefix=given).prefix == stored
    with create_backend("s3", {**BASE, "prefix": given}) as backend:
        assert backend.stats()["prefix"] == stored


@pytest.mark.parametrize("prefix", ["/tok", "tok//", "a//b", "a/../b", "./a", "bad prefix", "é"])
def test_bad_prefix_refused(prefix: str) -> None:
    with pytest.raises(ConfigError, match="prefix"):
        create_backend("s3", {**BASE, "prefix": prefix})


def test_a_full_disk_is_named_when_seaweedfs_takes_no_write(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A volume server on a disk with under 1 % free takes no write: the error says so."""
    total = 100 * 2**30
    monkeypatch.setattr(provision.shutil, "disk_usage", lambda _: _Usage(total, 0.5 * 2**30))
    note = provision.low_disk(tmp_path)
    assert "only 0.5 GiB of 100 GiB free" in note and str(tmp_path) in note
    monkeypatch.setattr(provision.shutil, "disk_usage", lambda _: _Usage(total, 2 * 2**30))
    assert provision.low_disk(tmp_path) == ""


class _Usage(NamedTuple):
    total: float
    free: float
