"""The key rule shared by every backend.

Keys become file names, object names and database keys, so they are restricted to an alphabet
that is safe everywhere: no path separators, no traversal, no whitespace or control characters,
no leading dot (hidden files), and short enough to leave room under ``NAME_MAX`` (255 bytes) for
temporary-file suffixes. The rule is applied once, by the validation layer, so backends can
trust every key they see.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from hicache_storage.errors import InvalidKeyError

__all__ = ["MAX_KEY_LENGTH", "validate_key", "validate_keys"]

MAX_KEY_LENGTH = 200
"""Longest accepted key, in bytes (every accepted key is ASCII, so also in characters)."""

_ALLOWED = "ASCII letters, digits, '_', '-' and '.', starting with a letter or digit, without '..'"
_SAFE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
_REPR_LIMIT = 80


def _quote(key: object) -> str:
    """Return a repr of ``key`` safe to put in a message: escaped and at most 80 chars."""
    text = repr(key)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _reject(key: str, reason: str) -> InvalidKeyError:
    return InvalidKeyError(f"invalid key {_quote(key)}: {reason}; keys must use {_ALLOWED}")


def _diagnose(key: object) -> InvalidKeyError:
    """Build the error for a key that failed the fast check, naming the first rule it breaks."""
    if not isinstance(key, str):
        return InvalidKeyError(f"key must be str, got {type(key).__name__} {_quote(key)}")
    if not key:
        return _reject(key, "it is empty")
    if len(key) > MAX_KEY_LENGTH:
        return _reject(key, f"it is {len(key)} characters long, the limit is {MAX_KEY_LENGTH}")
    if not (key[0].isascii() and key[0].isalnum()):
        return _reject(key, f"it starts with {key[0]!r}")
    bad = next((c for c in key if not (c.isascii() and (c.isalnum() or c in "_.-"))), None)
    if bad is not None:
        return _reject(key, f"it contains {bad!r}")
    return _reject(key, "it contains '..'")


def validate_key(key: object) -> str:
    """Return ``key`` unchanged if it obeys the key rule, else raise :class:`InvalidKeyError`.

    Raises
    ------
    InvalidKeyError
        If ``key`` is not a ``str``, is empty, longer than :data:`MAX_KEY_LENGTH`, starts with
        something other than a letter or digit, contains a character outside the safe alphabet,
        or contains ``..``. The message quotes the key and names the rule that failed.
    """
    if (
        isinstance(key, str)
        and len(key) <= MAX_KEY_LENGTH
        and _SAFE_KEY.fullmatch(key) is not None
        and ".." not in key
    ):
        return key
    raise _diagnose(key)


def validate_keys(keys: Sequence[object]) -> list[str]:
    """Validate every key of a batch; raise on the first invalid one (see :func:`validate_key`)."""
    return [validate_key(key) for key in keys]
