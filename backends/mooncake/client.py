"""One Mooncake store client per process and settings, shared by every backend instance.

``MooncakeDistributedStore.setup`` starts a transfer engine, opens listening ports and mounts a
segment; ``close`` takes about a second and drops every object stored in the client's segment.
So instances built with equal settings share one client (keyed by settings and PID, so a forked
child builds its own), it stays open while the process lives, and :func:`close_clients` (run
at exit) closes them.

Also here, the one place Mooncake's answers become typed errors: the return-code table, the TCP
probe of the master that runs before ``setup`` (with no master answering, ``setup`` blocks about
90 seconds), and the circuit breaker. Once a request finds the master unreachable, a background
thread probes it (a TCP connect, then ``is_exist``) until it answers again. Meanwhile a call fails
at once while the master is known to be silent (its port accepts but it does not answer: a
paused or hung master) or its port refuses connections; when the port accepts again and the
master was not known to be silent, the call asks it (a restarted master is used at once), and
any answer closes the breaker. So an outage costs one call one RPC timeout, and the others
nothing.

Deadlines. ``deadline_s`` is split (:class:`Timeouts`) into what the client library can be told:
the master RPC and connect timeouts (``MC_RPC_TIMEOUT_MS``, ``MC_RPC_CONNECT_TIMEOUT_MS``, read
once when a client is set up) and the TCP transfer timeouts (``MC_TCP_STATUS_TIMEOUT_SEC``,
``MC_TCP_PROGRESS_TIMEOUT_SEC``, whole seconds, read at every transfer, so they stay set for the
life of the process). Every request therefore returns by itself, and only after the transfers it
started have ended: nothing is abandoned while it could still write into a caller's buffer or a
registered host-pool page. A call starts a request only while what is left of its
:class:`~hicache_storage.kit.Deadline` covers that request's worst case (:meth:`Timeouts.cost`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from hicache_storage.errors import (
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    MissingDependencyError,
)
from hicache_storage.kit import ErrorMap, Verdict
from hicache_storage.redact import redact_url

from .config import MooncakeSettings

__all__ = [
    "CODES",
    "NOT_FOUND",
    "NO_SPACE",
    "RPC_FAIL",
    "SKIPPED",
    "UNCONFIRMED",
    "UNREACHABLE",
    "SharedClient",
    "Timeouts",
    "acquire",
    "close_clients",
    "code_name",
    "library_timeouts",
    "probe",
]

logger = logging.getLogger(__name__)

Count = Callable[..., None]
"""``count(reason)`` or ``count(reason, n)``: where a caller tallies failures by reason."""

NOT_FOUND = -704
NO_SPACE = -200
SKIPPED = -20000
"""Not Mooncake's: a request this backend did not start because its call's deadline left too
little time for it (counted as ``deadline_exceeded``)."""

UNCONFIRMED = -20001
"""Not Mooncake's: a put sent again after its first attempt failed at the connection, answered
``OBJECT_ALREADY_EXISTS``; the object may be the first attempt's, never completed, so the put
counts as not stored."""

RPC_FAIL = -900

CODES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    SKIPPED: "deadline_exceeded",
    UNCONFIRMED: "put_unconfirmed",
}
UNREACHABLE = frozenset({-900, -901, -1010})
"""Codes meaning the master could not be asked: the outage path, not an answer about a key."""

_SILENT = -901
"""``RPC_TIMEOUT``: the master took the request and did not answer (paused, hung, overloaded)."""

_PROBE_KEY = "hicache-mooncake-probe"
"""What the breaker's probe asks the master about (never stored)."""

_PROBE_INTERVAL_S = 0.2

_SETUP_ENV = ("MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS", "MC_STORE_CLIENT_SETUP_RETRIES")
"""Read only during ``setup``: the master client's RPC and connect timeouts (kept for its
life), and how many times ``setup`` retries building the client (20 by default, each waiting
on the master)."""

_SETUP_PAUSE_S = 0.1
"""What ``setup`` sleeps between its retries."""

_TRANSFER_ENV = ("MC_TCP_STATUS_TIMEOUT_SEC", "MC_TCP_PROGRESS_TIMEOUT_SEC")
"""Read at every TCP transfer, so they must stay set for the life of the process."""

_ENV_LOCK = threading.Lock()

Request = Literal["meta", "get", "put"]


@dataclasses.dataclass(frozen=True, slots=True)
class Timeouts:
    """How one per-call deadline is shared out among the client library's timeouts.

    ``transfer_s`` (the TCP transport's status-frame and no-progress timeouts) counts whole
    seconds: a fifth of the deadline, at least 1. ``rpc_s`` (each master RPC, and each connect
    to the master) is a quarter of the rest. The worst cases of one library request
    (:meth:`cost`) then fit in the deadline: a put waits on up to three RPCs (start, end,
    revoke) and a transfer, a get on one RPC (the replica query) and a transfer, a metadata
    query on one RPC.
    """

    deadline_s: float
    rpc_s: float
    transfer_s: int

    @classmethod
    def split(cls, deadline_s: float) -> Timeouts:
        """Share ``deadline_s`` out (it must be at least 2 seconds)."""
        transfer = max(1, int(deadline_s // 5))
        return cls(deadline_s=deadline_s, rpc_s=(deadline_s - transfer) / 4, transfer_s=transfer)

    @property
    def setup_retries(self) -> int:
        """How many client builds ``setup`` may try: as many as fit the deadline, at least 2."""
        return max(2, int(self.deadline_s // (self.rpc_s + _SETUP_PAUSE_S)))

    def cost(self, request: Request) -> float:
        """Return the longest one library request of this kind can wait on a silent master.

        A silent segment holder costs ``transfer_s`` per wave of transfers the library runs to
        it (four at a time), which no setting bounds per request (docs/backends/mooncake.md).
        """
        if request == "put":
            return 3 * self.rpc_s + self.transfer_s
        if request == "get":
            return self.rpc_s + self.transfer_s
        return self.rpc_s


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


@contextlib.contextmanager
def library_timeouts(timeouts: Timeouts) -> Iterator[None]:
    """Hand the client library the timeouts derived from a deadline, around its ``setup``.

    The RPC timeouts and the setup retries are set for the block only (the library reads them
    while it sets up); a smaller value already in the environment is kept. The TCP transfer
    timeouts stay set afterwards (the transport reads them at every transfer), lowered to this
    deadline's share when the environment holds none or a longer one: with clients of several
    deadlines in one process, the shortest wins for all of them.
    """
    with _ENV_LOCK:
        for name in _TRANSFER_ENV:
            current = _positive_int(os.environ.get(name))
            if current is None or current > timeouts.transfer_s:
                os.environ[name] = str(timeouts.transfer_s)
        saved = {name: os.environ.get(name) for name in _SETUP_ENV}
        rpc_ms = max(1, round(timeouts.rpc_s * 1000))
        ours = dict(zip(_SETUP_ENV, (rpc_ms, rpc_ms, timeouts.setup_retries), strict=True))
        for name, wanted in ours.items():
            current = _positive_int(saved[name])
            os.environ[name] = str(wanted if current is None else min(current, wanted))
        try:
            yield
        finally:
            for name, before in saved.items():
                if before is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = before


def code_name(code: int) -> str:
    """Return Mooncake's name for a return code (``E<code>`` when unknown)."""
    return CODES.get(code, f"E{code}")


def probe(host: str, port: int, timeout: float) -> str | None:
    """Return why ``host:port`` does not accept a TCP connection, or None when it does."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _ignore(reason: str, n: int = 1) -> None:
    """Count nothing (failures outside any backend instance's calls)."""


def _metadata_endpoint(metadata_server: str) -> tuple[str, int] | None:
    """Return the ``host:port`` of an HTTP or etcd metadata server (None for P2PHANDSHAKE)."""
    scheme, sep, rest = metadata_server.partition("://")
    if not sep or scheme not in ("http", "https", "etcd"):
        return None
    netloc = rest.split("/", 1)[0].split(",", 1)[0]
    host, sep, port = netloc.rpartition(":")
    if not sep or not port.isdigit():
        return (netloc, 443 if scheme == "https" else 80) if scheme != "etcd" else None
    return host.strip("[]"), int(port)


class SharedClient:
    """A set-up ``MooncakeDistributedStore`` with its staging buffer and registered regions.

    Parameters
    ----------
    settings
        The resolved settings; only those in :meth:`MooncakeSettings.client_key` matter.

    Raises
    ------
    MissingDependencyError
        If the ``mooncake`` package is not installed.
    BackendUnavailableError
        If the master (or an HTTP/etcd metadata server) does not accept connections, or
        ``setup`` fails.
    """

    def __init__(self, settings: MooncakeSettings) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise MissingDependencyError(
                "backend 'mooncake' needs the mooncake package; run: pip install "
                "'hicache-storage[mooncake]' (CUDA hosts) or 'hicache-storage[mooncake-cpu]'"
                f" (hosts without CUDA): {exc}"
            ) from exc
        self.settings = settings
        self.timeouts = Timeouts.split(settings.deadline_s)
        self.pid = os.getpid()
        self._regions: dict[int, tuple[int, int]] = {}
        self._regions_lock = threading.Lock()
        self._breaker = threading.Lock()
        self._down = False
        self._silent = False
        self._prober: threading.Thread | None = None
        self._closing = threading.Event()
        self._warned_no_space = False
        self._in_flight = threading.BoundedSemaphore(REQUESTS_IN_FLIGHT)
        self.staging_lock = threading.Lock()
        self._require_master("before setup")
        endpoint = _metadata_endpoint(settings.metadata_server)
        if endpoint is not None:
            reason = probe(*endpoint, settings.probe_timeout_s)
            if reason is not None:
                raise BackendUnavailableError(
                    f"mooncake metadata server {redact_url(settings.metadata_server)} is not "
                    f"reachable ({reason}); start it or set metadata_server / "
                    "$MOONCAKE_TE_META_DATA_SERVER"
                )
        store = MooncakeDistributedStore()
        started = time.monotonic()
        with library_timeouts(self.timeouts):
            code = store.setup(
                settings.local_hostname,
                settings.metadata_server,
                settings.global_segment_size,
                0,  # the library's own buffer serves put()/get(), which this backend never calls
                settings.protocol,
                settings.device,
                settings.master,
            )
        if code != 0:
            raise BackendUnavailableError(
                f"mooncake setup against master {settings.master} failed with {code} "
                f"({code_name(code)}) after {time.monotonic() - started:.1f}s; check the "
                f"master's log, protocol={settings.protocol!r} and device={settings.device!r}"
            )
        self.store: Any = store
        self.staging: npt.NDArray[np.uint8] = np.zeros(
            max(settings.local_buffer_size, 1), dtype=np.uint8
        )
        self.staging_ptr = int(self.staging.ctypes.data)
        self._register(self.staging_ptr, self.staging.nbytes)

    # -- errors and the breaker -----------------------------------------------------------------

    def _require_master(self, when: str) -> None:
        settings = self.settings
        reason = probe(settings.master_host, settings.master_port, settings.probe_timeout_s)
        if reason is not None:
            raise BackendUnavailableError(
                f"mooncake master {settings.master} is not reachable {when} ({reason}); start "
                "mooncake_master there or set the 'master' option / $MOONCAKE_MASTER"
            )

    @property
    def down(self) -> bool:
        """Whether the breaker is open: the master did not answer and has not answered since."""
        return self._down

    def mark_down(self, code: int) -> None:
        """Open the breaker after ``code`` (an unreachable code); start the background probe."""
        with self._breaker:
            self._down = True
            self._silent = code == _SILENT
            if self._prober is None and not self._closing.is_set():
                self._prober = threading.Thread(
                    target=self._probe_master, name="mooncake-master-probe", daemon=True
                )
                self._prober.start()

    def mark_up(self) -> None:
        """Close the breaker: the master answered a request."""
        if self._down:
            with self._breaker:
                self._down = False
                self._silent = False

    def _may_ask(self) -> bool:
        """While the breaker is open: whether a call may still send the master a request.

        Not while the master is known to be silent (the probe reopens the way); otherwise when
        its port accepts connections (a restarted master), within the RPC timeout.
        """
        if self._silent:
            return False
        settings = self.settings
        timeout = min(settings.probe_timeout_s, self.timeouts.rpc_s)
        return probe(settings.master_host, settings.master_port, timeout) is None

    def _probe_master(self) -> None:
        """While the breaker is open, probe the master; close the breaker when it answers.

        The query (``is_exist``) writes into no caller memory, and the library bounds it by the
        RPC timeout; no call waits on this thread.
        """
        settings = self.settings
        while True:
            with self._breaker:
                if not self._down or self._closing.is_set():
                    self._prober = None
                    return
            if probe(settings.master_host, settings.master_port, settings.probe_timeout_s) is None:
                try:
                    code = int(self.store.is_exist(_PROBE_KEY))
                except Exception:  # noqa: BLE001 - any failure means: not yet
                    code = -1
                if code in (0, 1):
                    self.mark_up()
                    logger.info("mooncake master %s answers again", settings.master)
                    continue
                # Silent only when it took the request and let it time out; a failed request
                # (a connection the restarted master reset) lets calls ask again.
                self._silent = code == _SILENT
            else:
                self._silent = False
            self._closing.wait(_PROBE_INTERVAL_S)

    @contextlib.contextmanager
    def call(self, what: str, count: Count) -> Iterator[None]:
        """Guard one request to the store: fail at once while the breaker is open.

        ``count(reason)`` is told about every failure.

        Raises
        ------
        BackendUnavailableError
            While the master is known not to answer.
        BackendTimeoutError
            If :data:`REQUESTS_IN_FLIGHT` requests stay in flight for a whole RPC timeout.
        """
        if self._down and not self._may_ask():
            count("master_unreachable")
            raise BackendUnavailableError(
                f"mooncake master {self.settings.master} did not answer a recent request; "
                f"{what} fails at once until it answers again"
            )
        if not self._in_flight.acquire(timeout=self.timeouts.rpc_s):
            count("requests_in_flight")
            raise BackendTimeoutError(
                f"mooncake {what} waited {self.timeouts.rpc_s:.3g} s for one of the "
                f"{REQUESTS_IN_FLIGHT} requests in flight to end"
            )
        try:
            with _ERRORS.guard(what, count):
                yield
        finally:
            self._in_flight.release()

    def check(self, code: int, what: str, count: Count) -> int:
        """Return ``code`` unless it says the master is unreachable; then raise.

        Raises
        ------
        BackendUnavailableError
            For ``RPC_FAIL``-like codes; the breaker opens.
        """
        if code in UNREACHABLE:
            self.mark_down(code)
            count(code_name(code))
            raise BackendUnavailableError(
                f"mooncake {what} failed with {code} ({code_name(code)}): master "
                f"{self.settings.master} did not answer"
            )
        self.mark_up()
        return code

    def check_batch(self, codes: list[int], what: str, count: Count) -> list[int]:
        """Return per-key codes; raise when no key got an answer.

        Raises
        ------
        BackendUnavailableError
            If every key failed because the master was unreachable.
        BackendTimeoutError
            If no key got an answer and some were not even asked, for want of time.
        """
        failed = next((code for code in codes if code in UNREACHABLE), None)
        if failed is not None:
            self.mark_down(failed)
        elif any(code != SKIPPED for code in codes):
            self.mark_up()
        if codes and all(code in UNREACHABLE for code in codes):
            self.check(codes[0], what, count)
        if codes and all(code in UNREACHABLE or code == SKIPPED for code in codes):
            count(code_name(SKIPPED))
            raise BackendTimeoutError(
                f"mooncake {what} did not finish within deadline_s={self.settings.deadline_s:g}s"
            )
        return codes

    def note_no_space(self) -> None:
        """Log once that a put found no segment memory (a client with no holder to use)."""
        if self._warned_no_space:
            return
        self._warned_no_space = True
        logger.warning(
            "mooncake master %s found no segment memory for a put (NO_AVAILABLE_HANDLE): the "
            "store is full, or no process contributes memory%s; run a segment holder "
            "(mooncake_client -global_segment_size=...) or give this backend "
            "global_segment_size",
            self.settings.master,
            " (this client mounts none: global_segment_size=0)"
            if self.settings.global_segment_size == 0
            else "",
        )

    # -- registered memory ----------------------------------------------------------------------

    def _register(self, ptr: int, nbytes: int) -> None:
        with _ERRORS.guard("register_buffer", _ignore):
            code = self.store.register_buffer(ptr, nbytes)
        if code != 0:
            raise BackendIOError(
                f"mooncake register_buffer of {nbytes} bytes at {ptr:#x} failed with {code} "
                f"({code_name(code)})"
            )

    def retain(self, ptr: int, nbytes: int) -> None:
        """Register ``[ptr, ptr + nbytes)`` once, counting the holders.

        Raises
        ------
        BackendIOError
            If Mooncake refuses the region (for example, it overlaps another registered one).
        """
        with self._regions_lock:
            held = self._regions.get(ptr)
            if held is not None and held[0] == nbytes:
                self._regions[ptr] = (nbytes, held[1] + 1)
                return
            self._register(ptr, nbytes)
            self._regions[ptr] = (nbytes, 1)

    def release(self, ptr: int) -> None:
        """Drop one hold on a region; unregister it when nobody holds it."""
        with self._regions_lock:
            held = self._regions.get(ptr)
            if held is None:
                return
            if held[1] > 1:
                self._regions[ptr] = (held[0], held[1] - 1)
                return
            del self._regions[ptr]
            code = self.store.unregister_buffer(ptr)
        if code != 0:
            logger.warning("mooncake unregister_buffer(%#x) returned %s", ptr, code_name(code))

    def registered_bytes(self) -> int:
        """Return the bytes of host-pool memory registered with the store."""
        with self._regions_lock:
            return sum(nbytes for nbytes, _ in self._regions.values())

    def close(self) -> None:
        """Stop the probe, unregister everything and close the store.

        Closing drops the objects in this client's segment.
        """
        self._closing.set()
        prober = self._prober
        if prober is not None:
            prober.join(self.timeouts.rpc_s + self.settings.probe_timeout_s + 1.0)
        with self._regions_lock:
            for ptr in list(self._regions):
                self.store.unregister_buffer(ptr)
            self._regions.clear()
        self.store.unregister_buffer(self.staging_ptr)
        self.store.close()

    @contextlib.contextmanager
    def temporary(self, nbytes: int) -> Iterator[tuple[npt.NDArray[np.uint8], int]]:
        """Yield a freshly registered buffer of ``nbytes`` (for values beyond the staging one)."""
        buffer = np.empty(nbytes, dtype=np.uint8)
        ptr = int(buffer.ctypes.data)
        self._register(ptr, nbytes)
        try:
            yield buffer, ptr
        finally:
            self.store.unregister_buffer(ptr)


class _ClientErrors(ErrorMap):
    """The client library raises plain Python exceptions: each is an I/O error of the call."""

    def describe(self, exc: BaseException, what: str) -> Verdict:
        return Verdict(BackendIOError, f"mooncake {what} failed: {exc}", "client_exception")


_ERRORS = _ClientErrors("mooncake", catch=(RuntimeError, ValueError, TypeError, OSError))
"""Turns the client library's exceptions into ``BackendIOError``, counted by the call."""

REQUESTS_IN_FLIGHT = 8
"""Most store requests one process's client has in flight at once. The client library opens a
connection (to the master, to a segment holder) for each request in flight that finds none idle
and pools it for the process's life, so unbounded callers (32 racing first calls) raise the
process's descriptors whenever more of them overlap than ever before (seen: 2 master connections
growing to 5 over four rounds of the suite's leak check). An engine calls storage from a handful
of threads (SGLang's prefetch, I/O and backup threads; vLLM's loads and stores), under the
bound; more callers wait their turn, within each request's own RPC timeout."""

_CLIENTS: dict[tuple[object, ...], SharedClient] = {}
_CLIENTS_LOCK = threading.Lock()


def acquire(settings: MooncakeSettings) -> SharedClient:
    """Return this process's client for ``settings``, setting one up on first use."""
    key = (os.getpid(), *settings.client_key())
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = SharedClient(settings)
        return client


def close_clients() -> None:
    """Close every client this process set up (run at interpreter exit)."""
    with _CLIENTS_LOCK:
        mine = [key for key, client in _CLIENTS.items() if client.pid == os.getpid()]
        clients = [_CLIENTS.pop(key) for key in mine]
    for client in clients:
        try:
            client.close()
        except Exception:
            logger.warning("closing the mooncake client failed", exc_info=True)


atexit.register(close_clients)
