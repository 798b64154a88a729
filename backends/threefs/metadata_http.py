"""The metadata service's client: each :class:`Metadata` call is one HTTP POST, bounded in time.

Requests are ``POST /v1/<method>`` with a JSON body of the method's arguments (plus ``ns``);
answers are JSON. Each thread keeps one keep-alive connection with ``timeout_s`` on every socket
operation, so a call to a dead or stuck service ends within the timeout with a typed error:
:class:`~hicache_storage.errors.BackendUnavailableError` (refused, reset, HTTP error) or
:class:`~hicache_storage.errors.BackendTimeoutError`. All translation happens in
:meth:`HttpMetadata._call`.

Nothing the service answers is trusted: every answer is decoded into constrained msgspec Structs
(no negative or oversized numbers, no unknown fields or status strings, no wrong types) and then
checked against the call (one result per key asked, slot runs inside the namespace's geometry and
long enough for the value). An answer that fails is a :class:`MalformedAnswer`, a
:class:`~hicache_storage.errors.BackendError` that the default layers turn into a counted miss.

A batch of more than :data:`MAX_KEYS_PER_CALL` keys (or whose body would pass
:data:`MAX_BODY_BYTES`) is sent as several calls, because the service refuses larger bodies
unread (``413``); their answers are joined.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

import msgspec

from hicache_storage.errors import (
    BackendClosedError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
)

from .metadata import (
    Geometry,
    GeometryError,
    Grant,
    Location,
    Lookup,
    Metadata,
    Reservation,
    SlotState,
)

__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_BODY_BYTES",
    "MAX_ITEM_BYTES",
    "MAX_KEYS_PER_CALL",
    "HttpMetadata",
    "MalformedAnswer",
    "Unauthorized",
]

T = TypeVar("T")
ItemT = TypeVar("ItemT")

MAX_KEYS_PER_CALL = 8192
"""Keys (items, pairs or ids) in one request; a longer batch is split into several calls.

A prefill of 128 k tokens is 2048 pages of 64 tokens: four such batches fit in one call.
"""

MAX_ITEM_BYTES = 256
"""JSON bytes of one item at most: a key (at most 200 characters of the key alphabet, which JSON
never escapes) in quotes, an integer of at most 19 digits, brackets and commas take 226."""

MAX_BODY_BYTES = MAX_KEYS_PER_CALL * MAX_ITEM_BYTES + 4096
"""Largest request body the service reads (2 MiB + 4 KiB): a full call plus its namespace,
epoch and geometry. The service answers ``413`` to a longer one without reading it."""

MAX_ANSWER_BYTES = 128 << 20
"""Largest answer the client reads; a longer one is a :class:`MalformedAnswer`."""

_INT_MAX = (1 << 63) - 1

_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
"""Errors a keep-alive connection the server has since closed gives on its next use."""

_encode = msgspec.json.Encoder().encode


class Unauthorized(BackendUnavailableError):
    """The service refused the bearer token (or none was given)."""

    retryable = False


class MalformedAnswer(BackendUnavailableError):
    """The service answered something that does not make sense for the call.

    Malformed JSON, a wrong type, a missing or unknown field, a negative or oversized length or
    slot, an unknown status, a slot run outside the namespace, or not one result per key asked.
    Treated like an unreachable service: the default layers count it and answer a miss.
    """

    retryable = False


# -- what an answer may contain: the protocol's records, with bounds ----------------------------
# Each subclasses the record of :mod:`.metadata` it checks, so the backend gets the same types,
# and a field added there is inherited here.

_Id = Annotated[int, msgspec.Meta(ge=0, le=_INT_MAX)]
_Length = Annotated[int, msgspec.Meta(ge=0, le=_INT_MAX)]
_Slot = Annotated[int, msgspec.Meta(ge=0, le=_INT_MAX)]
_Run = Annotated[int, msgspec.Meta(ge=1, le=_INT_MAX)]
_Epoch = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_Extent = tuple[_Slot, _Run]


class _Location(Location, frozen=True, array_like=True, forbid_unknown_fields=True):
    id: _Id
    length: _Length
    extents: list[_Extent]


class _Lookup(Lookup, frozen=True, forbid_unknown_fields=True):
    epoch: _Epoch
    locations: list[_Location | None]  # type: ignore[assignment]  # narrower, on purpose


class _Grant(Grant, frozen=True, array_like=True, forbid_unknown_fields=True):
    id: _Id = 0
    extents: list[_Extent] = msgspec.field(default_factory=list)


class _Reservation(Reservation, frozen=True, forbid_unknown_fields=True):
    epoch: _Epoch
    lease_s: Annotated[float, msgspec.Meta(gt=0, le=1e9)]
    grants: list[_Grant]  # type: ignore[assignment]  # narrower, on purpose


_Count = Annotated[int, msgspec.Meta(ge=0, le=_INT_MAX)]


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
        self._geometries: dict[str, Geometry] = {}

    # -- the interface --------------------------------------------------------------------------

    def open(self, ns: str, geometry: Geometry) -> str:
        """Create or check namespace ``ns``; return the service's epoch."""
        epoch: str = self._call("open", _encode({"ns": ns, "geometry": geometry}), _Epoch)
        self._geometries[ns] = geometry
        return epoch

    def lookup(self, ns: str, keys: Sequence[str]) -> Lookup:
        """Return where each committed key lives."""
        parts = self._batched(
            "lookup", keys, lambda chunk: {"ns": ns, "keys": chunk}, _Lookup, _n_locations
        )
        epoch = _same_epoch("lookup", [part.epoch for part in parts], self.url)
        locations = [location for part in parts for location in part.locations]
        values = [(loc.length, loc.extents) for loc in locations if loc is not None]
        self._check_slots("lookup", values, self._geometries.get(ns))
        if len(parts) == 1:
            single: Lookup = parts[0]
            return single
        return _Lookup(epoch, locations)

    def confirm(self, ns: str, epoch: str, pairs: Sequence[tuple[str, int]]) -> list[bool]:
        """Return per ``(key, id)`` whether that entry still holds the key."""
        return self._flags(
            "confirm", pairs, lambda chunk: {"ns": ns, "epoch": epoch, "pairs": chunk}
        )

    def exists(self, ns: str, keys: Sequence[str]) -> int:
        """Return the length of the leading run of committed keys."""
        total = 0
        for chunk, encoded in self._chunks(keys, lambda chunk: {"ns": ns, "keys": chunk}):
            found: int = self._call("exists", encoded, _Count)
            if found > len(chunk):
                raise self._malformed("exists", f"{found} of {len(chunk)} keys exist")
            total += found
            if found < len(chunk):
                break
        return total

    def reserve(self, ns: str, geometry: Geometry, items: Sequence[tuple[str, int]]) -> Reservation:
        """Reserve slots for each ``(key, nbytes)``."""
        parts = self._batched(
            "reserve",
            items,
            lambda chunk: {"ns": ns, "geometry": geometry, "items": chunk},
            _Reservation,
            lambda answer: len(answer.grants),
        )
        self._geometries.setdefault(ns, geometry)
        epoch = _same_epoch("reserve", [part.epoch for part in parts], self.url)
        grants = [grant for part in parts for grant in part.grants]
        values = [
            (nbytes, grant.extents)
            for (_, nbytes), grant in zip(items, grants, strict=True)
            if grant.status == "reserved"
        ]
        self._check_slots("reserve", values, geometry)
        if len(parts) == 1:
            single: Reservation = parts[0]
            return single
        return _Reservation(epoch, min(part.lease_s for part in parts), grants)

    def commit(self, ns: str, epoch: str, ids: Sequence[int]) -> list[bool]:
        """Make reserved entries visible."""
        return self._flags("commit", ids, lambda chunk: {"ns": ns, "epoch": epoch, "ids": chunk})

    def abort(self, ns: str, epoch: str, ids: Sequence[int]) -> None:
        """Give back reservations whose write failed."""
        for _, encoded in self._chunks(ids, lambda c: {"ns": ns, "epoch": epoch, "ids": c}):
            self._call("abort", encoded, type(None))

    def delete(self, ns: str, keys: Sequence[str]) -> list[bool]:
        """Remove committed keys."""
        return self._flags("delete", keys, lambda chunk: {"ns": ns, "keys": chunk})

    def clear(self, ns: str) -> int:
        """Remove every committed key of ``ns``."""
        cleared: int = self._call("clear", _encode({"ns": ns}), _Count)
        return cleared

    def states(self, ns: str, keys: Sequence[str]) -> list[SlotState]:
        """Return whether each key is absent, reserved or committed."""
        parts = self._batched(
            "states", keys, lambda chunk: {"ns": ns, "keys": chunk}, list[SlotState], len
        )
        return [state for part in parts for state in part]

    def stats(self, ns: str) -> dict[str, Any]:
        """Return the namespace's counters as the service reports them."""
        return self._call("stats", _encode({"ns": ns}), dict[str, Any])

    def close(self) -> None:
        """Close every thread's connection."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    # -- batches and checks ---------------------------------------------------------------------

    def _chunks(
        self, items: Sequence[ItemT], body: Callable[[Sequence[ItemT]], dict[str, Any]]
    ) -> list[tuple[Sequence[ItemT], bytes]]:
        """Cut ``items`` into runs the service accepts (few enough, a body small enough); encode."""
        chunks: list[tuple[Sequence[ItemT], bytes]] = []
        step = MAX_KEYS_PER_CALL
        pending = [items[i : i + step] for i in range(0, len(items), step)] or [items]
        pending.reverse()
        while pending:
            chunk = pending.pop()
            encoded = _encode(body(chunk))
            if len(encoded) > MAX_BODY_BYTES and len(chunk) > 1:
                half = len(chunk) // 2
                pending += [chunk[half:], chunk[:half]]
            else:
                chunks.append((chunk, encoded))
        return chunks

    def _batched(
        self,
        method: str,
        items: Sequence[ItemT],
        body: Callable[[Sequence[ItemT]], dict[str, Any]],
        kind: Any,
        count: Callable[[Any], int],
    ) -> list[Any]:
        """Call ``method`` once per chunk of ``items``; check each answer has one result each."""
        answers = []
        for chunk, encoded in self._chunks(items, body):
            answer = self._call(method, encoded, kind)
            if count(answer) != len(chunk):
                raise self._malformed(method, f"{count(answer)} results for {len(chunk)} asked")
            answers.append(answer)
        return answers

    def _flags(
        self, method: str, items: Sequence[ItemT], body: Callable[[Sequence[ItemT]], dict[str, Any]]
    ) -> list[bool]:
        parts = self._batched(method, items, body, list[bool], len)
        return [flag for part in parts for flag in part]

    def _check_slots(
        self,
        method: str,
        values: Sequence[tuple[int, Sequence[tuple[int, int]]]],
        ns_geometry: Geometry | None,
    ) -> None:
        """Refuse ``(nbytes, slot runs)`` outside the namespace, or with too few slots."""
        if ns_geometry is None:
            return
        slot_bytes = ns_geometry.slot_bytes
        total = ns_geometry.total_slots
        capacity = total * slot_bytes
        for nbytes, extents in values:
            if nbytes > capacity:
                raise self._malformed(method, f"a length of {nbytes} bytes exceeds the capacity")
            slots = 0
            for first, count in extents:
                if first + count > total:
                    raise self._malformed(
                        method, f"slots {first}+{count} are outside 0..{total - 1}"
                    )
                slots += count
            if slots * slot_bytes < nbytes:
                raise self._malformed(method, f"{slots} slots cannot hold {nbytes} bytes")

    def _malformed(self, method: str, what: str) -> MalformedAnswer:
        return MalformedAnswer(f"metadata service {self.url} ({method}) answered nonsense: {what}")

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
            if response.length is not None and response.length > MAX_ANSWER_BYTES:
                raise self._malformed(method, f"an answer of {response.length} bytes")
            data = response.read(MAX_ANSWER_BYTES + 1)
            if len(data) > MAX_ANSWER_BYTES:
                raise self._malformed(method, f"an answer of more than {MAX_ANSWER_BYTES} bytes")
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

    def _call(self, method: str, body: bytes, kind: type[T] | Any) -> T:
        """POST ``body`` to ``/v1/<method>``; decode the answer as ``kind``; map every error."""
        where = f"metadata service {self.url} ({method})"
        try:
            status, data = self._exchange(method, body)
        except MalformedAnswer:
            raise
        except TimeoutError as exc:
            raise BackendTimeoutError(f"{where} did not answer within {self.timeout_s}s") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise BackendUnavailableError(f"{where} is unreachable: {exc}") from exc
        if status == 200:
            try:
                result: T = msgspec.json.decode(data, type=kind)
            except msgspec.DecodeError as exc:  # malformed JSON, or a value out of its bounds
                raise MalformedAnswer(f"{where} sent a malformed answer: {exc}") from exc
            return result
        message = data.decode("utf-8", "replace").strip()[:300]
        if status in (401, 403):
            raise Unauthorized(f"{where} refused the token: {message}")
        if status == 409:
            raise GeometryError(message)
        raise BackendUnavailableError(f"{where} answered HTTP {status}: {message}")


def _n_locations(answer: Lookup) -> int:
    return len(answer.locations)


def _same_epoch(method: str, epochs: list[str], url: str) -> str:
    """Return the epoch of a call sent in parts; parts answered by different runs are refused."""
    if len(set(epochs)) > 1:
        raise BackendUnavailableError(
            f"metadata service {url} ({method}) restarted while a batch was sent in parts"
        )
    return epochs[0]
