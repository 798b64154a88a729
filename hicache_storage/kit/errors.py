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
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from hicache_storage.errors import (
    BackendError,
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    HiCacheError,
)
from hicache_storage.redact import redact_text

__all__ = ["Count", "ErrorMap", "Rule", "Verdict", "is_missing"]

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


class Verdict(NamedTuple):
    """What one client exception means, as a backend's :meth:`ErrorMap.describe` says it."""

    error: type[BackendError]
    """The typed error it becomes."""
    message: str
    """The whole message (secrets are masked afterwards)."""
    reason: str
    """The counter it bumps (the backend's ``errors`` stats)."""
    retryable: bool | None = None
    """Overrides the typed error's ``retryable`` (False: a retry cannot help, e.g. bad login)."""
    errno: int | None = None
    """The OS error number the typed error carries (the shared rules keep the client's)."""


Count = Callable[[str], None]
"""Told the reason of each error translated (a backend's error counters)."""


class ErrorMap:
    """Translate exceptions raised by a medium or client library into typed backend errors.

    A backend whose client says more than its exception classes (a status code, a reply
    prefix) subclasses the map and overrides :meth:`describe`.

    Parameters
    ----------
    service
        What the messages call the medium (``"fsspec memory://"``, ``"my-kv at 10.0.0.5"``).
    rules
        The client's own exceptions, checked in order before the shared rules, e.g.
        ``[(botocore.exceptions.EndpointConnectionError, BackendUnavailableError)]``.
    secrets
        Strings masked in every message, and in the messages of the client's exception and
        its chain (which stay attached as ``__cause__``); URL passwords are always masked.
    catch
        The exceptions :meth:`guard` translates; others (a bug in the backend) pass through.
    count
        Told the reason of every error translated; :meth:`describe` names it, and otherwise
        it is the client exception's class name.

    Examples
    --------
    >>> errors = ErrorMap("my-store", [(KeyError, BackendIOError)])
    >>> with errors.guard("read 'k'"):
    ...     raise ConnectionResetError("peer went away")
    Traceback (most recent call last):
    hicache_storage.errors.BackendUnavailableError: my-store could not read 'k': peer went away
    """

    def __init__(
        self,
        service: str,
        rules: Iterable[Rule] = (),
        *,
        secrets: Iterable[str] = (),
        catch: type[BaseException] | tuple[type[BaseException], ...] = Exception,
        count: Count | None = None,
    ) -> None:
        self.service = service
        self.rules = tuple(rules)
        self.secrets = frozenset(secrets)
        self.catch = catch
        self.count = count

    def kind(self, exc: BaseException) -> type[BackendError]:
        """Return the typed error ``exc`` maps to by the rules."""
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

    def describe(self, exc: BaseException, what: str) -> Verdict | None:
        """Return what ``exc`` means to this client, or None to apply the rules (the default)."""
        return None

    def redact(self, text: str) -> str:
        """Mask this map's secrets and any URL password in ``text``."""
        return redact_text(text, self.secrets)

    def translate(self, exc: BaseException, what: str, count: Count | None = None) -> HiCacheError:
        """Return the typed error for ``exc`` raised while trying to ``what``.

        A :class:`~hicache_storage.errors.HiCacheError` (already typed) is returned unchanged.
        Secrets are masked in the message and in ``exc``'s chain. ``count`` (default: the
        map's) is told the reason.
        """
        if isinstance(exc, HiCacheError):
            return exc
        self.scrub(exc)
        verdict = self.describe(exc, what)
        if verdict is None:
            detail = str(getattr(exc, "strerror", None) or exc or type(exc).__name__)
            message = f"{self.service} could not {what}: {detail}"
            code = getattr(exc, "errno", None)
            errno_ = code if isinstance(code, int) else None
            verdict = Verdict(self.kind(exc), message, type(exc).__name__, errno=errno_)
        typed, message, code = verdict.error, self.redact(verdict.message), verdict.errno
        error = (
            typed(code, message)
            if issubclass(typed, OSError) and code is not None
            else typed(message)
        )
        if verdict.retryable is not None:
            error.retryable = verdict.retryable
        counter = count or self.count
        if counter is not None:
            counter(verdict.reason)
        return error

    @contextlib.contextmanager
    def guard(self, what: str, count: Count | None = None) -> Iterator[None]:
        """Run the block; re-raise what it raises of ``catch`` as its typed error, chained.

        Typed errors pass through unchanged, as do exceptions outside ``catch`` (and
        ``KeyboardInterrupt``, which no ``catch`` of ``Exception`` holds).
        """
        try:
            yield
        except HiCacheError:
            raise
        except Exception as exc:
            if not isinstance(exc, self.catch):
                raise
            raise self.translate(exc, what, count) from exc

    def scrub(self, exc: BaseException) -> None:
        """Mask the secrets in ``exc`` and its chain (:meth:`mask` each exception)."""
        if not self.secrets:
            return
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            self.mask(current)
            current = current.__cause__ or current.__context__

    def mask(self, exc: BaseException) -> None:
        """Mask the secrets in one exception's arguments.

        A client that keeps text elsewhere (a parsed error response) overrides this to mask
        that too.
        """
        if any(isinstance(arg, str) and self.redact(arg) != arg for arg in exc.args):
            exc.args = tuple(self.redact(arg) if isinstance(arg, str) else arg for arg in exc.args)
