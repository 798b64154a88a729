"""The file backend's OS errors as the typed errors of the SDK (through an ``ErrorMap``)."""

from __future__ import annotations

import errno
import os
from typing import Final

from hicache_storage.errors import HiCacheError
from hicache_storage.kit import ErrorMap

__all__ = ["MISSING", "MISSING_ERRNOS", "io_error", "oserror"]

MISSING: Final = (FileNotFoundError, NotADirectoryError)
"""What ``os`` raises for a path that is not there: a miss, never a failure."""

MISSING_ERRNOS: Final = frozenset({errno.ENOENT, errno.ENOTDIR})
"""The errnos of :data:`MISSING`, as the native batch calls report them."""

_ERRORS = ErrorMap("file backend")


def io_error(what: str, exc: OSError) -> HiCacheError:
    """Return the typed error for ``exc``, met while doing ``what``."""
    return _ERRORS.translate(exc, what)


def oserror(code: int) -> OSError:
    """Return the exception ``os`` would raise for ``code`` (``OSError`` picks the subclass)."""
    return OSError(code, os.strerror(code))
