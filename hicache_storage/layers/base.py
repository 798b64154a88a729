"""The forwarding backend every layer builds on: it passes each call through unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import Buffer

from ..backend import HostPool, StorageBackend

if TYPE_CHECKING:
    import torch

__all__ = ["ForwardingBackend"]


class ForwardingBackend(StorageBackend):
    """A backend that delegates every call to ``inner``; layers override what they change."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Forward :meth:`StorageBackend.get`."""
        return self.inner.get(key, out)

    def exists(self, key: str) -> bool:
        """Forward :meth:`StorageBackend.exists`."""
        return self.inner.exists(key)

    def set(self, key: str, value: Buffer) -> bool:
        """Forward :meth:`StorageBackend.set`."""
        return self.inner.set(key, value)

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_get`."""
        return self.inner.batch_get(keys, outs)

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_set`."""
        return self.inner.batch_set(keys, values)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Forward :meth:`StorageBackend.batch_exists`."""
        return self.inner.batch_exists(keys)

    def register_host_pool(self, pool: HostPool) -> None:
        """Forward :meth:`StorageBackend.register_host_pool`."""
        self.inner.register_host_pool(pool)

    @property
    def host_pool(self) -> HostPool:
        """The inner backend's registered host pool."""
        return self.inner.host_pool

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_get_v1`."""
        return self.inner.batch_get_v1(keys, host_indices)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_set_v1`."""
        return self.inner.batch_set_v1(keys, host_indices)

    def delete(self, key: str) -> bool:
        """Forward :meth:`StorageBackend.delete`."""
        return self.inner.delete(key)

    def clear(self) -> None:
        """Forward :meth:`StorageBackend.clear`."""
        self.inner.clear()

    def stats(self) -> dict[str, Any]:
        """Forward :meth:`StorageBackend.stats`."""
        return self.inner.stats()

    @property
    def closed(self) -> bool:
        """Whether the inner backend is closed."""
        return self.inner.closed

    def close(self) -> None:
        """Close the inner backend."""
        self.inner.close()

    def unwrap(self) -> StorageBackend:
        """Return the bare backend under every layer."""
        inner = self.inner
        return inner.unwrap() if isinstance(inner, ForwardingBackend) else inner

    def __repr__(self) -> str:
        return f"<{type(self).__name__} over {self.inner!r}>"
