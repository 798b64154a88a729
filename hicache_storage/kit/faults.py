"""Make a backend's medium fail on demand, so the typed-error checks run on every backend.

Backends with a server get their outages from the conformance suite's server control (stop,
pause). A backend over a disk, a mount or an in-process library has no server to stop, so it
holds a :class:`MediumFaults` and calls :meth:`MediumFaults.check` just before each operation
on its medium. Disarmed, a check costs one attribute read. The suite arms it to raise the
medium's *own* exceptions (an ``OSError(EIO)``, a lost mount, a timeout, a file that vanished
between lookup and read) and requires the backend to turn them into typed errors, or into a
miss for an object that vanished while being read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping

from hicache_storage.errors import ConfigError

__all__ = ["FAULT_KINDS", "OPS", "POSIX_ERRORS", "MediumFaults"]

OPS = frozenset({"read", "write", "stat", "delete", "list"})
"""The medium operations a backend names when it calls :meth:`MediumFaults.check`."""

FAULT_KINDS = ("io", "unavailable", "timeout", "vanished")
"""What can go wrong, and what the contract turns it into:

``io`` a failed read or write (``BackendIOError``), ``unavailable`` the medium cannot be
reached (``BackendUnavailableError``), ``timeout`` it did not answer in time
(``BackendTimeoutError``), ``vanished`` the object went away while being read (a miss)."""


def _oserror(code: int, cls: type[OSError] = OSError) -> Callable[[], BaseException]:
    return lambda: cls(code, os.strerror(code))


POSIX_ERRORS: Mapping[str, Callable[[], BaseException]] = {
    "io": _oserror(errno.EIO),
    "unavailable": _oserror(errno.ENOTCONN),  # a network mount that lost its server
    "timeout": _oserror(errno.ETIMEDOUT),  # OSError(ETIMEDOUT) is a TimeoutError
    "vanished": _oserror(errno.ENOENT),  # a FileNotFoundError
}
"""What a POSIX filesystem raises for each :data:`FAULT_KINDS` entry."""


class MediumFaults:
    """A switch a backend consults before each medium operation; the suite flips it.

    Parameters
    ----------
    errors
        For each kind in :data:`FAULT_KINDS`, a callable returning the exception the medium
        itself raises (defaults to :data:`POSIX_ERRORS`). A client library would map
        ``"unavailable"`` to its connection error, ``"vanished"`` to its "no such object".
    """

    def __init__(self, errors: Mapping[str, Callable[[], BaseException]] = POSIX_ERRORS) -> None:
        unknown = set(errors) - set(FAULT_KINDS)
        if unknown:
            raise ConfigError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        self.errors = dict(errors)
        self._lock = threading.Lock()
        self._armed: tuple[str, frozenset[str], int | None] | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds this medium can raise."""
        return tuple(kind for kind in FAULT_KINDS if kind in self.errors)

    def arm(self, kind: str, *, ops: Collection[str] = OPS, times: int | None = None) -> None:
        """Make the next ``times`` checks of ``ops`` (every one if None) raise ``kind``'s error."""
        if kind not in self.errors:
            raise ConfigError(f"this medium raises no {kind!r} faults; it has {self.kinds}")
        unknown = set(ops) - OPS
        if unknown:
            raise ConfigError(f"unknown medium operations {sorted(unknown)}; known: {sorted(OPS)}")
        with self._lock:
            self._armed = (kind, frozenset(ops), times)

    def disarm(self) -> None:
        """Let every operation through again."""
        with self._lock:
            self._armed = None

    @contextlib.contextmanager
    def armed(
        self, kind: str, *, ops: Collection[str] = OPS, times: int | None = None
    ) -> Iterator[None]:
        """Arm for the block, disarm after it."""
        self.arm(kind, ops=ops, times=times)
        try:
            yield
        finally:
            self.disarm()

    def check(self, op: str) -> None:
        """Raise the armed error if ``op`` is one of the armed operations; else return."""
        if self._armed is None:
            return
        with self._lock:
            armed = self._armed
            if armed is None or op not in armed[1]:
                return
            kind, ops, times = armed
            if times is not None:
                self._armed = (kind, ops, times - 1) if times > 1 else None
        raise self.errors[kind]()
