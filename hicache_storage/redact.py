"""Keep secrets out of messages, reports and logs.

A secret is the value of an option whose name says so (``password``, ``token``, ``secret`` ...) or
the password part of a URL (``redis://user:pw@host``). :func:`redact_options` returns a copy of a
config safe to write anywhere; :func:`redact_text` scrubs the secrets of a config from a message.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["MASK", "is_secret_name", "redact_options", "redact_text", "redact_url", "secrets_in"]

MASK = "***"

_SHORT = 6
"""Secrets shorter than this are masked only where they are not part of a longer word."""

_SECRET_NAME = re.compile(r"password|passwd|secret|token|credential|api_key|private_key", re.I)
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/@\s:]*:)(?P<pw>[^@\s/]*)@")


def is_secret_name(name: str) -> bool:
    """Return whether an option called ``name`` holds a secret."""
    return _SECRET_NAME.search(name) is not None


def redact_url(url: str) -> str:
    """Return ``url`` with the password of its user part replaced by :data:`MASK`."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{MASK}@", url)


def _url_password(text: str) -> str | None:
    match = _URL_PASSWORD.search(text)
    if match is None or not match.group("pw"):
        return None
    return match.group("pw")


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
            password = _url_password(value)
            if password:
                found.update({password, urllib.parse.unquote(password)})

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
