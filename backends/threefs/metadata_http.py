"""The metadata service's client: each :class:`Metadata` call is one HTTP POST, bounded in time.

Requests are ``POST /v1/<method>`` with a JSON body of the method's arguments (plus ``ns``);
answers are JSON. Each thread keeps one keep-alive connection with ``timeout_s`` on every socket
operation, so a call to a dead or stuck service ends within the timeout with a typed error:
:class:`~hicache_storage.errors.BackendUnavailableError` (refused, reset, HTTP error) or
:class:`~hicache_storage.errors.BackendTimeoutError`. All translation happens in
:meth:`HttpMetadata._call`.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from hicache_storage.errors import (
    BackendClosedError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
)

from .metadata import Geometry, GeometryError, Lookup, Metadata, Reservation, SlotState

__all__ = ["HttpMetadata", "Unauthorized"]

T = TypeVar("T")

_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
"""Errors a keep-alive connection the server has since closed gives on its next use."""

_encode = msgspec.json.Encoder().encode


class Unauthorized(BackendUnavailableError):
    """The service refused the bearer token (or none was given)."""

    retryable = False


class _Local(threading.local):
    conn: http.client.HTTPConnection | None = None
    used = False


class HttpMetadata(Metadata):
    """Talks to a ``hicache metadata-server``.

    Parameters
    ----------
    url
        ``http://host:port`` (``https://`` works too).
    token
        Bearer token, if the service wants one.
    timeout_s
        Bound of every socket operation of a call.
    """

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 2.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"metadata_url must be http://host:port, got {url!r}")
        self.url = url
        self.timeout_s = timeout_s
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._base = parts.path.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._local = _Local()
        self._conns: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- the interface --------------------------------------------------------------------------

    def open(self, ns: str, geometry: Geometry) -> str:
        """Create or check namespace ``ns``; return the service's epoch."""
        return self._call("open", {"ns": ns, "geometry": geometry}, str)

    def lookup(self, ns: str, keys: Sequence[str]) -> Lookup:
        """Return where each committed key lives."""
        return self._call("lookup", {"ns": ns, "keys": keys}, Lookup)

    def confirm(self, ns: str, epoch: str, pairs: Sequence[tuple[str, int]]) -> list[bool]:
        """Return per ``(key, id)`` whether that entry still holds the key."""
        return self._call("confirm", {"ns": ns, "epoch": epoch, "pairs": pairs}, list[bool])

    def exists(self, ns: str, keys: Sequence[str]) -> int:
        """Return the length of the leading run of committed keys."""
        return self._call("exists", {"ns": ns, "keys": keys}, int)

    def reserve(self, ns: str, geometry: Geometry, items: Sequence[tuple[str, int]]) -> Reservation:
        """Reserve slots for each ``(key, nbytes)``."""
        body = {"ns": ns, "geometry": geometry, "items": items}
        return self._call("reserve", body, Reservation)

    def commit(self, ns: str, epoch: str, ids: Sequence[int]) -> list[bool]:
        """Make reserved entries visible."""
        return self._call("commit", {"ns": ns, "epoch": epoch, "ids": ids}, list[bool])

    def abort(self, ns: str, epoch: str, ids: Sequence[int]) -> None:
        """Give back reservations whose write failed."""
        self._call("abort", {"ns": ns, "epoch": epoch, "ids": ids}, type(None))

    def delete(self, ns: str, keys: Sequence[str]) -> list[bool]:
        """Remove committed keys."""
        return self._call("delete", {"ns": ns, "keys": keys}, list[bool])

    def clear(self, ns: str) -> int:
        """Remove every committed key of ``ns``."""
        return self._call("clear", {"ns": ns}, int)

    def states(self, ns: str, keys: Sequence[str]) -> list[SlotState]:
        """Return whether each key is absent, reserved or committed."""
        return self._call("states", {"ns": ns, "keys": keys}, list[SlotState])

    def stats(self, ns: str) -> dict[str, Any]:
        """Return the namespace's counters as the service reports them."""
        return self._call("stats", {"ns": ns}, dict[str, Any])

    def close(self) -> None:
        """Close every thread's connection."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    # -- transport ------------------------------------------------------------------------------

    def _connection(self) -> http.client.HTTPConnection:
        local = self._local
        if local.conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.timeout_s)
            with self._lock:
                if self._closed:
                    raise BackendClosedError("the metadata client is closed")
                self._conns.append(conn)
            local.conn, local.used = conn, False
        return local.conn

    def _drop(self) -> None:
        conn, self._local.conn = self._local.conn, None
        if conn is not None:
            conn.close()
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)

    def _exchange(self, method: str, body: bytes) -> tuple[int, bytes]:
        conn = self._connection()
        reused = self._local.used
        try:
            conn.request("POST", f"{self._base}/v1/{method}", body, self._headers)
            response = conn.getresponse()
            data = response.read()
        except _STALE:
            self._drop()
            if not reused:
                raise
            return self._exchange(method, body)  # the service closed an idle connection
        except BaseException:
            self._drop()
            raise
        self._local.used = True
        if response.will_close:
            self._drop()
        return response.status, data

    def _call(self, method: str, args: dict[str, Any], kind: type[T] | Any) -> T:
        """POST ``args`` to ``/v1/<method>``; decode the answer as ``kind``; map every error."""
        where = f"metadata service {self.url} ({method})"
        try:
            status, data = self._exchange(method, _encode(args))
        except TimeoutError as exc:
            raise BackendTimeoutError(f"{where} did not answer within {self.timeout_s}s") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise BackendUnavailableError(f"{where} is unreachable: {exc}") from exc
        if status == 200:
            try:
                result: T = msgspec.json.decode(data, type=kind)
            except msgspec.DecodeError as exc:
                raise BackendUnavailableError(f"{where} sent a malformed answer: {exc}") from exc
            return result
        message = data.decode("utf-8", "replace").strip()[:300]
        if status in (401, 403):
            raise Unauthorized(f"{where} refused the token: {message}")
        if status == 409:
            raise GeometryError(message)
        raise BackendUnavailableError(f"{where} answered HTTP {status}: {message}")
