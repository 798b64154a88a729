"""Refuse every call on a closed backend, for backends also used without the layers.

Through :func:`~hicache_storage.create_backend` the validation layer raises
:class:`~hicache_storage.errors.BackendClosedError` after ``close()``. A backend an engine
builds bare (as SGLang's adapters do) must do it itself, or a call after ``close()`` reads a
released client or a recycled file descriptor. :func:`closed_guard` adds the check to every
data and housekeeping method of a backend class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from hicache_storage.backend import StorageBackend
from hicache_storage.errors import BackendClosedError

__all__ = ["GUARDED", "closed_guard"]

GUARDED = (
    "get",
    "exists",
    "set",
    "batch_get",
    "batch_set",
    "batch_exists",
    "batch_get_v1",
    "batch_set_v1",
    "register_host_pool",
    "delete",
    "clear",
)
"""The methods :func:`closed_guard` wraps; ``stats`` and ``close`` keep working when closed."""

B = TypeVar("B", bound=type[StorageBackend])


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: StorageBackend, *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise BackendClosedError(f"{self!r} is closed; create a new backend")
        return method(self, *args, **kwargs)

    call.__hicache_guarded__ = True  # type: ignore[attr-defined]
    return call


def closed_guard(cls: B) -> B:
    """Class decorator: every method in :data:`GUARDED` raises ``BackendClosedError`` once closed.

    Inherited methods are wrapped too, so a subclass that overrides one stays guarded only if
    it is decorated as well.
    """
    for name in GUARDED:
        method = getattr(cls, name)
        if not getattr(method, "__hicache_guarded__", False):
            setattr(cls, name, _guarded(method))
    return cls
