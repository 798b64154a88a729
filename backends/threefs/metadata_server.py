"""The metadata service: a :class:`LocalMetadata` behind a small HTTP server, optionally persistent.

Run it with ``hicache metadata-server`` (or ``python -m`` this module). Every process and instance
of the 3FS backend that sets ``metadata_url`` shares it; namespaces keep ranks and file sets apart.

Protocol
    ``POST /v1/<method>`` with a JSON object of the :class:`Metadata` method's arguments;
    the answer is the JSON of its result. ``GET /v1/health`` answers the epoch and the seconds
    left before writes are accepted (``grace_s``, see below). With a token,
    every request needs ``Authorization: Bearer <token>`` (401 otherwise). A geometry conflict
    answers 409, a malformed request 400.

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

import contextlib
import hmac
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec

from .metadata import Geometry, GeometryError
from .metadata_local import LocalMetadata

__all__ = ["MetadataServer", "Persistence", "serve"]

logger = logging.getLogger(__name__)

_MAX_BODY = 64 << 20
_encode = msgspec.json.Encoder().encode


class _Open(msgspec.Struct, forbid_unknown_fields=True):
    ns: str
    geometry: Geometry


class _Keys(msgspec.Struct, forbid_unknown_fields=True):
    ns: str
    keys: list[str]


class _Confirm(msgspec.Struct, forbid_unknown_fields=True):
    ns: str
    epoch: str
    pairs: list[tuple[str, int]]


class _Reserve(msgspec.Struct, forbid_unknown_fields=True):
    ns: str
    geometry: Geometry
    items: list[tuple[str, int]]


class _Ids(msgspec.Struct, forbid_unknown_fields=True):
    ns: str
    epoch: str
    ids: list[int]


class _Ns(msgspec.Struct, forbid_unknown_fields=True):
    ns: str


def _methods(store: LocalMetadata) -> dict[str, tuple[type[Any], Callable[[Any], Any]]]:
    """Map each method name to its request type and the call it makes."""
    return {
        "open": (_Open, lambda r: store.open(r.ns, r.geometry)),
        "lookup": (_Keys, lambda r: store.lookup(r.ns, r.keys)),
        "confirm": (_Confirm, lambda r: store.confirm(r.ns, r.epoch, r.pairs)),
        "exists": (_Keys, lambda r: store.exists(r.ns, r.keys)),
        "reserve": (_Reserve, lambda r: store.reserve(r.ns, r.geometry, r.items)),
        "commit": (_Ids, lambda r: store.commit(r.ns, r.epoch, r.ids)),
        "abort": (_Ids, lambda r: store.abort(r.ns, r.epoch, r.ids)),
        "delete": (_Keys, lambda r: store.delete(r.ns, r.keys)),
        "clear": (_Ns, lambda r: store.clear(r.ns)),
        "states": (_Keys, lambda r: store.states(r.ns, r.keys)),
        "stats": (_Ns, lambda r: store.stats(r.ns)),
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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: MetadataServer

    def setup(self) -> None:
        super().setup()
        with contextlib.suppress(OSError):
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return True
        self._reply(401, b'"missing or wrong bearer token"')
        return False

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path.rstrip("/") == "/v1/health":
            store = self.server.store
            self._reply(200, _encode({"epoch": store.epoch, "grace_s": store.grace_left()}))
        else:
            self._reply(404, b'"unknown path"')

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY:
            self.close_connection = True
            self._reply(413, b'"request too large"')
            return
        body = self.rfile.read(length)
        if not self._authorized():
            return
        name = self.path.rstrip("/").removeprefix("/v1/")
        method = self.server.methods.get(name)
        if method is None:
            self._reply(404, _encode(f"unknown method {name!r}"))
            return
        kind, call = method
        try:
            request = msgspec.json.decode(body, type=kind)
            self._reply(200, _encode(call(request)))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._reply(400, _encode(f"malformed {name} request: {exc}"))
        except GeometryError as exc:
            self._reply(409, _encode(str(exc)))


class MetadataServer(ThreadingHTTPServer):
    """The HTTP server around one :class:`LocalMetadata`.

    Parameters
    ----------
    address
        ``(host, port)``; port 0 picks a free one.
    store
        The metadata it serves.
    token
        Bearer token every request must carry, or ``None``.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], store: LocalMetadata, *, token: str | None = None
    ) -> None:
        self.store = store
        self.token = token or None
        self.methods = _methods(store)
        super().__init__(address, _Handler)


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 18000,
    token: str | None = None,
    snapshot: str | None = None,
    lease_s: float = 30.0,
    ready: Callable[[MetadataServer], None] | None = None,
) -> None:
    """Run the metadata service until SIGTERM or SIGINT (then snapshot, if persistent).

    Parameters
    ----------
    host, port
        Where to listen; 127.0.0.1 unless the service must be reached from other hosts.
    token
        Bearer token clients must send.
    snapshot
        Snapshot file for persistence (its journal sits beside it); ``None`` keeps state in
        memory only.
    lease_s
        How long a reservation lives without a commit; also the start-up grace without state.
    ready
        Called with the server once it listens.
    """
    persistence = Persistence(snapshot) if snapshot else None
    restored = persistence is not None and persistence.found()
    # Nothing to restore: writers of an earlier run may still be writing into slots this run
    # does not know are taken, so no slot is handed out until their leases have run out.
    store = LocalMetadata(lease_s=lease_s, grace_s=0.0 if restored else lease_s)
    if persistence is not None:
        persistence.load(store)
    server = MetadataServer((host, port), store, token=token)

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    bound_host, bound_port = server.server_address[:2]
    print(
        f"hicache metadata service on http://{bound_host!s}:{bound_port} epoch {store.epoch} "
        f"lease {lease_s:g}s "
        + (f"snapshot {persistence.path}" if persistence else "in memory (no snapshot)")
        + ("; state restored" if restored else ""),
        file=sys.stderr,
        flush=True,
    )
    if ready is not None:
        ready(server)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        if persistence is not None:
            persistence.close()


if __name__ == "__main__":
    from hicache_storage.cli.metadata_server import metadata_server_command

    metadata_server_command()
