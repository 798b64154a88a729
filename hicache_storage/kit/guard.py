"""Refuse calls on a closed backend, and never release its resources under a running call.

Through :func:`~hicache_storage.create_backend` the validation layer raises
:class:`~hicache_storage.errors.BackendClosedError` after ``close()``. A backend an engine
builds bare (as SGLang's adapters do) must do it itself, or a call after ``close()`` reads a
released client or a recycled file descriptor. And ``close()`` may come from another thread
while calls are running: releasing a descriptor, connection or registered buffer under them
makes them fail with the client library's raw errors, or read and write whatever reuses it.

:class:`CallGate` counts the calls inside a resource; :func:`closed_guard` puts one in front of
every data and housekeeping method of a backend class and makes ``close()`` go through it:
new calls are refused at once, calls in flight run to their end (bounded by the backend's
``close_timeout_s``), and only then is the backend's own ``close()`` run. A call still running
past that bound keeps the resources alive: the last call to leave releases them, so nothing is
ever used after it is released, and ``close()`` itself stays bounded.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

from hicache_storage.backend import StorageBackend
from hicache_storage.errors import BackendClosedError

__all__ = ["DRAIN_S", "GUARDED", "CallGate", "closed_guard", "gate_of"]

logger = logging.getLogger(__name__)

GUARDED = (
    "get",
    "exists",
    "set",
    "batch_get",
    "batch_set",
    "batch_exists",
    "batch_get_v1",
    "batch_set_v1",
    "register_host_pool",
    "delete",
    "clear",
)
"""The methods :func:`closed_guard` wraps; ``stats`` and ``close`` keep working when closed."""

DRAIN_S = 10.0
"""How long ``close()`` waits for calls in flight when a backend sets no ``close_timeout_s``."""

_GATE = "_hicache_call_gate"
_GATES_LOCK = threading.Lock()
_MARK = "__hicache_guarded__"

B = TypeVar("B", bound=type[StorageBackend])


class CallGate:
    """Admits calls until shut; releases the guarded resources once the last call has left.

    :meth:`enter` / :meth:`leave` (or :meth:`inside`) bracket every use of the resources; they
    nest within a thread. :meth:`shut` refuses new calls, waits a bounded time for the calls
    of other threads, and runs the release then, or, when calls are still inside (a hung one,
    or the closing thread's own), in the thread of the last call to leave.

    Parameters
    ----------
    what
        Names the guarded object in the ``BackendClosedError`` message.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._cond = threading.Condition()
        self._inside = 0
        self._shut = False
        self._pending: Callable[[], None] | None = None
        self._depth = threading.local()

    @property
    def is_shut(self) -> bool:
        """Whether :meth:`shut` was called: every new call is refused."""
        return self._shut

    def enter(self) -> None:
        """Count a call in.

        Raises
        ------
        BackendClosedError
            Once the gate is shut.
        """
        with self._cond:
            if self._shut:
                raise BackendClosedError(f"{self.what} is closed; create a new one")
            self._inside += 1
        self._depth.n = getattr(self._depth, "n", 0) + 1

    def leave(self) -> None:
        """Count a call out; the last one out of a shut gate runs the deferred release."""
        self._depth.n -= 1
        with self._cond:
            self._inside -= 1
            if self._inside:
                return
            self._cond.notify_all()
            release, self._pending = self._pending, None
        if release is not None:
            try:
                release()
            except Exception:  # the caller's call succeeded; a failed release is logged
                logger.warning("releasing %s after its last call failed", self.what, exc_info=True)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Run the block as one call (:meth:`enter`, then :meth:`leave` whatever happens)."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def shut(self, release: Callable[[], None], timeout_s: float) -> bool:
        """Refuse new calls, wait up to ``timeout_s`` for calls in flight, then ``release()``.

        Returns whether ``release`` ran here: False when the gate was already shut (nothing is
        done) or when calls are still inside after the wait (the last to leave runs it).
        """
        own = getattr(self._depth, "n", 0)
        with self._cond:
            if self._shut:
                return False
            self._shut = True
            self._cond.wait_for(lambda: self._inside <= own, timeout_s)
            if self._inside:
                self._pending = release
                if self._inside > own:
                    logger.warning(
                        "%s: %d calls still running %.3g s after close(); they keep its "
                        "resources until they end",
                        self.what,
                        self._inside - own,
                        timeout_s,
                    )
                return False
        release()
        return True


def gate_of(backend: object) -> CallGate:
    """Return the :class:`CallGate` of a :func:`closed_guard` backend (made on first use)."""
    gate: CallGate | None = vars(backend).get(_GATE)
    if gate is None:
        with _GATES_LOCK:
            name = getattr(backend, "name", type(backend).__name__)
            gate = vars(backend).setdefault(_GATE, CallGate(f"backend {name!r}"))
    return gate


def _is_shut(backend: object) -> bool:
    gate: CallGate | None = vars(backend).get(_GATE)
    return gate is not None and gate.is_shut


def _marked(method: Callable[..., Any]) -> Callable[..., Any]:
    setattr(method, _MARK, True)
    return method


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: StorageBackend, *args: Any, **kwargs: Any) -> Any:
        gate = gate_of(self)
        gate.enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            gate.leave()

    return _marked(call)


def _closing(method: Callable[[StorageBackend], None]) -> Callable[[StorageBackend], None]:
    @functools.wraps(method)
    def close(self: StorageBackend) -> None:
        timeout = float(getattr(self, "close_timeout_s", DRAIN_S))
        gate_of(self).shut(functools.partial(method, self), timeout)

    return _marked(close)


def _closed(prop: property) -> property:
    def closed(self: StorageBackend) -> bool:
        return _is_shut(self) or bool(prop.__get__(self, type(self)))

    return property(_marked(closed), doc=prop.__doc__)


def _guard(cls: B, also: Sequence[str]) -> B:
    for name in (*GUARDED, *also):
        method = getattr(cls, name)
        if not getattr(method, _MARK, False):
            setattr(cls, name, _guarded(method))
    if not getattr(cls.close, _MARK, False):
        setattr(cls, "close", _closing(cls.close))  # noqa: B010 - a method, not a field
    closed = inspect.getattr_static(cls, "closed")
    if isinstance(closed, property) and not getattr(closed.fget, _MARK, False):
        setattr(cls, "closed", _closed(closed))  # noqa: B010 - a property, not a field
    return cls


@overload
def closed_guard(cls: B, /) -> B: ...


@overload
def closed_guard(*, also: Sequence[str]) -> Callable[[B], B]: ...


def closed_guard(cls: B | None = None, /, *, also: Sequence[str] = ()) -> B | Callable[[B], B]:
    """Class decorator: guard every method in :data:`GUARDED` (and ``also``) with a gate.

    A guarded call raises ``BackendClosedError`` once ``close()`` has begun; ``close()`` waits
    for the calls in flight (up to the instance's ``close_timeout_s``, default
    :data:`DRAIN_S`) before the class's own ``close()`` releases anything, and ``closed`` is
    true from its first moment. ``@closed_guard(also=("locate",))`` guards more public methods.

    Inherited methods are wrapped too, so a subclass that overrides one stays guarded only if
    it is decorated as well.
    """
    if cls is None:
        return lambda target: _guard(target, also)
    return _guard(cls, also)
