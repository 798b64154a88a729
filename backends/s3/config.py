"""Settings of the S3 backend.

Credentials are deliberately not settings: they come from the standard AWS chain (environment
variables, the shared credentials and config files or ``profile``, web identity, container and
instance metadata), so they never sit in a config file, a report or a log line.
"""

from __future__ import annotations

import math
import re
from typing import Literal

import msgspec

__all__ = ["MAX_OBJECT_KEY_BYTES", "HASHED_NAME_BYTES", "S3Config"]

MAX_OBJECT_KEY_BYTES = 1024
"""The longest object key S3 accepts, in UTF-8 bytes."""

HASHED_NAME_BYTES = len("~sha256-") + 64
"""Length of the name a too-long key is stored under (``~sha256-<hex digest>``)."""

_PREFIX = re.compile(r"(?:[A-Za-z0-9_.\-]+/)*")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,253}[a-z0-9]")
_NON_THROTTLING_BACKOFF_S = 0.05
"""botocore's backoff scale for errors that are not throttling (connection refused, 5xx)."""


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if math.isnan(value) or not 0 < value <= 3600:
        raise ValueError(f"{name} must be within (0, 3600] seconds, got {value}")


def _check_count(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be within [{low}, {high}], got {value}")


class S3Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of :class:`~hicache_storage.backends.s3.S3Backend`.

    Attributes
    ----------
    bucket
        The bucket holding the objects.
    prefix
        Namespace inside the bucket: every object is ``<prefix><key>``. Empty, or path segments
        each ending in ``/`` (``"kvcache/llama-70b/"``). ``clear()`` removes only this
        namespace's objects, never those of a deeper or sibling prefix.
    endpoint_url
        ``http(s)://host:port`` of an S3-compatible store; ``None`` for AWS S3 itself.
    region
        Signing region; ``None`` takes it from the AWS chain (``AWS_REGION``, the profile),
        else ``us-east-1``.
    addressing_style
        ``"path"`` (``host/bucket/key``, what most S3-compatible stores want), ``"virtual"``
        (``bucket.host/key``) or ``"auto"`` (botocore chooses).
    profile
        Named profile of the shared AWS config and credentials files; ``None`` uses the default
        chain.
    max_concurrency
        Requests in flight at once for the batch calls (worker threads of the pool); the HTTP
        connection pool holds twice as many, for callers' own single-key calls too.
    connect_timeout_s
        Longest wait for a TCP (and TLS) connection.
    read_timeout_s
        Longest wait for any bytes of a response once connected.
    retry_mode
        botocore retry mode: ``"standard"``, ``"adaptive"`` (adds client-side rate limiting
        after throttling) or ``"legacy"``.
    max_attempts
        Attempts per request, the first included (1 means no retry).
    create_bucket
        Create the bucket when it does not exist; otherwise a missing bucket is a
        :class:`~hicache_storage.errors.ConfigError` when the backend opens.
    verify_bucket
        Check the bucket once when the backend opens (``HeadBucket``), so wrong credentials, a
        missing bucket or an unreachable endpoint fail at once with a clear error instead of
        turning every later call into a counted miss.
    conditional_put
        Write with ``If-None-Match: *`` so the first complete value of a key is kept (a store
        that answers ``501 NotImplemented`` is detected and switched to the fallback). ``False``
        uses the fallback from the start: ``HeadObject``, then ``PutObject`` if absent, for
        stores that ignore the header; racing writers may then replace each other's value, but
        every value is written whole, so readers still see one complete value.
    checksums
        ``"when_supported"``: botocore sends a CRC32 of every value and checks the checksum of
        every object read that has one (a mismatch is an error, never data);
        ``"when_required"``: only where the operation demands it.
    """

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    profile: str | None = None
    max_concurrency: int = 16
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    retry_mode: Literal["standard", "adaptive", "legacy"] = "standard"
    max_attempts: int = 3
    create_bucket: bool = False
    verify_bucket: bool = True
    conditional_put: bool = True
    checksums: Literal["when_supported", "when_required"] = "when_supported"

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or _BUCKET.fullmatch(self.bucket) is None:
            raise ValueError(
                f"bucket must be an S3 bucket name (3-255 of a-z 0-9 . - _), got {self.bucket!r}"
            )
        if not isinstance(self.prefix, str) or _PREFIX.fullmatch(self.prefix) is None:
            raise ValueError(
                f"prefix must be empty or segments of A-Z a-z 0-9 _ . - each ending in '/', "
                f"got {self.prefix!r}"
            )
        if ".." in self.prefix.split("/") or "." in self.prefix.split("/"):
            raise ValueError(f"prefix must not contain '.' or '..' segments, got {self.prefix!r}")
        if len(self.prefix) + HASHED_NAME_BYTES > MAX_OBJECT_KEY_BYTES:
            raise ValueError(
                f"prefix is {len(self.prefix)} bytes; at most "
                f"{MAX_OBJECT_KEY_BYTES - HASHED_NAME_BYTES} leave room for object names"
            )
        if self.endpoint_url is not None and (
            not isinstance(self.endpoint_url, str)
            or not self.endpoint_url.startswith(("http://", "https://"))
        ):
            raise ValueError(
                f"endpoint_url must start with http:// or https://, got {self.endpoint_url!r}"
            )
        for name in ("region", "profile"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or null, got {value!r}")
        _check_count("max_concurrency", self.max_concurrency, 1, 1024)
        _check_count("max_attempts", self.max_attempts, 1, 20)
        _check_seconds("connect_timeout_s", self.connect_timeout_s)
        _check_seconds("read_timeout_s", self.read_timeout_s)
        for name in ("create_bucket", "verify_bucket", "conditional_put"):
            _check_bool(name, getattr(self, name))

    def worst_call_s(self) -> float:
        """Return the longest one request may take when the endpoint is down or stalls.

        Every attempt may wait the connect timeout and then the read timeout; between
        attempts botocore sleeps at most ``0.05 * 2**i`` seconds after a connection error.
        A batch call stops at its first infrastructure error, so it is bounded by about the
        same time.
        """
        attempts = self.max_attempts
        backoff = sum(_NON_THROTTLING_BACKOFF_S * float(1 << i) for i in range(attempts - 1))
        return attempts * (self.connect_timeout_s + self.read_timeout_s) + backoff
