"""What several areas of checks share: markers, hypothesis profiles, constants, pool helpers."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

from hicache_storage.backend import HostPool, StorageBackend
from hicache_storage.buffers import as_readable
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
SHARED_POOLS = sys.platform == "linux"
"""The suite's host pools live in shared memory where they can (Linux), so that a backend
serving pages from another process (``shared_host_pool``) can be checked like any other."""
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
            size,
            page_size,
            layers,
            2,
            8,
            dtype=torch.float16,
            layout=layout,
            pin_memory=False,
            shared=SHARED_POOLS,
        )
    return MLAHostPool(
        size,
        page_size,
        layers,
        16,
        dtype=torch.float16,
        layout=layout,
        pin_memory=False,
        shared=SHARED_POOLS,
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


# -- data-path helpers (sizes, keys, pages) ------------------------------------------------------


def _difference(got: object, expected: bytes) -> str | None:
    """Say how the bytes of ``got`` differ from ``expected``, or ``None`` when they are equal."""
    have = as_readable(got)
    a = np.frombuffer(have, dtype=np.uint8)
    b = np.frombuffer(expected, dtype=np.uint8)
    if a.size == b.size and np.array_equal(a, b):  # memoryview == compares item by item: slow
        return None
    if have.nbytes != len(expected):
        text = f"{have.nbytes} bytes, expected {len(expected)}"
        if a.size < b.size and np.array_equal(a, b[: a.size]):
            whole = " (a whole number of MiB)" if have.nbytes and have.nbytes % MiB == 0 else ""
            text += f": the tail after byte {have.nbytes}{whole} was lost"
        return text
    diff = np.flatnonzero(a != b)
    first = int(diff[0])
    return (
        f"{len(expected)} bytes of which {diff.size} differ, the first at offset {first} "
        f"(0x{first:x}: expected 0x{b[first]:02x}, got 0x{a[first]:02x})"
    )


def mismatch(op: str, key: str, got: object, expected: bytes) -> str | None:
    """Describe how ``op`` on ``key`` returned other bytes than ``expected`` (``None``: equal).

    The message names the operation and the key, then the lengths (and whether the shorter one
    lost its tail) or the first differing offset and how many bytes differ.
    """
    text = _difference(got, expected)
    return None if text is None else f"{op} of {key!r} returned {text}"


def slot_problem(out: object, value: bytes | None) -> str | None:
    """Say what is wrong with one slot of a batch read (``None``: nothing).

    ``value`` is what a hit's slot must hold; ``None`` says the key missed, and its slot (a
    buffer filled with :data:`SENTINEL` before the call) must be untouched.
    """
    if value is not None:
        text = _difference(out, value)
        return None if text is None else f"holds {text}"
    have = np.frombuffer(as_readable(out), dtype=np.uint8)
    written = np.flatnonzero(have != SENTINEL)
    if written.size == 0:
        return None
    first = int(written[0])
    return (
        f"was written although the key missed: {written.size} of its {have.size} bytes are no "
        f"longer the sentinel 0x{SENTINEL:02x}, the first at offset {first} (now "
        f"0x{have[first]:02x})"
    )


def value_limit(backend: StorageBackend, options: Mapping[str, object], want: int) -> int:
    """Return ``want`` capped by ``max_value_size`` and by half of a bounded store's capacity."""
    limit = want
    claimed = backend.capabilities.max_value_size
    if claimed is not None:
        limit = min(limit, claimed)
    for source in (backend.stats(), options):
        bound = source.get("max_bytes")
        if isinstance(bound, int) and not isinstance(bound, bool) and bound > 0:
            return min(limit, bound // 2)
    return limit


def model_pool(
    kind: str,
    layout: str,
    *,
    pages: int,
    page_size: int,
    layers: int,
    heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.float16,
) -> HostKVPool:
    """Return an unpinned pool of a model's geometry (for MLA, ``head_dim`` is ``kv_cache_dim``)."""
    size = pages * page_size
    if kind == "mha":
        return MHAHostPool(
            size,
            page_size,
            layers,
            heads,
            head_dim,
            dtype=dtype,
            layout=layout,
            pin_memory=False,
            shared=SHARED_POOLS,
        )
    return MLAHostPool(
        size,
        page_size,
        layers,
        head_dim,
        dtype=dtype,
        layout=layout,
        pin_memory=False,
        shared=SHARED_POOLS,
    )


def page_bytes(pool: HostPool, indices: torch.Tensor) -> list[bytes]:
    """Return the object bytes of each page of ``indices`` (its buffers, concatenated)."""
    return [b"".join(bytes(view) for view in views) for views in pool.page_buffer_views(indices)]


def pool_pages(pool: HostKVPool) -> list[bytes]:
    """Return the object bytes of every page of ``pool`` (together, every byte of the pool)."""
    return page_bytes(pool, _indices(pool, range(pool.num_pages)))


def pages_mismatch(op: str, pool: HostKVPool, expected: Sequence[bytes]) -> str | None:
    """Compare every page of ``pool`` with ``expected``; describe the pages that differ."""
    problems = []
    for page, (have, want) in enumerate(zip(pool_pages(pool), expected, strict=True)):
        text = _difference(have, want)
        if text is not None:
            problems.append(f"page {page} holds {text}")
    if not problems:
        return None
    return f"after {op}, {len(problems)} page(s) of the pool differ: " + "; ".join(problems[:3])


def fill_random(pool: HostKVPool, seed: int) -> None:
    """Fill ``pool`` with seeded random bytes (NumPy's generator: several times torch's speed)."""
    raw = _raw(pool).numpy()
    raw[:] = np.frombuffer(np.random.default_rng(seed).bytes(raw.size), dtype=np.uint8)
