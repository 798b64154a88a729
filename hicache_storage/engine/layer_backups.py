"""Write-through backups that ride the forward: each layer's new KV copied to the host once written.

Under ``write_through`` a request's prompt pages are copied to the host once the forward that
finished its prompt is done (:meth:`TierCache.prefilled
<hicache_storage.engine.cache.TierCache.prefilled>`), every layer in one copy. Copied layer by
layer instead, layer ``i``'s copy queued on the backup stream as soon as the forward has written
layer ``i``, the copies run under the forward's later layers and only the last layer's is still
in flight when it ends; the tree then takes the host slots as the request's nodes' host copies,
with no copy of its own.

Only what a whole-prompt backup would copy is copied: the pages a request computed (not those
its lease found cached, nor those its storage query found, which a backup may skip), for the
requests whose prompt ends in the forward, into host room that needs no wait (free slots, or
host leaves storage already holds). Whatever finds no such room is backed up whole when the
prompt is inserted. A forward that fails takes its requests' copies with it: their host slots
are given back and nothing is attached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .copies import CopiesInFlight, LayerCopies
from .leases import Lease, RiddenCopy
from .policies import WritePolicy
from .tiers import Tiers
from .writes import StorageWrites

__all__ = ["ForwardBackups", "LayerBackups", "RiddenTaker"]


class ForwardBackups:
    """One forward's ridden copies, queued layer by layer; ended by ``finish`` or ``abandon``."""

    def __init__(self, owner: LayerBackups, copies: LayerCopies, leases: list[Lease]) -> None:
        self._owner = owner
        self._copies = copies
        self._leases = leases
        self._next = 0
        self._ended = False

    def written(self, layer: int) -> None:
        """Queue the copies of every layer up to ``layer``, whose KV writes the forward queued."""
        while self._next <= layer:
            self._copies.copy(self._next)
            self._next += 1

    def finish(self) -> None:
        """Queue the layers not yet copied and register the copies as in flight."""
        if self._ended:
            return
        self.written(self._copies.layers - 1)
        self._copies.finish()
        self._ended = True

    def abandon(self) -> None:
        """Give every host slot back, after the copies queued into it: the forward failed.

        No copy is attached to a node: the KV they copied may be a failed forward's.
        """
        if not self._ended:
            self._copies.finish()
            self._ended = True
        for lease in self._leases:
            self._owner.give_back(lease)


class LayerBackups:
    """Plans the ridden copies of a forward and hands their slots to the insert that takes them.

    Parameters
    ----------
    tiers
        The cache's shared state.
    copies
        Copies in flight: runs the layer copies on the backup stream and tracks them.
    writes
        Host room: slots taken only where no write has to be waited for.
    """

    def __init__(self, tiers: Tiers, copies: CopiesInFlight, writes: StorageWrites) -> None:
        self.tiers = tiers
        self.copies = copies
        self.writes = writes

    @property
    def enabled(self) -> bool:
        """Whether forwards ride backups: ``write_through``, a host pool, the option on."""
        config = self.tiers.config
        return (
            config.transfer.layer_backups
            and config.prefix_cache
            and config.write.policy is WritePolicy.WRITE_THROUGH
            and self.tiers.host_pool is not None
            and self.tiers.transfer is not None
        )

    def plan(self, finishing: Sequence[tuple[Lease, int]]) -> ForwardBackups | None:
        """Take host room for the next forward's copies; None when there is nothing to copy.

        ``finishing`` holds a ``(lease, prompt tokens)`` pair for each request whose prompt
        the forward ends.
        """
        if not finishing or not self.enabled:
            return None
        page = self.tiers.page_size
        devices: list[torch.Tensor] = []
        hosts: list[torch.Tensor] = []
        leases: list[Lease] = []
        for lease, prompt_tokens in finishing:
            if lease.released or lease.ridden:
                continue
            end = min(prompt_tokens // page * page, int(lease.slots.numel()))
            for start, stop in _computed(lease.cached, end, lease.in_storage):
                host = self.writes.alloc_host(stop - start, stored_only=True)
                if host is None:  # the rest is backed up whole after the forward
                    break
                device = lease.slots[start:stop].to("cpu", torch.int64)
                lease.ridden.append(RiddenCopy(start, stop, device, host))
                devices.append(device)
                hosts.append(host)
            if lease.ridden:
                leases.append(lease)
        if not hosts:
            return None
        layers = self.copies.layer_copies(torch.cat(devices), torch.cat(hosts))
        return ForwardBackups(self, layers, leases)

    def taker(self, lease: Lease) -> RiddenTaker | None:
        """Return what a backup of ``lease``'s path asks for ridden slots (None if it has none)."""
        return RiddenTaker(lease.ridden) if lease.ridden else None

    def split_at_copies(self, lease: Lease, tokens: Sequence[int]) -> None:
        """Split the tree where ``lease``'s ridden copies end within ``tokens``.

        They end at the prompt's end, before the output's pages: whole nodes then cover them,
        and an insert's backup takes each node's host slots from one copy.
        """
        for copy in lease.ridden:
            for end in (copy.start, copy.stop):
                if 0 < end < len(tokens):
                    self.tiers.tree.match_prefix(tokens[:end], seed=lease.seed, touch=False)

    def give_back(self, lease: Lease) -> None:
        """Free the host slots of ``lease``'s ridden copies that no node took."""
        pool = self.tiers.host_pool
        for copy in lease.ridden:
            rest = copy.untaken()
            if pool is not None and rest.numel():
                pool.free(rest)
        lease.ridden.clear()


@dataclass
class RiddenTaker:
    """A request's ridden copies, asked by token position for a node's host slots."""

    copies: list[RiddenCopy]

    def __call__(self, begin: int, device: torch.Tensor) -> torch.Tensor | None:
        """Return the ridden host slots of a node from ``begin`` on ``device`` slots, or None."""
        for copy in self.copies:
            slots = copy.take(begin, device)
            if slots is not None:
                return slots
        return None


def _computed(begin: int, end: int, in_storage: tuple[int, int]) -> list[tuple[int, int]]:
    """``[begin, end)`` without the stretch storage holds: at most two ranges, none empty."""
    low, high = in_storage
    if high <= low or high <= begin or low >= end:
        return [(begin, end)] if end > begin else []
    return [(a, b) for a, b in ((begin, low), (high, end)) if b > a]
