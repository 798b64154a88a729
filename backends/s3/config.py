"""Settings of the S3 backend.

Credentials are deliberately not settings: they come from the standard AWS chain (environment
variables, the shared credentials and config files or ``profile``, web identity, container and
instance metadata), so they never sit in a config file, a report or a log line.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Literal

import msgspec

from hicache_storage.capabilities import Capabilities
from hicache_storage.kit.options import check_count, check_port, check_seconds
from hicache_storage.redact import redact_url

__all__ = [
    "HASHED_NAME_BYTES",
    "MAX_OBJECT_KEY_BYTES",
    "MAX_PUT_BYTES",
    "S3Config",
    "capabilities",
]

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


def _check_endpoint(url: object) -> None:
    """Refuse an endpoint that is not ``http(s)://host[:port][/path]`` with a port in 1..65535.

    The URL must not carry ``user:password@``: S3 credentials come from the AWS chain, and a
    password there would be echoed wherever the endpoint is named (the message masks it).
    """
    if not isinstance(url, str):
        raise TypeError(f"endpoint_url must be a string or null, got {type(url).__name__}")
    shown = redact_url(url)
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(
            f"endpoint_url must be http(s)://host[:port] with a port in 1..65535, got {shown!r}"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint_url must be http(s)://host[:port], got {shown!r}")
    if url != url.strip() or any(c.isspace() for c in url):
        raise ValueError(f"endpoint_url must not contain whitespace, got {shown!r}")
    if "@" in parts.netloc:
        raise ValueError(
            f"endpoint_url must not carry user or password (S3 credentials come from the AWS "
            f"chain), got {shown!r}"
        )
    if port is not None or parts.netloc.endswith(":"):
        check_port("endpoint_url port", port)


class S3Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of :class:`~hicache_storage.backends.s3.S3Backend`.

    Attributes
    ----------
    bucket
        The bucket holding the objects.
    prefix
        Namespace inside the bucket: every object is ``<prefix><key>``. Empty, or path segments
        separated by ``/`` (``"kvcache/llama-70b"``); a ``/`` is added at the end when missing
        (``"tok"`` is the namespace ``"tok/"``), so the prefix always ends in a character no key
        contains and ``tok`` and ``tokx`` never share an object. ``clear()`` removes only this
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
        Requests in flight at once (worker threads of the pool every call runs on); the HTTP
        connection pool holds twice as many, so requests abandoned at a deadline do not starve
        the next calls of connections.
    deadline_s
        Longest any call takes, whatever the store does (down, hung with its sockets open,
        trickling bytes): the caller gets its answer or ``BackendTimeoutError`` by then, retries
        and backoff included, and no request of the call writes into the caller's buffers
        afterwards. Batch calls share one deadline.
    connect_timeout_s
        Longest wait for a TCP (and TLS) connection, per attempt (at most ``deadline_s``).
    read_timeout_s
        Longest wait for any bytes of a response once connected, per attempt (at most
        ``deadline_s``).
    retry_mode
        botocore retry mode: ``"standard"``, ``"adaptive"`` (adds client-side rate limiting
        after throttling) or ``"legacy"``.
    max_attempts
        Attempts per request, the first included (1 means no retry); a retry is made only when
        its backoff and a useful attempt still fit before the call's deadline.
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
    deadline_s: float = 10.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 5.0
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
        if not isinstance(self.prefix, str):
            raise TypeError(f"prefix must be a string, got {type(self.prefix).__name__}")
        if self.prefix and not self.prefix.endswith("/"):
            msgspec.structs.force_setattr(self, "prefix", self.prefix + "/")
        if _PREFIX.fullmatch(self.prefix) is None:
            raise ValueError(
                f"prefix must be empty or segments of A-Z a-z 0-9 _ . - separated by '/', "
                f"got {self.prefix!r}"
            )
        if ".." in self.prefix.split("/") or "." in self.prefix.split("/"):
            raise ValueError(f"prefix must not contain '.' or '..' segments, got {self.prefix!r}")
        if len(self.prefix) + HASHED_NAME_BYTES > MAX_OBJECT_KEY_BYTES:
            raise ValueError(
                f"prefix is {len(self.prefix)} bytes; at most "
                f"{MAX_OBJECT_KEY_BYTES - HASHED_NAME_BYTES} leave room for object names"
            )
        if self.endpoint_url is not None:
            _check_endpoint(self.endpoint_url)
        for name in ("region", "profile"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or null, got {value!r}")
        check_count("max_concurrency", self.max_concurrency, minimum=1, maximum=1024)
        check_count("max_attempts", self.max_attempts, minimum=1, maximum=20)
        check_seconds("deadline_s", self.deadline_s)
        check_seconds("connect_timeout_s", self.connect_timeout_s)
        check_seconds("read_timeout_s", self.read_timeout_s)
        for name in ("create_bucket", "verify_bucket", "conditional_put"):
            _check_bool(name, getattr(self, name))

    @property
    def attempt_connect_timeout_s(self) -> float:
        """The connect timeout of one attempt: ``connect_timeout_s``, at most ``deadline_s``."""
        return min(self.connect_timeout_s, self.deadline_s)

    @property
    def attempt_read_timeout_s(self) -> float:
        """The read timeout of one attempt: ``read_timeout_s``, at most ``deadline_s``."""
        return min(self.read_timeout_s, self.deadline_s)

    def worst_call_s(self) -> float:
        """Return the longest one call may take, whatever the store does: ``deadline_s``.

        A call against a store that is down or hangs may end sooner: each attempt waits at most
        the connect and then the read timeout, and botocore sleeps at most ``0.05 * 2**i``
        seconds between attempts after a connection error. The smaller of the two bounds is
        returned.
        """
        attempts = self.max_attempts
        backoff = sum(_NON_THROTTLING_BACKOFF_S * float(1 << i) for i in range(attempts - 1))
        per_attempt = self.attempt_connect_timeout_s + self.attempt_read_timeout_s
        return min(self.deadline_s, attempts * per_attempt + backoff)


MAX_PUT_BYTES = 5 << 30
"""The largest object one S3 PUT stores (5 GiB)."""


def capabilities() -> Capabilities:
    """Return what every S3 backend promises: the registry's record and each instance's.

    No option changes it.
    """
    return Capabilities(
        persistent=True,
        shared=True,
        delete=True,
        crash_safe_writes=True,
        max_value_size=MAX_PUT_BYTES,
    )
