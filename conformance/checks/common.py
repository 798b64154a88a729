"""What several areas of checks share: markers, hypothesis profiles, constants, pool helpers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, settings

from hicache_storage.hostpool import HostKVPool, MHAHostPool, MLAHostPool

__all__ = ["KiB", "MiB", "SENTINEL", "SLACK_S", "requires"]

requires = pytest.mark.hicache_requires

# -- hypothesis profiles (registered, never loaded globally) -------------------------------------

settings.register_profile(
    "hicache-ci",
    derandomize=True,
    deadline=None,
    max_examples=30,
    stateful_step_count=20,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "hicache-nightly",
    deadline=None,
    max_examples=500,
    stateful_step_count=50,
    suppress_health_check=[HealthCheck.too_slow],
)

KiB = 1 << 10
MiB = 1 << 20
SENTINEL = 0xA5
SLACK_S = 2.0


# -- helpers (shared by the area modules) -----------------------------------------------------


def _bytes(value: object) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
    return bytes(memoryview(value))  # type: ignore[arg-type]


def _pool(
    kind: str, layout: str, pages: int = 8, page_size: int = 4, layers: int = 2
) -> HostKVPool:
    size = pages * page_size
    if kind == "mha":
        return MHAHostPool(
            size, page_size, layers, 2, 8, dtype=torch.float16, layout=layout, pin_memory=False
        )
    return MLAHostPool(
        size, page_size, layers, 16, dtype=torch.float16, layout=layout, pin_memory=False
    )


def _raw(pool: HostKVPool) -> torch.Tensor:
    return pool.kv_buffer.view(-1).view(torch.uint8)


def _random_fill(pool: HostKVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = _raw(pool)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _sentinel_fill(pool: HostKVPool) -> None:
    _raw(pool).fill_(SENTINEL)


def _indices(pool: HostKVPool, pages: Sequence[int]) -> torch.Tensor:
    parts = [torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _expected_after_load(
    target: HostKVPool, source: HostKVPool, moves: Sequence[tuple[int, int]], kind: str
) -> torch.Tensor:
    """Bytes ``target`` must hold after loading source page ``s`` into target page ``t``."""
    expected = _pool(kind, target.layout.value, target.num_pages, target.page_size)
    _raw(expected).copy_(_raw(target))
    for src, dst in moves:
        expected.set_data_page(dst * target.page_size, source.get_data_page(src * target.page_size))
    return _raw(expected).clone()
