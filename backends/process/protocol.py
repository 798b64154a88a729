"""The messages between the process backend and its storage process (pickled, one per call)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from hicache_storage.config import Deployment
from hicache_storage.hostpool import HostKVPool, Layout
from hicache_storage.hostpool.shared import SharedRegion
from hicache_storage.keys import UnifiedPlan

__all__ = ["PoolDescription", "Reply", "Request", "Start"]


@dataclass(frozen=True)
class Start:
    """The first message: which backend to build, and how many calls to serve at once."""

    backend: str
    options: msgspec.Struct
    deployment: Deployment
    threads: int


@dataclass(frozen=True)
class Request:
    """One call of the contract; ``None`` in its place asks the storage process to exit."""

    call_id: int
    method: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Reply:
    """The answer to a call (or to :class:`Start`, ``call_id`` -1): its value or its error."""

    call_id: int
    ok: bool
    value: Any


@dataclass(frozen=True)
class PoolDescription:
    """Enough for the storage process to rebuild the engine's host pool over shared memory."""

    kind: type[HostKVPool]
    region: SharedRegion
    shape: tuple[int, ...]
    dtype: torch.dtype
    page_size: int
    layout: Layout
    plan: UnifiedPlan | None
