"""Keep secrets out of messages, reports and logs.

A secret is the value of an option whose name says so (``password``, ``token``, ``secret`` ...) or
the password part of a URL (``redis://user:pw@host``), found the way the clients find it
(:func:`urllib.parse.urlsplit`, which redis-py, fsspec and aiohttp's yarl follow): the netloc ends
at the first ``/``, ``?`` or ``#``, the user part at its last ``@`` and the password starts after
the first ``:``, so a password may hold ``@``, ``:`` and whitespace. :func:`redact_options`
returns a copy of a config safe to write anywhere; :func:`redact_text` scrubs the secrets of a
config from a message; :func:`redacted_repr` is the ``repr`` of every config record that can hold
a secret, so a log line or a traceback's locals never show one.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "MASK",
    "is_secret_name",
    "redact_options",
    "redact_text",
    "redact_url",
    "redacted_repr",
    "secrets_in",
]

MASK = "***"

_SHORT = 6
"""Secrets shorter than this are masked only where they are not part of a longer word."""

_SECRET_NAME = re.compile(r"password|passwd|secret|token|credential|api_key|private_key", re.I)
_SCHEME = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://")
_LEADING = "".join(map(chr, range(33)))
"""What :func:`urllib.parse.urlsplit` strips before a URL (C0 controls and space)."""
_REMOVED = str.maketrans("", "", "\t\r\n")
"""What :func:`urllib.parse.urlsplit` removes anywhere in a URL."""


def is_secret_name(name: str) -> bool:
    """Return whether an option called ``name`` holds a secret."""
    return _SECRET_NAME.search(name) is not None


def _password_spans(text: str) -> list[tuple[int, int]]:
    """Return where the password of each URL in ``text`` lies, as ``(start, end)`` indexes.

    A URL that is the whole string (or follows fsspec's ``::`` chaining) is read exactly as
    :func:`urllib.parse.urlsplit` reads it: its netloc runs to the first ``/``, ``?`` or ``#``,
    whitespace included. A URL inside a longer message also ends at whitespace, since the
    prose after it may hold an ``@`` of its own.
    """
    spans: list[tuple[int, int]] = []
    whole_at = len(text) - len(text.lstrip(_LEADING))
    pos = 0
    while (match := _SCHEME.search(text, pos)) is not None:
        start = match.end()
        whole = match.start() == whole_at or text.startswith("::", match.start() - 2)
        end = start
        while end < len(text) and text[end] not in "/?#" and (whole or not text[end].isspace()):
            end += 1
        user = text.rfind("@", start, end)
        colon = text.find(":", start, user) if user >= 0 else -1
        if colon >= 0:
            spans.append((colon + 1, user))
        pos = max(end, start)
    return spans


def redact_url(url: str) -> str:
    """Return ``url`` (or a message holding URLs) with each URL password masked (:data:`MASK`)."""
    for start, end in reversed(_password_spans(url)):
        url = f"{url[:start]}{MASK}{url[end:]}"
    return url


def _url_passwords(text: str) -> set[str]:
    """Return the non-empty URL passwords in ``text``: as written and as the client reads them."""
    found: set[str] = set()
    for start, end in _password_spans(text):
        written = text[start:end]
        for form in (written, written.translate(_REMOVED)):
            found.update(form for form in (form, urllib.parse.unquote(form)) if form)
    return found


def secrets_in(options: Any) -> set[str]:
    """Return every secret string held in ``options`` (nested mappings and lists included)."""
    found: set[str] = set()

    def walk(value: Any, secret: bool) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, secret or (isinstance(key, str) and is_secret_name(key)))
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, secret)
        elif isinstance(value, str) and value:
            if secret:
                found.add(value)
            found.update(_url_passwords(value))

    walk(options, False)
    return found


def redact_options(options: Any) -> Any:
    """Return a copy of ``options`` with secret values and URL passwords masked."""
    if isinstance(options, Mapping):
        return {
            key: MASK
            if isinstance(key, str) and is_secret_name(key) and value not in (None, "")
            else redact_options(value)
            for key, value in options.items()
        }
    if isinstance(options, (list, tuple)):
        return [redact_options(item) for item in options]
    if isinstance(options, str):
        return redact_url(options)
    return options


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """Return ``text`` with URL passwords and each of ``secrets`` (longest first) masked."""
    text = redact_url(text)
    for secret in sorted(set(secrets), key=len, reverse=True):
        for form in {secret, repr(secret)[1:-1]}:
            if len(form) >= _SHORT:
                text = text.replace(form, MASK)
            elif form:
                # A short secret is masked only where it stands alone, not inside words.
                text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(form)}(?![A-Za-z0-9])", MASK, text)
    return text


def _field_names(record: object) -> tuple[str, ...]:
    """Return the fields of a msgspec Struct or a dataclass instance, in declaration order."""
    names: tuple[str, ...] | None = getattr(type(record), "__struct_fields__", None)
    if names is not None:
        return names
    if dataclasses.is_dataclass(record):
        return tuple(field.name for field in dataclasses.fields(record) if field.repr)
    raise TypeError(f"{type(record).__name__} is neither a msgspec Struct nor a dataclass")


def redacted_repr(record: object) -> str:
    """Return ``repr(record)`` (a msgspec Struct or a dataclass) with its secrets masked.

    A field named as a secret (:func:`is_secret_name`) shows :data:`MASK` when set; strings,
    mappings and lists show what :func:`redact_options` leaves of them (URL passwords and
    secret-named options masked, at any depth); a nested record shows its own ``repr``, so each
    record masks its own secrets. Use it as the ``__repr__`` of every config that can hold one.
    """
    parts = []
    for name in _field_names(record):
        value = getattr(record, name)
        if is_secret_name(name) and value not in (None, ""):
            shown: Any = MASK
        elif isinstance(value, tuple) and not hasattr(value, "_fields"):
            shown = tuple(redact_options(list(value)))
        elif isinstance(value, (str, Mapping, list)):
            shown = redact_options(value)
        else:
            shown = value
        parts.append(f"{name}={shown!r}")
    return f"{type(record).__name__}({', '.join(parts)})"
