"""AWS secrets never show: not in messages, logs (botocore's DEBUG lines included), repr or stats.

The secret key and session token come from the AWS chain, never from options; the backend masks
them wherever it or its client library prints, including an error message a store echoes back.
An endpoint URL carrying ``user:password@`` is refused, with the password masked.
"""

from __future__ import annotations

import http.server
import logging
from typing import Any

import pytest

from hicache_storage import create_backend
from hicache_storage.backends.s3 import S3Backend, S3Config, provision
from hicache_storage.errors import BackendUnavailableError, ConfigError

from .fakes import Received, error_response, fake_store

TOKEN = "IQoJb3JpZ2luX2VjEOr-session-token-canary-5e1f"
FAST = {"deadline_s": 2.0, "connect_timeout_s": 0.5, "read_timeout_s": 0.5, "max_attempts": 2}


def _texts(error: BaseException | None) -> str:
    """Every message and repr along an exception's chain."""
    seen = []
    while error is not None:
        seen.append(f"{error!s} {error!r}")
        error = error.__cause__ or error.__context__
    return "\n".join(seen)


def test_endpoint_password_refused_and_masked(test_credentials: None) -> None:
    url = "http://kvuser:hunter2-canary-77@127.0.0.1:9000"
    with pytest.raises(ConfigError, match="endpoint_url") as info:
        create_backend("s3", {"bucket": "ok-bucket", "endpoint_url": url})
    assert "hunter2-canary-77" not in _texts(info.value)
    assert "***" in str(info.value)


def test_session_token_never_logged_or_shown(
    s3_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """botocore logs every request's headers at DEBUG, the session token among them."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG)
    shown: list[str] = []
    try:
        backend = create_backend("s3", {**s3_options, **FAST})
    except ConfigError as exc:  # the gateway may refuse a token it never issued
        shown.append(_texts(exc))
        backend = create_backend("s3", {**s3_options, **FAST, "verify_bucket": False})
    with backend:
        backend.set("k1", b"value")
        backend.get("k1")
        backend.batch_get(["k1", "k2"], [bytearray(5), bytearray(5)])
        backend.batch_exists(["k1", "k2"])
        shown += [repr(backend), repr(backend.stats())]
    assert "X-Amz-Security-Token" in caplog.text, "botocore logged no request headers"
    for secret in (TOKEN, provision.TEST_SECRET_KEY):
        assert secret not in caplog.text, "a secret reached the log"
        assert not any(secret in text for text in shown), "a secret reached a message or stats"


def test_secrets_a_store_echoes_are_masked(
    test_credentials: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)

    def echo(handler: http.server.BaseHTTPRequestHandler, request: Received) -> None:
        message = f"denied for secret {provision.TEST_SECRET_KEY} and token {TOKEN}"
        error_response(handler, 403, "AccessDenied", message)

    with fake_store(echo) as store:
        options = {
            "bucket": "fake-bucket",
            "endpoint_url": store.url,
            "region": "us-east-1",
            "addressing_style": "path",
            **FAST,
        }
        with pytest.raises(ConfigError) as opened:
            create_backend("s3", options)
        bare = S3Backend(S3Config(**options, verify_bucket=False))
        try:
            with pytest.raises(BackendUnavailableError, match="access denied") as info:
                bare.get("k1", bytearray(4))
            stats = repr(bare.stats())
        finally:
            bare.close()
        caplog.set_level(logging.DEBUG)
        with create_backend("s3", {**options, "verify_bucket": False}) as layered:
            assert layered.get("k1") is None  # a counted miss, logged by the degrade layer
    assert "***" in str(info.value)
    for secret in (TOKEN, provision.TEST_SECRET_KEY):
        for text in (_texts(opened.value), _texts(info.value), stats, caplog.text):
            assert secret not in text
