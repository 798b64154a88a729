"""One Mooncake store client per process and settings, shared by every backend instance.

``MooncakeDistributedStore.setup`` starts a transfer engine, opens listening ports and mounts a
segment; ``close`` takes about a second and drops every object stored in the client's segment.
So instances built with equal settings share one client (keyed by settings and PID, so a forked
child builds its own), it stays open while the process lives, and :func:`close_clients` (run
at exit) closes them.

Also here, the one place Mooncake's answers become typed errors: the return-code table, the TCP
probe of the master that runs before ``setup`` (with no master answering, ``setup`` blocks about
90 seconds) and, once a call has failed with an RPC error, before every call until the master
answers again, so an outage costs one client RPC timeout (about 4 s) and then fails fast.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from hicache_storage.errors import (
    BackendError,
    BackendIOError,
    BackendUnavailableError,
    MissingDependencyError,
)

from .config import MooncakeSettings

__all__ = [
    "CODES",
    "NOT_FOUND",
    "SharedClient",
    "acquire",
    "close_clients",
    "code_name",
    "probe",
]

logger = logging.getLogger(__name__)

Count = Callable[..., None]
"""``count(reason)`` or ``count(reason, n)``: where a caller tallies failures by reason."""

NOT_FOUND = -704
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
}
_UNREACHABLE = frozenset({-900, -901, -1010})
"""Codes meaning the master could not be asked: the outage path, not an answer about a key."""


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
        self.pid = os.getpid()
        self._regions: dict[int, tuple[int, int]] = {}
        self._regions_lock = threading.Lock()
        self._down = False
        self.staging_lock = threading.Lock()
        self._require_master("before setup", _ignore)
        endpoint = _metadata_endpoint(settings.metadata_server)
        if endpoint is not None:
            reason = probe(*endpoint, settings.probe_timeout_s)
            if reason is not None:
                raise BackendUnavailableError(
                    f"mooncake metadata server {settings.metadata_server} is not reachable "
                    f"({reason}); start it or set metadata_server / $MOONCAKE_TE_META_DATA_SERVER"
                )
        store = MooncakeDistributedStore()
        started = time.monotonic()
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

    # -- errors ---------------------------------------------------------------------------------

    def _require_master(self, when: str, count: Count) -> None:
        settings = self.settings
        reason = probe(settings.master_host, settings.master_port, settings.probe_timeout_s)
        if reason is not None:
            count("master_unreachable")
            raise BackendUnavailableError(
                f"mooncake master {settings.master} is not reachable {when} ({reason}); start "
                "mooncake_master there or set the 'master' option / $MOONCAKE_MASTER"
            )

    @contextlib.contextmanager
    def call(self, what: str, count: Count) -> Iterator[None]:
        """Guard one client call: fail fast while the master is down, translate exceptions.

        ``count(reason)`` is told about every failure.
        """
        if self._down:
            self._require_master(f"for {what}", count)
            self._down = False
        try:
            yield
        except BackendError:
            raise
        except (RuntimeError, ValueError, TypeError, OSError) as exc:
            count("client_exception")
            raise BackendIOError(f"mooncake {what} failed: {exc}") from exc

    def check(self, code: int, what: str, count: Count) -> int:
        """Return ``code`` unless it says the master is unreachable; then raise.

        Raises
        ------
        BackendUnavailableError
            For ``RPC_FAIL``-like codes; later calls probe the master first.
        """
        if code in _UNREACHABLE:
            self._down = True
            count(code_name(code))
            raise BackendUnavailableError(
                f"mooncake {what} failed with {code} ({code_name(code)}): master "
                f"{self.settings.master} did not answer"
            )
        return code

    def check_batch(self, codes: list[int], what: str, count: Count) -> list[int]:
        """Return per-key codes; raise when every key failed because the master was unreachable.

        Raises
        ------
        BackendUnavailableError
            If no key got an answer.
        """
        if codes and all(code in _UNREACHABLE for code in codes):
            self.check(codes[0], what, count)
        if any(code in _UNREACHABLE for code in codes):
            self._down = True
        return codes

    # -- registered memory ----------------------------------------------------------------------

    def _register(self, ptr: int, nbytes: int) -> None:
        with self.call("register_buffer", _ignore):
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
        """Unregister everything and close the store (drops objects in this client's segment)."""
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
