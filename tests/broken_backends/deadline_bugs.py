"""Backends that give up a call at its deadline but leave its work running (act after return).

Each talks to an in-process "server" the suite can pause (:data:`SERVING`, flipped through
:mod:`.plugin`'s server control): a call waits for the server up to :data:`DEADLINE_S`, then
raises ``BackendTimeoutError``, as a correct client does. The bug is the work a timed-out call
leaves behind, as a client library's I/O thread or a storage process does: once the server runs
again, it still copies a stored page into the caller's buffer, or reads the caller's buffer and
publishes it. A correct backend cancels that work (``hicache_storage.kit.Deadline``) or does it in
buffers of its own.
"""

from __future__ import annotations

import threading
from typing import ClassVar

from typing_extensions import Buffer

from hicache_storage import BackendTimeoutError
from hicache_storage.buffers import as_readable, as_writable

from . import Bug, bug
from .dict_bugs import DictBackend

__all__ = ["BUGS", "DEADLINE_S", "SERVING", "LateReader", "LateWriter"]

DEADLINE_S = 0.2
"""Every call's deadline (the server control's ``timeout_s``); short, because the default batch
calls wait it out once per key."""

SERVING = threading.Event()
"""Set while the server answers; cleared by the suite to pause it."""
SERVING.set()


class _Deadlined(DictBackend):
    """A dictionary behind a pausable server; every call waits for it up to its deadline."""

    late_reads: ClassVar[bool] = False
    late_writes: ClassVar[bool] = False

    def _wait(self) -> None:
        if not SERVING.wait(DEADLINE_S):
            raise BackendTimeoutError(f"{self.name}: the server did not answer in {DEADLINE_S} s")

    def _in_background(self, work: threading.Thread) -> None:
        """Run ``work`` once the server answers; give up waiting for it at the deadline."""
        work.start()
        work.join(DEADLINE_S)
        if work.is_alive():
            raise BackendTimeoutError(f"{self.name}: the server did not answer in {DEADLINE_S} s")

    def exists(self, key: str) -> bool:
        self._wait()
        return super().exists(key)

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        if not self.late_reads or out is None:
            self._wait()
            return super().get(key, out)
        found: list[bool] = []

        def fetch() -> None:
            SERVING.wait()
            value = self._lookup(key)
            if value is not None and len(value) == memoryview(out).nbytes:
                as_writable(out)[:] = value  # into the caller's buffer, whenever that is
                found.append(True)

        self._in_background(threading.Thread(target=fetch, daemon=True))
        return out if found else None

    def set(self, key: str, value: Buffer) -> bool:
        if not self.late_writes:
            self._wait()
            return super().set(key, value)
        view = as_readable(value)
        stored: list[bool] = []

        def store() -> None:
            SERVING.wait()
            stored.append(DictBackend.set(self, key, bytes(view)))  # the caller's buffer, late

        self._in_background(threading.Thread(target=store, daemon=True))
        return bool(stored and stored[0])


class LateReader(_Deadlined):
    """Bug: a read that timed out still copies the page into the caller's buffer later."""

    name = "broken-late-read"
    late_reads = True


class LateWriter(_Deadlined):
    """Bug: a write that timed out still reads the caller's buffer and publishes it later."""

    name = "broken-late-write"
    late_writes = True


_M = __name__
BUGS: list[Bug] = [
    bug(
        "broken-late-read",
        f"{_M}:LateReader",
        "a read given up at its deadline writes the caller's buffer once the server answers",
        "TestNothingAfterReturn::test_read_past_deadline_never_writes_buffers_after_return",
    ),
    bug(
        "broken-late-write",
        f"{_M}:LateWriter",
        "a write given up at its deadline publishes the caller's buffer once the server answers",
        "TestNothingAfterReturn::test_write_past_deadline_never_publishes_reused_buffers",
    ),
]
