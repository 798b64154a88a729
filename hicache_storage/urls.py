"""Backend URLs: ``redis://host:6379/0``, ``s3://bucket/prefix``, ``file:///path`` as a backend.

Wherever the CLI takes a backend name (``hicache check BACKEND``, ``hicache bench BACKEND``) it
also takes a URL: its scheme picks the backend and the URL gives some of its options.

=================  ========  ==============================================================
scheme             backend   options
=================  ========  ==============================================================
``redis://``       redis     ``url``: the whole URL (``redis://[user:pw@]host[:port][/db]``)
``rediss://``      redis     ``url``: the whole URL (TLS)
``s3://``          s3        ``bucket``, and ``prefix`` from the path (``s3://bucket/a/b``)
``file://``        file      ``root``: the path (``file:///data/kv``, three slashes)
=================  ========  ==============================================================

Each backend's plugin module claims its schemes through the
:func:`~hicache_storage.hookspecs.hicache_url_schemes` hook, built-in backends as third-party
ones do::

    from hicache_storage.registry import hookimpl
    from hicache_storage.urls import UrlScheme


    def _options(url: str) -> dict[str, object]:
        return {"root": url.removeprefix("dirkv://")}


    @hookimpl
    def hicache_url_schemes() -> list[UrlScheme]:
        return [UrlScheme(scheme="dirkv", backend="dirkv", options=_options)]

A scheme that a built-in backend claims, or that an earlier plugin took, is not replaced.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from .errors import ConfigError
from .redact import redact_url
from .registry import origin_of, plugin_manager

__all__ = ["UrlScheme", "is_url", "parse_backend_url", "refuse_extras", "url_schemes"]

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://")
"""A URL as a backend argument: a scheme (RFC 3986's alphabet) and ``://``; no name has those."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UrlScheme:
    """A URL scheme that names a backend.

    Attributes
    ----------
    scheme
        The scheme, without ``://`` (``"redis"``); compared lower-cased.
    backend
        The name of the backend it stands for.
    options
        Called with the whole URL; returns the backend options it gives. Raises
        :class:`ValueError` (or :class:`~hicache_storage.errors.ConfigError`) with a message
        saying what is wrong with a URL it cannot read.
    example
        A URL of this scheme to show a user who gave a backend no options (``""``: none).
    """

    scheme: str
    backend: str
    options: Callable[[str], Mapping[str, Any]]
    example: str = ""


def refuse_extras(parts: urllib.parse.SplitResult, form: str) -> None:
    """Raise :class:`ValueError` if a URL of ``form`` carries a query or a fragment."""
    if parts.query or parts.fragment:
        raise ValueError(f"{form} takes no ?query or #fragment; give other options in the config")


def url_schemes() -> Mapping[str, UrlScheme]:
    """Return every claimed scheme by its lower-cased name.

    Built-in backends claim theirs through the same hook as plugins
    (:func:`~hicache_storage.hookspecs.hicache_url_schemes`); a scheme naming a built-in backend
    comes first, then plugins' in the order they were registered, and a scheme already claimed is
    not replaced.
    """
    # pluggy calls the most recently registered plugin first; earlier plugins come first here.
    claims = [
        claim for batch in reversed(plugin_manager().hook.hicache_url_schemes()) for claim in batch
    ]
    builtin = [claim for claim in claims if _builtin(claim.backend)]
    schemes: dict[str, UrlScheme] = {}
    for claim in builtin + [claim for claim in claims if not _builtin(claim.backend)]:
        schemes.setdefault(claim.scheme.lower(), claim)
    return MappingProxyType(schemes)


def _builtin(backend: str) -> bool:
    origin = origin_of(backend)
    return origin is not None and origin.builtin


def is_url(text: str) -> bool:
    """Return whether ``text`` is a URL (``scheme://...``) rather than a backend name."""
    return _URL.match(text) is not None


def parse_backend_url(url: str) -> tuple[str, dict[str, Any]]:
    """Return the backend that ``url`` names and the options it gives.

    Raises
    ------
    ConfigError
        If ``url`` is not a URL, no backend claims its scheme (the message lists those that are
        claimed), or the URL does not read as its scheme requires; any password in it is masked.
    """
    match = _URL.match(url)
    if match is None:
        raise ConfigError(f"{redact_url(url)!r} is not a URL (scheme://...)")
    scheme = match.group("scheme").lower()
    schemes = url_schemes()
    claim = schemes.get(scheme)
    if claim is None:
        known = ", ".join(f"{name}://" for name in sorted(schemes)) or "none"
        raise ConfigError(
            f"no backend claims URL scheme {scheme!r} in {redact_url(url)!r} (known schemes: "
            f"{known}); give a backend name and its options with --config instead"
        )
    try:
        options = dict(claim.options(url))
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"backend URL {redact_url(url)!r}: {redact_url(str(exc))}") from None
    return claim.backend, options
