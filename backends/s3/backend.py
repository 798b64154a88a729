"""The S3 backend: one object per key in a bucket, under a key prefix.

Naming
    A key is stored as ``<prefix><key>``. Keys obey the key rule (no ``/``), so every object is a
    direct child of the prefix and no key can reach another namespace. When ``<prefix><key>``
    would exceed S3's 1024-byte limit, the object is ``<prefix>~sha256-<hex digest of the key>``
    instead: deterministic, so every process finds it, and never equal to a key's own name.

Writes
    One ``PutObject`` per value, with ``If-None-Match: *``: S3 makes an object visible only once
    its upload is complete, and the condition keeps the first complete value (a ``412`` means
    the key already holds one, so ``set`` answers True). A store that answers ``501`` to the
    condition is switched to ``HeadObject`` + ``PutObject`` for the rest of the instance's life.

Reads
    ``GetObject``: the ``Content-Length`` is checked before any byte moves, so an object of
    another size is a miss (``BufferSizeError`` for ``get(out=...)``) and the destination is left
    untouched; the body is then read in chunks straight into the caller's buffer or the host
    pool's page buffers, and the end of the stream is read too, which makes botocore check the
    length and, with ``checksums="when_supported"``, the object's checksum. A short stream or a
    checksum mismatch raises (the default layers answer a miss), never a hit.

Batches
    Requests run on a thread pool of ``max_concurrency`` workers sharing one thread-safe
    client. ``batch_exists`` keeps at most that many ``HeadObject`` requests in flight, in key
    order, and issues none past the first miss. Every batch stops at its first infrastructure
    error: requests not yet started are dropped, those in flight are abandoned, and the error
    is raised.

The deadline
    Every call, single-key ones included, runs its requests on the pool while the caller waits
    at most ``deadline_s``; then it raises ``BackendTimeoutError`` (a miss through the default
    layers) whatever the store does. Requests still running are abandoned, and three things
    keep that safe and short:

    * a worker never writes into the caller's buffer after the call gave up: response bodies
      are read into a worker-private chunk, and each chunk is copied into the destination under
      the call's lock, only while the call is not cancelled; the caller sets the flag under the
      same lock before it returns. Values to write are immutable ``bytes`` (copied from a
      mutable buffer first), so a caller reusing its buffer cannot change what an abandoned
      ``PutObject`` sends;
    * botocore's retries are gated by the call's deadline (a ``needs-retry`` handler refuses a
      retry whose backoff and a useful attempt no longer fit; a ``before-send`` handler refuses
      to send once the call is over), and each attempt's socket timeouts are at most
      ``deadline_s``;
    * a streamed body is abandoned between chunks once the call is over.

Closing
    ``close()`` refuses new calls at once and shuts the pool and the client only once the calls
    in flight have returned (:func:`~hicache_storage.kit.closed_guard`, waiting up to
    ``deadline_s``), so no call finds its pool or client gone under it.

Secrets
    Credentials are never options. The secret key and session token the AWS chain resolved are
    masked (``***``) in every message this backend makes and in botocore's and urllib3's own log
    records (their DEBUG lines print request headers, the session token among them).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from typing_extensions import Buffer

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.config import Deployment
from hicache_storage.errors import (
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    BufferSizeError,
    ConfigError,
    HiCacheError,
    IntegrityError,
)
from hicache_storage.keys.validation import validate_key
from hicache_storage.kit import (
    Count,
    Deadline,
    ErrorMap,
    Verdict,
    closed_guard,
    current_deadline,
    flat,
)
from hicache_storage.redact import redact_text, redact_url

from .config import MAX_OBJECT_KEY_BYTES, MAX_PUT_BYTES, S3Config, capabilities

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_PUT_BYTES", "S3Backend", "client_config", "make_client"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

"""The largest object one ``PutObject`` may carry (5 GiB)."""

HASHED_MARK = "~sha256-"
"""Start of the name a too-long key is stored under; ``~`` never occurs in a key."""

_CHUNK = 1 << 20
"""Bytes asked of the response stream per read while filling a destination."""

_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_AUTH_CODES = frozenset(
    {
        "403",
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
    }
)
_BUSY_CODES = frozenset(
    {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling"}
)
_CONFLICT_RETRIES = 3
_CREDENTIAL_ERRORS = (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)
_ATTEMPT_TIMEOUTS = (ConnectTimeoutError, ReadTimeoutError)
"""An attempt's timeouts, each at most ``deadline_s``: one that fires once the call's deadline
passed is that deadline, and is reported as it (the worker thread may see it before the waiting
caller wakes)."""

_LOADER_LOCK = threading.Lock()
_LOADER: Any = None
"""botocore's parsed service models, shared by every client this process makes: a new session
would otherwise parse the S3 model again (about 60 ms per backend instance)."""

_MIN_ATTEMPT_S = 0.1
"""A retry is made only when at least this much of the call's time is left after its backoff."""

_THROTTLING_BACKOFF_S = 1.0
"""botocore's backoff scale after an error response (throttling), and in legacy mode always."""
_NON_THROTTLING_BACKOFF_S = 0.05
"""botocore's standard backoff scale after a connection error or timeout."""
_MAX_BACKOFF_S = 20.0
_RETRY_AFTER_EXTRA_S = 5.0
"""How far ``x-amz-retry-after`` may stretch botocore's standard backoff."""

_LOG_SCOPES = ("botocore", "urllib3", "boto3", "s3transfer")
"""Libraries whose log records may quote request headers (the session token among them)."""


class _DeadlinePassed(Exception):
    """Raised inside a worker when its call is over (deadline reached or given up)."""


_scratch = threading.local()
"""``chunk``: each worker thread's private buffer that response bodies are read into."""

_SECRETS_LOCK = threading.Lock()
_SECRETS: frozenset[str] = frozenset()
"""Credentials resolved by any S3 backend of this process, masked in library log records."""


class _RedactSecrets(logging.Filter):
    """Masks the resolved AWS secrets in the log records of botocore and urllib3."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = _SECRETS
        if not secrets:
            return True
        try:
            message = record.getMessage()
        except (TypeError, ValueError, KeyError):  # malformed: the logging module's business
            return True
        clean = redact_text(message, secrets)
        if clean != message:
            record.msg, record.args = clean, None
        return True


_REDACT_FILTER = _RedactSecrets()


def _guard_library_logs(secrets: frozenset[str]) -> None:
    """Add ``secrets`` to the masked set; filter every logger of the client libraries."""
    global _SECRETS
    with _SECRETS_LOCK:
        _SECRETS = _SECRETS | secrets
        names = [
            name
            for name in list(logging.Logger.manager.loggerDict)
            if name.split(".", 1)[0] in _LOG_SCOPES
        ]
        for name in (*_LOG_SCOPES, *names):
            logger_ = logging.getLogger(name)
            if _REDACT_FILTER not in logger_.filters:
                logger_.addFilter(_REDACT_FILTER)


def _credential_secrets(credentials: Any) -> frozenset[str]:
    """Return the secret key and session token of resolved botocore credentials.

    Read from the instance's own attributes, so refreshable credentials are not refreshed.
    """
    if credentials is None:
        return frozenset()
    try:
        fields = vars(credentials)
    except TypeError:
        return frozenset()
    found = {
        value
        for name in ("secret_key", "_secret_key", "token", "_token")
        if isinstance(value := fields.get(name), str) and value
    }
    return frozenset(found)


def _session(profile: str | None) -> botocore.session.Session:
    """Return a fresh botocore session (its own credential chain) over the shared model cache."""
    global _LOADER
    session = botocore.session.Session(profile=profile)
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _LOADER)
    return session


def client_config(config: S3Config) -> Config:
    """Return the botocore client settings of ``config``: timeouts, retries, pool, checksums.

    Each attempt's timeouts are at most ``deadline_s``. The backend and its raw baseline use
    the same settings, so ``hicache bench`` compares like with like.
    """
    return Config(
        connect_timeout=config.attempt_connect_timeout_s,
        read_timeout=config.attempt_read_timeout_s,
        retries={"mode": config.retry_mode, "total_max_attempts": config.max_attempts},
        max_pool_connections=2 * config.max_concurrency,
        s3={"addressing_style": config.addressing_style},
        request_checksum_calculation=config.checksums,
        response_checksum_validation=config.checksums,
        tcp_keepalive=True,
    )


def make_client(config: S3Config) -> Any:
    """Build the S3 client ``config`` describes; credentials come from the AWS chain."""
    client, _ = _make_client(config)
    return client


def _make_client(config: S3Config) -> tuple[Any, frozenset[str]]:
    """Build the client; return it with the secrets of the credentials it resolved."""
    session = _session(config.profile)
    client = session.create_client(
        "s3",
        region_name=config.region,
        endpoint_url=config.endpoint_url,
        config=client_config(config),
    )
    try:
        secrets = _credential_secrets(session.get_credentials())
    except (BotoCoreError, OSError):  # no credentials resolve: nothing to mask
        secrets = frozenset()
    return client, secrets


def _body(view: memoryview) -> bytes:
    """Return the value as immutable ``bytes``, copying unless it is ``bytes`` already.

    A request abandoned at the deadline may still be sending; the caller is then free to reuse
    its buffer, which must not change what that request sends.
    """
    owner = view.obj
    if type(owner) is bytes and len(owner) == view.nbytes:
        return owner
    return view.tobytes()


def _code(exc: ClientError) -> tuple[str, int]:
    """Return the error code and HTTP status of a client error."""
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    code = str(exc.response.get("Error", {}).get("Code") or status)
    return code, status


def _is_missing(exc: ClientError) -> bool:
    code, status = _code(exc)
    return status == 404 and code in _MISSING_CODES


class _S3Errors(ErrorMap):
    """botocore's and the socket's failures of one request as typed errors, counted by code.

    ``exc`` and the exceptions chained to it are scrubbed of secrets (the resolved AWS
    credentials), error responses included, as they stay chained to the error returned.
    """

    def __init__(self, config: S3Config, secrets: frozenset[str], count: Count) -> None:
        super().__init__(
            "s3", secrets=secrets, catch=(ClientError, BotoCoreError, OSError), count=count
        )
        self.config = config

    def describe(self, exc: BaseException, what: str) -> Verdict:
        where = f"s3 {what}"
        if isinstance(exc, ClientError):
            code, status = _code(exc)
            message = exc.response.get("Error", {}).get("Message") or f"HTTP {status}"
            if status == 403 or code in _AUTH_CODES:
                text = (
                    f"{where}: access denied ({code}: {message}); check the credentials and "
                    f"the bucket policy"
                )
                return Verdict(BackendUnavailableError, text, code, retryable=False)
            if code == "NoSuchBucket":
                text = f"{where}: the bucket does not exist"
                return Verdict(BackendUnavailableError, text, code, retryable=False)
            if status >= 500 or code in _BUSY_CODES:
                text = f"{where}: the store is failing ({code}: {message})"
                return Verdict(BackendUnavailableError, text, code)
            return Verdict(BackendIOError, f"{where}: {code}: {message}", code)
        code = type(exc).__name__
        if isinstance(exc, _ATTEMPT_TIMEOUTS):
            call = current_deadline()
            if call is not None and call.left() <= 0:
                text = f"{where}: no answer within deadline_s={self.config.deadline_s:g} s"
                return Verdict(BackendTimeoutError, text, "DeadlineExceeded")
            text = (
                f"{where}: no answer within the timeouts (connect "
                f"{self.config.connect_timeout_s:g} s, read {self.config.read_timeout_s:g} s, "
                f"{self.config.max_attempts} attempts)"
            )
            return Verdict(BackendTimeoutError, text, code)
        if isinstance(exc, FlexibleChecksumError):
            text = f"{where}: the object failed its checksum; not used"
            return Verdict(IntegrityError, text, code)
        if isinstance(exc, IncompleteReadError):
            text = f"{where}: the response ended before its Content-Length"
            return Verdict(BackendIOError, text, code)
        if isinstance(exc, _CREDENTIAL_ERRORS):
            text = (
                f"{where}: no usable AWS credentials ({code}); set them through the AWS "
                f"chain (environment, shared credentials file, profile, instance role)"
            )
            return Verdict(BackendUnavailableError, text, code, retryable=False)
        if isinstance(exc, (OSError, BotoConnectionError, HTTPClientError)):
            return Verdict(
                BackendUnavailableError, f"{where}: cannot reach the store ({code})", code
            )
        return Verdict(BackendIOError, f"{where}: {code}", code)

    def mask(self, exc: BaseException) -> None:
        """Mask the exception's arguments and, for an error response, its parsed fields."""
        super().mask(exc)
        details = exc.response.get("Error") if isinstance(exc, ClientError) else None
        if isinstance(details, dict):
            for field, value in details.items():
                if isinstance(value, str):
                    details[field] = self.redact(value)


@closed_guard
class S3Backend(StorageBackend):
    """Stores each key as one object of an S3 bucket; see the module docstring.

    Parameters
    ----------
    config
        The backend's settings.
    deployment
        Unused (every rank shares the namespace); accepted like every backend.

    Raises
    ------
    ConfigError
        If the bucket does not exist (and ``create_bucket`` is off) or the store refuses the
        credentials, when ``verify_bucket`` or ``create_bucket`` is on.
    BackendUnavailableError, BackendTimeoutError
        If the endpoint cannot be reached then, within the configured timeouts.
    """

    name = "s3"

    def __init__(self, config: S3Config, deployment: Deployment | None = None) -> None:
        super().__init__()
        self.config = config
        self.deployment = deployment if deployment is not None else Deployment()
        self.capabilities = capabilities()
        self._bucket = config.bucket
        prefix = config.prefix
        self._prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self._endpoint = redact_url(config.endpoint_url) if config.endpoint_url else "AWS S3"
        self._conditional = config.conditional_put
        self._deadline_s = config.deadline_s
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._error_counts: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._secrets: frozenset[str] = frozenset()
        self._client, self._secrets = _make_client(config)
        self._error_map = _S3Errors(config, self._secrets, self._count_failure)
        _guard_library_logs(self._secrets)
        events = self._client.meta.events
        events.register_first("needs-retry.s3", self._gate_retry)
        events.register_first("before-send.s3", self._gate_send)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_concurrency, thread_name_prefix="hicache-s3"
        )
        try:
            if config.verify_bucket or config.create_bucket:
                self._run_one("open", "", self._open_bucket)
        except BaseException:
            self._close()
            raise

    @property
    def close_timeout_s(self) -> float:
        """How long ``close()`` waits for calls in flight: ``deadline_s``, which bounds each."""
        return self._deadline_s

    # -- the contract ---------------------------------------------------------------------------

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the object of ``key`` (``bytes``), or read it into ``out``; None on a miss.

        Raises
        ------
        BufferSizeError
            If ``out`` is not exactly the object's size (``out`` is left untouched).
        BackendError
            If the store failed, the stream ended early or the checksum did not match.
        """
        name = self._name(key)
        if out is None:
            return self._run_one("get", name, self._read_bytes, name)
        dst = flat(as_writable(out))
        loaded = self._run_one("get", name, self._load, name, [dst], True)
        return out if loaded else None

    def exists(self, key: str) -> bool:
        """Return whether ``key`` holds an object (one ``HeadObject``)."""
        name = self._name(key)
        return self._run_one("head", name, self._head, name)

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key`` unless it holds a value already (the first one wins).

        Raises
        ------
        BackendError
            If the store failed; the key is then absent or holds its old complete value.
        """
        name = self._name(key)
        return self._run_one("set", name, self._store, name, _body(as_readable(value)))

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each object straight into its buffer, concurrently; a size mismatch is a miss."""
        jobs = [
            (self._name(key), [flat(as_writable(out))]) for key, out in zip(keys, outs, strict=True)
        ]
        return self._map("get", self._load_page, jobs)

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value under its key, concurrently (the first value of a key wins)."""
        jobs = [
            (self._name(key), _body(as_readable(value)))
            for key, value in zip(keys, values, strict=True)
        ]
        return self._map("set", self._store, jobs)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the length of the leading run of keys that exist.

        At most ``max_concurrency`` ``HeadObject`` requests are in flight, in key order; none is
        issued past the first miss.
        """
        names = [self._name(key) for key in keys]
        call = self._new_call()
        window: deque[concurrent.futures.Future[bool]] = deque()
        issued = count = 0
        try:
            while True:
                while issued < len(names) and len(window) < self.config.max_concurrency:
                    window.append(self._submit(call, self._head, (names[issued],)))
                    issued += 1
                if not window:
                    return count
                done, _ = concurrent.futures.wait([window[0]], timeout=max(0.0, call.left()))
                if not done:
                    raise self._expired("head", names[count], len(names))
                if not self._result(window.popleft(), "head", names[count], len(names)):
                    return count
                count += 1
        finally:
            if window:
                call.cancel()
                for future in window:
                    future.cancel()

    # -- page I/O against the host pool -----------------------------------------------------------

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Read each object straight into the buffers of its host-pool page, concurrently.

        An object whose size differs from a page is a miss and its page is left untouched.
        """
        pages = self.page_views(keys, host_indices)
        jobs = [
            (self._name(key), [flat(view) for view in views])
            for key, views in zip(keys, pages, strict=True)
        ]
        return self._map("get", self._load_page, jobs)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Store each key's host-pool page as one object, concurrently."""
        pages = self.page_views(keys, host_indices)
        jobs: list[tuple[str, bytes | bytearray]] = []
        for key, views in zip(keys, pages, strict=True):
            parts = [flat(view) for view in views]
            body = parts[0].tobytes() if len(parts) == 1 else b"".join(parts)
            jobs.append((self._name(key), body))
        return self._map("set", self._store, jobs)

    # -- housekeeping ---------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed (``HeadObject``, then ``DeleteObject``)."""
        name = self._name(key)
        return self._run_one("delete", name, self._delete, name)

    def clear(self) -> None:
        """Delete every object of this namespace, in batches of up to 1000 per request.

        Only direct children of ``prefix`` whose names are keys (or hashed keys) are removed:
        deeper prefixes (other namespaces) and foreign names are left alone. Each request (a
        listing page, a deletion of up to 1000) has its own ``deadline_s``.
        """
        names = self._list_own()
        where = self._prefix or "/"
        for start in range(0, len(names), 1000):
            batch = names[start : start + 1000]
            answer = self._run_one("clear", where, self._delete_objects, batch)
            failed = answer.get("Errors") or []
            if failed:
                first = failed[0]
                self._count_error(str(first.get("Code", "DeleteError")))
                raise BackendIOError(
                    self._redact(
                        f"s3 clear of {self._where(self._prefix)}: {len(failed)} of "
                        f"{len(batch)} objects were not deleted (first {first.get('Key')!r}: "
                        f"{first.get('Code')}: {first.get('Message')})"
                    )
                )

    def stats(self) -> dict[str, Any]:
        """Return the request, byte and error counters of this instance."""
        with self._lock:
            counts = dict(self._counts)
            return {
                "backend": self.name,
                "bucket": self._bucket,
                "prefix": self._prefix,
                "endpoint": self._endpoint,
                "max_concurrency": self.config.max_concurrency,
                "conditional_put": self._conditional,
                "requests": dict(sorted(self._requests.items())),
                "bytes_read": counts.get("bytes_read", 0),
                "bytes_written": counts.get("bytes_written", 0),
                "size_mismatches": counts.get("size_mismatch", 0),
                "kept_existing": counts.get("kept_existing", 0),
                "errors": dict(sorted(self._error_counts.items())),
            }

    def _close(self) -> None:
        # Requests abandoned at a deadline may still run; they touch no caller buffer, and
        # their sockets time out on their own, so close does not wait for them.
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # -- naming ---------------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        """Return the object name of ``key`` inside this namespace."""
        name = self._prefix + validate_key(key)
        if len(name) <= MAX_OBJECT_KEY_BYTES:
            return name
        return f"{self._prefix}{HASHED_MARK}{hashlib.sha256(key.encode()).hexdigest()}"

    def _owns(self, name: str) -> bool:
        """Return whether object ``name`` (listed under the prefix) is one of this namespace's."""
        rest = name[len(self._prefix) :]
        if rest.startswith(HASHED_MARK):
            return len(rest) == len(HASHED_MARK) + 64
        with contextlib.suppress(HiCacheError):
            return validate_key(rest) == rest
        return False

    def _list_own(self) -> list[str]:
        """List this namespace's objects (direct children of the prefix with key names)."""
        names: list[str] = []
        token: str | None = None
        while True:
            request: dict[str, Any] = {
                "Bucket": self._bucket,
                "Prefix": self._prefix,
                "Delimiter": "/",
                "MaxKeys": 1000,
            }
            if token is not None:
                request["ContinuationToken"] = token
            page = self._run_one("list", self._prefix or "/", self._list_page, request)
            names.extend(
                item["Key"] for item in page.get("Contents") or [] if self._owns(item["Key"])
            )
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if token is None:
                return names

    # -- requests (each runs on a worker thread, inside one call) --------------------------------

    def _list_page(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._errors("list", self._prefix or "/"):
            self._count_request("list")
            page: dict[str, Any] = self._client.list_objects_v2(**request)
        return page

    def _delete(self, name: str) -> bool:
        if not self._head(name):
            return False
        with self._errors("delete", name):
            self._count_request("delete")
            self._client.delete_object(Bucket=self._bucket, Key=name)
        return True

    def _delete_objects(self, batch: list[str]) -> dict[str, Any]:
        with self._errors("clear", self._prefix or "/"):
            self._count_request("delete_objects")
            answer: dict[str, Any] = self._client.delete_objects(
                Bucket=self._bucket,
                Delete={"Objects": [{"Key": name} for name in batch], "Quiet": True},
            )
        return answer

    def _head(self, name: str) -> bool:
        with self._errors("head", name):
            self._count_request("head")
            try:
                self._client.head_object(Bucket=self._bucket, Key=name)
            except ClientError as exc:
                if _is_missing(exc):
                    return False
                raise
        return True

    def _get_object(self, name: str) -> Any:
        """Start a ``GetObject``; return the response, or None when the object is absent."""
        self._count_request("get")
        try:
            return self._client.get_object(Bucket=self._bucket, Key=name)
        except ClientError as exc:
            if _is_missing(exc):
                return None
            raise

    def _read_bytes(self, name: str) -> bytes | None:
        """Return object ``name`` read in chunks (abandoned between chunks at the deadline)."""
        call = _the_call()
        with self._errors("get", name):
            response = self._get_object(name)
            if response is None:
                return None
            body = response["Body"]
            try:
                parts: list[bytes] = []
                while True:
                    if not call.live():
                        raise _DeadlinePassed
                    # Reading up to the empty chunk makes botocore check length and checksum.
                    chunk = body.read(_CHUNK)
                    if not chunk:
                        break
                    parts.append(chunk)
            finally:
                body.close()
        data = b"".join(parts)
        self._add("bytes_read", len(data))
        return data

    def _load_page(self, name: str, views: list[memoryview]) -> bool:
        return self._load(name, views, False)

    def _load(self, name: str, views: list[memoryview], strict: bool) -> bool:
        """Fill ``views`` (back to back) with object ``name``; return False on a miss.

        A size mismatch leaves ``views`` untouched: with ``strict`` it raises
        ``BufferSizeError``, else it is a miss. Bytes reach ``views`` only through
        :func:`_fill`, which copies under the call's lock while the call is not cancelled.
        """
        call = _the_call()
        size = sum(view.nbytes for view in views)
        with self._errors("get", name):
            response = self._get_object(name)
            if response is None:
                return False
            body = response["Body"]
            try:
                length = int(response["ContentLength"])
                if length != size:
                    self._add("size_mismatch", 1)
                    if strict:
                        raise BufferSizeError(
                            f"output buffer has {size} bytes but object {name!r} has {length}"
                        )
                    return False
                for view in views:
                    _fill(body, view, call)
                # Reading past the end makes botocore check the length and the checksum.
                if body.readinto(bytearray(1)) != 0:
                    raise IncompleteReadError(actual_bytes=length + 1, expected_bytes=length)
            finally:
                body.close()
        self._add("bytes_read", size)
        return True

    def _store(self, name: str, body: bytes) -> bool:
        """Write ``body`` as object ``name`` unless it exists; return True once it holds one."""
        with self._errors("set", name):
            if self._conditional:
                stored = self._put_if_absent(name, body)
                if stored is not None:
                    return stored
            if self._head(name):
                self._add("kept_existing", 1)
                return True
            self._count_request("put")
            self._client.put_object(Bucket=self._bucket, Key=name, Body=body)
        self._add("bytes_written", len(body))
        return True

    def _put_if_absent(self, name: str, body: bytes) -> bool | None:
        """Put with ``If-None-Match: *``; None when the store turned out not to support it."""
        conflicts = 0
        while True:
            self._count_request("put")
            try:
                self._client.put_object(Bucket=self._bucket, Key=name, Body=body, IfNoneMatch="*")
            except ClientError as exc:
                code, status = _code(exc)
                if status == 412:
                    self._add("kept_existing", 1)
                    return True
                if status == 501 or code == "NotImplemented":
                    self._conditional = False
                    logger.warning(
                        "S3 store %s does not support If-None-Match on PutObject; bucket %r "
                        "falls back to HeadObject + PutObject (see docs/backends/s3.md)",
                        self._endpoint,
                        self._bucket,
                    )
                    return None
                # 409: another conditional write of this key is in flight; ask again.
                if status == 409 and conflicts < _CONFLICT_RETRIES:
                    conflicts += 1
                    continue
                raise
            self._add("bytes_written", len(body))
            return True

    def _open_bucket(self) -> None:
        """Check (or create) the bucket, turning the usual setup mistakes into clear errors.

        Raises
        ------
        ConfigError
            If the bucket is missing (without ``create_bucket``) or access is refused.
        """
        try:
            self._count_request("head_bucket")
            self._client.head_bucket(Bucket=self._bucket)
        except ClientError as exc:
            self._error_map.scrub(exc)
            code, status = _code(exc)
            if status == 404 and self.config.create_bucket:
                with self._errors("create_bucket", ""):
                    self._create_bucket()
                return
            if status == 404:
                self._count_error("NoSuchBucket")
                raise ConfigError(
                    f"bucket {self._bucket!r} does not exist at {self._endpoint}; create it, "
                    f"fix the bucket name, or set create_bucket=true"
                ) from exc
            if status in (400, 403) or code in _AUTH_CODES:
                self._count_error(code)
                raise ConfigError(
                    f"{self._endpoint} refused access to bucket {self._bucket!r} (HTTP {status} "
                    f"{code}); check the credentials the AWS chain supplies "
                    f"(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the profile "
                    f"option, the shared credentials file), the region and the bucket policy"
                ) from exc
            raise self._translate("open", "", exc) from exc
        except _CREDENTIAL_ERRORS as exc:
            self._count_error(type(exc).__name__)
            raise ConfigError(
                f"no usable AWS credentials for {self._endpoint} ({type(exc).__name__}); set "
                f"them through the AWS chain (environment, shared credentials file, profile, "
                f"instance role)"
            ) from exc
        except (BotoCoreError, OSError) as exc:
            raise self._translate("open", "", exc) from exc

    def _create_bucket(self) -> None:
        request: dict[str, Any] = {"Bucket": self._bucket}
        region = self._client.meta.region_name
        if region and region != "us-east-1":
            request["CreateBucketConfiguration"] = {"LocationConstraint": region}
        self._count_request("create_bucket")
        try:
            self._client.create_bucket(**request)
        except ClientError as exc:
            if _code(exc)[0] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
            self._client.head_bucket(Bucket=self._bucket)
        logger.info("created bucket %r at %s", self._bucket, self._endpoint)

    # -- concurrency and the deadline ---------------------------------------------------------

    def _new_call(self) -> Deadline:
        return Deadline(self._deadline_s)

    def _job(self, call: Deadline, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """Run ``fn(*args)`` on a worker thread on behalf of ``call`` (nothing once it is over)."""
        if not call.live():
            raise _DeadlinePassed
        with call.applied():
            return fn(*args)

    def _submit(
        self, call: Deadline, fn: Callable[..., T], args: tuple[Any, ...]
    ) -> concurrent.futures.Future[T]:
        return self._pool.submit(self._job, call, fn, args)

    def _run_one(self, op: str, name: str, fn: Callable[..., T], *args: Any) -> T:
        """Run one request on the pool; its answer, or ``BackendTimeoutError`` at the deadline."""
        return self._run(op, [name], fn, [args])[0]

    def _map(self, op: str, fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]]) -> list[T]:
        """Run ``fn(*job)`` for every job (``job[0]`` names the object) within one deadline."""
        return self._run(op, [str(job[0]) for job in jobs], fn, jobs)

    def _run(
        self, op: str, names: Sequence[str], fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]]
    ) -> list[T]:
        """Run ``fn(*job)`` for every job on the pool; results in order, first error raised.

        The caller waits until every job is done, the first error (raised, in key order among
        those done) or the deadline (``BackendTimeoutError``). Returning early cancels the
        call first: jobs not started are dropped, and those running never write into the
        caller's buffers again (see :func:`_fill`).
        """
        if not jobs:
            return []
        call = self._new_call()
        futures = [self._submit(call, fn, job) for job in jobs]
        try:
            _, pending = concurrent.futures.wait(
                futures,
                timeout=max(0.0, call.left()),
                return_when=concurrent.futures.FIRST_EXCEPTION,
            )
            for index, future in enumerate(futures):
                if future.done() and not future.cancelled() and future.exception() is not None:
                    self._result(future, op, names[index], len(jobs))
            if pending:
                index = next(i for i, future in enumerate(futures) if future in pending)
                raise self._expired(op, names[index], len(jobs))
            return [future.result() for future in futures]
        finally:
            if not all(future.done() for future in futures):
                call.cancel()
                for future in futures:
                    future.cancel()

    def _result(self, future: concurrent.futures.Future[T], op: str, name: str, count: int) -> T:
        """Return a finished job's result; a job that found its call over reads as the deadline."""
        try:
            return future.result()
        except _DeadlinePassed:
            raise self._expired(op, name, count) from None

    def _expired(self, op: str, name: str, count: int) -> BackendTimeoutError:
        what = f"s3 {op} of {self._where(name)}" + (f" (and {count - 1} more)" if count > 1 else "")
        self._count_error("DeadlineExceeded")
        return BackendTimeoutError(
            self._redact(f"{what}: no answer within deadline_s={self._deadline_s:g} s")
        )

    def _gate_send(self, **kwargs: Any) -> None:
        """Send nothing for a call that is over (botocore's ``before-send`` event)."""
        call = current_deadline()
        if call is not None and not call.live():
            raise _DeadlinePassed

    def _gate_retry(self, attempts: int = 1, response: Any = None, **kwargs: Any) -> bool | None:
        """Refuse a retry that cannot fit before the call's deadline (``needs-retry`` event).

        Returning False stops botocore's retries; None leaves the decision (and the backoff)
        to botocore's retry handler. The longest backoff botocore may then choose is assumed:
        up to ``2**i`` s (at most 20, plus up to 5 for ``x-amz-retry-after``) after an error
        response or in legacy mode, ``0.05 * 2**i`` s after a connection error.
        """
        call = current_deadline()
        if call is None:
            return None
        if not call.live():
            return False
        step = float(1 << min(max(attempts - 1, 0), 10))
        if response is not None or self.config.retry_mode == "legacy":
            backoff = min(_THROTTLING_BACKOFF_S * step, _MAX_BACKOFF_S)
            headers = getattr(response[0], "headers", None) if response is not None else None
            if headers is not None and "x-amz-retry-after" in headers:
                backoff += _RETRY_AFTER_EXTRA_S
        else:
            backoff = min(_NON_THROTTLING_BACKOFF_S * step, _MAX_BACKOFF_S)
        if call.left() < backoff + _MIN_ATTEMPT_S:
            return False
        return None

    # -- errors and counters --------------------------------------------------------------------

    def _where(self, name: str) -> str:
        return f"s3://{self._bucket}/{name} at {self._endpoint}"

    def _errors(self, op: str, name: str) -> contextlib.AbstractContextManager[None]:
        """Translate botocore and socket failures of one request into typed backend errors."""
        return self._error_map.guard(f"{op} of {self._where(name)}")

    def _translate(self, op: str, name: str, exc: BaseException) -> HiCacheError:
        """Return the typed error for a failed request (counted by code)."""
        return self._error_map.translate(exc, f"{op} of {self._where(name)}")

    def _count_failure(self, code: str) -> None:
        """Count a failed request by code, unless its call gave up first (that counted itself)."""
        call = current_deadline()
        if call is None or not call.cancelled:
            self._count_error(code)

    def _redact(self, text: str) -> str:
        """Mask the resolved AWS secrets and any URL password in ``text``."""
        return self._error_map.redact(text)

    def _count_request(self, op: str) -> None:
        with self._lock:
            self._requests[op] += 1

    def _count_error(self, code: str) -> None:
        with self._lock:
            self._error_counts[code] += 1

    def _add(self, counter: str, amount: int) -> None:
        with self._lock:
            self._counts[counter] += amount


def _the_call() -> Deadline:
    """Return the deadline of the call the running worker serves; outside a job, none that ends."""
    return current_deadline() or Deadline(float("inf"))


def _chunk_buffer() -> memoryview:
    """Return this thread's private chunk buffer (allocated on first use)."""
    chunk: memoryview | None = getattr(_scratch, "chunk", None)
    if chunk is None:
        chunk = _scratch.chunk = memoryview(bytearray(_CHUNK))
    return chunk


def _fill(body: Any, view: memoryview, call: Deadline) -> None:
    """Read exactly ``view.nbytes`` bytes of ``body`` into ``view``, chunk by chunk.

    Each chunk is read into this thread's private buffer, then copied into ``view`` under the
    call's lock, only while the call is not cancelled: once the caller gave up, nothing more
    reaches ``view``, however late the store answers. The stream is abandoned between chunks
    once the call is over.

    Raises
    ------
    IncompleteReadError
        If the stream ends first (botocore raises it itself when it sees the end).
    _DeadlinePassed
        If the call is over.
    """
    scratch = _chunk_buffer()
    got = 0
    total = view.nbytes
    while got < total:
        if not call.live():
            raise _DeadlinePassed
        n = body.readinto(scratch[: min(_CHUNK, total - got)])
        if not n:
            raise IncompleteReadError(actual_bytes=got, expected_bytes=total)
        with call.lock:
            if call.cancelled:
                raise _DeadlinePassed
            view[got : got + n] = scratch[:n]
        got += n
