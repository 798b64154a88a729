"""The layers' bases: one that passes every call through, one that may answer with a miss."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from typing_extensions import Buffer

from ..backend import HostPool, StorageBackend

if TYPE_CHECKING:
    import torch

__all__ = ["AnsweringLayer", "ForwardingBackend"]

T = TypeVar("T")


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


class AnsweringLayer(ForwardingBackend):
    """A layer that may answer a data call itself, with a miss, instead of the backend's answer.

    Every data call goes through ``_answer`` with the miss that stands for it (``None``,
    ``False``, ``0``, a ``False`` per key); the degrade layer answers it when the backend
    failed, the health layer while the store is down.
    """

    @abc.abstractmethod
    def _answer(self, op: str, call: Callable[[], T], miss: T) -> T:
        """Return ``call()``, or ``miss`` when the layer answers for the backend."""

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Forward :meth:`StorageBackend.get`; or a miss."""
        return self._answer("get", lambda: self.inner.get(key, out), None)

    def exists(self, key: str) -> bool:
        """Forward :meth:`StorageBackend.exists`; or ``False``."""
        return self._answer("exists", lambda: self.inner.exists(key), False)

    def set(self, key: str, value: Buffer) -> bool:
        """Forward :meth:`StorageBackend.set`; or ``False``."""
        return self._answer("set", lambda: self.inner.set(key, value), False)

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_get`; or every key a miss."""
        return self._answer(
            "batch_get", lambda: self.inner.batch_get(keys, outs), [False] * len(keys)
        )

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_set`; or every key ``False``."""
        return self._answer(
            "batch_set", lambda: self.inner.batch_set(keys, values), [False] * len(keys)
        )

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Forward :meth:`StorageBackend.batch_exists`; or a prefix of 0."""
        return self._answer("batch_exists", lambda: self.inner.batch_exists(keys), 0)

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_get_v1`; or every key a miss."""
        return self._answer(
            "batch_get_v1",
            lambda: self.inner.batch_get_v1(keys, host_indices),
            [False] * len(keys),
        )

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Forward :meth:`StorageBackend.batch_set_v1`; or every key ``False``."""
        return self._answer(
            "batch_set_v1",
            lambda: self.inner.batch_set_v1(keys, host_indices),
            [False] * len(keys),
        )

    def delete(self, key: str) -> bool:
        """Forward :meth:`StorageBackend.delete`; or ``False``."""
        return self._answer("delete", lambda: self.inner.delete(key), False)

    def clear(self) -> None:
        """Forward :meth:`StorageBackend.clear`; or nothing."""
        self._answer("clear", self.inner.clear, None)
