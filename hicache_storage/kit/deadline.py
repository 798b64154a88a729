"""One call, one deadline: the moment a backend call must have returned by.

A backend that talks to a server bounds every public call by its ``deadline_s``. The call
makes a :class:`Deadline` when it starts and asks it before each request (:meth:`allows` a
request that may take so long, :meth:`left` for a client's timeout). Code the call does not
own, such as a client library's socket reads or its retry loop, finds the deadline through
the thread: :meth:`Deadline.applied` makes it the thread's current one for a block, and
:func:`current_deadline` / :func:`bounded` read it there. A call that returns before its
workers are done cancels the deadline (:meth:`Deadline.cancel`), so those workers stop and
never touch the caller's buffers again: they write them only under ``Deadline.lock``
while :meth:`Deadline.live`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["Deadline", "bounded", "current_deadline"]

_THREAD = threading.local()
"""``deadline``: the :class:`Deadline` this thread's current call runs under (or None)."""


class Deadline:
    """The moment one backend call must have returned by, and whether it was given up.

    Parameters
    ----------
    seconds
        How long from now the call may take (``float("inf")`` for no bound).
    """

    __slots__ = ("cancelled", "end", "lock")

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.lock = threading.Lock()
        self.cancelled = False

    def left(self) -> float:
        """Return the seconds left (negative once passed)."""
        return self.end - time.monotonic()

    def allows(self, cost: float) -> bool:
        """Return whether a request that may take ``cost`` seconds still fits."""
        return self.left() >= cost

    def live(self) -> bool:
        """Return whether the call still wants work done: not cancelled, not past its end."""
        return not self.cancelled and time.monotonic() < self.end

    def cancel(self) -> None:
        """Give the call up: from now on :meth:`live` is false (taken under ``lock``)."""
        with self.lock:
            self.cancelled = True

    @contextlib.contextmanager
    def applied(self) -> Iterator[Deadline]:
        """Make this the thread's current deadline for the block (an earlier outer one wins).

        Nested calls keep the sooner of the two ends, so an inner call never outlives the
        call that made it.
        """
        outer: Deadline | None = getattr(_THREAD, "deadline", None)
        _THREAD.deadline = self if outer is None or self.end < outer.end else outer
        try:
            yield self
        finally:
            _THREAD.deadline = outer


def current_deadline() -> Deadline | None:
    """Return the deadline of the call this thread runs (None outside :meth:`Deadline.applied`)."""
    deadline: Deadline | None = getattr(_THREAD, "deadline", None)
    return deadline


def bounded(cap: float | None) -> float | None:
    """Return the timeout ``cap`` cut to the time the thread's current call has left.

    ``cap`` is None for no timeout of its own; with no current deadline it is returned as is.

    Raises
    ------
    TimeoutError
        The builtin, when the current call's deadline has passed: a client library maps it
        to its own timeout, as it does a socket's.
    """
    deadline = current_deadline()
    if deadline is None:
        return cap
    left = deadline.left()
    if left <= 0:
        raise TimeoutError("the call's deadline has passed")
    return left if cap is None else min(cap, left)
