"""The transfer API the engine and backends call: :class:`KVTransfer`.

One object binds a device pool to a host pool and picks an implementation once: the Triton kernel
when the device pool is on a GPU (or on the CPU under ``TRITON_INTERPRET=1``), the torch reference
otherwise. Every call is asynchronous on the current CUDA stream, like a ``copy_``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

import torch

from hicache_storage.errors import (
    BatchMismatchError,
    ConfigError,
    HostPoolError,
    IndexAlignmentError,
    MissingDependencyError,
)
from hicache_storage.hostpool import HostKVPool
from hicache_storage.kernels.pools import DevicePool, HostView
from hicache_storage.kernels.reference import transfer_reference

if TYPE_CHECKING:
    from hicache_storage.kernels.triton_kernels import LaunchPlan

__all__ = ["Backend", "CopyFence", "Indices", "KVTransfer", "KernelConfig"]

Backend: TypeAlias = Literal["auto", "triton", "reference"]
Indices: TypeAlias = torch.Tensor | Sequence[int]

_INTERPRETER_PROGRAMS = 4


@dataclass(frozen=True)
class KernelConfig:
    """Tuning of the Triton kernel's launches.

    Attributes
    ----------
    tile_bytes
        Bytes one program moves per loop iteration: the bytes in flight per SM that hide the
        PCIe latency when few SMs do the work.
    num_warps
        Warps per program (one CTA).
    max_chunk_bytes
        Upper bound on the bytes of one chunk, the power-of-two piece of a row a tile row holds.
    programs_per_sm
        Programs per SM when the launch has no SM budget.
    balance_rounds
        Launches of at most this many tiles per program are cut into smaller tiles when that
        evens out the programs' shares (0: never).
    pdl
        Launch with programmatic dependent launch where the GPU has it (Hopper and later): a
        launch starts while the previous kernel on the stream drains, which hides most of the
        launch latency between back-to-back per-layer copies.
    """

    tile_bytes: int = 32768
    num_warps: int = 16
    max_chunk_bytes: int = 512
    programs_per_sm: int = 1
    balance_rounds: int = 4
    pdl: bool = True


class CopyFence:
    """The copies launched before it on a stream: wait for them, or ask whether they are done.

    A GPU copy runs after the kernels queued before it, so the slots a :meth:`KVTransfer.backup`
    writes are not final when it returns; whoever reads them on the CPU, or writes them there
    once they are given to another use, waits first. CPU copies are done when they return.
    """

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    def wait(self) -> None:
        """Return once the copies are done."""
        if self._event is not None:
            self._event.synchronize()

    def done(self) -> bool:
        """Whether the copies are done, without waiting."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def order(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream`` wait for the copies, on the GPU: the calling thread does not block."""
        if self._event is not None:
            stream.wait_event(self._event)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _index_tensor(values: Indices, name: str, size: int, device: torch.device) -> torch.Tensor:
    """Return ``values`` as int64 on ``device``; bounds are checked when they live on the CPU."""
    tensor = values if isinstance(values, torch.Tensor) else torch.as_tensor(values)
    if tensor.numel() == 0 and not isinstance(values, torch.Tensor):
        tensor = tensor.to(torch.int64)  # an empty list carries no dtype
    if (
        tensor.dim() != 1
        or tensor.is_floating_point()
        or tensor.is_complex()
        or (tensor.dtype == torch.bool)
    ):
        raise IndexAlignmentError(
            f"{name} must be a 1-D integer tensor or sequence, got {tensor.dtype} "
            f"with shape {tuple(tensor.shape)}"
        )
    if tensor.device.type == "cpu" and tensor.numel():
        low, high = int(tensor.min()), int(tensor.max())
        if low < 0 or high >= size:
            raise IndexAlignmentError(f"{name} range [{low}, {high}] is outside [0, {size})")
    return tensor.to(device=device, dtype=torch.int64, non_blocking=True)


class KVTransfer:
    """Copy token slots between a device pool and a host pool, per layer or all layers.

    Parameters
    ----------
    device
        The layer-first device pool.
    host
        A host pool (:class:`~hicache_storage.hostpool.MHAHostPool` or
        :class:`~hicache_storage.hostpool.MLAHostPool`, any layout) or a :class:`HostView` of any
        other buffer. For the GPU kernel it must be pinned.
    sm_budget
        Most SMs one launch may occupy (the grid size of the persistent kernel); None lets it
        spread over the whole GPU. Settable later.
    backend
        ``"triton"``, ``"reference"`` or ``"auto"`` (Triton where it can run, else reference).
    config
        Kernel tuning; the default suits an H200.

    Raises
    ------
    InvalidValueError, HostPoolError
        If the two pools hold different rows, or the host buffer is not reachable by the GPU.
    MissingDependencyError
        If ``backend="triton"`` and Triton is not installed.

    Notes
    -----
    Index lists need not be sorted or page-contiguous. Destination slots must be distinct: two
    sources written to one slot leave either. CPU index tensors are bounds-checked; indices
    already on the GPU are trusted (checking them would synchronise the stream).
    """

    def __init__(
        self,
        device: DevicePool,
        host: HostKVPool | HostView,
        *,
        sm_budget: int | None = None,
        backend: Backend = "auto",
        config: KernelConfig | None = None,
    ) -> None:
        self.device = device
        self.host = host if isinstance(host, HostView) else HostView.from_pool(host)
        self.host.check_matches(device)
        self.sm_budget = sm_budget
        self.backend: Literal["triton", "reference"] = self._resolve(backend)
        self.config = config or KernelConfig()
        self._plan: LaunchPlan | None = None
        self._pdl = (
            self.config.pdl
            and device.device.type == "cuda"
            and torch.cuda.get_device_capability(device.device) >= (9, 0)
        )
        if self.backend == "triton":
            from hicache_storage.kernels.triton_kernels import plan_transfer

            self._plan = plan_transfer(device, self.host, self.config)

    @property
    def sm_budget(self) -> int | None:
        """Most SMs one launch may occupy; None for no limit."""
        return self._sm_budget

    @sm_budget.setter
    def sm_budget(self, value: int | None) -> None:
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ConfigError(f"sm_budget must be a positive int or None, got {value!r}")
        self._sm_budget = value

    def load(
        self,
        host_indices: Indices,
        device_indices: Indices,
        *,
        layer: int | None = None,
        max_gbps: float | None = None,
    ) -> None:
        """Copy host slots into device slots (host → device), one layer or all.

        ``max_gbps`` paces the GPU kernel to about that many GB/s (see :meth:`backup`).
        """
        self._run(device_indices, host_indices, to_host=False, layer=layer, max_gbps=max_gbps)

    def backup(
        self,
        device_indices: Indices,
        host_indices: Indices,
        *,
        layer: int | None = None,
        max_gbps: float | None = None,
    ) -> None:
        """Copy device slots into host slots (device → host), one layer or all.

        ``max_gbps`` paces the GPU kernel to about that many GB/s, leaving the rest of the PCIe
        link to a load running at the same time (``docs/kernels.md``, *Both directions at
        once*). The reference and interpreter paths have no link to share and ignore it.
        """
        self._run(device_indices, host_indices, to_host=True, layer=layer, max_gbps=max_gbps)

    def fence(self) -> CopyFence:
        """Return a fence after every copy launched so far on the current stream."""
        if self.device.device.type != "cuda":
            return CopyFence()
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return CopyFence(event)

    def _resolve(self, backend: Backend) -> Literal["triton", "reference"]:
        if backend == "reference":
            return "reference"
        on_gpu = self.device.device.type == "cuda"
        runnable = on_gpu or (_interpreting() and self.device.device.type == "cpu")
        if backend == "auto" and not runnable:
            return "reference"
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            if backend == "auto":
                return "reference"
            raise MissingDependencyError(
                "the Triton transfer kernels need triton: pip install 'hicache-storage[gpu]'"
            ) from exc
        if not runnable:
            raise HostPoolError(
                f"the Triton kernel needs a CUDA device pool (or TRITON_INTERPRET=1 with CPU "
                f"tensors); this one is on {self.device.device}"
            )
        buffer = self.host.buffer
        if on_gpu and buffer.device.type == "cpu" and not buffer.is_pinned():
            raise HostPoolError(
                "the host buffer must be pinned for the GPU kernel to reach it; "
                "build the host pool with pin_memory=True"
            )
        return "triton"

    def _programs(self) -> int:
        if self.device.device.type != "cuda":
            return self._sm_budget or _INTERPRETER_PROGRAMS
        if self._sm_budget is not None:
            return self._sm_budget
        sms = torch.cuda.get_device_properties(self.device.device).multi_processor_count
        return int(sms) * self.config.programs_per_sm

    def _run(
        self,
        device_indices: Indices,
        host_indices: Indices,
        *,
        to_host: bool,
        layer: int | None,
        max_gbps: float | None,
    ) -> None:
        if layer is not None and not 0 <= layer < self.device.layer_num:
            raise HostPoolError(f"layer {layer} is outside [0, {self.device.layer_num})")
        if max_gbps is not None and (
            isinstance(max_gbps, bool)
            or not isinstance(max_gbps, int | float)
            or not 0 < max_gbps < math.inf
        ):
            raise ConfigError(f"max_gbps must be a positive number or None, got {max_gbps!r}")
        target = self.device.device
        dev_idx = _index_tensor(device_indices, "device_indices", self.device.size, target)
        host_idx = _index_tensor(host_indices, "host_indices", self.host.size, target)
        if dev_idx.numel() != host_idx.numel():
            raise BatchMismatchError(
                f"got {dev_idx.numel()} device indices but {host_idx.numel()} host indices"
            )
        if self._plan is None:
            transfer_reference(
                self.device, self.host, dev_idx, host_idx, to_host=to_host, layer=layer
            )
            return
        from hicache_storage.kernels.triton_kernels import launch

        launch(
            self._plan,
            dev_idx,
            host_idx,
            to_host=to_host,
            layer_begin=0 if layer is None else layer,
            layer_count=self.device.layer_num if layer is None else 1,
            programs=self._programs(),
            max_gbps=max_gbps if self.device.device.type == "cuda" else None,
            pdl=self._pdl,
        )
