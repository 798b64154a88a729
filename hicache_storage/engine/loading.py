"""L2→L1 loads that run layer by layer, so that loading layer ``i + 1`` overlaps computing ``i``.

On a GPU, :class:`LayerLoad` issues one transfer kernel per layer on a side stream as soon as it is
made and records an event after each; the model's per-layer hook (:meth:`LayerLoad.wait`) makes
the compute stream wait for event ``i`` right before layer ``i`` reads the pool. The host thread
never blocks. On CPU the same work runs synchronously: layer ``i`` is copied when the model asks
for it.

Exposed load time is the time the compute stream spends waiting on the load's events, measured
with CUDA events on the compute stream (a ``begin``/``end`` pair around each wait); the load's own
duration is measured on the side stream. On CPU every copy is exposed.

:class:`EarlyLoad` copies a waiting request's pages as its storage reads return them, before the
request is admitted: at admission only the pages read last are left for the layer-by-layer load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hicache_storage.kernels import KVTransfer

__all__ = ["EarlyLoad", "LayerLoad", "LoadTiming"]


def _event() -> torch.cuda.Event:
    """Return a CUDA event that records time (torch leaves its constructor untyped)."""
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


@dataclass
class LoadTiming:
    """How long a load took and how much of it the model waited for, in seconds."""

    layers: int
    load_s: float = 0.0
    exposed_s: float = 0.0
    per_layer_exposed_s: list[float] = field(default_factory=list)


class LayerLoad:
    """Copy host slots to device slots, layer by layer, ahead of the model's forward.

    Parameters
    ----------
    transfer
        The device↔host transfer of the cache's pools.
    host_indices, device_indices
        The slots to copy (every request loaded before one forward, concatenated).
    max_gbps
        Pace of the copy kernel (see :meth:`~hicache_storage.kernels.KVTransfer.load`); None
        for full speed.
    """

    def __init__(
        self,
        transfer: KVTransfer,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        *,
        max_gbps: float | None = None,
    ) -> None:
        self.transfer = transfer
        self.layers = transfer.device.layer_num
        self._host = host_indices
        self._device = device_indices
        self._max_gbps = max_gbps
        self._next = 0
        self._cuda = transfer.device.device.type == "cuda"
        self._events: list[torch.cuda.Event] = []
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._cpu_s: list[float] = []
        self._bounds: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if self._cuda:
            self._start_on_side_stream()

    def _start_on_side_stream(self) -> None:
        device = self.transfer.device.device
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        host = self._host.to(device, non_blocking=True)
        dev = self._device.to(device, non_blocking=True)
        stream.wait_stream(torch.cuda.current_stream(device))
        begin = _event()
        with torch.cuda.stream(stream):
            begin.record()
            for layer in range(self.layers):
                self.transfer.load(host, dev, layer=layer, max_gbps=self._max_gbps)
                event = _event()
                event.record()
                self._events.append(event)
        self._bounds = (begin, self._events[-1])
        host.record_stream(stream)
        dev.record_stream(stream)

    @property
    def tokens(self) -> int:
        """Token slots this load copies."""
        return int(self._device.numel())

    def wait(self, layer: int) -> None:
        """Make layer ``layer`` of the loaded slots ready for the model (the per-layer hook)."""
        if layer < self._next:
            return
        if self._cuda:
            stream = torch.cuda.current_stream(self.transfer.device.device)
            for i in range(self._next, layer + 1):
                begin, end = _event(), _event()
                begin.record(stream)
                stream.wait_event(self._events[i])
                end.record(stream)
                self._waits.append((begin, end))
        else:
            for i in range(self._next, layer + 1):
                t0 = time.perf_counter()
                self.transfer.load(self._host, self._device, layer=i)
                self._cpu_s.append(time.perf_counter() - t0)
        self._next = layer + 1

    def finish(self) -> None:
        """Make every layer ready (for a forward that did not ask for all of them)."""
        if self._next < self.layers:
            self.wait(self.layers - 1)

    def done(self) -> bool:
        """Whether every copy has read its host slots (they may be reused from then on)."""
        if self._bounds is not None:
            return bool(self._bounds[1].query())  # type: ignore[no-untyped-call]
        return self._next >= self.layers

    def timing(self) -> LoadTiming:
        """Return the load's duration and the model's exposed wait (synchronises on a GPU)."""
        self.finish()
        if not self._cuda:
            total = sum(self._cpu_s)
            return LoadTiming(self.layers, total, total, list(self._cpu_s))
        assert self._bounds is not None
        self._bounds[1].synchronize()
        for _, end in self._waits:
            end.synchronize()
        per_layer = [begin.elapsed_time(end) / 1e3 for begin, end in self._waits]
        load = self._bounds[0].elapsed_time(self._bounds[1]) / 1e3
        return LoadTiming(self.layers, load, sum(per_layer), per_layer)


class EarlyLoad:
    """Device copies of a waiting request's leading fetched pages, made as their reads return.

    Each :meth:`extend` copies one stretch of host slots (every layer at once) into device
    slots: on a GPU on ``stream`` behind the work already queued on the current stream (slots
    just freed may still be read there), on CPU at once. The slots stay the caller's; before the
    model reads them, :meth:`order` makes the current stream wait for the copies, and before
    the host or device slots are reused, :meth:`synchronize` waits for them.

    Parameters
    ----------
    transfer
        The device↔host transfer of the cache's pools.
    stream
        The side stream to copy on (a GPU only; None on CPU).
    max_gbps
        Pace of the copy kernel; None for full speed.
    """

    def __init__(
        self,
        transfer: KVTransfer,
        stream: torch.cuda.Stream | None,
        *,
        max_gbps: float | None = None,
    ) -> None:
        self.transfer = transfer
        self._stream = stream
        self._max_gbps = max_gbps
        self._slots: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self.tokens = 0
        """Token slots copied (or being copied) so far."""

    @property
    def slots(self) -> torch.Tensor:
        """The device slots of every copied token, in the order of the fetch's pages."""
        if not self._slots:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(self._slots)

    def extend(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Copy the next stretch of fetched tokens from ``host_indices`` to ``device_indices``."""
        stream = self._stream
        if stream is None:
            self.transfer.load(host_indices, device_indices, max_gbps=self._max_gbps)
        else:
            device = self.transfer.device.device
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                # From pageable memory a copy to the GPU waits for the stream, which waits for
                # the forward in flight: pinned indices leave the scheduler's thread free.
                host = host_indices.pin_memory().to(device, non_blocking=True)
                dev = device_indices.pin_memory().to(device, non_blocking=True)
                self.transfer.load(host, dev, max_gbps=self._max_gbps)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            self._events.append(event)
        self._slots.append(device_indices)
        self.tokens += int(device_indices.numel())

    def order(self) -> None:
        """Make the current stream wait for every copy (before the model reads the slots)."""
        if self._events:
            current = torch.cuda.current_stream(self.transfer.device.device)
            for event in self._events:
                current.wait_event(event)

    def synchronize(self) -> None:
        """Block until every copy is done (before the host or device slots are reused)."""
        for event in self._events:
            event.synchronize()

    def done(self) -> bool:
        """Whether every copy is done, without waiting (a CPU copies at once)."""
        return all(event.query() for event in self._events)  # type: ignore[no-untyped-call]
