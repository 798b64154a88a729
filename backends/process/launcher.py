"""Starts storage processes in milliseconds: forks them from one pre-imported launcher process.

A fresh interpreter needs seconds to import torch and the registry's plugins; an engine, a test
suite or a bench that builds many process backends would pay that for each. The first launch
starts one launcher process (``python -m hicache_storage.backends.process.worker --launcher``),
which imports everything once, never touches a GPU and forks a storage process for each request,
handing it the socket it was sent. The launcher exits when this process does (its socket
closes); each storage process exits when its own socket closes.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable

from hicache_storage.errors import BackendUnavailableError

__all__ = ["Launcher", "launcher"]

PID = struct.Struct("<q")


class Launcher:
    """The parent's handle on its launcher process; one per process (:func:`launcher`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None

    def launch(self, timeout_s: float) -> tuple[socket.socket, int]:
        """Return a socket to a new storage process and its pid (it waits for a ``Start``).

        Raises
        ------
        BackendUnavailableError
            If no storage process could be started within ``timeout_s``.
        """
        with self._lock:
            problem = ""
            for _ in range(2):  # a launcher that died is replaced once
                if (
                    self._socket is None
                    or self._process is None
                    or self._process.poll() is not None
                ):
                    self._start()
                assert self._socket is not None
                ours, theirs = socket.socketpair()
                try:
                    self._socket.settimeout(timeout_s)
                    socket.send_fds(self._socket, [b"+"], [theirs.fileno()])
                    pid = PID.unpack(_recv_exact(self._socket, PID.size))[0]
                    return ours, pid
                except OSError as exc:
                    ours.close()
                    problem = str(exc) or type(exc).__name__
                    self._stop()
                finally:
                    theirs.close()
        raise BackendUnavailableError(
            f"cannot start a storage process within {timeout_s} s: {problem}"
        )

    def _start(self) -> None:
        self._stop()
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hicache_storage.backends.process.worker",
                    "--launcher",
                    str(theirs.fileno()),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            ours.close()
            raise BackendUnavailableError(f"cannot start the storage launcher: {exc}") from exc
        finally:
            theirs.close()
        self._socket = ours

    def _stop(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            self._process = None


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the storage launcher exited")
        data += chunk
    return data


_LAUNCHER = Launcher()


def launcher() -> Launcher:
    """Return this process's launcher (started on its first launch)."""
    return _LAUNCHER


def serve_launches(fd: int, serve: Callable[[int], None]) -> None:
    """Fork a process running ``serve(fd)`` for every socket received on ``fd`` (the launcher)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # storage processes reap themselves
    with socket.socket(fileno=fd) as requests:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(requests, 1, 1)
            except OSError:
                return
            if not message or not fds:
                return
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    requests.close()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    serve(fds[0])
                except BaseException:  # noqa: BLE001 - a storage process never returns to the loop
                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            os.close(fds[0])
            try:
                requests.sendall(PID.pack(pid))
            except OSError:
                return
