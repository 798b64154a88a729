"""The tier cache's bookkeeping of copies between the device and host pools.

- :class:`CopiesInFlight`: the copies that may still touch host slots after the call that queued
  them returned: device→host copies (a fetch must not read into their slots before they land)
  and host→device loads (their nodes stay pinned on the host until the loads have read them).
- :class:`StoredCopies`: whether host copies of pages storage already holds are hit there often
  enough to be worth evicting other host pages for.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from hicache_storage.kernels import CopyFence

from .loading import EarlyLoad, LayerLoad
from .nodes import Node
from .tiers import Tiers

__all__ = ["CopiesInFlight", "LayerCopies", "StoredCopies"]

_COPY_OUTCOMES = 64
"""Stored pages copied to the host whose fate (hit there, or evicted unread) decides whether
the next such copy may evict another host page."""

_COPY_PAYS = 0.25
"""Share of those copies hit on the host at which a copy into a full host is worth making: a
hit saves a storage read of the page (0.4-0.5 ms for 8 MiB on the H200), a copy costs a
device→host transfer on the forward's stream (about 0.16 ms) and the host page it evicts."""


class CopiesInFlight:
    """Copies between the pools that may still be running, and the slots they touch.

    On a GPU with ``transfer.overlap_backups`` (the default) device→host copies run on a side
    stream of their own, beside the forwards: a backup queued behind a forward on the
    forward's stream held the next forward back for as long as it ran, and a request's time
    to first token with it. Whoever reuses a copy's slots is ordered after it instead: a
    device slot freed for another use (:meth:`release_device`, on the GPU, without blocking
    the scheduler's thread), a host slot read by a fetch or the storage writer (its fence).
    """

    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        device = tiers.device_pool.device
        overlap = device.type == "cuda" and tiers.config.transfer.overlap_backups
        self._stream = torch.cuda.Stream(device) if overlap else None  # type: ignore[no-untyped-call]
        self._host_copies: list[tuple[torch.Tensor, CopyFence]] = []
        """Device→host copies that may still be in flight: their host slots and fences."""
        self._device_copies: list[tuple[torch.Tensor, CopyFence]] = []
        """Side-stream copies that may still read device slots: the slots and fences."""
        self._last: CopyFence | None = None
        """The fence of the latest side-stream copy."""
        self._loading: list[tuple[LayerLoad | EarlyLoad, list[Node]]] = []
        """Loads that may still read host slots, and the nodes pinned on the host meanwhile."""

    def copy_to_host(self, device: torch.Tensor, host: torch.Tensor) -> CopyFence:
        """Queue the device→host copy of ``device`` into ``host``; return its fence.

        With a storage tier the copy is remembered until done: a fetch may read into these
        slots once they are freed (:meth:`copies_into`).
        """
        transfer = self.tiers.transfer
        assert transfer is not None
        pace = self.tiers.config.transfer.backup_max_gbps
        stream = self._stream
        if stream is None:
            transfer.backup(device, host, max_gbps=pace)
            fence = transfer.fence()
        else:
            target = self.tiers.device_pool.device
            stream.wait_stream(torch.cuda.current_stream(target))  # after the forward wrote them
            with torch.cuda.stream(stream):
                # Pinned indices: a copy from pageable memory would wait for the stream, and
                # the stream for the forward in flight, holding the scheduler's thread.
                dev = device.pin_memory().to(target, non_blocking=True)
                slots = host.pin_memory().to(target, non_blocking=True)
                transfer.backup(dev, slots, max_gbps=pace)
                fence = transfer.fence()
            self._device_copies = [c for c in self._device_copies if not c[1].done()]
            self._device_copies.append((device, fence))
            self._last = fence
        if self.tiers.io is not None:
            self._in_flight().append((host, fence))
        return fence

    def layer_copies(self, device: torch.Tensor, host: torch.Tensor) -> LayerCopies:
        """Return copies of ``device`` into ``host`` to queue layer by layer (``layer_backups``)."""
        return LayerCopies(self, device, host)

    def track_copy(self, device: torch.Tensor, host: torch.Tensor, fence: CopyFence) -> None:
        """Order later uses of ``device`` and ``host`` slots after a copy ending at ``fence``."""
        if self._stream is not None:
            self._device_copies = [c for c in self._device_copies if not c[1].done()]
            self._device_copies.append((device, fence))
            self._last = fence
        if self.tiers.io is not None:
            self._in_flight().append((host, fence))

    def fence(self) -> CopyFence | None:
        """Return a fence after every device→host copy queued so far (None without a transfer)."""
        if self._stream is not None:
            return self._last or CopyFence()
        transfer = self.tiers.transfer
        return None if transfer is None else transfer.fence()

    def release_device(self, slots: torch.Tensor) -> None:
        """Order the next use of device ``slots`` after the side-stream copies still reading them.

        Called as slots leave the tree (evicted to make room): the forward that reuses them
        waits on the GPU for those copies alone; the scheduler's thread does not block.
        """
        copies = self._device_copies = [c for c in self._device_copies if not c[1].done()]
        if not copies or not slots.numel():
            return
        hit = torch.isin(torch.cat([dev for dev, _ in copies]), slots)
        sizes = [dev.numel() for dev, _ in copies]
        current = torch.cuda.current_stream(self.tiers.device_pool.device)
        behind = 0
        for (_, fence), part in zip(copies, hit.split_with_sizes(sizes), strict=True):
            reused = int(part.sum())
            if reused:
                fence.order(current)
                behind += reused
        self.tiers.stats.slots_behind_backups += behind

    def copies_into(self, slots: torch.Tensor) -> Callable[[], None] | None:
        """Return the wait for the device→host copies still in flight into ``slots`` (or None).

        A backed-up page storage holds can be evicted from the host as soon as it is there, and
        its slots handed to a fetch while its copy still waits behind a forward on the GPU: the
        copy would then land on the pages the fetch read (measured on the H200 as checksum
        failures of the file backend, and wrong KV where the copy landed after the check).
        Only copies into the fetch's slots are waited for, and by the read threads before they
        read: neither the scheduler's thread nor the read waits for other pages' backups.
        """
        copies = self._in_flight()
        if not copies:
            return None
        hit = torch.isin(torch.cat([host for host, _ in copies]), slots)
        sizes = [host.numel() for host, _ in copies]
        fences = [
            fence
            for (_, fence), part in zip(copies, hit.split_with_sizes(sizes), strict=True)
            if bool(part.any())
        ]
        if not fences:
            return None

        def ready() -> None:
            for fence in fences:
                fence.wait()

        return ready

    def _in_flight(self) -> list[tuple[torch.Tensor, CopyFence]]:
        """Forget the device→host copies that are done; return those that may not be."""
        self._host_copies = [c for c in self._host_copies if not c[1].done()]
        return self._host_copies

    def track_load(self, load: LayerLoad | EarlyLoad, nodes: list[Node]) -> None:
        """Keep ``nodes`` pinned on the host until ``load`` has read them (:meth:`unpin_loaded`).

        ``nodes`` is kept, not copied: a caller may add to it after the load is queued.
        """
        self._loading.append((load, nodes))

    def unpin_loaded(self) -> None:
        """Unpin the host copies whose loads to the device are done (their slots may go)."""
        if not self._loading:
            return
        still: list[tuple[LayerLoad | EarlyLoad, list[Node]]] = []
        for load, nodes in self._loading:
            if load.done():
                for node in nodes:
                    self.tiers.tree.unpin_host(node)
            else:
                still.append((load, nodes))
        self._loading = still


class LayerCopies:
    """Device→host copies of a fixed set of slots, queued one layer at a time.

    On the backup stream (with ``transfer.overlap_backups`` on a GPU) each layer's copy waits
    for the work the forward's stream has queued so far, which includes that layer's KV
    writes; elsewhere each copy runs as it is queued.
    """

    def __init__(self, copies: CopiesInFlight, device: torch.Tensor, host: torch.Tensor) -> None:
        tiers = copies.tiers
        assert tiers.transfer is not None
        self._copies = copies
        self._transfer = tiers.transfer
        self._pace = tiers.config.transfer.backup_max_gbps
        self._stream = copies._stream
        self.device = device
        self.host = host
        self.layers = tiers.device_pool.layer_num
        self._target = tiers.device_pool.device
        if self._stream is None:
            self._dev, self._host = device, host
        else:
            with torch.cuda.stream(self._stream):  # pinned: see CopiesInFlight.copy_to_host
                self._dev = device.pin_memory().to(self._target, non_blocking=True)
                self._host = host.pin_memory().to(self._target, non_blocking=True)

    def copy(self, layer: int) -> None:
        """Queue layer ``layer``'s copy, after what the forward's stream has queued."""
        stream = self._stream
        if stream is None:
            self._transfer.backup(self._dev, self._host, layer=layer, max_gbps=self._pace)
            return
        stream.wait_stream(torch.cuda.current_stream(self._target))
        with torch.cuda.stream(stream):
            self._transfer.backup(self._dev, self._host, layer=layer, max_gbps=self._pace)

    def finish(self) -> CopyFence:
        """Return a fence after every layer queued, and track the slots until it passes."""
        if self._stream is None:
            fence = self._transfer.fence()
        else:
            with torch.cuda.stream(self._stream):
                fence = self._transfer.fence()
        self._copies.track_copy(self.device, self.host, fence)
        return fence


class StoredCopies:
    """Whether host copies of stored pages pay: hit on the host before they leave it.

    A workload whose reuse the host holds keeps copying; one whose histories cycle through
    more than the device and host hold (each copy evicted unread) stops, and its copies into
    free room keep the measure current.
    """

    def __init__(self) -> None:
        self._nodes: OrderedDict[int, None] = OrderedDict()
        """Stored nodes copied to the host that have been neither hit nor evicted there yet."""
        self.outcomes: deque[bool] = deque(maxlen=_COPY_OUTCOMES)
        """Whether each of the last such copies was hit on the host before it left."""

    def pay(self) -> bool:
        """Whether recent host copies of stored pages were hit there often enough to evict for.

        True until a few copies have an outcome.
        """
        outcomes = self.outcomes
        return len(outcomes) < 8 or sum(outcomes) >= _COPY_PAYS * len(outcomes)

    def copied(self, node: Node) -> None:
        """Remember that stored ``node`` was copied to the host; its outcome is yet to come."""
        self._nodes[node.id] = None
        while len(self._nodes) > 16 * _COPY_OUTCOMES:  # nodes split since
            self._nodes.popitem(last=False)

    def outcome(self, node: Node, *, hit: bool) -> None:
        """Record whether a stored node copied to the host was hit there before it left."""
        if node.id in self._nodes:
            del self._nodes[node.id]
            self.outcomes.append(hit)
