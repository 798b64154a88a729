"""The metadata service: a :class:`LocalMetadata` behind a small HTTP server, optionally persistent.

Run it with ``hicache metadata-server`` (or ``python -m`` this module). Every process and instance
of the 3FS backend that sets ``metadata_url`` shares it; namespaces keep ranks and file sets apart.

Protocol
    ``POST /v1/<method>`` with a JSON object of the :class:`Metadata` method's arguments;
    the answer is the JSON of its result. ``GET /v1/health`` answers the epoch and the seconds
    left before writes are accepted (``grace_s``, see below). With a token,
    every request needs ``Authorization: Bearer <token>`` (401 otherwise). A geometry conflict
    answers 409, a malformed request 400.

Hostile clients (see "Metadata service security" in ``docs/backends/3fs.md``)
    The server is aiohttp's: one event loop holds every connection, so a connection costs a few
    kilobytes and no thread, and the store's calls run on a small fixed pool of threads. A
    request's headers are checked before its body is read: the token first (401), then the
    method (404/405), then ``Content-Length``: missing or chunked 411, negative or not a number
    400 (aiohttp's parser), larger than :data:`~.metadata_http.MAX_BODY_BYTES` 413; a refused
    body is never stored. A client has ``client_timeout_s`` to send a whole request line and
    headers (from its connection or its previous answer) and as long again for the body;
    idle connections are closed after as long. At most ``max_connections`` are open: past that
    the oldest connection that has not yet made an authorized request is closed.

Persistence (``--snapshot PATH``)
    Every change is appended to ``PATH.journal`` (one JSON line, written before the answer is
    sent, so a service killed with SIGKILL loses nothing it acknowledged); at start the snapshot
    is loaded, the journal replayed (a torn last line is ignored), a fresh snapshot written and
    the journal emptied, and the same happens every ``compact_every`` records and at shutdown.
    Pending reservations are persisted too, with their wall-clock lease, so a restarted service
    never hands out slots a writer of its previous run may still be writing. The epoch is kept.

Without persistence
    A restart starts empty with a new epoch: every key is a miss, clients' ids from the old epoch
    are refused, and for one lease period ``reserve`` answers ``starting`` (writes are refused),
    because writers of the previous run may still be writing into slots the new service would
    otherwise hand out again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import ipaddress
import logging
import os
import re
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import msgspec

from hicache_storage.errors import ConfigError, MissingDependencyError
from hicache_storage.keys.validation import MAX_KEY_LENGTH

from .metadata import Geometry, GeometryError
from .metadata_http import MAX_BODY_BYTES, MAX_KEYS_PER_CALL
from .metadata_local import LocalMetadata

try:
    from aiohttp import web
    from aiohttp.web_protocol import RequestHandler
except ImportError as exc:  # pragma: no cover - the 3fs extra installs it
    raise MissingDependencyError(
        "the 3fs metadata service needs aiohttp: pip install 'hicache-storage[3fs]'"
    ) from exc

__all__ = ["Limits", "MetadataServer", "Persistence", "check_exposure", "check_token", "serve"]

logger = logging.getLogger(__name__)


class _RateLimit(logging.Filter):
    """Let one record through per ``interval_s``: a client's bad requests must not flood logs."""

    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.suppressed = 0
        self._last = -interval_s

    def filter(self, record: logging.LogRecord) -> bool:
        """Return whether ``record`` is logged; note how many were not since the last one."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self.suppressed += 1
            return False
        self._last = now
        if self.suppressed:
            record.msg = f"{record.msg} ({self.suppressed} similar suppressed)"
            self.suppressed = 0
        return True


_http_logger = logging.getLogger(f"{__name__}.http")
"""What aiohttp logs about connections (malformed requests, resets), at most once in 10 s."""
_http_logger.addFilter(_RateLimit())

_encode = msgspec.json.Encoder().encode

_INLINE_BYTES = 64 << 10
"""Requests up to this size run on the event loop; longer ones on the worker threads."""

# -- requests: the arguments of each method, with bounds ---------------------------------------

_INT_MAX = (1 << 63) - 1
_Ns = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
_Key = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_LENGTH)]
_Epoch = Annotated[str, msgspec.Meta(max_length=128)]
_Int = Annotated[int, msgspec.Meta(ge=0, le=_INT_MAX)]
_Positive = Annotated[int, msgspec.Meta(ge=1, le=_INT_MAX)]
_MAX_SLOTS = 1 << 40
_PerCall = msgspec.Meta(max_length=MAX_KEYS_PER_CALL)  # clients split longer batches
_KeyList = Annotated[list[_Key], _PerCall]
_PairList = Annotated[list[tuple[_Key, _Int]], _PerCall]
_IdList = Annotated[list[_Int], _PerCall]


class _Geometry(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    slot_bytes: _Positive
    slots_per_file: _Positive
    file_count: _Positive

    def plain(self) -> Geometry:
        geometry = Geometry(self.slot_bytes, self.slots_per_file, self.file_count)
        if geometry.total_slots > _MAX_SLOTS:
            raise msgspec.ValidationError(f"more than {_MAX_SLOTS} slots: {geometry}")
        return geometry


class _Open(msgspec.Struct, forbid_unknown_fields=True):
    ns: _Ns
    geometry: _Geometry


class _Keys(msgspec.Struct, forbid_unknown_fields=True):
    ns: _Ns
    keys: _KeyList


class _Confirm(msgspec.Struct, forbid_unknown_fields=True):
    ns: _Ns
    epoch: _Epoch
    pairs: _PairList


class _Reserve(msgspec.Struct, forbid_unknown_fields=True):
    ns: _Ns
    geometry: _Geometry
    items: _PairList


class _Ids(msgspec.Struct, forbid_unknown_fields=True):
    ns: _Ns
    epoch: _Epoch
    ids: _IdList


class _NsOnly(msgspec.Struct, forbid_unknown_fields=True):
    ns: _Ns


def _methods(store: LocalMetadata) -> dict[str, tuple[type[Any], Callable[[Any], Any]]]:
    """Map each method name to its request type and the call it makes."""
    return {
        "open": (_Open, lambda r: store.open(r.ns, r.geometry.plain())),
        "lookup": (_Keys, lambda r: store.lookup(r.ns, r.keys)),
        "confirm": (_Confirm, lambda r: store.confirm(r.ns, r.epoch, r.pairs)),
        "exists": (_Keys, lambda r: store.exists(r.ns, r.keys)),
        "reserve": (_Reserve, lambda r: store.reserve(r.ns, r.geometry.plain(), r.items)),
        "commit": (_Ids, lambda r: store.commit(r.ns, r.epoch, r.ids)),
        "abort": (_Ids, lambda r: store.abort(r.ns, r.epoch, r.ids)),
        "delete": (_Keys, lambda r: store.delete(r.ns, r.keys)),
        "clear": (_NsOnly, lambda r: store.clear(r.ns)),
        "states": (_Keys, lambda r: store.states(r.ns, r.keys)),
        "stats": (_NsOnly, lambda r: store.stats(r.ns)),
    }


class Persistence:
    """A snapshot file plus an append-only journal of the changes made since.

    Parameters
    ----------
    path
        The snapshot file; the journal is ``path + ".journal"``.
    compact_every
        Journal records after which the snapshot is rewritten and the journal emptied.
    """

    def __init__(self, path: str, *, compact_every: int = 100_000) -> None:
        self.path = os.path.abspath(path)
        self.journal_path = self.path + ".journal"
        self.compact_every = compact_every
        self._fd: int | None = None
        self._records = 0
        self._store: LocalMetadata | None = None

    def found(self) -> bool:
        """Return whether a snapshot or journal exists to restore from."""
        return os.path.exists(self.path) or os.path.exists(self.journal_path)

    def load(self, store: LocalMetadata) -> None:
        """Restore ``store`` from the snapshot and journal (if any), compact, start journaling."""
        state: dict[str, Any] = {}
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            state = msgspec.json.decode(f.read())
        records: list[list[Any]] = []
        with contextlib.suppress(FileNotFoundError), open(self.journal_path, "rb") as f:
            for line in f:
                try:
                    records.append(msgspec.json.decode(line))
                except msgspec.DecodeError:
                    break  # a record torn by a kill: everything before it is whole
        if state or records:
            store.restore(state, records)
        self._store = store
        self._write_snapshot(store.snapshot())
        self._fd = os.open(
            self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600
        )
        store.journal = self.append

    def append(self, record: list[Any]) -> None:
        """Append one record (called with the store's lock held)."""
        if self._fd is None:
            return
        os.write(self._fd, _encode(record) + b"\n")
        self._records += 1
        if self._records >= self.compact_every and self._store is not None:
            self._compact(self._store.snapshot_locked())

    def close(self) -> None:
        """Write a final snapshot and stop journaling."""
        store = self._store
        if store is not None and self._fd is not None:
            with store.lock:  # requests still in flight must not append between the two steps
                self._compact(store.snapshot_locked())
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _compact(self, state: dict[str, Any]) -> None:
        self._write_snapshot(state)
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
        self._records = 0

    def _write_snapshot(self, state: dict[str, Any]) -> None:
        temporary = f"{self.path}.tmp.{os.getpid()}"
        with open(temporary, "wb") as f:
            f.write(_encode(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, self.path)


# -- who may start it ---------------------------------------------------------------------------

_TOKEN = re.compile(r"[\x21-\x7e]{1,4096}")
"""A token is one word of visible ASCII: what an ``Authorization`` header carries unchanged."""

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")


def check_token(token: str | None, source: str = "the token") -> str | None:
    """Return ``token`` stripped, ``None`` for no token; refuse an empty or unusable one.

    Raises
    ------
    ConfigError
        If ``token`` is empty or only whitespace (which would silently mean "no authentication"),
        or not one word of visible ASCII of at most 4096 characters.
    """
    if token is None:
        return None
    token = token.strip()
    if not token:
        raise ConfigError(f"{source} is empty: refusing to start without authentication")
    if not _TOKEN.fullmatch(token):
        raise ConfigError(
            f"{source} must be one word of visible ASCII characters, at most 4096 of them"
        )
    return token


def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Return the addresses ``host`` stands for (an IP literal is not looked up)."""
    try:
        return [ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))]
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(host) or re.fullmatch(r"[0-9.]+", host):
        raise ConfigError(f"--host {host!r} is neither an IP address nor a host name")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"--host {host!r} does not resolve: {exc.strerror or exc}") from exc
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def check_exposure(host: str, token: str | None, *, insecure_no_auth: bool = False) -> None:
    """Refuse to listen beyond loopback without a token, unless ``insecure_no_auth``.

    Raises
    ------
    ConfigError
        If ``host`` is not an address or a resolvable name, or is reachable from other hosts
        while ``token`` is ``None`` and ``insecure_no_auth`` is false.
    """
    addresses = _addresses(host)
    if token is None and not insecure_no_auth and not all(a.is_loopback for a in addresses):
        raise ConfigError(
            f"refusing to listen on {host!r} without a token (anyone who reaches it could read "
            "and overwrite the key map): give --token-file or $THREEFS_METADATA_TOKEN, listen on "
            "127.0.0.1, or pass --insecure-no-auth"
        )


# -- the server -----------------------------------------------------------------------------------


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """How much of the service clients may hold, one or all together.

    Attributes
    ----------
    client_timeout_s
        Seconds a client has to send a request line and headers (counted from its connection, or
        from the previous answer on a kept-alive one), and again its body; an idle connection
        is closed after as long.
    max_connections
        Connections open at once. Past it, the oldest connection that has not made an authorized
        request yet is closed (the new one when every other one has).
    workers
        Threads that run the store's calls (which hold one lock anyway).
    max_inflight
        Requests read or answered at once, which bounds their bodies' memory to about
        ``max_inflight`` times :data:`~.metadata_http.MAX_BODY_BYTES`; the others wait, unread.
    backlog
        Listen backlog: connections the kernel queues before the server accepts them.
    shutdown_timeout_s
        At SIGTERM, how long requests in flight may take to finish.
    """

    client_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 15.0
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 4096
    workers: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    max_inflight: Annotated[int, msgspec.Meta(ge=1)] = 64
    backlog: Annotated[int, msgspec.Meta(ge=1)] = 1024
    shutdown_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 5.0


class _Connections(web.Server):
    """aiohttp's low-level server with a cap on open connections and a first-request deadline.

    aiohttp closes a kept-alive connection whose next request has not arrived
    ``keepalive_timeout`` after the previous answer; the deadline here does the same for the
    first request, which only recent aiohttp releases bound themselves.
    """

    def __init__(self, handler: Any, *, limits: Limits, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._limits = limits
        # Open connections, oldest first; each with its first-request timer until one arrives.
        self._open: dict[RequestHandler, asyncio.TimerHandle | None] = {}
        self._trusted: set[RequestHandler] = set()
        self.evicted = 0
        self.expired = 0

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        loop = asyncio.get_running_loop()
        self._open[handler] = loop.call_later(self._limits.client_timeout_s, self._expire, handler)
        if len(self._open) > self._limits.max_connections:
            victim = next(
                (c for c in self._open if c not in self._trusted and c is not handler), handler
            )
            self.evicted += 1
            self._forget(victim)
            victim.force_close()

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self._forget(handler)
        super().connection_lost(handler, exc)

    def started(self, handler: RequestHandler) -> None:
        """Note that a request's headers arrived on ``handler``: its first deadline is met."""
        if self._open.get(handler) is not None:
            timer = self._open[handler]
            assert timer is not None
            timer.cancel()
            self._open[handler] = None  # keeps its place: age is the time of connection

    def trust(self, handler: RequestHandler) -> None:
        """Note that ``handler`` made an authorized request: it is evicted only last."""
        if handler in self._open:
            self._trusted.add(handler)

    def _forget(self, handler: RequestHandler) -> None:
        timer = self._open.pop(handler, None)
        if timer is not None:
            timer.cancel()
        self._trusted.discard(handler)

    def _expire(self, handler: RequestHandler) -> None:
        if handler in self._open and self._open[handler] is not None:
            self._open[handler] = None
            self.expired += 1
            handler.force_close()


def _answer(status: int, payload: Any, *, close: bool = False) -> web.Response:
    """Return a JSON answer; ``close`` ends the connection after it (its body is left unread)."""
    response = web.Response(status=status, body=_encode(payload), content_type="application/json")
    if close:
        response.force_close()
    return response


class MetadataServer:
    """The HTTP service around one :class:`LocalMetadata`, on an asyncio loop.

    Parameters
    ----------
    store
        The metadata it serves.
    host, port
        Where to listen; port 0 picks a free one.
    token
        Bearer token every request must carry, or ``None``.
    limits
        What clients may hold (connections, time, memory).
    """

    def __init__(
        self,
        store: LocalMetadata,
        *,
        host: str = "127.0.0.1",
        port: int = 18000,
        token: str | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.store = store
        self.host = host
        self.port = port
        self.limits = limits or Limits()
        self._expected = f"Bearer {token}".encode() if token else None
        self._methods = _methods(store)
        self._executor: ThreadPoolExecutor | None = None
        self._runner: web.ServerRunner | None = None
        self._connections: _Connections | None = None
        self._inflight: asyncio.Semaphore | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The ``(host, port)`` it listens on (the first, where a name has several addresses)."""
        assert self._runner is not None, "start() first"
        bound = self._runner.addresses[0]
        return str(bound[0]), int(bound[1])

    async def start(self) -> None:
        """Listen (on the running loop).

        Raises
        ------
        OSError
            If the address cannot be bound (in use, not an address of this host).
        """
        limits = self.limits
        self._executor = ThreadPoolExecutor(limits.workers, thread_name_prefix="hicache-meta")
        self._inflight = asyncio.Semaphore(limits.max_inflight)
        wanted: dict[str, Any] = {
            "keepalive_timeout": limits.client_timeout_s,
            "lingering_time": min(2.0, limits.client_timeout_s),
            "max_line_size": 4096,
            "max_field_size": 8190,
            "max_headers": 32,
            "auto_decompress": False,
            "access_log": None,
            "logger": _http_logger,
        }
        accepted = inspect.signature(RequestHandler.__init__).parameters
        options = {name: value for name, value in wanted.items() if name in accepted}
        self._connections = _Connections(self._handle, limits=limits, **options)
        self._runner = web.ServerRunner(
            self._connections, shutdown_timeout=limits.shutdown_timeout_s
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.host, self.port, backlog=limits.backlog, reuse_address=True
        )
        await site.start()

    async def stop(self) -> None:
        """Stop listening, close idle connections, let requests in flight finish."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- requests -------------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        connections, inflight = self._connections, self._inflight
        assert connections is not None and inflight is not None
        connection = request.protocol
        connections.started(connection)
        if not self._authorized(request):  # before anything else, and before any body
            return _answer(401, "missing or wrong bearer token", close=True)
        connections.trust(connection)
        path = request.path.rstrip("/")
        if path == "/v1/health":
            if request.method != "GET":
                return _answer(405, "use GET for /v1/health", close=True)
            store = self.store
            return _answer(200, {"epoch": store.epoch, "grace_s": store.grace_left()})
        name = path.removeprefix("/v1/") if path.startswith("/v1/") else ""
        if name not in self._methods:
            return _answer(404, f"unknown method {name[:64]!r}", close=True)
        if request.method != "POST":
            return _answer(405, f"use POST for /v1/{name}", close=True)
        refused = _refuse_body(request)
        if refused is not None:
            return _answer(*refused, close=True)
        length = int(request.headers["Content-Length"])
        timeout = self.limits.client_timeout_s
        async with inflight:
            try:
                body = await _read_body(request, length, timeout)
            except asyncio.TimeoutError:
                return _answer(408, f"the body did not arrive within {timeout:g}s", close=True)
            except (asyncio.IncompleteReadError, ConnectionError, web.RequestPayloadError):
                return _answer(400, "the body ended early", close=True)
            if length <= _INLINE_BYTES:  # a thread hop would cost more than the call itself
                status, data = self._execute(name, body)
            else:  # a long batch: the loop goes on serving other connections meanwhile
                loop = asyncio.get_running_loop()
                status, data = await loop.run_in_executor(self._executor, self._execute, name, body)
        return web.Response(status=status, body=data, content_type="application/json")

    def _authorized(self, request: web.BaseRequest) -> bool:
        expected = self._expected
        if expected is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode("utf-8", "backslashreplace"), expected)

    def _execute(self, name: str, body: bytes) -> tuple[int, bytes]:
        """Decode, call the store, encode (on a worker thread)."""
        kind, call = self._methods[name]
        try:
            return 200, _encode(call(msgspec.json.decode(body, type=kind)))
        except msgspec.DecodeError as exc:  # malformed JSON, or a value out of its bounds
            return 400, _encode(f"malformed {name} request: {exc}")
        except GeometryError as exc:
            return 409, _encode(str(exc))
        except Exception:
            logger.exception("metadata service: %s failed", name)
            return 500, _encode(f"{name} failed inside the service")


async def _read_body(request: web.BaseRequest, length: int, timeout: float) -> bytes:
    """Read the ``length`` bytes of the body of ``request`` within ``timeout`` seconds."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await request.content.readexactly(length)
    return await asyncio.wait_for(request.content.readexactly(length), timeout)


def _refuse_body(request: web.BaseRequest) -> tuple[int, str] | None:
    """Return why the body of ``request`` will not be read, judged on its headers alone."""
    headers = request.headers
    declared = headers.get("Content-Length")
    if declared is None or "Transfer-Encoding" in headers:
        return 411, "send the body with a Content-Length (chunked bodies are not accepted)"
    if not (declared.isascii() and declared.isdigit()):
        return 400, f"Content-Length {declared[:32]!r} is not a length"
    if headers.get("Content-Encoding", "identity").lower() != "identity":
        return 415, "compressed bodies are not accepted"
    if int(declared) > MAX_BODY_BYTES:
        return 413, (
            f"a body of {int(declared)} bytes is over the limit of {MAX_BODY_BYTES}: "
            f"send at most {MAX_KEYS_PER_CALL} keys per call"
        )
    return None


# -- running it -----------------------------------------------------------------------------------


def _fit_descriptors(limits: Limits) -> Limits:
    """Raise the open-files limit to fit ``max_connections``, or lower it to what fits."""
    spare = 64  # the listening sockets, snapshot, journal, stdio
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = limits.max_connections + spare
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitted = max(1, soft - spare)
        print(
            f"hicache metadata service: {fitted} connections at most (open-files limit {soft})",
            file=sys.stderr,
        )
        return msgspec.structs.replace(limits, max_connections=fitted)
    return limits


def _load(persistence: Persistence, store: LocalMetadata) -> None:
    """Restore ``store``; any failure is a one-line :class:`ConfigError`."""
    try:
        persistence.load(store)
    except OSError as exc:
        journal = exc.filename == persistence.journal_path
        where = persistence.journal_path if journal else persistence.path
        raise ConfigError(f"cannot use snapshot {where}: {exc.strerror or exc}") from exc
    except (msgspec.DecodeError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"cannot restore from snapshot {persistence.path}: {exc!r}") from exc


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 18000,
    token: str | None = None,
    snapshot: str | None = None,
    lease_s: float = 30.0,
    insecure_no_auth: bool = False,
    limits: Limits | None = None,
    ready: Callable[[MetadataServer], None] | None = None,
) -> None:
    """Run the metadata service until SIGTERM or SIGINT (then snapshot, if persistent).

    Parameters
    ----------
    host, port
        Where to listen; 127.0.0.1 unless the service must be reached from other hosts.
    token
        Bearer token clients must send; required for a ``host`` other than loopback.
    snapshot
        Snapshot file for persistence (its journal sits beside it); ``None`` keeps state in
        memory only.
    lease_s
        How long a reservation lives without a commit; also the start-up grace without state.
    insecure_no_auth
        Listen beyond loopback without a token all the same.
    limits
        What clients may hold (see :class:`Limits`).
    ready
        Called with the server once it listens.

    Raises
    ------
    ConfigError
        If the service cannot start as asked: an empty token, no token beyond loopback, a bad
        host, a snapshot that cannot be read or written, an address in use. Its message is one
        line; nothing has been served.
    """
    token = check_token(token)
    check_exposure(host, token, insecure_no_auth=insecure_no_auth)
    limits = _fit_descriptors(limits or Limits())
    persistence = Persistence(snapshot) if snapshot else None
    restored = persistence is not None and persistence.found()
    # Nothing to restore: writers of an earlier run may still be writing into slots this run
    # does not know are taken, so no slot is handed out until their leases have run out.
    store = LocalMetadata(lease_s=lease_s, grace_s=0.0 if restored else lease_s)
    if persistence is not None:
        _load(persistence, store)
    try:
        asyncio.run(_run(store, host, port, token, limits, persistence, restored, ready))
    finally:
        if persistence is not None:
            persistence.close()


async def _run(
    store: LocalMetadata,
    host: str,
    port: int,
    token: str | None,
    limits: Limits,
    persistence: Persistence | None,
    restored: bool,
    ready: Callable[[MetadataServer], None] | None,
) -> None:
    server = MetadataServer(store, host=host, port=port, token=token, limits=limits)
    try:
        await server.start()
    except OSError as exc:
        await server.stop()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    bound_host, bound_port = server.address
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(
        f"hicache metadata service on http://{shown}:{bound_port} epoch {store.epoch} "
        f"lease {store.lease_s:g}s "
        + (f"snapshot {persistence.path}" if persistence else "in memory (no snapshot)")
        + ("; state restored" if restored else "")
        + ("" if token else "; no token"),
        file=sys.stderr,
        flush=True,
    )
    if ready is not None:
        ready(server)
    try:
        await stopping.wait()
    finally:
        await server.stop()


if __name__ == "__main__":
    from hicache_storage.backends.threefs.command import metadata_server_command

    metadata_server_command()
