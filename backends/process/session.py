"""One storage process and the socket to it: calls out, replies in, and a death that is final.

The storage process moves pages in the caller's shared host pool, so a call that has returned
must never be served afterwards: its slots may already hold other KV. A reply that comes too late
cannot be prevented by the caller, only made impossible: a call unanswered by its deadline kills
the storage process (SIGKILL through a pidfd, so a reused pid is never signalled) and returns only
once the process is dead, with everything else in flight failed as unavailable. The caller never
blocks on the socket either: a sender thread writes the requests, so a full socket to a paused
process delays no call past its deadline.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import select
import signal
import socket
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Final

from hicache_storage.errors import BackendTimeoutError, BackendUnavailableError

from .launcher import launcher
from .protocol import Reply, Request, Start

__all__ = ["DEATH_S", "EXIT_S", "StorageProcess", "live_processes"]

logger = logging.getLogger(__name__)

EXIT_S: Final = 10.0
"""How long ``close`` lets the storage process finish its calls and exit before killing it."""

DEATH_S: Final = 5.0
"""How long to wait for a killed process to be gone. SIGKILL takes effect when the process next
leaves the kernel, so only an uninterruptible system call delays it; past this the caller is
answered anyway and the delay is logged as an error."""

_STOP: Final = object()
"""Put in the outbox to end the sender thread."""

_LIVE: weakref.WeakSet[StorageProcess] = weakref.WeakSet()


def live_processes() -> list[StorageProcess]:
    """Return the storage processes of this interpreter that are not known to be dead."""
    return [process for process in list(_LIVE) if process.lost is None]


class StorageProcess:
    """A started storage process serving one backend, and the threads that talk to it.

    Parameters
    ----------
    start
        The first message: which backend to build and how many calls to serve at once.
    start_timeout_s
        How long the process may take to start and build its backend.
    on_lost
        Called once, from a thread of this object, after the process is known dead.

    Raises
    ------
    BackendUnavailableError
        If no process started in time.
    HiCacheError
        The error the served backend raised while it was built.
    """

    def __init__(
        self, start: Start, start_timeout_s: float, on_lost: Callable[[str], None]
    ) -> None:
        ours, self.pid = launcher().launch(start_timeout_s)
        self.lost: str | None = None
        self._dead = threading.Event()
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future[Reply]] = {}
        self._ids = itertools.count()
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._socket = ours
        self._conn = Connection(os.dup(ours.fileno()))
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            self._close_sockets()
            raise BackendUnavailableError(
                f"the storage process {self.pid} exited as it started"
            ) from None
        self.capabilities = self._handshake(start, start_timeout_s)
        self._sender = threading.Thread(
            target=self._send_requests, name=f"hicache-process-{self.pid}-send", daemon=True
        )
        self._reader = threading.Thread(
            target=self._read_replies, name=f"hicache-process-{self.pid}-replies", daemon=True
        )
        self._sender.start()
        self._reader.start()
        _LIVE.add(self)

    def _handshake(self, start: Start, timeout_s: float) -> Any:
        try:
            self._conn.send(start)
            reply: Reply | None = self._conn.recv() if self._conn.poll(timeout_s) else None
        except (EOFError, OSError) as exc:
            self._die(f"the storage process {self.pid} exited as it started: {exc}", notify=False)
            raise BackendUnavailableError(self.lost) from exc
        if reply is None:
            self._die(f"the storage process did not start within {timeout_s} s", notify=False)
            raise BackendUnavailableError(self.lost)
        if not reply.ok:
            self._die(f"the storage process {self.pid} could not build its backend", notify=False)
            raise reply.value
        return reply.value

    def call(self, method: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        """Make one call; its answer, or an error once the process answered nothing in time.

        Raises
        ------
        BackendTimeoutError
            No answer within ``timeout_s``: the process is killed, and this returns once it is
            dead, so the call is never served after it returned.
        BackendUnavailableError
            The process is dead (or died during the call).
        """
        future: concurrent.futures.Future[Reply] = concurrent.futures.Future()
        with self._lock:
            if self.lost is not None:
                raise BackendUnavailableError(self.lost)
            call_id = next(self._ids)
            self._pending[call_id] = future
        self._outbox.put(Request(call_id, method, args))
        try:
            reply = future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self._die(
                f"the storage process {self.pid} did not answer {method} within {timeout_s} s"
            )
            with contextlib.suppress(concurrent.futures.TimeoutError, BackendUnavailableError):
                reply = future.result(0)  # answered while it was being killed
                if reply.ok:
                    return reply.value
            raise BackendTimeoutError(
                f"the storage process did not answer {method} within {timeout_s} s; it was "
                f"killed and a new one is starting"
            ) from None
        if not reply.ok:
            raise reply.value
        return reply.value

    def close(self) -> None:
        """Ask the process to exit once its calls are done; kill it after :data:`EXIT_S`."""
        if self.lost is None:
            self._outbox.put(None)
            self._reader.join(EXIT_S)  # the reader sees the socket close when the process exits
        self._die(f"the storage process {self.pid} was closed", notify=False)
        self._sender.join(EXIT_S)
        self._reader.join(EXIT_S)

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the process (nothing once it is known dead)."""
        if self.lost is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, signum)

    # -- threads ----------------------------------------------------------------------------------

    def _send_requests(self) -> None:
        while True:
            request = self._outbox.get()
            if request is _STOP:
                return
            try:
                self._conn.send(request)
            except (OSError, ValueError, TypeError) as exc:
                # TypeError: _die closed the connection while this thread was writing to it
                # (multiprocessing's Connection then writes to a handle of None).
                self._die(f"the storage process {self.pid} is gone: {exc}")
                return

    def _read_replies(self) -> None:
        while True:
            try:
                reply: Reply = self._conn.recv()
            except (EOFError, OSError, TypeError):  # TypeError: closed while reading, as above
                break
            with self._lock:
                future = self._pending.pop(reply.call_id, None)
            if future is not None:
                future.set_result(reply)
        self._die(f"the storage process {self.pid} exited")

    # -- death ------------------------------------------------------------------------------------

    def _die(self, reason: str, *, notify: bool = True) -> None:
        """Kill the process, wait until it is gone, then fail every call still waiting.

        The first caller does the work and keeps its reason; others wait until it is done, so no
        caller returns while the process may still act.
        """
        with self._lock:
            first = self.lost is None
            if first:
                self.lost = reason
        if not first:
            self._dead.wait(DEATH_S + 1.0)
            return
        pidfd = getattr(self, "_pidfd", None)
        if pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            if not _wait_exit(pidfd, DEATH_S):
                logger.error(
                    "the storage process %d is still alive %.0f s after SIGKILL (stuck in the "
                    "kernel); its calls are answered as failed anyway",
                    self.pid,
                    DEATH_S,
                )
            os.close(pidfd)
        self._close_sockets()
        self._outbox.put(_STOP)
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(BackendUnavailableError(reason))
        self._dead.set()
        if notify:
            self._on_lost(reason)

    def _close_sockets(self) -> None:
        # shutdown wakes the reader and the sender wherever they block; closing alone would not.
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        conn = getattr(self, "_conn", None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()


def _wait_exit(pidfd: int, timeout_s: float) -> bool:
    """Return whether the process behind ``pidfd`` exited within ``timeout_s``."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))
