"""How full a store is: the ``capacity`` section a backend's ``stats()`` may carry.

One shape for every backend that holds a bound or reads its store's, so the metrics layer's
gauges and ``hicache doctor`` read the same figures whatever the backend: bytes held, the bound
and, for disks, the free-space floor and the free bytes, evictions since the backend was built,
and what the figures measure (``scope``): this backend's own objects (``namespace``), or a whole
server it shares (``server``: a Redis ``maxmemory`` covers every client's keys).
"""

from __future__ import annotations

from typing import Literal, TypedDict

__all__ = ["MEASURES", "Capacity"]


class Capacity(TypedDict, total=False):
    """``stats()["capacity"]``: every field optional, absent where the store does not say."""

    scope: Literal["namespace", "server"]
    used_bytes: int
    bound_bytes: int | None
    """None where nothing bounds the store (Redis ``maxmemory 0``)."""
    floor_bytes: int
    """Free bytes the backend keeps on its disk, whatever the bound says."""
    free_bytes: int | None
    evictions: int
    """Objects removed to make room, by the backend or (scope ``server``) by the store."""
    policy: str
    """How the store picks what to evict (``lru``; a Redis ``maxmemory-policy``)."""


MEASURES: dict[str, str] = {
    "used": "used_bytes",
    "bound": "bound_bytes",
    "floor": "floor_bytes",
    "free": "free_bytes",
}
"""The ``measure`` label of each capacity gauge, and the :class:`Capacity` field it reads."""
