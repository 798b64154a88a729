"""Options and promises of the ``memory`` backend (imported by its plugin: nothing heavy)."""

from __future__ import annotations

import msgspec

from hicache_storage.capabilities import Capabilities

__all__ = ["MemoryConfig", "capabilities"]


class MemoryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the memory backend (it has none)."""


def capabilities() -> Capabilities:
    """Return what every memory backend promises: the registry's record and each instance's."""
    return Capabilities(delete=True, atomic_first_wins=True)
