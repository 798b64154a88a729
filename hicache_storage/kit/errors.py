"""Map a storage client's exceptions onto the typed errors of the contract.

The default layers count a :class:`~hicache_storage.errors.BackendError` as a miss and let
anything else through as a bug, so a backend must never leak its client's own exceptions.
:class:`ErrorMap` does the translation in one place: the author lists the client's exceptions
that mean "unavailable" or "timed out", and everything else falls back to the rules every medium
shares (``TimeoutError`` and ``ETIMEDOUT`` time out; refused, reset or lost connections and a
network mount gone stale are unavailable; any other ``OSError`` is an I/O error).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterable, Iterator

from hicache_storage.errors import (
    BackendError,
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    HiCacheError,
)
from hicache_storage.redact import redact_text

__all__ = ["ErrorMap", "Rule", "is_missing"]

Rule = tuple[type[BaseException] | tuple[type[BaseException], ...], type[BackendError]]
"""``(client exception type(s), typed error)``: instances of the first become the second."""

_UNAVAILABLE_ERRNOS = frozenset(
    code
    for code in (
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ENOTCONN,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ESHUTDOWN,
        getattr(errno, "EHOSTDOWN", None),
        getattr(errno, "ESTALE", None),
    )
    if code is not None
)
_MISSING = (FileNotFoundError, NotADirectoryError)


def is_missing(exc: BaseException) -> bool:
    """Return whether ``exc`` says the object is not there (a miss on a read, not a failure)."""
    return isinstance(exc, _MISSING)


class ErrorMap:
    """Translate exceptions raised by a medium or client library into typed backend errors.

    Parameters
    ----------
    service
        What the messages call the medium (``"fsspec memory://"``, ``"my-kv at 10.0.0.5"``).
    rules
        The client's own exceptions, checked in order before the shared rules, e.g.
        ``[(botocore.exceptions.EndpointConnectionError, BackendUnavailableError)]``.

    Examples
    --------
    >>> errors = ErrorMap("my-store", [(KeyError, BackendIOError)])
    >>> with errors.guard("read 'k'"):
    ...     raise ConnectionResetError("peer went away")
    Traceback (most recent call last):
    hicache_storage.errors.BackendUnavailableError: my-store could not read 'k': peer went away
    """

    def __init__(self, service: str, rules: Iterable[Rule] = ()) -> None:
        self.service = service
        self.rules = tuple(rules)

    def kind(self, exc: BaseException) -> type[BackendError]:
        """Return the typed error ``exc`` maps to."""
        for types, typed in self.rules:
            if isinstance(exc, types):
                return typed
        if isinstance(exc, TimeoutError):
            return BackendTimeoutError
        if isinstance(exc, ConnectionError):
            return BackendUnavailableError
        if isinstance(exc, OSError):
            if exc.errno in _UNAVAILABLE_ERRNOS:
                return BackendUnavailableError
            return BackendIOError
        return BackendError

    def translate(self, exc: BaseException, what: str) -> HiCacheError:
        """Return the typed error for ``exc`` raised while trying to ``what``.

        A :class:`~hicache_storage.errors.HiCacheError` (already typed) is returned unchanged.
        Secrets in the client's message are masked.
        """
        if isinstance(exc, HiCacheError):
            return exc
        typed = self.kind(exc)
        detail = redact_text(str(getattr(exc, "strerror", None) or exc or type(exc).__name__))
        message = f"{self.service} could not {what}: {detail}"
        code = getattr(exc, "errno", None)
        if issubclass(typed, OSError) and isinstance(code, int):
            return typed(code, message)
        return typed(message)

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run the block; re-raise any ``Exception`` from it as its typed error, chained.

        ``KeyboardInterrupt`` and other non-``Exception`` exceptions pass through unchanged.
        """
        try:
            yield
        except HiCacheError:
            raise
        except Exception as exc:
            raise self.translate(exc, what) from exc
