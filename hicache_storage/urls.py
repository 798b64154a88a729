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

A plugin claims schemes of its own by implementing the :func:`hicache_url_schemes` hook, which
this module adds to the plugin manager the first time a URL is resolved::

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
import sys
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import pluggy

from .errors import ConfigError
from .hookspecs import hookspec
from .redact import redact_url
from .registry import plugin_manager

__all__ = ["BUILT_IN_SCHEMES", "UrlScheme", "is_url", "parse_backend_url", "url_schemes"]

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
    """

    scheme: str
    backend: str
    options: Callable[[str], Mapping[str, Any]]


def _refuse_extras(parts: urllib.parse.SplitResult, form: str) -> None:
    if parts.query or parts.fragment:
        raise ValueError(f"{form} takes no ?query or #fragment; give other options in the config")


def _redis_options(url: str) -> dict[str, Any]:
    """``redis://`` and ``rediss://``: the URL is the backend's ``url`` option, as written."""
    return {"url": url}


def _s3_options(url: str) -> dict[str, Any]:
    """``s3://BUCKET[/PREFIX]``: ``bucket`` and, when the path is not empty, ``prefix``."""
    form = "s3://BUCKET[/PREFIX]"
    parts = urllib.parse.urlsplit(url)
    _refuse_extras(parts, form)
    if "@" in parts.netloc or ":" in parts.netloc:
        raise ValueError(
            f"{form} takes no user, password or port: credentials come from the AWS chain, and "
            "an S3-compatible store's address is the endpoint_url option (or AWS_ENDPOINT_URL)"
        )
    if not parts.netloc:
        raise ValueError(f"{form} needs a bucket")
    options: dict[str, Any] = {"bucket": parts.netloc}
    prefix = urllib.parse.unquote(parts.path.lstrip("/"))
    if prefix:
        options["prefix"] = prefix
    return options


def _file_options(url: str) -> dict[str, Any]:
    """``file:///PATH``: the backend's ``root`` directory."""
    form = "file:///PATH"
    parts = urllib.parse.urlsplit(url)
    _refuse_extras(parts, form)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"{form} names a local directory by its absolute path, after three slashes "
            f"(file:///{parts.netloc}{parts.path} for /{parts.netloc}{parts.path}); "
            f"{parts.netloc!r} reads as a host"
        )
    if not parts.path:
        raise ValueError(f"{form} needs a path")
    return {"root": urllib.parse.unquote(parts.path)}


BUILT_IN_SCHEMES: tuple[UrlScheme, ...] = (
    UrlScheme(scheme="redis", backend="redis", options=_redis_options),
    UrlScheme(scheme="rediss", backend="redis", options=_redis_options),
    UrlScheme(scheme="s3", backend="s3", options=_s3_options),
    UrlScheme(scheme="file", backend="file", options=_file_options),
)
"""The schemes of the built-in backends; plugins add theirs through :func:`hicache_url_schemes`."""


@hookspec
def hicache_url_schemes() -> list[UrlScheme]:  # type: ignore[empty-body]
    """Return the URL schemes this plugin's backends claim (see :class:`UrlScheme`).

    The hook a plugin implements, with :data:`~hicache_storage.registry.hookimpl`, to claim
    schemes of its own; its specification lives here rather than in
    :mod:`~hicache_storage.hookspecs` and is added to the plugin manager on first use.
    """


_SPEC_LOCK = threading.Lock()


def _manager() -> pluggy.PluginManager:
    """Return the plugin manager, with the :func:`hicache_url_schemes` hook specified."""
    manager = plugin_manager()
    with _SPEC_LOCK:
        caller = getattr(manager.hook, "hicache_url_schemes", None)
        if caller is None or not caller.has_spec():
            manager.add_hookspecs(sys.modules[__name__])
    return manager


def url_schemes() -> Mapping[str, UrlScheme]:
    """Return every claimed scheme by its lower-cased name: the built-in ones, then plugins'.

    A scheme already claimed is not replaced by a later claim.
    """
    schemes: dict[str, UrlScheme] = {}
    provided: list[list[UrlScheme]] = [list(BUILT_IN_SCHEMES)]
    # pluggy calls the most recently registered plugin first; earlier plugins come first here.
    provided += reversed(_manager().hook.hicache_url_schemes())
    for claims in provided:
        for claim in claims:
            schemes.setdefault(claim.scheme.lower(), claim)
    return MappingProxyType(schemes)


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
