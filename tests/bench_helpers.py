"""Broken backends for tests/test_bench.py, importable by a BackendSpec factory string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import Buffer

from hicache_storage.backend import StorageBackend, copy_into
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.capabilities import Capabilities
from hicache_storage.registry import BackendSpec, hookimpl

MEMORY = "hicache_storage.backends.memory.backend"


class PlainBackend(StorageBackend):
    """A correct dictionary backend (first write wins)."""

    name = "plain"
    capabilities = Capabilities(delete=True)

    def __init__(self, config: Any = None, deployment: Any = None) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        value = self.data.get(key)
        if value is None:
            return None
        return value if out is None else copy_into(value, out)

    def exists(self, key: str) -> bool:
        return key in self.data

    def set(self, key: str, value: Buffer) -> bool:
        self.data.setdefault(key, bytes(as_readable(value)))
        return True

    def delete(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


class CorruptingBackend(PlainBackend):
    """Answers every get with a hit, but flips the last byte of what it copies out."""

    name = "corrupting"

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        result = super().get(key, out)
        if result is not None and out is not None:
            view = as_writable(out)
            view[-1] ^= 0xFF
        return result


class ForgetfulBackend(PlainBackend):
    """Says every set succeeded and every key exists, then misses every get."""

    name = "forgetful"

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        return None

    def exists(self, key: str) -> bool:
        return True


class StrayBackend(PlainBackend):
    """Reads its pages right, but the first read of pages other than the pool's first flips
    the first byte of the pool: a write outside the call's pages."""

    name = "stray"
    strayed = False

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        hits = super().batch_get_v1(keys, host_indices)
        if not self.strayed and 0 not in [int(i) for i in host_indices]:
            self.strayed = True
            grid = self.host_pool.kv_buffer.view(-1).view(torch.uint8)
            grid[0] ^= 0xFF
        return hits


def _spec(name: str, factory: str, baseline: bool = True) -> BackendSpec:
    return BackendSpec(
        name=name,
        factory=f"bench_helpers:{factory}",
        config=f"{MEMORY}:MemoryConfig",
        baseline=f"{MEMORY}:DictBaseline" if baseline else None,
        description=f"test backend {name}",
    )


class BrokenBackends:
    """A plugin providing the broken backends, plus a correct one without a raw baseline."""

    @hookimpl
    def hicache_backends(self) -> list[BackendSpec]:
        return [
            _spec("corrupting", "CorruptingBackend"),
            _spec("forgetful", "ForgetfulBackend"),
            _spec("corrupting-v1", "CorruptingBackend", baseline=False),  # no raw v1 calls
            _spec("stray", "StrayBackend", baseline=False),
            _spec("nobaseline", "PlainBackend", baseline=False),
        ]
