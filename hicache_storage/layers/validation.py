"""Refuse caller mistakes before they reach a backend, once, for every backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, final

from typing_extensions import Buffer

from ..backend import HostPool, check_host_pool
from ..buffers import as_readable, as_writable
from ..errors import BackendClosedError, BatchMismatchError, BufferSizeError, IndexAlignmentError
from ..keys import validate_key, validate_keys
from .base import ForwardingBackend

if TYPE_CHECKING:
    import torch

__all__ = ["ValidationLayer"]


@final
class ValidationLayer(ForwardingBackend):
    """Check keys, buffers, batch lengths, host indices and the open state; raise at once.

    Values and output buffers reach the backend as flat unsigned-byte memoryviews.
    """

    def _check_open(self) -> None:
        if self.inner.closed:
            raise BackendClosedError(f"backend {self.name!r} is closed; create a new one")

    def _value(self, value: object) -> memoryview:
        view = as_readable(value)
        limit = self.capabilities.max_value_size
        if limit is not None and len(view) > limit:
            raise BufferSizeError(
                f"a value of {len(view)} bytes exceeds backend {self.name!r}'s "
                f"max_value_size of {limit} bytes"
            )
        return view

    def _keys(self, keys: Sequence[object]) -> list[str]:
        self._check_open()
        if isinstance(keys, (str, bytes)):
            raise BatchMismatchError("batch calls take a sequence of keys, not a single key")
        return validate_keys(keys)

    def _pages(self, keys: list[str], host_indices: torch.Tensor | Sequence[int]) -> None:
        starts = self.inner.host_pool.page_starts(host_indices)
        if len(starts) != len(keys):
            raise IndexAlignmentError(
                f"{len(keys)} keys need {len(keys)} pages of host indices, got {len(starts)}"
            )

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Validate, then forward :meth:`StorageBackend.get`; return ``out`` itself on a hit."""
        self._check_open()
        key = validate_key(key)
        if out is None:
            return self.inner.get(key)
        return out if self.inner.get(key, as_writable(out)) is not None else None

    def exists(self, key: str) -> bool:
        """Validate, then forward :meth:`StorageBackend.exists`."""
        self._check_open()
        return self.inner.exists(validate_key(key))

    def set(self, key: str, value: Buffer) -> bool:
        """Validate, then forward :meth:`StorageBackend.set`."""
        self._check_open()
        return self.inner.set(validate_key(key), self._value(value))

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Validate, then forward :meth:`StorageBackend.batch_get`."""
        checked = self._keys(keys)
        if len(outs) != len(checked):
            raise BatchMismatchError(f"got {len(checked)} keys but {len(outs)} output buffers")
        return self.inner.batch_get(checked, [as_writable(out) for out in outs])

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Validate, then forward :meth:`StorageBackend.batch_set`."""
        checked = self._keys(keys)
        if len(values) != len(checked):
            raise BatchMismatchError(f"got {len(checked)} keys but {len(values)} values")
        return self.inner.batch_set(checked, [self._value(value) for value in values])

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Validate, then forward :meth:`StorageBackend.batch_exists`."""
        return self.inner.batch_exists(self._keys(keys))

    def register_host_pool(self, pool: HostPool) -> None:
        """Check the backend is open and ``pool`` is a host pool, then forward it."""
        self._check_open()
        self.inner.register_host_pool(check_host_pool(pool))

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Validate keys and host indices, then forward :meth:`StorageBackend.batch_get_v1`."""
        checked = self._keys(keys)
        self._pages(checked, host_indices)
        return self.inner.batch_get_v1(checked, host_indices)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Validate keys and host indices, then forward :meth:`StorageBackend.batch_set_v1`."""
        checked = self._keys(keys)
        self._pages(checked, host_indices)
        return self.inner.batch_set_v1(checked, host_indices)

    def delete(self, key: str) -> bool:
        """Validate, then forward :meth:`StorageBackend.delete`."""
        self._check_open()
        return self.inner.delete(validate_key(key))

    def clear(self) -> None:
        """Check the backend is open, then forward :meth:`StorageBackend.clear`."""
        self._check_open()
        self.inner.clear()

    def stats(self) -> dict[str, Any]:
        """Forward :meth:`StorageBackend.stats` (allowed after close)."""
        return self.inner.stats()
