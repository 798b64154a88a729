"""Settings of the fsspec backend."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from hicache_storage.capabilities import Capabilities
from hicache_storage.kit.options import check_count, check_seconds
from hicache_storage.redact import redact_options, redact_url

__all__ = ["CAPABILITIES", "FsspecConfig", "Kind", "capabilities"]

_RESERVED = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time"})
"""Options the backend sets itself: a cached listing or a shared instance would serve other
processes' deletions stale, so every backend gets its own uncached filesystem."""


class FsspecConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of :class:`~hicache_storage.backends.fsspec.FsspecBackend`.

    Attributes
    ----------
    url
        Where the objects live, as an fsspec URL with its protocol: ``file:///var/cache/kv``,
        ``memory://kv``, ``s3://bucket/prefix``, ``gcs://bucket/prefix`` ... The path part is
        the backend's root: ``clear()`` removes only this backend's objects under it. It must
        not be a filesystem's root itself.
    storage_options
        Keyword arguments of the filesystem class (``endpoint_url``, ``key``, ``secret``,
        ``client_kwargs`` for s3fs, ...). Values of secret-named options (``secret``,
        ``token``, ``password`` ...) never appear in messages, ``repr`` or ``stats()``.
    fanout
        Spread objects over two levels of 256 directories named from a hash of the key
        (``root/ab/cd/<key>``), so no directory or listing grows huge. Readers and writers of
        one root must agree on it.
    deadline_s
        Longest one call (a batch included) may take on an asynchronous filesystem (s3, gcs,
        http ...): the request is cancelled then and the call raises ``BackendTimeoutError``.
        Synchronous filesystems (local, memory) have no such bound.
    max_concurrency
        Requests a batch keeps in flight at once on an asynchronous filesystem.
    """

    url: str
    storage_options: dict[str, Any] = msgspec.field(default_factory=dict)
    fanout: bool = True
    deadline_s: float = 10.0
    max_concurrency: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise TypeError(f"url must be a string, got {type(self.url).__name__}")
        shown = redact_url(self.url)
        if "://" not in self.url or self.url.startswith("://"):
            raise ValueError(
                f"url must name its protocol (file:///path, memory://name, s3://bucket/prefix), "
                f"got {shown!r}"
            )
        if "\x00" in self.url or any(c.isspace() for c in self.url):
            raise ValueError(f"url must not contain whitespace or NUL characters, got {shown!r}")
        if not isinstance(self.storage_options, dict) or not all(
            isinstance(name, str) for name in self.storage_options
        ):
            raise TypeError("storage_options must be a mapping of option names to values")
        reserved = sorted(_RESERVED & set(self.storage_options))
        if reserved:
            raise ValueError(
                f"storage_options must not set {reserved}: the backend always uses an uncached "
                f"filesystem of its own so that other processes' writes and deletions show"
            )
        if not isinstance(self.fanout, bool):
            raise TypeError(f"fanout must be a bool, got {type(self.fanout).__name__}")
        check_seconds("deadline_s", self.deadline_s)
        check_count("max_concurrency", self.max_concurrency, maximum=1024)

    def __repr__(self) -> str:
        return (
            f"FsspecConfig(url={redact_url(self.url)!r}, "
            f"storage_options={redact_options(self.storage_options)!r}, "
            f"fanout={self.fanout!r}, deadline_s={self.deadline_s!r}, "
            f"max_concurrency={self.max_concurrency!r})"
        )


Kind = Literal["local", "memory", "s3", "other"]
"""The media the backend tells apart; each has its own write path and capabilities."""

CAPABILITIES: dict[Kind, Capabilities] = {
    "local": Capabilities(
        persistent=True,
        shared=True,
        native_zero_copy=True,
        delete=True,
        crash_safe_writes=True,
        atomic_first_wins=True,
    ),
    "memory": Capabilities(delete=True, atomic_first_wins=True),
    "s3": Capabilities(
        persistent=True, shared=True, delete=True, crash_safe_writes=True, atomic_first_wins=True
    ),
    "other": Capabilities(delete=True),
}
"""What an instance claims on each medium (the module docstring says why)."""


def capabilities(kind: Kind = "other") -> Capabilities:
    """Return what an instance on a medium of ``kind`` claims (``CAPABILITIES``).

    The registry's record is ``"other"``'s: what any URL is sure of before the filesystem it
    names is opened.
    """
    return CAPABILITIES[kind]
