"""Inject delays and failures, per operation, seeded per thread (for tests and chaos runs).

A single-key call fails by raising :class:`~hicache_storage.errors.InjectedFaultError` (an
infrastructure error, which the degrade layer turns into a miss). A batch call fails *per key*:
the failed keys are reported as misses and only the others reach the backend, which is how a
prefix hit whose load then fails looks to an engine.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar, final

from typing_extensions import Buffer

from ..backend import StorageBackend
from ..config import FaultConfig, FaultRule
from ..errors import InjectedFaultError
from .base import ForwardingBackend

if TYPE_CHECKING:
    import torch

__all__ = ["FaultInjectionLayer"]

T = TypeVar("T")


@final
class FaultInjectionLayer(ForwardingBackend):
    """Delay and fail calls according to a :class:`~hicache_storage.config.FaultConfig`."""

    def __init__(self, inner: StorageBackend, config: FaultConfig) -> None:
        super().__init__(inner)
        self._config = config
        self._local = threading.local()
        self._lock = threading.Lock()
        self._injected: Counter[str] = Counter()

    def _rng(self) -> random.Random:
        rng: random.Random | None = getattr(self._local, "rng", None)
        if rng is None:
            rng = random.Random(f"{self._config.seed}:{threading.current_thread().name}")
            self._local.rng = rng
        return rng

    def _rule(self, op: str) -> FaultRule:
        rule = self._config.ops.get(op, self._config.default)
        if rule.delay_s:
            time.sleep(rule.delay_s)
        return rule

    def _fails(self, rule: FaultRule) -> bool:
        return rule.failure_rate > 0 and self._rng().random() < rule.failure_rate

    def _count(self, op: str, n: int) -> None:
        if n:
            with self._lock:
                self._injected[op] += n

    def _single(self, op: str) -> None:
        if self._fails(self._rule(op)):
            self._count(op, 1)
            raise InjectedFaultError(f"injected failure in {op}")

    def _mask(self, op: str, n: int) -> list[bool]:
        """Return, per key, whether it survives; counts the failed ones."""
        rule = self._rule(op)
        alive = [not self._fails(rule) for _ in range(n)]
        self._count(op, alive.count(False))
        return alive

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Maybe fail, else forward :meth:`StorageBackend.get`."""
        self._single("get")
        return self.inner.get(key, out)

    def exists(self, key: str) -> bool:
        """Maybe fail, else forward :meth:`StorageBackend.exists`."""
        self._single("exists")
        return self.inner.exists(key)

    def set(self, key: str, value: Buffer) -> bool:
        """Maybe fail, else forward :meth:`StorageBackend.set`."""
        self._single("set")
        return self.inner.set(key, value)

    def delete(self, key: str) -> bool:
        """Maybe fail, else forward :meth:`StorageBackend.delete`."""
        self._single("delete")
        return self.inner.delete(key)

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Fail some keys; forward the rest to :meth:`StorageBackend.batch_get`."""
        alive = self._mask("batch_get", len(keys))
        inner = self.inner.batch_get(_pick(keys, alive), _pick(outs, alive))
        return _spread(inner, alive)

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Fail some keys; forward the rest to :meth:`StorageBackend.batch_set`."""
        alive = self._mask("batch_set", len(keys))
        inner = self.inner.batch_set(_pick(keys, alive), _pick(values, alive))
        return _spread(inner, alive)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Cut the batch at the first failed key; forward the part before it."""
        rule = self._rule("batch_exists")
        cut = next((i for i in range(len(keys)) if self._fails(rule)), len(keys))
        self._count("batch_exists", int(cut < len(keys)))
        return self.inner.batch_exists(keys[:cut]) if cut else 0

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Fail some keys (their pages stay untouched); forward the rest."""
        alive = self._mask("batch_get_v1", len(keys))
        indices = self._pages(host_indices, alive)
        return _spread(self.inner.batch_get_v1(_pick(keys, alive), indices), alive)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Fail some keys; forward the rest."""
        alive = self._mask("batch_set_v1", len(keys))
        indices = self._pages(host_indices, alive)
        return _spread(self.inner.batch_set_v1(_pick(keys, alive), indices), alive)

    def _pages(
        self, host_indices: torch.Tensor | Sequence[int], alive: list[bool]
    ) -> torch.Tensor | list[int]:
        size = self.inner.host_pool.page_size
        kept = [i for i, keep in enumerate(alive) if keep]
        if isinstance(host_indices, Sequence):
            return [int(j) for i in kept for j in host_indices[i * size : (i + 1) * size]]
        import torch

        pages = [host_indices[i * size : (i + 1) * size] for i in kept]
        return torch.cat(pages) if pages else host_indices[:0]

    def stats(self) -> dict[str, Any]:
        """Return the inner stats plus a ``faults`` section of injected failures."""
        with self._lock:
            section = dict(self._injected)
        return {**self.inner.stats(), "faults": section}


def _pick(items: Sequence[T], alive: list[bool]) -> list[T]:
    return [item for item, keep in zip(items, alive, strict=True) if keep]


def _spread(results: list[bool], alive: list[bool]) -> list[bool]:
    it = iter(results)
    return [next(it) if keep else False for keep in alive]
