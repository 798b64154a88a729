"""What the cache hands a request: a :class:`Lookup` while it waits, a :class:`Lease` once admitted.

Both are records the scheduler holds and gives back to :class:`TierCache
<hicache_storage.engine.cache.TierCache>`; only the cache changes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .loading import EarlyLoad
from .nodes import Node
from .storage_jobs import Prefetch

__all__ = ["Lease", "Lookup", "RiddenCopy"]


@dataclass
class Lookup:
    """A waiting request's match and its storage prefetch, from :meth:`TierCache.lookup`."""

    tokens: tuple[int, ...]
    seed: str | None
    anchor: Node
    anchor_len: int
    fetch: Prefetch | None = None
    rechecked: bool = False
    pinned: bool = False
    """The anchor's host copy is pinned for the fetch (once storage was found to hold pages)."""
    early: EarlyLoad | None = None
    """The fetched pages already copied to the device (``prefetch.early_loads``)."""


@dataclass
class RiddenCopy:
    """The host copy a forward made of prompt tokens ``[start, stop)`` of one request.

    ``device`` and ``host`` hold one slot per token, the copy's source and target; ``taken``
    marks the tokens whose host slots a tree node took as its host copy (the rest go back to
    the pool at release).
    """

    start: int
    stop: int
    device: torch.Tensor
    host: torch.Tensor
    taken: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.taken = torch.zeros(self.stop - self.start, dtype=torch.bool)

    def take(self, begin: int, device: torch.Tensor) -> torch.Tensor | None:
        """Return the host copy of tokens from ``begin`` if made from ``device`` and not taken.

        A node whose tokens another request inserted first holds that request's device slots:
        its host copy is made from them, not taken from this request's copy.
        """
        count = int(device.numel())
        if begin < self.start or begin + count > self.stop:
            return None
        part = slice(begin - self.start, begin - self.start + count)
        if bool(self.taken[part].any()) or not torch.equal(
            self.device[part], device.to("cpu", torch.int64)
        ):
            return None
        self.taken[part] = True
        return self.host[part]

    def untaken(self) -> torch.Tensor:
        """Return the host slots no node took."""
        return self.host[~self.taken]


@dataclass
class Lease:
    """An admitted request's hold on its prefix and device slots, until ``release``.

    Attributes
    ----------
    slots
        Device slots of the whole request: the cached prefix's, then fresh ones for every token
        it computes or generates (whole pages).
    cached
        Leading prompt tokens whose KV the cache supplied (ready once the pending load is).
    device_hit, host_hit, storage_hit
        How many of them came from each tier.
    in_storage
        Prompt tokens ``[begin, end)`` its existence query found in storage: what it computes
        of them (a fetch cut or not worth it) is not written again.
    ridden
        Host copies of its computed pages that the forward ending its prompt made layer by
        layer (:mod:`~hicache_storage.engine.layer_backups`), until the insert of its pages takes
        them.
    inserted
        Leading prompt tokens the tree took from its slots when its prefill ended
        (:meth:`TierCache.prefilled <hicache_storage.engine.cache.TierCache.prefilled>`): those
        slots are the tree's, not freed at release. 0 until then.
    """

    tokens: tuple[int, ...]
    seed: str | None
    node: Node
    slots: torch.Tensor
    cached: int
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    released: bool = False
    in_storage: tuple[int, int] = (0, 0)
    ridden: list[RiddenCopy] = field(default_factory=list)
    inserted: int = 0
