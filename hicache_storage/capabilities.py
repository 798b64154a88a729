"""What a backend promises: the record the conformance suite reads to choose its checks."""

from __future__ import annotations

import dataclasses

__all__ = ["CLAIMED_METHODS", "Capabilities", "unbacked_claims"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """Declared abilities of a backend.

    Every flag defaults to the weakest promise, so a backend claims only what it proves.

    Attributes
    ----------
    persistent
        Data survives ``close()`` and a new instance over the same store sees it.
    shared
        Several processes may use one store at once and see each other's writes.
    native_zero_copy
        ``batch_get_v1``/``batch_set_v1`` move pages straight between the store and the host
        pool's memory, without the generic bounce through ``get``/``set``.
    bounded
        Usage stays under a configured capacity by evicting old objects.
    delete
        ``delete(key)`` removes an object.
    ttl
        Objects expire after a configured time.
    crash_safe_writes
        A writer killed during ``set`` leaves the key absent or holding its old complete value.
    atomic_first_wins
        Concurrent writers of one key race atomically: one value is published, and a value once
        read under a key never changes until the key is deleted or evicted. (A second ``set``
        after the first returned keeps the first value on every backend.)
    max_value_size
        The largest value in bytes the backend accepts, or ``None`` for no limit.
    exists_stale_s
        How long, in seconds, ``exists``/``batch_exists`` (and the "already stored" answer of a
        first-wins ``set``) on one instance may still report a key that another instance over the
        same store deleted. ``0`` (the default) promises no staleness: a backend that caches
        existence states its cache's lifetime here. ``get`` is never stale.
    foreign_names
        Objects are named as another system names them (the file backend's SGLang-compatible
        naming), so callers must use that system's exact keys, which do not say what the bytes
        mean (no :class:`~hicache_storage.keys.format.ObjectFormat` tag). Such a backend keeps
        the format itself and refuses, when a host pool is registered, a pool whose format
        differs from the one its store holds under the same key suffix.
    shared_host_pool
        The v1 calls need the registered host pool in shared memory (built with
        ``shared=True``): the ``process`` backend's storage process moves pages in place there.
    """

    persistent: bool = False
    shared: bool = False
    native_zero_copy: bool = False
    bounded: bool = False
    delete: bool = False
    ttl: bool = False
    crash_safe_writes: bool = False
    atomic_first_wins: bool = False
    max_value_size: int | None = None
    exists_stale_s: float = 0.0
    foreign_names: bool = False
    shared_host_pool: bool = False

    def claimed(self) -> list[str]:
        """Return the names of the boolean capabilities this record claims, in field order."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.type in ("bool", bool) and getattr(self, f.name)
        ]


CLAIMED_METHODS: dict[str, str] = {"delete": "delete"}
"""A capability whose claim promises a method of :class:`~hicache_storage.StorageBackend` that
the base class only refuses (``UnsupportedOperationError``)."""


def unbacked_claims(backend_class: type, claims: Capabilities) -> list[str]:
    """Return a sentence per capability ``claims`` makes that ``backend_class`` does not implement.

    A backend claiming ``delete`` without a ``delete`` method fails every check that cleans up
    after itself; saying so once, up front, names the one mistake.
    """
    from .backend import StorageBackend

    return [
        f"{backend_class.__name__} claims {claim!r} but does not implement {method}()"
        for claim, method in CLAIMED_METHODS.items()
        if getattr(claims, claim)
        and getattr(backend_class, method, None) is getattr(StorageBackend, method)
    ]
