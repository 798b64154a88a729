"""The process backend's server control: its "server" is the storage processes of this interpreter.

The conformance suite's fault checks stop, pause and resume a backend's server through a
:class:`~hicache_storage.kit.services.PausableServerControl`. For the process backend that server
is the storage process each instance forks: pausing (SIGSTOP) leaves its socket open with nothing
answering, the fault that finds a call acting after its deadline; stopping kills it, as the OOM
killer would, and the backend starts a new one by itself.
"""

from __future__ import annotations

import signal
import time

from .session import StorageProcess, live_processes

__all__ = ["StorageProcessControl"]


class StorageProcessControl:
    """Stop, start, pause and resume every storage process this interpreter has running.

    Parameters
    ----------
    timeout_s
        The served calls' ``call_timeout_s``: the longest a call may take while paused.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._paused: list[StorageProcess] = []

    def stop(self) -> None:
        """Kill every storage process (each backend starts a new one)."""
        for process in live_processes():
            process.send_signal(signal.SIGKILL)

    def start(self) -> None:
        """Return once a storage process serves again (new ones start by themselves)."""
        deadline = time.monotonic() + self.timeout_s
        while not live_processes() and time.monotonic() < deadline:
            time.sleep(0.01)

    def pause(self) -> None:
        """Freeze every storage process: sockets open, nothing answered."""
        self._paused = live_processes()
        for process in self._paused:
            process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let the frozen storage processes that are still alive run again."""
        paused, self._paused = self._paused, []
        for process in paused:
            process.send_signal(signal.SIGCONT)
