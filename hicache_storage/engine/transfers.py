"""Moves between the device and the host: loads (L2→L1), backups (L1→L2) and device room.

:class:`Transfers` gives nodes device slots, making room by evicting device leaves to the host
(:meth:`~Transfers.alloc_device`, copying them first unless there), copies device nodes to the
host (:meth:`~Transfers.backup`), and queues the loads of host-only nodes that the next forward
runs layer by layer (:meth:`~Transfers.take_load`). An admitted request's early copies
(:class:`~hicache_storage.engine.early_loads.EarlyLoads`) become its nodes' device copies here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache_storage.errors import HostPoolError

from .copies import CopiesInFlight, StoredCopies
from .early_loads import EarlyLoads
from .leases import Lookup
from .loading import LayerLoad
from .nodes import MatchResult, Node, Tier
from .tiers import Tiers
from .writes import StorageWrites

__all__ = ["Transfers"]


class Transfers:
    """Device room, and the copies between the device and host pools.

    Parameters
    ----------
    tiers
        The cache's shared state.
    copies
        Copies in flight, told of every copy and load queued here.
    stored_copies
        Host copies of stored pages: whether they pay, told of every one made and hit.
    writes
        Host room (a backup makes it by writing host pages to storage) and the writes queued.
    early
        The waiting requests' early loads: device room they give back, copies an admission
        takes over.
    """

    def __init__(
        self,
        tiers: Tiers,
        copies: CopiesInFlight,
        stored_copies: StoredCopies,
        writes: StorageWrites,
        early: EarlyLoads,
    ) -> None:
        self.tiers = tiers
        self.copies = copies
        self.stored_copies = stored_copies
        self.writes = writes
        self.early = early
        self._loads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._load_pins: list[Node] = []
        """Nodes whose host copies the next :meth:`take_load` copies to the device."""

    # -- device room ------------------------------------------------------------------------------

    def alloc_device(self, count: int) -> torch.Tensor:
        """Allocate whole pages for at least ``count`` device slots, evicting to the host.

        Raises
        ------
        HostPoolError
            If locked pages leave too little room.
        """
        tiers = self.tiers
        page = tiers.page_size
        device_alloc = tiers.device_alloc
        need = -(-count // page) * page
        if need == 0:
            return torch.empty(0, dtype=torch.int64)
        while device_alloc.available_size() < need:
            victim = next(tiers.tree.evictable(Tier.DEVICE), None)
            if victim is None and self.early.reclaim(need):
                continue
            if victim is None:
                raise HostPoolError(
                    f"the device pool cannot hold {need} more tokens: every page is locked"
                )
            if Tier.HOST not in victim.tiers and tiers.host_pool is not None:
                kept = (
                    self.backup(victim, keep_stored=not victim.stored)
                    or victim.stored
                    or victim.id in self.writes.writing
                )
                if not kept and tiers.io is not None:  # nowhere else: recomputed when next asked
                    tiers.stats.pages_dropped += victim.num_tokens // page
            freed = tiers.tree.evict_device(victim)
            self.copies.release_device(freed)
            device_alloc.free(freed)
        slots = device_alloc.alloc(need)
        if slots is None:
            raise HostPoolError(f"the device pool cannot hold {need} more tokens")
        return slots

    def evictable_device_reaches(self, tokens: int) -> bool:
        """Whether unlocked device pages hold ``tokens`` slots; walks the tree until they do."""
        found = 0
        for node in self.tiers.tree.nodes():
            if node.device_indices is not None and node.lock_ref == 0:
                found += node.num_tokens
                if found >= tokens:
                    return True
        return False

    # -- L1→L2 ------------------------------------------------------------------------------------

    def on_host(self, node: Node) -> bool:
        """Whether ``node`` is a root or on the host, backing it up to the host if needed."""
        return node.is_root or Tier.HOST in node.tiers or self.backup(node, keep_stored=True)

    def backup(
        self,
        node: Node,
        *,
        keep_stored: bool = False,
        ridden: Callable[[int, torch.Tensor], torch.Tensor | None] | None = None,
    ) -> bool:
        """L1→L2: copy a device node (and any ancestors not yet on the host) to the host.

        A page storage holds evicts another stored host page for its copy only while such
        copies pay (:meth:`StoredCopies.pay <hicache_storage.engine.copies.StoredCopies.pay>`)
        or ``keep_stored`` (an unstored node or a fetch below it needs the path on the host);
        else it takes free room or stays off the host. On the H200 a multi-turn run whose
        histories outgrow the host copied 9,473 pages (74 GiB) so, a request's whole stored
        prefix at each release, and its host tier served no page. Such a path's new pages reach
        storage through staging slots. The path is locked meanwhile, so that making room on
        the host never evicts the part of it already copied.

        ``ridden`` gives, by a node's first token position on the path and its device slots,
        host slots the forward already copied those slots into
        (:mod:`~hicache_storage.engine.layer_backups`): the node takes them as its host copy,
        with no copy of its own.
        """
        tiers = self.tiers
        pool = tiers.host_pool
        tiers.tree.lock(node)
        try:
            position = 0
            for step in tiers.tree.path(node):
                begin, position = position, position + step.num_tokens
                if step.is_root or Tier.HOST in step.tiers:
                    continue
                device = step.device_indices
                early = None if ridden is None or device is None else ridden(begin, device)
                if early is not None:
                    tiers.tree.attach_host(step, early)
                    pages = step.num_tokens // tiers.page_size
                    tiers.stats.pages_backed_up += pages
                    tiers.stats.pages_backed_up_by_layer += pages
                    continue
                if step.stored and not keep_stored and not self.stored_copies.pay():
                    free = tiers.free_host() >= step.num_tokens
                    host = pool.alloc(step.num_tokens) if pool is not None and free else None
                else:  # a page storage holds is not worth a wait for writes to free host room
                    host = self.writes.alloc_host(step.num_tokens, stored_only=step.stored)
                if step.stored and host is not None:
                    self.stored_copies.copied(step)
                if device is None or host is None or tiers.transfer is None:
                    if host is not None and pool is not None:
                        pool.free(host)
                    return False
                self.copies.copy_to_host(device, host)
                tiers.tree.attach_host(step, host)
                tiers.stats.pages_backed_up += step.num_tokens // tiers.page_size
            return True
        finally:
            tiers.tree.unlock(node)

    # -- L2→L1 ------------------------------------------------------------------------------------

    def load_host_nodes(self, match: MatchResult, lookup: Lookup) -> None:
        """Put the match's host-only nodes on the device: early copies where they cover a node.

        The other nodes are loaded layer by layer in the next forward. Early slots no node
        takes (pages the device held already) are given back.
        """
        tree = self.tiers.tree
        for host_node in match.host_nodes:
            self.stored_copies.outcome(host_node, hit=True)
        early = lookup.early
        if early is None:
            for host_node in match.host_nodes:
                self.schedule_load(host_node)
            return
        lookup.early = None  # from here on each early slot is a node's or freed
        early.order()  # whatever uses the slots from now on runs after the copies
        slots = early.slots
        taken = torch.zeros(slots.numel(), dtype=torch.bool)
        begin = lookup.anchor_len
        pos = match.device_len
        copied: list[Node] = []
        self.copies.track_load(early, copied)  # their copies may still read the host slots
        try:
            for host_node in match.host_nodes:
                end = pos + host_node.num_tokens
                if begin <= pos and end <= begin + early.tokens:
                    tree.attach_device(host_node, slots[pos - begin : end - begin])
                    tree.pin_host(host_node)
                    copied.append(host_node)
                    taken[pos - begin : end - begin] = True
                else:
                    self.schedule_load(host_node)
                pos = end
        finally:
            self.early.settle(early, slots[~taken])

    def schedule_load(self, node: Node) -> None:
        """L2→L1: give a host-only node device slots; its copy runs in the next forward."""
        tiers = self.tiers
        host = node.host_indices
        if host is None or tiers.transfer is None:
            raise HostPoolError(f"{node!r} is not on the host")
        device = self.alloc_device(host.numel())
        try:
            tiers.tree.attach_device(node, device)
        except BaseException:
            tiers.device_alloc.free(device)
            raise
        tiers.tree.pin_host(node)  # until the copy has read it (CopiesInFlight.unpin_loaded)
        self._load_pins.append(node)
        self._loads.append((host, device))
        tiers.stats.pages_loaded += host.numel() // tiers.page_size

    def take_load(self) -> LayerLoad | None:
        """Start the L2→L1 loads of every request admitted since the last call, layer by layer.

        The next forward must pass :meth:`LayerLoad.wait
        <hicache_storage.engine.loading.LayerLoad.wait>` as its per-layer hook.
        """
        self.copies.unpin_loaded()
        transfer = self.tiers.transfer
        if not self._loads or transfer is None:
            return None
        host = torch.cat([h for h, _ in self._loads])
        device = torch.cat([d for _, d in self._loads])
        self._loads.clear()
        load = LayerLoad(transfer, host, device, max_gbps=self.tiers.config.transfer.load_max_gbps)
        self.copies.track_load(load, self._load_pins)
        self._load_pins = []
        return load
