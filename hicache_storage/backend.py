"""The backend contract: three required methods, fast paths a backend may override, housekeeping.

A backend author implements :meth:`StorageBackend.get`, :meth:`StorageBackend.exists` and
:meth:`StorageBackend.set`; every batch and zero-copy call has a correct default built on them.
Keys reach a backend already validated when it is built through
:func:`hicache_storage.create_backend`, which wraps it in the default layers.

Misses are values (``None``, ``False``, a short prefix count), never exceptions. Infrastructure
failures raise :class:`~hicache_storage.errors.BackendError` subclasses; caller mistakes raise the
other :class:`~hicache_storage.errors.HiCacheError` subclasses.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from typing_extensions import Buffer, Self

from .buffers import as_readable, as_writable, scatter
from .capabilities import Capabilities
from .errors import (
    BatchMismatchError,
    BufferSizeError,
    HostPoolError,
    IndexAlignmentError,
    PoolNotRegisteredError,
    UnsupportedOperationError,
)
from .kit.options import positive_int

if TYPE_CHECKING:
    import torch

    from .quota import QuotaLedger

__all__ = ["HostPool", "StorageBackend", "check_host_pool", "copy_into"]


class HostPool(Protocol):
    """What a backend needs from a host KV pool to move pages in place."""

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        ...

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page object (the sum of its buffers)."""
        ...

    def page_starts(self, host_indices: torch.Tensor | Sequence[int]) -> list[int]:
        """Return the validated first token index of every page."""
        ...

    def page_buffer_meta(
        self, host_indices: torch.Tensor | Sequence[int]
    ) -> list[list[tuple[int, int]]]:
        """Return ``(address, nbytes)`` of every buffer of every page, in object byte order."""
        ...

    def page_buffer_views(
        self, host_indices: torch.Tensor | Sequence[int]
    ) -> list[list[memoryview]]:
        """Return writable zero-copy views of every buffer of every page, in object byte order."""
        ...


class StorageBackend(abc.ABC):
    """Base class of every storage backend (the L3 tier of a hierarchical KV cache).

    Subclasses set :attr:`name` and :attr:`capabilities` and implement ``get``/``exists``/``set``.
    Everything else has a default that is correct for any backend; override it to be fast.
    """

    #: The name the backend is registered under (what ``create_backend`` is given).
    name: str = ""
    #: What the backend promises; the conformance suite picks its checks from it.
    capabilities: Capabilities = Capabilities()

    def __init__(self) -> None:
        self._closed = False
        self._host_pool: HostPool | None = None

    # -- required -------------------------------------------------------------------------------

    @abc.abstractmethod
    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the value stored under ``key``, or ``None`` on a miss.

        With ``out``, write the value into it and return ``out``.

        Raises
        ------
        BufferSizeError
            If ``out`` is not exactly the stored object's size; ``out`` is left untouched.
        BackendError
            If the store could not answer.
        """

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Return whether ``key`` holds a complete value.

        Raises
        ------
        BackendError
            If the store could not answer.
        """

    @abc.abstractmethod
    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key``; return whether the key now holds a complete value.

        Writing a key that exists keeps one complete value (the first, for most backends). A
        failed or interrupted write leaves the key absent or holding its old complete value.

        Raises
        ------
        BackendError
            If the store could not answer.
        """

    # -- batch ----------------------------------------------------------------------------------

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each key into its output buffer; return per key whether it was a hit.

        An object whose size differs from its output buffer is reported as a miss.
        """
        _check_lengths(keys, outs, "output buffers")
        results = []
        for key, out in zip(keys, outs, strict=True):
            try:
                results.append(self.get(key, out) is not None)
            except BufferSizeError:
                results.append(False)
        return results

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value under its key; return per key whether it now holds a value."""
        _check_lengths(keys, values, "values")
        return [self.set(key, value) for key, value in zip(keys, values, strict=True)]

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the length of the leading run of keys that exist (a prefix hit)."""
        for count, key in enumerate(keys):
            if not self.exists(key):
                return count
        return len(keys)

    # -- zero-copy page I/O against a registered host pool --------------------------------------

    def register_host_pool(self, pool: HostPool) -> None:
        """Attach the host pool whose pages ``batch_get_v1``/``batch_set_v1`` address.

        Raises
        ------
        HostPoolError
            If ``pool`` does not implement the :class:`HostPool` protocol.
        """
        self._host_pool = check_host_pool(pool)

    @property
    def host_pool(self) -> HostPool:
        """The registered host pool.

        Raises
        ------
        PoolNotRegisteredError
            If :meth:`register_host_pool` was not called.
        """
        if self._host_pool is None:
            raise PoolNotRegisteredError(
                "no host pool is registered; call register_host_pool(pool) before the v1 calls"
            )
        return self._host_pool

    def page_views(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[list[memoryview]]:
        """Return the buffers of each key's page, checking one page per key.

        Raises
        ------
        PoolNotRegisteredError, IndexAlignmentError
        """
        pages = self.host_pool.page_buffer_views(host_indices)
        if len(pages) != len(keys):
            raise IndexAlignmentError(
                f"{len(keys)} keys need {len(keys)} pages of host indices, got {len(pages)}"
            )
        return pages

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Load each key's object into its page of the host pool; return per-key hits.

        ``host_indices`` has ``page_size`` entries per key; page *i* starts at
        ``host_indices[i * page_size]``. The default reads a single-buffer page in place and
        bounces a multi-buffer page through one temporary; native backends override it.
        """
        pages = self.page_views(keys, host_indices)
        outs: list[memoryview] = [
            views[0] if len(views) == 1 else memoryview(bytearray(sum(map(len, views))))
            for views in pages
        ]
        hits = self.batch_get(keys, outs)
        for hit, views, out in zip(hits, pages, outs, strict=True):
            if hit and len(views) > 1:
                scatter(out, views)
        return hits

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Store each key's page of the host pool as one object; return per-key success."""
        pages = self.page_views(keys, host_indices)
        values: list[Buffer] = [views[0] if len(views) == 1 else b"".join(views) for views in pages]
        return self.batch_set(keys, values)

    # -- housekeeping ---------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed.

        Raises
        ------
        UnsupportedOperationError
            If the backend cannot delete (``capabilities.delete`` is false).
        """
        raise UnsupportedOperationError(f"backend {self.name!r} does not support delete")

    def clear(self) -> None:
        """Remove every object this backend instance owns (never other tenants' objects).

        Raises
        ------
        UnsupportedOperationError
            If the backend cannot clear.
        """
        raise UnsupportedOperationError(f"backend {self.name!r} does not support clear")

    def stats(self) -> dict[str, Any]:
        """Return counters describing this backend; layers add their own sections."""
        return {"backend": self.name}

    def quota_ledger(self) -> QuotaLedger | None:
        """Return the ledger this backend's store can keep for its namespace's quota, or None.

        A store every writer of the namespace reaches can hold the accounting a quota needs
        (``hicache_storage.quota``); the quota layer asks for it when its config names none.
        """
        return None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Release connections, files and threads. Calling it again does nothing."""
        if not self._closed:
            self._closed = True
            self._close()

    def _close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release resources; called once by :meth:`close`."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<{type(self).__name__} {self.name!r}{state}>"


_POOL_METHODS = ("page_starts", "page_buffer_meta", "page_buffer_views")


def check_host_pool(pool: object) -> HostPool:
    """Return ``pool`` if it implements :class:`HostPool`, else raise at once.

    Registration is where a wrong object must be refused: a later v1 call would otherwise fail
    with a raw ``AttributeError`` deep inside a backend.

    Raises
    ------
    HostPoolError
        Naming what is missing or invalid.
    """
    what = type(pool).__name__
    missing = [name for name in _POOL_METHODS if not callable(getattr(pool, name, None))]
    if missing:
        raise HostPoolError(
            f"a {what} is not a host pool: it lacks {', '.join(missing)}; register an "
            f"MHAHostPool, MLAHostPool or another implementation of hicache_storage.HostPool"
        )
    for name in ("page_size", "page_nbytes"):
        positive_int(
            f"a host pool's {name} ({what}.{name})", getattr(pool, name, None), HostPoolError
        )
    return pool  # type: ignore[return-value]


def _check_lengths(keys: Sequence[str], others: Sequence[object], what: str) -> None:
    if len(keys) != len(others):
        raise BatchMismatchError(f"got {len(keys)} keys but {len(others)} {what}")


def copy_into(value: Buffer, out: Buffer) -> Buffer:
    """Copy ``value`` into ``out`` after checking sizes; return ``out``.

    Raises
    ------
    BufferSizeError
        If the sizes differ; ``out`` is left untouched.
    """
    src = as_readable(value)
    dst = as_writable(out)
    if len(src) != len(dst):
        raise BufferSizeError(
            f"output buffer has {len(dst)} bytes but the stored object has {len(src)}"
        )
    dst[:] = src
    return out
